"""A forward whose backward PyTorch would not derive from its ops: refused at capture.

ORTModule's backward is the gradient of the exported forward's ops (``autodiff/``). Two things in a forward
make PyTorch's backward something else, and the exporters keep neither:

- a custom ``torch.autograd.Function``: its ``forward`` is traced, its ``backward`` dropped, so a
  straight-through estimator (``round`` forward, identity backward) would train with zero gradients and a
  gradient-reversal layer with the wrong sign;
- ``Tensor.register_hook`` on an intermediate tensor: the hook would never run.

While capture runs, :func:`refusing_custom_backward` makes both raise :class:`~onnxtrain.capture.refuse.Refused`
naming what the forward called, so the module runs in PyTorch (decided before training). PyTorch's own
Functions are let through: their backward is their forward's gradient (reentrant activation checkpointing,
and the Functions torch.library generates for ops with a registered autograd formula, which tracing itself
calls, e.g. for ``prims.convert_element_type``). So are the Functions named in :data:`FORWARD_GRADIENT`:
others' Functions whose backward we read and found to be their forward's gradient, kept for memory or
speed (DeepSpeed ZeRO-3 swaps ``F.linear`` for one), and those a user declares with
:func:`declare_forward_gradient`.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from onnxtrain.capture.refuse import Refused

#: Qualified names of third-party Functions whose ``backward`` is the gradient of their ``forward``, each
#: read against its source: what tracing keeps (the forward's ops) is then what PyTorch's backward computes.
FORWARD_GRADIENT: set[str] = {
    # DeepSpeed 0.19: matmul(+bias) forward; backward grad_output @ W, grad_output^T @ x, sum(grad_output),
    # the weight gathered again if ZeRO-3 partitioned it after the forward (tests/distributed).
    "deepspeed.runtime.zero.linear.LinearFunctionForZeroStage3",
    # transformers 5.x BLOOM's GELU (every BloomForCausalLM MLP): forward x/2 (1 + tanh(u)),
    # u = 0.79788456 (x + 0.044715 x^3); backward (1 + tanh u)/2 + x/2 (1 - tanh^2 u) du/dx, with
    # du/dx = 0.79788456 + 0.1070322243 x^2 (= 3 * 0.044715 * 0.79788456): the forward's exact derivative.
    "transformers.models.bloom.modeling_bloom.GeLUFunction",
}


def declare_forward_gradient(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Declare that FUNCTION's ``backward`` computes the gradient of its ``forward``'s ops.

    ORTModule then traces through it (its forward's ops go into the graph, whose backward is their
    gradient) instead of running the module in PyTorch. Declare only a Function whose backward is exactly
    that (one that saves memory or fuses kernels); a straight-through estimator or a gradient-reversal layer
    would then train with the wrong gradients. Usable as a class decorator; returns FUNCTION.
    """
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise TypeError(f"declare_forward_gradient takes a torch.autograd.Function subclass, not {function!r}")
    FORWARD_GRADIENT.add(_name(function))
    return function


def _name(function: type) -> str:
    return f"{function.__module__}.{function.__qualname__}"


@contextlib.contextmanager
def refusing_custom_backward():
    """While the block runs, a custom autograd.Function or a tensor hook in the forward raises Refused."""
    base = torch.autograd.Function
    apply, register_hook = base.__dict__["apply"], torch.Tensor.register_hook

    def refusing_apply(cls, *args, **kwargs):
        if cls.__module__.partition(".")[0] != "torch" and _name(cls) not in FORWARD_GRADIENT:
            raise Refused(f"the forward calls the custom autograd.Function {_name(cls)}, whose backward the "
                          "graph cannot run (it would use the gradient of the Function's forward ops instead); "
                          "it runs in PyTorch (onnxtrain.ortmodule.declare_forward_gradient declares a Function "
                          "whose backward is its forward's gradient)")
        # ``apply`` is a classmethod (torch 2.13) or a C classmethod descriptor (2.15): bind it either way.
        return apply.__get__(None, cls)(*args, **kwargs)

    def refusing_hook(self, hook):
        if sys._getframe(1).f_globals.get("__name__", "").partition(".")[0] == "torch":
            return register_hook(self, hook)  # PyTorch's own machinery, not the forward's
        name = getattr(hook, "__qualname__", type(hook).__name__)
        raise Refused(f"the forward registers a hook ({name}) on a tensor with Tensor.register_hook, which "
                      "would never run inside the graph's backward; it runs in PyTorch")

    base.apply = classmethod(refusing_apply)
    torch.Tensor.register_hook = refusing_hook
    try:
        yield
    finally:
        base.apply = apply
        torch.Tensor.register_hook = register_hook
