"""The dtype each output of a module call has in eager PyTorch under the current ``torch.autocast`` state.

ORTModule captures the float32 graph (autocast off) and runs its precision on the backend; to hand the
user's code what eager autocast would (bfloat16 logits, a float32 loss after cross-entropy, a float32
LayerNorm output), it asks PyTorch itself: the module's forward runs once under the caller's autocast state
on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes only, no arithmetic, no memory for
the activations). The dtypes are then exactly eager's, from the same Python code and the same dispatcher's
autocast rules (per op, including the ops autocast keeps float32 and those it promotes), which a rule table
read off the exported graph would have to copy and keep in step with every torch release.

A forward that fake tensors cannot run (it reads a tensor's value: ``.item()``, a data-dependent branch)
raises :class:`AutocastDtypeError`; ORTModule then returns the graph's float32 outputs, as before, and says
why once.
"""

from __future__ import annotations

import torch

from onnxtrain.capture.flatten import flatten, unflatten


class AutocastDtypeError(RuntimeError):
    """The forward could not run on fake tensors, so eager autocast's output dtypes are unknown."""


def autocast_output_dtypes(module: torch.nn.Module, args: tuple, kwargs: dict) -> list[torch.dtype]:
    """The dtype of each flattened output (``flatten(module(*args, **kwargs), "output")``'s order) that eager
    PyTorch gives under the autocast state the caller is in. Neither the module's parameters and buffers nor
    the RNG change: the forward runs on fake copies (the caller still restores buffers, as around export)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = torch.is_autocast_cache_enabled()
    # Autocast caches its casts of parameters for the rest of the caller's region: fake casts must not stay
    # there, where the caller's next eager op on these parameters would read them.
    torch.set_autocast_cache_enabled(False)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            flat, spec = flatten((tuple(args), dict(kwargs)))
            fake_args, fake_kwargs = unflatten([mode.from_tensor(t) for t in flat], spec)
            out = module(*fake_args, **fake_kwargs)
            return [t.dtype for t in flatten(out, "output")[0]]
    except Exception as exc:  # noqa: BLE001 - any failure means: not known, keep the graph's dtypes
        raise AutocastDtypeError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    finally:
        torch.set_autocast_cache_enabled(cache)

