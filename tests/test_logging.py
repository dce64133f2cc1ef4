"""onnxtrain's log level just works: messages on stderr without configuring Python logging, only ours,
the root logger untouched, and no double lines once the user configures logging themselves."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from onnxtrain import DebugOptions, ORTModule


@pytest.fixture
def unconfigured_logging(monkeypatch):
    """Call it first in the test: logging as in a fresh script, no handler on the root logger (pytest adds
    its capturing handlers when the test starts, so they are set aside then)."""
    ours = logging.getLogger("onnxtrain")
    yield lambda: monkeypatch.setattr(logging.getLogger(), "handlers", [])
    for handler in list(ours.handlers):
        ours.removeHandler(handler)
    ours.setLevel(logging.NOTSET)
    logging.getLogger("onnxtrain.ortmodule").setLevel(logging.NOTSET)


def _train_once(options):
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()), options)
    model(torch.randn(2, 4)).sum().backward()


def _lines(text):
    return [line for line in text.splitlines() if line.strip()]


def test_info_level_prints_on_stderr_without_configuring_logging(unconfigured_logging, capsys):
    unconfigured_logging()
    _train_once(DebugOptions(log_level="INFO"))
    err = _lines(capsys.readouterr().err)
    start = "onnxtrain INFO onnxtrain.ortmodule: exporting Sequential for a new input schema (s0_0) in this process: "
    assert len([line for line in err if line.startswith(start)]) == 1, err
    assert all(line.startswith("onnxtrain ") for line in err), err  # nobody else's chatter
    assert logging.getLogger().handlers == []  # the root logger is left alone


def test_default_level_is_silent(unconfigured_logging, capsys):
    unconfigured_logging()
    _train_once(DebugOptions())
    assert _lines(capsys.readouterr().err) == []


def test_user_logging_configuration_gets_each_message_once(unconfigured_logging, capsys):
    unconfigured_logging()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("USER %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    _train_once(DebugOptions(log_level="INFO"))
    exporting = [line for line in _lines(capsys.readouterr().err) if "exporting Sequential" in line]
    assert len(exporting) == 1, exporting
    assert exporting[0].startswith("USER onnxtrain.ortmodule: exporting Sequential for a new input schema (s0_0) in "
                                   "this process: "), exporting


SCRIPT = textwrap.dedent("""
    import torch
    from onnxtrain import ORTModule

    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()))
    model(torch.randn(2, 4)).sum().backward()
""")


def test_env_log_level_is_followed_in_a_fresh_process():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "ONNXTRAIN_LOG_LEVEL": "INFO"})
    assert result.returncode == 0, result.stderr
    assert "onnxtrain INFO onnxtrain.ortmodule: exporting Sequential" in result.stderr, result.stderr
