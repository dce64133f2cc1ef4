"""Keep the exporter's chatter out of the user's console, and our own warnings short.

On every export, ``torch.onnx`` and ``torch.export`` talk: ``torchvision is not installed. Skipping ...``
log lines, ``[torch.onnx] Obtain model graph ...`` progress prints, deprecation warnings (``LeafSpec``), FX
graph dumps. None of it is for the user of ORTModule. :func:`quiet_exporter` silences it during an export
unless verbose logging was asked for (``LogLevel.VERBOSE``): their loggers go to ERROR, their warnings are
ignored, and what they print is kept and logged at DEBUG on ``onnxtrain.capture``.

:func:`summary` cuts a long reason (an exporter error with an FX dump) to one line for a warning; the full
text goes to the log at DEBUG, and where the caller keeps it (``ORTModule.fallback_reason``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator

logger = logging.getLogger("onnxtrain.capture")

EXPORTER_LOGGERS = ("torch.onnx", "torch.export", "torch._dynamo", "torch._export", "torch.fx", "onnxscript")
SUMMARY_CHARS = 300


@contextlib.contextmanager
def quiet_exporter(verbose: bool) -> Iterator[None]:
    """Silence the exporter's logs, warnings and prints for the ``with`` block, unless ``verbose``."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in EXPORTER_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    out, err = io.StringIO(), io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        printed = (out.getvalue() + err.getvalue()).strip()
        if printed:
            logger.debug("the exporter printed:\n%s", printed)


def summary(text: str, limit: int = SUMMARY_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters (the full text belongs in the log or a field)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3].rstrip() + "..."
