"""PyTorch's OpInfo database through ORTModule under ``torch.autocast("cpu", dtype=torch.bfloat16)``.

The float32 sweep's samples (:mod:`tests.opinfo.harness`: the same ops, the first ``SAMPLES_PER_OP`` samples,
the two ways ``"inputs"``/``"params"``), float32 tensors and parameters as a user's model has them, each run
three times:

- **eager autocast**: the module in PyTorch under ``torch.autocast("cpu", dtype=torch.bfloat16)``;
- **ORTModule** under the same autocast (a fresh one per sample; OpenVINO with its bfloat16 hint and the
  precision policy, docs/precision.md);
- **the reference**: the same sample cast to float64, eager, autocast off. A sample that draws random numbers
  (its outputs change with torch's seed) takes float32 eager without autocast instead: float64 draws other
  numbers from the same seed (``torch.rand``, ``normal``, ``bernoulli`` draw by dtype), and eager autocast draws
  float32's.

Each output and each gradient of the fixed random weighting of the outputs (the float32 sweep's generator and
seed, rounded to bfloat16 so that every side's backward starts from the same exact numbers) is compared:

- the outputs' number, types, shapes and **dtypes** must be eager autocast's exactly (a bfloat16 output where
  eager returns float32, or the reverse, is wrong), and so must the gradients';
- integer and bool outputs must equal eager autocast's or the reference's;
- the NaN and +-inf places of a float tensor must be eager autocast's or the reference's (cast to the tensor's
  dtype, so that an overflow of the low type counts as eager's does);
- on the places all three have finite, ORTModule's norm-relative error against the reference is at most
  :func:`bound` of eager autocast's: ``RATIO`` times it (at least ``ROUNDING``, one bfloat16 rounding of each
  value, where eager's shows it rounded), plus ``FLOOR``; each error is ``|x - ref| / s`` with ``s = max(|ref|,
  SCALE_FLOOR * the largest |ref| among the sample's outputs (gradients), for outputs also SCALE_FLOOR * the
  largest norm of its float inputs)``, as the families' test takes it (tests/ortmodule/test_families_bf16.py).
  The floor is far below a bfloat16 rounding (7e-4 and more, measured) and above float32 noise (3e-5 at most),
  so an op that autocast leaves in float32 (eager exact to float32) must stay float32 in the graph too: where
  OpenVINO's hint lowered it, its error is a bfloat16 rounding's and the sample is wrong. docs/opinfo.md says how
  the numbers were chosen.

Statuses as the float32 sweep's (``pass``, ``fallback``, ``error``, ``wrong``, ``skip``); a pass or wrong sample
also says where its graphs ran (``ran``: backend and precision) and what eager autocast returned (``kind``:
``bf16`` where any output is bfloat16, else ``f32``). ``tests/opinfo/test_opinfo_bf16.py`` runs the subset in the
default suite and the whole sweep under the ``opinfo_bf16`` marker; ``python -m tests.opinfo.table --bf16``
prints the table of docs/opinfo.md.
"""

from __future__ import annotations

import contextlib
import gc
import io
import warnings
from dataclasses import dataclass

import torch

from tests.opinfo import harness

RATIO = 2.0
FLOOR = 1e-4
ROUNDING = 2.0**-8  # bfloat16's unit roundoff (8 significant bits): one rounding of each value, norm-relative
SCALE_FLOOR = 1e-2
COLLECT_EVERY = 25  # samples between garbage collections (sweep)

# The default suite's subset: one op or two per class of the precision policy (docs/opinfo.md)
SUBSET = (
    "matmul", "nn.functional.linear", "addmm",  # products autocast lowers
    "nn.functional.layer_norm", "softmax",  # normalizations autocast keeps float32
    "sum", "var", "cumsum",  # reductions (left alone; cumsum kept float32 on OpenVINO, openvino_float32)
    "nn.functional.cross_entropy", "nn.functional.mse_loss",  # losses (float32 in autocast)
    "exp", "pow",  # elementwise ops autocast keeps float32
    "add", "tanh", "where",  # ops it leaves alone (float32 in, float32 out)
)


@dataclass
class Bf16Result(harness.Result):
    ran: str = ""  # where the graphs ran ("openvino/bf16"), for a sample that ran in them
    kind: str = ""  # "bf16" where eager autocast returns a bfloat16 output, else "f32"
    worst: tuple = ()  # (what, ORTModule's error, eager autocast's) of the tensor nearest its bound


