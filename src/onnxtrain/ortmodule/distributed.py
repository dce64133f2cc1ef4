"""ORTModule under DeepSpeed ZeRO and FSDP2 (``docs/distributed.md``).

ORTModule runs its module as one graph that reads every parameter at once, where eager PyTorch reads them
module by module. What the wrappers need from it:

- **DeepSpeed ZeRO-1/2** partition the optimizer states and gradients only: the gradients ORTModule's
  backward hands to autograd reach DeepSpeed's per-parameter hooks as in eager. Nothing to do.
- **DeepSpeed ZeRO-3** partitions the parameters and gathers each module's in its forward hooks. ORTModule
  flags itself as a ZeRO-3 *leaf module* (DeepSpeed's ``_z3_leaf`` attribute, read by
  ``deepspeed.initialize``): DeepSpeed then gathers all of its parameters before its forward and again
  before its backward, and hooks none of the submodules (whose forwards the graph replaces). DeepSpeed
  reduces a leaf module's gradients in a full backward hook on it, which PyTorch fires as soon as the
  gradients of the module's *outputs* are known when no input requires grad (token ids): before the graph's
  backward has produced the parameters' gradients. So a full backward hook registered on an ORTModule whose
  parameters are ZeRO-3 partitions is deferred: it runs once, at the end of the backward pass
  (:func:`register_deferred`, :func:`after_backward`).
- **A partition is never fed to onnxruntime**: :func:`partitioned` names the ZeRO-3 parameters that are not
  gathered when the graph is about to run, and ORTModule raises instead.
- **FSDP2** (``fully_shard``) around the ORTModule unshards every parameter in its pre-forward hook and
  reduce-scatters the gradients autograd accumulates: exact as it is. ``fully_shard`` on submodules *inside*
  the ORTModule leaves their parameters sharded (DTensors) when the one graph would read them: ORTModule
  falls back to PyTorch at its first call, with the reason :func:`unsupported` gives.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle


def is_zero3(param: torch.Tensor) -> bool:
    """Whether ``param`` is managed by DeepSpeed ZeRO-3 (it carries DeepSpeed's partition attributes)."""
    return hasattr(param, "ds_id") and hasattr(param, "ds_status")


def partitioned(named: dict[str, torch.Tensor]) -> list[str]:
    """The names of the ZeRO-3 parameters in ``named`` that hold only this rank's partition now."""
    return [name for name, p in named.items()
            if is_zero3(p) and getattr(p.ds_status, "name", "") == "NOT_AVAILABLE"]


def unsupported(module: torch.nn.Module) -> str | None:
    """A one-line reason why ORTModule cannot run ``module`` as one graph under FSDP2, or ``None``."""
    from torch.distributed.tensor import DTensor

    sharded = [name for name, p in module.named_parameters() if isinstance(p, DTensor)]
    if not sharded:
        return None
    return (f"FSDP2 fully_shard on submodules inside the ORTModule leaves {len(sharded)} parameters sharded "
            f"(DTensors, e.g. {sharded[0]!r}) when its one graph reads them all; apply fully_shard to the "
            "ORTModule itself (around the whole model) to train in onnxruntime")


def register_deferred(hooks: dict, hook) -> RemovableHandle:
    """Keep a full backward hook in ``hooks`` to run at the end of the backward pass (see the docstring)."""
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def after_backward(module: torch.nn.Module, hooks: dict, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``outputs`` through an identity whose backward queues ``hooks`` to run when the backward pass ends,
    after every parameter's gradient has been accumulated."""
    if not hooks or not torch.is_grad_enabled():
        return outputs
    flags = [isinstance(t, torch.Tensor) and t.requires_grad for t in outputs]
    if not any(flags):
        return outputs
    through = _AfterBackward.apply(module, hooks, *(t for t, f in zip(outputs, flags) if f))
    it = iter(through)
    return [next(it) if f else t for t, f in zip(outputs, flags)]


class _AfterBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, hooks, *tensors):
        ctx.module, ctx.hooks = module, hooks
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        module, hooks = ctx.module, list(ctx.hooks.values())

        def run():
            for hook in hooks:
                hook(module, (), ())

        torch.autograd.Variable._execution_engine.queue_callback(run)
        return (None, None, *grads)
