"""What eager PyTorch does under the current ``torch.autocast`` state: each output's dtype, and where the
forward leaves autocast's precision (its products in another type, its branches on the autocast state).

ORTModule captures the float32 graph (autocast off) and runs its precision on the backend; to hand the
user's code what eager autocast would (bfloat16 logits, a float32 loss after cross-entropy, a float32
LayerNorm output), it asks PyTorch itself: the module's forward runs once under the caller's autocast state
on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes only, no arithmetic, no memory for
the activations). The dtypes are then exactly eager's, from the same Python code and the same dispatcher's
autocast rules (per op, including the ops autocast keeps float32 and those it promotes), which a rule table
read off the exported graph would have to copy and keep in step with every torch release.

The same run says what the backend's precision cannot follow (:class:`AutocastRun`):

- **products** (matrix products, convolutions, attention) that eager runs in a type other than autocast's:
  an ``autocast(enabled=False)`` region or ``@torch.autocast`` decorator, ``torch.amp.custom_fwd(
  cast_inputs=torch.float32)``, a float64 tensor, a nested autocast of the other low type, or an op autocast
  keeps float32 (``torch.mv``, ``torch.dot``). The backend lowers every product of the float32 graph, so
  such a product would run in bfloat16 (float16) where eager runs it in float32: 1000x its error, silently.
  They are seen where the dispatcher runs them, below autocast (a :class:`TorchDispatchMode` inside the fake
  mode), with the dtypes autocast gave their operands.
- **reads of the autocast state** (``torch.is_autocast_enabled()``) by the model's code that return True:
  the float32 graph is traced with autocast off, where the same read returns False, so the graph would
  hold the other branch.

An op whose output size depends on values (``nonzero``, boolean indexing) gets a symbolic size (the fake mode
has a shape environment). A forward that fake tensors still cannot run (it branches on a tensor's value, or
an op has no fake kernel for these dtypes: Hugging Face Mixtral's grouped matmul of float32 weights) raises
:class:`AutocastDtypeError`; ORTModule then falls back under bf16, where every product would be lowered
unchecked, and elsewhere returns the graph's float32 outputs and says why once.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from onnxtrain.capture.flatten import flatten, unflatten

# The aten ops the dispatcher runs a product as, below autocast (linear and matmul arrive as mm/addmm/bmm,
# conv2d as convolution, einsum as bmm); autocast lowers the first ones and keeps mv, dot and addmv float32,
# and cdist (``_cdist_forward``), which the exported graph computes with a MatMul (its output 15x further from
# float64 than eager's when that ran bf16), and the grouped matmul of MoE experts (``_grouped_mm``: Hugging
# Face Mixtral casts its input to the float32 weights' type, so eager runs it float32; bf16 on OpenVINO its
# ``down_proj`` gradient was 20x further from float64 than eager autocast's).
# Also ops eager computes without a product that the graph computes with one (the OpInfo sweep under autocast
# bf16, tests/opinfo/autocast.py: their outputs a bf16 rounding, 2e-3, from float64, eager's 4e-8): ``addr`` (an
# outer product, a MatMul in the graph) and ``_trilinear`` (``F.bilinear``'s); ``avg_pool2d/3d`` with
# ``divisor_override`` (window sums as a Conv of ones, capture/pooling.py) and ``torch.einsum`` of several
# operands that ran no product in eager (``"i,j->ij"``: a ``mul``; an Einsum in the graph) are filed as products
# by :class:`_Products` and :class:`_Attention`.
PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "convolution",
                      "_convolution", "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_attention_math", "_native_multi_head_attention", "_cdist_forward",
                      "_grouped_mm", "addr", "_trilinear"})
# Ops OpenVINO's CPU plugin lowers by itself at its bfloat16 hint (its Interpolate, a node it runs in bf16 as
# it does products), where eager autocast keeps them float32: products for the bf16 graphs only (onnxruntime
# runs the fp16 graphs' Resize float32). Their outputs were 2e-3 from float64 against eager's 2e-8.
OPENVINO_PRODUCTS = frozenset({"upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
                               "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"})
_POOLS = frozenset({"avg_pool2d", "avg_pool3d"})  # a product where given divisor_override (their 7th argument)
# Functions that report the autocast state; a True read by the model's code makes the float32 trace differ.
_STATE_READS = ("is_autocast_enabled", "is_autocast_cpu_enabled")
# Readers whose choice makes no difference to the float32 trace: Hugging Face's ``maybe_autocast`` picks
# between ``torch.autocast(..., enabled=False)`` and no region, and autocast is off during the trace anyway
# (a product inside such a region is still seen as a float32 product).
_HARMLESS_READERS = frozenset({("transformers.utils.generic", "maybe_autocast")})


class AutocastDtypeError(RuntimeError):
    """The forward could not run on fake tensors, so eager autocast's output dtypes are unknown."""


