"""PyTorch's OpInfo database driven through ORTModule, one fresh ORTModule per sample.

For every op of ``op_db`` that supports autograd in float32 on CPU, the first ``SAMPLES_PER_OP`` samples are
run in eager PyTorch and under :class:`onnxtrain.ORTModule`, in one of two ways:

- ``"inputs"``: every tensor of the sample is an input of the module's forward (the float ones require grad);
- ``"params"``: the sample's input stays an input (as a model's data does); every other float tensor that
  requires grad is an ``nn.Parameter`` of the module (conv weights are parameters in real models), and the
  other tensors (indices, masks) stay inputs.

The forward outputs (values, shapes, dtypes, NaN/inf patterns) and the gradients of a fixed random
weighting of the outputs are compared with eager's, and the sample is classified:

- ``pass``: ORTModule ran it in onnxruntime and matched eager;
- ``fallback``: ORTModule decided before running that it runs in PyTorch (``fallback_reason``);
- ``error``: ORTModule raised (at run time, or while building graphs with the fallback off never happens here:
  the fallback is on);
- ``wrong``: it ran in onnxruntime and differed from eager;
- ``skip``: cannot be compared (ties whose winner PyTorch leaves unspecified, a sample eager itself cannot
  run), with the reason.

Random ops are compared too: torch is seeded the same way before both runs (op_db's own reseeding inside the
call, ``wrapper_set_seed``, is taken out of both), so ORTModule must draw what eager draws (dropout's masks,
:mod:`onnxtrain.passes.dropout_masks`) or fall back (``RandomDrawsError``).

``tests/opinfo/test_opinfo.py`` runs a representative subset in the default suite and the whole sweep under
the ``opinfo_full`` marker; ``python -m tests.opinfo.table`` prints the table of ``docs/opinfo.md``.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import warnings
from unittest import mock
from dataclasses import dataclass, field

import torch

SAMPLES_PER_OP = 2
MODES = ("inputs", "params")
RTOL, ATOL = 1e-3, 1e-4

# Ops that pick one of several equal elements, where PyTorch leaves which one unspecified: a sample whose
# tensors hold repeated values is skipped (the index, and where the gradient goes, may differ).
TIES = {
    "max.reduction_with_dim", "max.reduction_no_dim", "min.reduction_with_dim", "min.reduction_no_dim",
    "median", "nanmedian", "mode", "kthvalue", "sort", "msort", "topk", "cummax", "cummin", "aminmax",
    "nn.functional.max_pool1d", "nn.functional.max_pool2d", "nn.functional.max_pool3d",
    "nn.functional.adaptive_max_pool1d", "nn.functional.adaptive_max_pool2d",
    "nn.functional.adaptive_max_pool3d", "quantile", "nanquantile", "masked.median", "amax", "amin",
    "masked.amax", "masked.amin", "scatter_reduce.amax", "scatter_reduce.amin", "index_reduce.amax",
    "index_reduce.amin", "max.binary", "min.binary", "maximum", "minimum", "fmax", "fmin",
    "nn.functional.multilabel_margin_loss", "nn.functional.multi_margin_loss",
}
# The subset run in the default suite: the families training graphs use.
SUBSET = (
    "add", "mul", "div.no_rounding_mode", "pow", "exp", "log", "rsqrt", "tanh", "sigmoid", "where", "sum",
    "mean", "var", "amax", "logsumexp", "cumsum", "softmax", "log_softmax", "matmul", "bmm", "addmm",
    "reshape", "permute", "transpose", "squeeze", "unsqueeze", "cat", "split", "expand", "narrow", "gather",
    "index_select", "masked_fill", "__getitem__", "nn.functional.linear", "nn.functional.conv2d",
    "nn.functional.layer_norm", "nn.functional.embedding", "nn.functional.gelu", "nn.functional.silu",
    "nn.functional.cross_entropy", "nn.functional.mse_loss", "nn.functional.avg_pool2d",
    "nn.functional.max_pool2d", "nn.functional.pad.constant", "nn.functional.scaled_dot_product_attention",
    "nn.functional.dropout",
)


@dataclass
class Result:
    op: str
    index: int
    mode: str
    status: str  # pass, fallback, error, wrong, skip
    reason: str = ""

    @property
    def family(self) -> str:
        return family(self.op)


@dataclass
class Totals:
    counts: dict = field(default_factory=dict)

    def add(self, status: str) -> None:
        self.counts[status] = self.counts.get(status, 0) + 1


def full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def family(name: str) -> str:
    """The op family a table row groups by."""
    for prefix, fam in (("nn.functional.", "nn.functional"), ("linalg.", "linalg"), ("special.", "special"),
                        ("fft.", "fft"), ("masked.", "masked"), ("sparse.", "sparse")):
        if name.startswith(prefix):
            return fam
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, ReductionOpInfo, ShapeFuncInfo, UnaryUfuncInfo

    kind = _op_types().get(name)
    if kind in (UnaryUfuncInfo, BinaryUfuncInfo):
        return "elementwise"
    if kind is ReductionOpInfo:
        return "reductions"
    if kind is ShapeFuncInfo:
        return "shape"
    base = name.split(".")[0]
    if base in _INDEXING:
        return "indexing"
    if base in _SHAPE:
        return "shape"
    if base in _LINALG:
        return "linalg"
    return "other"


_INDEXING = {
    "gather", "index_fill", "index_copy", "index_select", "index_add", "index_reduce", "_unsafe_masked_index",
    "_unsafe_masked_index_put_accumulate", "__getitem__", "index_put", "put", "take", "scatter", "scatter_add",
    "scatter_reduce", "take_along_dim", "masked_fill", "masked_scatter", "masked_select", "select_scatter",
    "slice_scatter", "diagonal_scatter", "as_strided_scatter", "_segment_reduce", "embedding",
}
_SHAPE = {
    "broadcast_to", "broadcast_tensors", "block_diag", "chunk", "unsafe_chunk", "clone", "contiguous",
    "sum_to_size", "expand", "expand_as", "expand_copy", "diag", "diag_embed", "diagonal", "diagonal_copy",
    "alias_copy", "flip", "fliplr", "flipud", "narrow", "narrow_copy", "view_copy", "permute", "permute_copy",
    "roll", "rot90", "split", "unsafe_split", "split_with_sizes", "split_with_sizes_copy", "select", "slice",
    "tensor_split", "hsplit", "vsplit", "dsplit", "ravel", "reshape", "reshape_as", "view", "view_as",
    "atleast_1d", "atleast_2d", "atleast_3d", "flatten", "unflatten", "column_stack", "stack", "hstack", "cat",
    "unbind", "unbind_copy", "vstack", "dstack", "unfold", "unfold_copy", "movedim", "repeat", "squeeze",
    "squeeze_copy", "tile", "unsqueeze", "unsqueeze_copy", "transpose", "transpose_copy", "T", "H", "mT",
    "mH", "tril", "triu", "t", "t_copy", "diagflat", "as_strided", "as_strided_copy", "meshgrid",
    "repeat_interleave", "cartesian_prod", "combinations", "to", "bfloat16", "double", "float", "half",
    "cdouble", "cfloat", "chalf", "conj", "conj_physical", "resolve_conj", "resolve_neg", "positive",
}
_LINALG = {
    "addmm", "addmv", "addbmm", "baddbmm", "dot", "vdot", "bmm", "mv", "addr", "matmul", "mm", "outer",
    "inner", "kron", "tensordot", "einsum", "cholesky", "cholesky_inverse", "cholesky_solve", "lu_unpack",
    "lu", "lu_solve", "matrix_exp", "ormqr", "qr", "svd", "pinverse", "triangular_solve", "logdet", "trace",
    "__rmatmul__", "cdist", "dist", "cross", "norm",
}


_TYPES: dict | None = None


def _op_types() -> dict:
    global _TYPES
    if _TYPES is None:
        _TYPES = {full_name(op): type(op) for op in op_db()}
    return _TYPES


def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def swept_ops(names=None):
    """The ops of ``op_db`` the sweep covers (autograd, float32 on CPU), in op_db's order; ``names`` picks some."""
    ops = [op for op in op_db() if op.supports_autograd and torch.float32 in op.supported_dtypes("cpu")]
    if names is not None:
        wanted = set(names)
        ops = [op for op in ops if full_name(op) in wanted]
    return ops


