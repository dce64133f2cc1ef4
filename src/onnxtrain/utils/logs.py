"""onnxtrain's log output: the ``onnxtrain`` logger's level, and a stderr handler when nobody else set one.

``DebugOptions(log_level="INFO")`` or ``ONNXTRAIN_LOG_LEVEL=INFO`` should print onnxtrain's messages
without the user configuring Python logging. :func:`set_level` sets the level of the ``onnxtrain``
logger (never the root logger, never another library's) and, while the user has configured no handler of
their own (on the root logger or on ``onnxtrain``), gives ``onnxtrain`` one handler writing to stderr.
Once the user configures logging, that handler is removed at the next call, so nothing prints twice.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "onnxtrain"
FORMAT = "onnxtrain %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """The handler onnxtrain adds itself (recognised by its class), writing to the current ``sys.stderr``."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT))

    @property
    def stream(self):
        return sys.stderr  # looked up on each record, so pytest's capture and redirects see it

    @stream.setter
    def stream(self, value):
        pass


def _user_configured(logger: logging.Logger) -> bool:
    own = [h for h in logger.handlers if not isinstance(h, _StderrHandler)]
    return bool(own or logging.getLogger().handlers)


def set_level(level: int) -> logging.Logger:
    """Set the ``onnxtrain`` logger to ``level`` (a Python logging level); add or drop our stderr handler."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    ours = [h for h in logger.handlers if isinstance(h, _StderrHandler)]
    if _user_configured(logger):
        for handler in ours:
            logger.removeHandler(handler)
    elif not ours:
        logger.addHandler(_StderrHandler())
    return logger