@dataclass
class AutocastRun:
    """What the forward did on fake tensors under the caller's autocast state."""

    dtypes: list[torch.dtype]  # each flattened output's dtype
    shapes: list[tuple[int, ...] | None] = field(default_factory=list)  # and its shape (None: a symbolic size)
    products: dict[str, set[torch.dtype]] = field(default_factory=dict)  # aten product -> its operands' dtypes
    reads: list[str] = field(default_factory=list)  # "torch.is_autocast_enabled (file:line)" that returned True
    # (aten product, dtype) -> the model's line that first ran it so ("file:line"; the innermost frame outside
    # torch and onnxtrain), for the reason a product off autocast's policy gives
    sites: dict[tuple[str, torch.dtype], str] = field(default_factory=dict)
    # The operand dtypes of the products run inside ``F.scaled_dot_product_attention`` (not in ``products``): on
    # CPU under autocast its math kernel (chosen with dropout_p > 0) computes in float32 from the low-type
    # inputs, its flash kernel in the low type
    attention: set[torch.dtype] = field(default_factory=set)
    attention_site: str | None = None  # the model's line of the first attention call
    attention_dropout: bool = False  # whether some attention call was made with dropout_p > 0

    def off_policy(self, low: torch.dtype, lowered: frozenset, openvino: bool = False) -> list[str]:
        """The products eager runs in a type the backend would lower to ``low``: "mm in torch.float32 at
        model.py:12". ``openvino``: the bf16 graphs' backend, which lowers :data:`OPENVINO_PRODUCTS` too."""
        return [f"{name} in {dtype}" + (f" at {self.sites[name, dtype]}" if (name, dtype) in self.sites else "")
                for name, dtypes in self.products.items() for dtype in sorted(dtypes, key=str)
                if dtype != low and dtype in lowered and (openvino or name not in OPENVINO_PRODUCTS)]