def samples(op, count: int = SAMPLES_PER_OP):
    """The first ``count`` samples of ``op``, float32 on CPU, float tensors requiring grad."""
    torch.manual_seed(0)
    out = []
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=True):
        out.append(sample)
        if len(out) == count:
            break
    return out


# -- one sample ---------------------------------------------------------------------------------------------
def _leaves(value, out):
    """Flatten nested tuples/lists/dicts into ``out``; tensors stay tensors, other values stay as they are."""
    if isinstance(value, (tuple, list)):
        for v in value:
            _leaves(v, out)
    elif isinstance(value, dict):
        for k in value:
            _leaves(value[k], out)
    else:
        out.append(value)
    return out


def _rebuild(value, it):
    if isinstance(value, tuple):
        return tuple(_rebuild(v, it) for v in value)
    if isinstance(value, list):
        return [_rebuild(v, it) for v in value]
    if isinstance(value, dict):
        return {k: _rebuild(v, it) for k, v in value.items()}
    return next(it)


class _OpModule(torch.nn.Module):
    """``op(sample)`` as a module: the tensors picked as parameters live on it; the rest arrive as inputs."""

    def __init__(self, op, structure, as_param: list[bool], leaves: list):
        super().__init__()
        self.op = op
        self.structure = structure  # (input, args, kwargs) with its tensors standing for leaves
        self.as_param = as_param
        self.is_tensor = [torch.is_tensor(v) for v in leaves]
        self.constants = [None if t else v for v, t in zip(leaves, self.is_tensor)]
        self.params = torch.nn.ParameterList(
            [torch.nn.Parameter(v.detach().clone()) for v, p in zip(leaves, as_param) if p])

    def forward(self, *inputs):
        inputs, params = iter(inputs), iter(self.params)
        values = []
        for const, param, tensor in zip(self.constants, self.as_param, self.is_tensor):
            if param:
                values.append(next(params))
            elif tensor:
                values.append(next(inputs))
            else:
                values.append(const)
        sample_input, args, kwargs = _rebuild(self.structure, iter(values))
        return self.op(sample_input, *args, **kwargs)


