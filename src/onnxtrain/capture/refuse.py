"""Ops that the exporter translates into another function: refused, so that ORTModule runs the module in PyTorch.

A translation here raises :class:`Refused` with the op and the argument at fault. :func:`refused_reason` finds
it in the exporter's error, and capture then falls back at once, without trying the TorchScript exporter (which
could mistranslate the same op silently).
"""

from __future__ import annotations


class Refused(Exception):
    """An op (with these arguments) that no exporter translates into PyTorch's function."""


def refused_reason(exc: BaseException) -> str | None:
    """The message of a :class:`Refused` in ``exc``'s chain of causes, else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, Refused):
            return str(exc)
        exc = exc.__cause__ or exc.__context__
    return None


def special_log_ndtr(self):
    """``torch.special.log_ndtr``: the exporter's translation underflows to -inf for large negative x."""
    raise Refused("special.log_ndtr: the ONNX translation underflows to -inf for large negative inputs, where "
                  "PyTorch is finite; it runs in PyTorch")



def special_erfcx(self):
    """``torch.special.erfcx``: the exporter's translation differed from PyTorch's by up to 0.13 on op_db's samples."""
    raise Refused("special.erfcx: the ONNX translation differs from PyTorch's (by up to 0.13 on PyTorch's own "
                  "test samples); it runs in PyTorch")