class _Attention(TorchFunctionMode):
    """Marks the calls of ``F.scaled_dot_product_attention`` (however the model imported it), so that
    :class:`_Products` files the products its kernel runs under the attention; and files a ``torch.einsum`` of
    several operands that runs no product as a product in its operands' type (the graph's Einsum is one)."""

    def __init__(self, run: AutocastRun):
        super().__init__()
        self.run, self.depth = run, 0
        self.einsum_products: list[int] = []  # per einsum call being run: the products run inside it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) == "einsum" and not self.einsum_products:
            return self._einsum(func, args, kwargs or {})
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        if self.run.attention_site is None:
            self.run.attention_site = _model_line()
        kwargs = kwargs or {}
        dropout_p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        if isinstance(dropout_p, (int, float)) and dropout_p > 0:
            self.run.attention_dropout = True
        self.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= 1

    def _einsum(self, func, args, kwargs):
        self.einsum_products.append(0)
        try:
            out = func(*args, **kwargs)
        finally:
            products = self.einsum_products.pop()
        operands = [t for t in _leaves(args) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if len(operands) > 1 and not products:
            dtypes = {t.dtype for t in operands}
            seen = self.run.products.setdefault("einsum", set())
            site = _model_line()
            for dtype in dtypes - seen:
                if site is not None:
                    self.run.sites["einsum", dtype] = site
            seen.update(dtypes)
        return out


def _leaves(value):
    """The items of nested lists and tuples (``torch.einsum(equation, [a, b])`` passes its operands in one)."""
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


class _Products(TorchDispatchMode):
    """Records the operand dtypes of each product the dispatcher runs (after autocast cast them), and where the
    model's code first ran each product in each dtype; those inside attention go to ``AutocastRun.attention``."""

    def __init__(self, products: dict[str, set[torch.dtype]], sites: dict[tuple[str, torch.dtype], str],
                 attention: _Attention | None = None):
        super().__init__()
        self.products, self.sites, self.attention = products, sites, attention

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _POOLS and (len(args) > 6 and args[6] is not None or (kwargs or {}).get("divisor_override")):
            name = f"{name}(divisor_override)"
        elif name not in PRODUCTS and name not in OPENVINO_PRODUCTS:
            return func(*args, **(kwargs or {}))
        if self.attention is not None and self.attention.einsum_products:
            self.attention.einsum_products[-1] += 1
        dtypes = {t.dtype for t in (*args, *(kwargs or {}).values())
                  if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if self.attention is not None and self.attention.depth:
            self.attention.run.attention.update(dtypes)
            return func(*args, **(kwargs or {}))
        seen = self.products.setdefault(name, set())
        if not dtypes <= seen:
            site = _model_line()
            for dtype in dtypes - seen:
                if site is not None:
                    self.sites[name, dtype] = site
        seen.update(dtypes)
        return func(*args, **(kwargs or {}))


def _model_line() -> str | None:
    """"file:line" of the innermost caller outside torch and onnxtrain (the model's code), or None."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in ("torch", "onnxtrain"):  # an installed package's path from its name on
            return f"{frame.f_code.co_filename.rpartition('site-packages/')[2]}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class _StateReads:
    """Wraps torch's autocast-state functions to record the model's reads that return True."""

    def __init__(self, reads: list[str]):
        self.reads = reads

    def __enter__(self):
        self.originals = {name: getattr(torch, name) for name in _STATE_READS if hasattr(torch, name)}
        for name, original in self.originals.items():
            setattr(torch, name, self._recording(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(torch, name, original)
        return False

    def _recording(self, name, original):
        def read(*args, **kwargs):
            value = original(*args, **kwargs)
            frame = sys._getframe(1)
            module = frame.f_globals.get("__name__", "")
            if (value and module != "torch" and not module.startswith("torch.")
                    and (module, frame.f_code.co_name) not in _HARMLESS_READERS):
                self.reads.append(f"torch.{name} ({frame.f_code.co_filename}:{frame.f_lineno})")
            return value
        return read


def autocast_run(module: torch.nn.Module, args: tuple, kwargs: dict) -> AutocastRun:
    """Run the module's forward on fake tensors under the autocast state the caller is in: each flattened
    output's dtype (``flatten(module(*args, **kwargs), "output")``'s order), its products' operand dtypes and
    its reads of the autocast state. Neither the module's parameters and buffers nor the RNG change: the
    forward runs on fake copies (the caller still restores buffers, as around export)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    cache = torch.is_autocast_cache_enabled()
    # Autocast caches its casts of parameters for the rest of the caller's region: fake casts must not stay
    # there, where the caller's next eager op on these parameters would read them.
    torch.set_autocast_cache_enabled(False)
    run = AutocastRun([])
    try:
        # A shape environment lets an op whose output size depends on values (nonzero, boolean indexing: ELECTRA's
        # loss over the unmasked tokens) return a symbolic size instead of failing the run.
        attention = _Attention(run)
        with (FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()) as mode,
              attention,
              _Products(run.products, run.sites, attention),
              _StateReads(run.reads)):
            flat, spec = flatten((tuple(args), dict(kwargs)))
            fake_args, fake_kwargs = unflatten([mode.from_tensor(t, static_shapes=True) for t in flat], spec)
            out = module(*fake_args, **fake_kwargs)
            flat_out = flatten(out, "output")[0]
            run.dtypes = [t.dtype for t in flat_out]
            run.shapes = [tuple(t.shape) if all(isinstance(n, int) for n in t.shape) else None for t in flat_out]
            return run
    except Exception as exc:  # noqa: BLE001 - any failure means: not known, keep the graph's dtypes
        raise AutocastDtypeError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    finally:
        torch.set_autocast_cache_enabled(cache)