def _has_ties(leaves) -> bool:
    for t in leaves:
        if torch.is_tensor(t) and t.is_floating_point() and t.numel() > 1:
            flat = t.detach().flatten()
            if flat.unique().numel() < flat.numel():
                return True
    return False


def _weights(outputs):
    gen = torch.Generator().manual_seed(1234)
    return [torch.rand(o.shape, generator=gen, dtype=o.dtype) + 0.5
            if torch.is_tensor(o) and o.is_floating_point() else None for o in outputs]


def _loss(outputs, weights):
    # An output of another shape than eager's gets no weight: the comparison reports it as wrong.
    terms = [(o * w).sum() for o, w in zip(outputs, weights)
             if w is not None and torch.is_tensor(o) and o.requires_grad and o.numel() > 0 and o.shape == w.shape]
    return sum(terms) if terms else None


def _grads(leaves_or_params):
    return [None if t.grad is None else t.grad.detach().clone() for t in leaves_or_params]


def compare_kind(what: str, expected, actual, side: str = "eager") -> str | None:
    """Why ``actual`` differs from ``expected`` (``side``'s) in kind (None, a tensor or another value), value (not a
    tensor), shape or dtype; ``""`` where they agree and are not two tensors; None where both are tensors of one
    shape and dtype, whose values are left to compare."""
    if expected is None and actual is None:
        return ""
    if torch.is_tensor(expected) != torch.is_tensor(actual):
        if expected is None and torch.is_tensor(actual) and not actual.any():
            return ""  # no gradient in eager, zeros here
        if actual is None and torch.is_tensor(expected) and not expected.any():
            return ""
        return f"{what}: {type(expected).__name__} in {side}, {type(actual).__name__} here"
    if not torch.is_tensor(expected):
        if expected != actual and not (isinstance(expected, float) and math.isnan(expected)
                                       and isinstance(actual, float) and math.isnan(actual)):
            return f"{what}: {expected!r} in {side}, {actual!r} here"
        return ""
    if expected.shape != actual.shape:
        return f"{what}: shape {tuple(expected.shape)} in {side}, {tuple(actual.shape)} here"
    if expected.dtype != actual.dtype:
        return f"{what}: dtype {expected.dtype} in {side}, {actual.dtype} here"
    return None


def _compare(what: str, expected, actual) -> str | None:
    """Why ``actual`` differs from ``expected`` (None if it does not)."""
    kind = compare_kind(what, expected, actual)
    if kind is not None:
        return kind or None
    e, a = expected.detach(), actual.detach()
    if not e.is_floating_point():
        if not torch.equal(e, a):
            return f"{what}: values differ ({int((e != a).sum())} of {e.numel()})"
        return None
    if not torch.equal(e.isnan(), a.isnan()):
        return f"{what}: NaN at {int((e.isnan() != a.isnan()).sum())} places where the other has none"
    if not torch.equal(e.isinf(), a.isinf()) or not torch.equal(e[e.isinf()], a[a.isinf()]):
        return f"{what}: inf pattern differs"
    ok = torch.isclose(a, e, rtol=RTOL, atol=ATOL, equal_nan=True)
    if not ok.all():
        diff = (a - e).abs().nan_to_num(0.0, 0.0, 0.0)
        return f"{what}: {int((~ok).sum())} of {e.numel()} values differ, max abs diff {float(diff.max()):.3g}"
    return None


def _run(module, inputs, grad_leaves, weights):
    """Forward, then backward of the weighted sum; the outputs (flattened) and the gradients."""
    for t in grad_leaves:
        t.grad = None
    outputs = _leaves(module(*inputs), [])
    loss = _loss(outputs, _weights(outputs) if weights is None else weights)
    if loss is not None:
        loss.backward()
    return outputs, _grads(grad_leaves)


