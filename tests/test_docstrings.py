"""Every public name has a docstring: the modules users import, their public classes and functions, and the
public methods and properties of those classes (a method that overrides a documented one inherits its doc)."""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC_MODULES = ["onnxtrain", "onnxtrain.artifacts", "onnxtrain.api", "onnxtrain.hf", "onnxtrain.optim",
                  "onnxtrain.autodiff", "onnxtrain.ortmodule", "onnxtrain.cli"]


def _undocumented(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    missing = [] if (module.__doc__ or "").strip() else [module_name]
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    for name in names:
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(f"{module_name}.{name}")
        if not inspect.isclass(obj):
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_"):
                continue
            if isinstance(member, property):
                doc = member.__doc__
            elif inspect.isfunction(getattr(member, "__func__", member)):
                doc = inspect.getdoc(getattr(obj, attr))
            else:
                continue
            if not (doc or "").strip():
                missing.append(f"{module_name}.{name}.{attr}")
    return missing


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_names_have_docstrings(module_name):
    assert _undocumented(module_name) == []


def test_package_docstring_points_to_every_entry_point():
    import onnxtrain

    for name in ("ORTModule", "onnxtrain.artifacts", "onnxtrain.api", "onnxtrain.hf", "onnxtrain.optim",
                 "onnxtrain grad", "onnxtrain artifacts", "python -m onnxtrain"):
        assert name in onnxtrain.__doc__, name


def test_load_checkpoint_is_documented():
    from onnxtrain.api import CheckpointState

    assert "checkpoint" in inspect.getdoc(CheckpointState.load_checkpoint).lower()