def run_sample(op, sample, mode: str, index: int = 0) -> Bf16Result:
    """Run one sample under autocast bf16 in eager, under a fresh ORTModule and as the reference; classify it."""
    with harness._seeded_by_caller():
        return _run_sample(op, sample, mode, index)


def sweep(names=None, modes=harness.MODES, count: int = harness.SAMPLES_PER_OP, progress=None):
    """Every sample of every swept op (or of ``names``) under autocast bf16; yields :class:`Bf16Result`s."""
    for k, result in enumerate(harness.sweep(names, modes, count, progress, run=run_sample)):
        if k % COLLECT_EVERY == COLLECT_EVERY - 1:
            # a dropped ORTModule's OpenVINO sessions wait in reference cycles for the collector, with their
            # threads (about 4 a sample): 5830 after the whole sweep, whose interpreter then took minutes to exit
            gc.collect()
        yield result


def _weights(outputs):
    """The float32 sweep's weighting, drawn in float32 and rounded to bfloat16 (exact in every float type)."""
    gen = torch.Generator().manual_seed(1234)
    return [(torch.rand(o.shape, generator=gen) + 0.5).bfloat16().double()
            if torch.is_tensor(o) and o.is_floating_point() else None for o in outputs]


def _run(module, inputs, grad_leaves, weights, autocast: bool):
    """Forward (under autocast bf16 or not), then backward of the weighted sum, summed in float64 outside
    autocast; the outputs (flattened) and the gradients."""
    for t in grad_leaves:
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outputs = harness._leaves(module(*inputs), [])
    if weights is None:
        weights = _weights(outputs)
    terms = [(o.double() * w).sum() for o, w in zip(outputs, weights)
             if w is not None and torch.is_tensor(o) and o.requires_grad and o.numel() > 0 and o.shape == w.shape]
    if terms:
        sum(terms).backward()
    return outputs, harness._grads(grad_leaves), weights


def _as_double(module, inputs):
    module.double()
    inputs = [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    return module, inputs, [t for t in inputs if t.requires_grad] + list(module.params)


def _same(a, b) -> bool:
    """Whether two runs' outputs are equal (NaN equal to NaN); outputs torch cannot compare so (sparse, complex
    half) count as equal: such an op is not taken for a random one."""
    try:
        return _equal(a, b)
    except (RuntimeError, NotImplementedError):
        return True


def _equal(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if torch.is_tensor(x) != torch.is_tensor(y):
            return False
        if torch.is_tensor(x) and not (x.shape == y.shape and torch.equal(x.isnan(), y.isnan())
                                       and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))):
            return False
    return True


def _quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


def _run_sample(op, sample, mode: str, index: int) -> Bf16Result:
    from onnxtrain import DebugOptions, ORTModule

    result = Bf16Result(harness.full_name(op), index, mode, "skip")
    fresh = harness.module_factory(op, sample, mode)
    if isinstance(fresh, str):
        result.reason = fresh
        return result

    try:
        with _quiet():
            torch.manual_seed(0)
            expected, expected_grads, weights = _run(*fresh(), None, autocast=True)
    except Exception as exc:  # noqa: BLE001 - a sample eager autocast cannot run is not ours to compare
        result.reason = f"eager autocast raises {type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        return result
    if not any(torch.is_tensor(o) for o in expected):
        result.reason = "returns no tensor"
        return result
    result.kind = "bf16" if any(torch.is_tensor(o) and o.dtype == torch.bfloat16 for o in expected) else "f32"

    try:
        with _quiet(), torch.no_grad():
            torch.manual_seed(1)
            module, inputs, _ = fresh()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                random = not _same(expected, harness._leaves(module(*inputs), []))
            torch.manual_seed(0)
        with _quiet():
            module, inputs, grad_leaves = fresh()
            if not random:
                module, inputs, grad_leaves = _as_double(module, inputs)
            torch.manual_seed(0)
            reference, reference_grads, _ = _run(module, inputs, grad_leaves, weights, autocast=False)
    except Exception as exc:  # noqa: BLE001
        result.reason = f"the float64 reference raises {type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        return result

    module, inputs, grad_leaves = fresh()
    model = ORTModule(module, DebugOptions(fallback=True))
    try:
        with _quiet():
            torch.manual_seed(0)
            actual, actual_grads, _ = _run(model, inputs, grad_leaves, weights, autocast=True)
    except Exception as exc:  # noqa: BLE001 - classified, not raised: the sweep reports every error
        result.status = "error"
        result.reason = harness.short_reason(f"{type(exc).__name__}: {exc}")
        return result
    if model.fallback_reason is not None:
        result.status = "fallback"
        result.reason = harness.short_reason(model.fallback_reason)
        return result
    result.ran = ",".join(sorted({f"{g.backend}/{g.precision}" for entries in model._cache.values()
                                  for g in entries}))
    input_norm = max((float(t.detach().double().nan_to_num(0.0, 0.0, 0.0).norm()) for t in [*inputs, *module.params]
                      if t.is_floating_point()), default=0.0)
    problem, result.worst = compare(expected, actual, reference, expected_grads, actual_grads, reference_grads,
                                    input_norm)
    result.status = "wrong" if problem else "pass"
    result.reason = problem or ""
    return result


