"""Shape and indexing ops that used to fall back, against eager PyTorch (forward and input gradients), beyond
the OpInfo sweep's samples: each must run in onnxruntime (a fallback fails the test)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from onnxtrain import ORTModule
from onnxtrain.capture.split_to_slices import split_to_slices


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *tensors):
        return self.fn(*tensors)


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _check(model: ORTModule, fn, shapes, seed: int = 0):
    """One step of ``model`` against eager ``fn`` on fresh inputs of ``shapes``: outputs and input gradients."""
    torch.manual_seed(seed)
    xs = [torch.randn(*s, requires_grad=True) for s in shapes]
    refs = [x.detach().clone().requires_grad_() for x in xs]
    out, ref = _as_tuple(model(*xs)), _as_tuple(fn(*refs))
    assert model.fallback_reason is None, model.fallback_reason
    assert len(out) == len(ref)
    weights = [torch.randn_like(r) for r in ref]
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        torch.testing.assert_close(o, r)
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)), xs)
    expected = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), refs)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


CASES = {
    "split_scalar_axis0": (lambda x: torch.split(x, 2, 0), [(5, 3)]),
    "split_scalar_axis1": (lambda x: x.split(3, dim=1), [(4, 7)]),
    "split_sizes": (lambda x: torch.split(x, [1, 3, 2], 1), [(4, 6, 2)]),
    "split_negative_axis": (lambda x: torch.split(x, 2, -1), [(3, 2, 5)]),
    "split_one_chunk_used": (lambda x: x.split(2)[1] * 3, [(6, 2)]),
    "unsafe_split": (lambda x: torch.unsafe_split(x, 2, 0), [(5, 4)]),
    "unbind_axis0": (lambda x: torch.unbind(x, 0), [(4, 3)]),
    "unbind_axis1": (lambda x: [t * (i + 1) for i, t in enumerate(x.unbind(1))], [(2, 3, 4)]),
    "hstack": (lambda a, b: torch.hstack([a, b]), [(3, 2), (3, 4)]),
    "hstack_1d": (lambda a, b: torch.hstack([a, b]), [(3,), (5,)]),
    "vstack_mixed": (lambda a, b: torch.vstack([a, b]), [(5,), (2, 5)]),
    "dstack": (lambda a, b, c: torch.dstack([a, b, c]), [(4,), (1, 4), (1, 4, 2)]),
    "column_stack": (lambda a, b, c: torch.column_stack([a, b, c]), [(5,), (5, 3), (5, 1)]),
    "atleast_3d_list": (lambda a, b: torch.atleast_3d([a, b]), [(4,), (2, 3)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_runs_in_onnxruntime_and_matches_eager(name):
    fn, shapes = CASES[name]
    _check(ORTModule(_Fn(fn)), fn, shapes)


@pytest.mark.parametrize("fn", [lambda x: torch.split(x, 2, 0), lambda x: torch.unbind(x, 0),
                                lambda x: x.split(2)[-1] * 2], ids=["split", "unbind", "last_chunk"])
def test_chunk_count_follows_each_batch_size(fn):
    """How many chunks the forward returns depends on the split axis' size: a batch of another size must not
    reuse the first graph (torch.export leaves that axis dynamic for split)."""
    model = ORTModule(_Fn(fn))
    for step, n in enumerate((5, 6, 8, 3)):
        _check(model, fn, [(n, 2)], seed=step)


def _split_model(split: list[int] | int | None, keepdims: int, indices: list[int]) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    nodes, inits = [], []
    split_inputs = ["x"]
    if split is not None:
        inits.append(helper.make_tensor("split", TensorProto.INT64, [] if isinstance(split, int) else [len(split)],
                                        [split] if isinstance(split, int) else split))
        split_inputs.append("split")
    nodes.append(helper.make_node("SplitToSequence", split_inputs, ["seq"], axis=0, keepdims=keepdims))
    outputs = []
    for k, i in enumerate(indices):
        inits.append(helper.make_tensor(f"i{k}", TensorProto.INT64, [], [i]))
        nodes.append(helper.make_node("SequenceAt", ["seq", f"i{k}"], [f"y{k}"]))
        outputs.append(helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [x], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _run(proto: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize(("split", "keepdims", "indices"), [
    (2, 1, [0, 1, 2]), ([1, 3, 2], 1, [2, 0]), (None, 0, [0, 3, 5]), (None, 1, [1]), (4, 1, [1]),
])
def test_split_to_slices_pass_keeps_onnxruntime_results(split, keepdims, indices):
    """The pass alone, run by onnxruntime before and after: the same outputs, no sequence op left, and the
    split axis made static."""
    proto = _split_model(split, keepdims, indices)
    x = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    before = _run(proto, x)
    model = ir.from_proto(proto)
    assert split_to_slices(model.graph, [x.shape])
    assert not {n.op_type for n in model.graph} & {"SplitToSequence", "SequenceAt"}
    assert model.graph.inputs[0].shape[0] == 6
    after = _run(ir.to_proto(model), x)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_split_to_slices_leaves_a_dynamic_index_alone():
    proto = _split_model(2, 1, [0])
    proto.graph.input.append(helper.make_tensor_value_info("i", TensorProto.INT64, []))
    proto.graph.node[1].input[1] = "i"
    model = ir.from_proto(proto)
    assert not split_to_slices(model.graph, [(6, 3), ()])
    assert "SequenceAt" in {n.op_type for n in model.graph}
    assert not isinstance(model.graph.inputs[0].shape[0], int)


def test_split_to_slices_leaves_split_with_keepdims_0_alone():
    model = ir.from_proto(_split_model(1, 0, [0]))  # ONNX ignores keepdims here; onnxruntime squeezes
    assert not split_to_slices(model.graph, [(6, 3)])


@pytest.mark.parametrize("reduce", ["amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_scatter_reduce_amax_amin_gradients(reduce, include_self, ties):
    """``ScatterElements(reduction="max"/"min")``'s gradient: shared evenly among the entries equal to the
    result, as PyTorch's backward does (with ``include_self=False`` it still counts ``self``'s ties)."""
    torch.manual_seed(3)
    index = torch.randint(0, 4, (6, 5))
    for dim, src_shape in ((0, (6, 5)), (1, (4, 7))):
        idx = index if dim == 0 else torch.randint(0, 5, src_shape)

        def fn(x, src, idx=idx, dim=dim):
            return x.scatter_reduce(dim, idx, src, reduce, include_self=include_self)

        model = ORTModule(_Fn(fn))
        draw = (lambda shape: torch.randint(0, 3, shape).float()) if ties else torch.randn
        x, src = draw((4, 5)), draw(src_shape)
        xs = [x.requires_grad_(), src.requires_grad_()]
        refs = [t.detach().clone().requires_grad_() for t in xs]
        out, ref = model(*xs), fn(*refs)
        assert model.fallback_reason is None, model.fallback_reason
        torch.testing.assert_close(out, ref)
        weight = torch.randn_like(ref)
        for got, expected in zip(torch.autograd.grad((out * weight).sum(), xs),
                                 torch.autograd.grad((ref * weight).sum(), refs)):
            torch.testing.assert_close(got, expected)