def short_reason(text: str, limit: int = 240) -> str:
    """The part of a fallback reason or error that says what went wrong: for an exporter failure, the first
    exception its summary lists (the rest is the exporter's boilerplate); on one line."""
    causes = re.findall(r"<class '([\w.]+)'>: (.*)", text)
    if causes:
        kind, message = causes[0]
        text = f"{kind.rsplit('.', 1)[-1]}: {message}"
    return " ".join(text.split())[:limit]


@contextlib.contextmanager
def _seeded_by_caller():
    """op_db calls its random ops through ``wrapper_set_seed``, which seeds torch inside the call (with 42); a graph
    cannot seed torch in the middle of its call, so here both runs call the op itself, and the draws come from the
    generator as the caller seeded it (the harness seeds it the same way before each run)."""
    from torch.testing._internal import common_methods_invocations as cmi

    with mock.patch.object(cmi, "wrapper_set_seed", lambda fn, *args, **kwargs: fn(*args, **kwargs)):
        yield


def run_sample(op, sample, mode: str, index: int = 0) -> Result:
    """Run one sample in eager and under a fresh ORTModule and classify it (see the module docstring)."""
    with _seeded_by_caller():
        return _run_sample(op, sample, mode, index)


def module_factory(op, sample, mode: str):
    """A function making a fresh ``(module, inputs, grad_leaves)`` for ``op(sample)`` run ``mode``'s way
    (``grad_leaves``: the inputs that require grad, then the parameters), or why the sample is skipped (ties)."""
    structure = (sample.input, tuple(sample.args), dict(sample.kwargs))
    leaves = _leaves(structure, [])
    if full_name(op) in TIES and _has_ties(leaves):
        return "repeated values: which tied element wins is unspecified"
    first = len(_leaves(sample.input, []))  # the sample's input stays an input, as a model's data does
    as_param = [mode == "params" and i >= first and torch.is_tensor(t) and t.requires_grad
                for i, t in enumerate(leaves)]
    fn = op.get_op()

    def fresh():
        module = _OpModule(fn, structure, as_param, leaves)
        inputs = [t.detach().clone().requires_grad_(t.requires_grad)
                  for t, p in zip(leaves, as_param) if torch.is_tensor(t) and not p]
        grad_leaves = [t for t in inputs if t.requires_grad] + list(module.params)
        return module, inputs, grad_leaves

    return fresh


def _run_sample(op, sample, mode: str, index: int) -> Result:
    from onnxtrain import DebugOptions, ORTModule

    name = full_name(op)
    result = Result(name, index, mode, "skip")
    fresh = module_factory(op, sample, mode)
    if isinstance(fresh, str):
        result.reason = fresh
        return result

    module, inputs, grad_leaves = fresh()
    try:
        torch.manual_seed(0)
        expected, expected_grads = _run(module, inputs, grad_leaves, None)
        weights = _weights(expected)
    except Exception as exc:  # noqa: BLE001 - a sample eager cannot run is not ours to compare
        result.reason = f"eager raises {type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        return result
    if not any(torch.is_tensor(o) for o in expected):
        result.reason = "returns no tensor"
        return result

    module, inputs, grad_leaves = fresh()
    model = ORTModule(module, DebugOptions(fallback=True))
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            actual, actual_grads = _run(model, inputs, grad_leaves, weights)
    except Exception as exc:  # noqa: BLE001 - classified, not raised: the sweep reports every error
        result.status = "error"
        result.reason = short_reason(f"{type(exc).__name__}: {exc}")
        return result
    if model.fallback_reason is not None:
        result.status = "fallback"
        result.reason = short_reason(model.fallback_reason)
        return result
    problem = None
    if len(actual) != len(expected):
        problem = f"{len(expected)} outputs in eager, {len(actual)} here"
    for i, (e, a) in enumerate(zip(expected, actual)):
        problem = problem or _compare(f"output {i}", e, a)
    for i, (e, a) in enumerate(zip(expected_grads, actual_grads)):
        problem = problem or _compare(f"gradient {i}", e, a)
    result.status = "wrong" if problem else "pass"
    result.reason = problem or ""
    return result


def sweep(names=None, modes=MODES, count: int = SAMPLES_PER_OP, progress=None, run=None):
    """Every sample of every swept op (or of ``names``), both ways; yields :class:`Result`s. ``run``: what runs
    one sample (default :func:`run_sample`; ``tests/opinfo/autocast.py`` passes its own)."""
    run = run_sample if run is None else run
    torch.set_num_threads(1)
    for op in swept_ops(names):
        try:
            op_samples = samples(op, count)
        except Exception as exc:  # noqa: BLE001
            for mode in modes:
                yield Result(full_name(op), 0, mode, "skip", f"sample_inputs raises {type(exc).__name__}")
            continue
        for index, sample in enumerate(op_samples):
            for mode in modes:
                result = run(op, sample, mode, index)
                if progress is not None:
                    progress(result)
                yield result