def bound(e_eager: float) -> float:
    """The most ORTModule's norm-relative error may be where eager autocast's is ``e_eager``: ``RATIO`` times it,
    at least one bfloat16 rounding of each value where eager's shows it rounded to bfloat16 (over a few values the
    ratio of two roundings is chance: ``linalg.multi_dot`` of a 1x2 and a 2x1 matrix, a gradient of 2 values, was
    2.4e-3 against eager's 6.4e-4), plus ``FLOOR``."""
    return max(RATIO * e_eager, ROUNDING if e_eager >= FLOOR else 0.0) + FLOOR


def compare(expected, actual, reference, expected_grads, actual_grads, reference_grads, input_norm: float = 0.0):
    """(why ORTModule's outputs and gradients are not as close to the reference as the bound allows, or None;
    the (what, ORTModule's error, eager autocast's) of the tensor nearest its bound). ``input_norm``: the largest
    norm of the sample's float inputs, which the outputs' scale is at least ``SCALE_FLOOR`` of."""
    if len(actual) != len(expected):
        return f"{len(expected)} outputs in eager autocast, {len(actual)} here", ()
    worst, used = (), -1.0
    for group, triples, least in (("output", zip(expected, actual, reference), input_norm),
                                  ("gradient", zip(expected_grads, actual_grads, reference_grads), 0.0)):
        measured = []
        for i, (e, a, r) in enumerate(triples):
            what = f"{group} {i}"
            problem = _compare_exact(what, e, a, r)
            if problem:
                return problem, ()
            if torch.is_tensor(e) and torch.is_tensor(a) and e.is_floating_point() and e.numel():
                measured.append((what, *_distances(e, a, r)))
        largest = max((norm for *_, norm in measured), default=0.0)
        for what, d_ort, d_eager, norm in measured:
            scale = max(norm, SCALE_FLOOR * max(largest, least), 1e-30)
            e_ort, e_eager = d_ort / scale, d_eager / scale
            if e_ort / bound(e_eager) > used:
                used, worst = e_ort / bound(e_eager), (what, e_ort, e_eager)
            if e_ort > bound(e_eager):
                return (f"{what}: {e_ort:.2e} from the reference, eager autocast {e_eager:.2e}"
                        + (f" ({e_ort / e_eager:.1f}x)" if e_eager else "")), worst
    return None, worst


def _compare_exact(what: str, e, a, r) -> str | None:
    """What must equal eager autocast's: types, shapes, dtypes, non-float values, NaN/inf places."""
    kind = harness.compare_kind(what, e, a, "eager autocast")
    if kind is not None:
        return kind or None
    e, a = e.detach(), a.detach()
    r = None if not torch.is_tensor(r) or r.shape != e.shape else r.detach()
    if not e.is_floating_point():
        if torch.equal(e, a) or (r is not None and torch.equal(r.to(a.dtype), a)):
            return None
        return f"{what}: values differ from eager autocast's ({int((e != a).sum())} of {e.numel()})"
    if not (_same_pattern(a, e) or (r is not None and _same_pattern(a, r.to(a.dtype)))):
        return f"{what}: NaN/inf places differ from eager autocast's and the reference's"
    return None


def _same_pattern(x, y) -> bool:
    return all(torch.equal(f(x), f(y)) for f in (torch.isnan, torch.isposinf, torch.isneginf))


def _distances(e, a, r):
    """(|ORTModule - reference|, |eager autocast - reference|, |reference|) over the places all three have
    finite; a gradient the reference has none of counts as zeros."""
    r = torch.zeros_like(e, dtype=torch.float64) if r is None else r.detach().double()
    e, a = e.detach().double(), a.detach().double()
    finite = e.isfinite() & a.isfinite() & r.isfinite()
    e, a, r = e[finite], a[finite], r[finite]
    return float((a - r).norm()), float((e - r).norm()), float(r.norm())
