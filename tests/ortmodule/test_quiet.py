"""The exporter's chatter stays out of the console; our own warnings are short, the details kept."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from onnxtrain import DebugOptions, ORTModule
from onnxtrain.capture.quiet import quiet_exporter, summary
from tests.ortmodule.models import Unexportable


def test_export_prints_nothing_at_the_default_level(capfd):
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(3, 4)).sum().backward()
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert [str(w.message) for w in caught] == []


def test_exporter_output_is_kept_at_debug(caplog, capsys):
    with caplog.at_level(logging.DEBUG, logger="onnxtrain.capture"), quiet_exporter(verbose=False):
        print("[torch.onnx] Obtain model graph ...")
        logging.getLogger("torch.onnx._internal.exporter._registration").warning("torchvision is not installed")
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning)
    assert capsys.readouterr() == ("", "")
    assert "Obtain model graph" in caplog.text
    assert "torchvision" not in caplog.text.replace("the exporter printed", "")


def test_verbose_lets_the_exporter_talk(capsys):
    with quiet_exporter(verbose=True):
        print("[torch.onnx] Obtain model graph ...")
    assert "Obtain model graph" in capsys.readouterr().out


def test_summary_is_one_short_line():
    long = "ExportError: could not export\n" + "graph():\n    %x = placeholder\n" * 200
    line = summary(long)
    assert "\n" not in line and len(line) <= 300 and line.startswith("ExportError: could not export graph():")
    assert summary("short reason") == "short reason"


def test_fallback_warning_is_short_and_names_where_the_details_are(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "1")

    model = ORTModule(Unexportable(), DebugOptions())
    with pytest.warns(UserWarning, match="falls back to PyTorch") as caught:
        model(torch.ones(1, 2))
    message = str(caught[0].message)
    assert len(message.splitlines()) <= 2 and len(message) < 600, message
    assert "model.fallback_reason" in message and "ONNXTRAIN_FALLBACK=0" in message
    assert len(model.fallback_reason) > len(message.splitlines()[0]) - 80  # the full reason is kept there
