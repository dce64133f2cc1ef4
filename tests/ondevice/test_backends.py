"""Module(..., backend=, precision=): the on-device training and eval models on OpenVINO, against onnxruntime
and PyTorch (float32), and against float64 PyTorch and torch.autocast (bfloat16)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.runtime import backends
from tests.ondevice.helpers import assert_losses_close, clone, generate, torch_losses

pytest.importorskip("openvino")  # an optional extra: onnxtrain[openvino] (CI's test extra installs it)

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 16)).astype(np.float32)
Y = RNG.integers(0, 5, 64).astype(np.int64)


def _load(paths, **kwargs):
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, paths.eval_model, **kwargs)
    optimizer = Optimizer(paths.optimizer_model, module)
    optimizer.set_learning_rate(1e-2)
    return state, module, optimizer


def _train(module, optimizer, steps=10) -> list[float]:
    losses = []
    for step in range(steps):
        rows = slice(16 * (step % 4), 16 * (step % 4) + 16)
        losses.append(float(module(X[rows], Y[rows])))
        optimizer.step()
        module.lazy_reset_grad()
    return losses


def _torch_grads(model, dtype=None, double=False) -> dict[str, np.ndarray]:
    m = clone(model)
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    if double:
        m, x = m.double(), x.double()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        logits = m(x)
    torch.nn.functional.cross_entropy(logits.float() if not double else logits, y).backward()
    return {n: p.grad.double().numpy() for n, p in m.named_parameters()}


def _rel(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_openvino_fp32_trains_as_onnxruntime_and_pytorch(mlp_onnx, mlp_artifacts):
    model, _ = mlp_onnx
    _, ort_module, ort_optimizer = _load(mlp_artifacts)
    _, ov_module, ov_optimizer = _load(mlp_artifacts, backend="openvino", precision="fp32")
    assert (ov_module.backend, ov_module.precision) == ("openvino", "fp32")
    ours, theirs = _train(ov_module, ov_optimizer), _train(ort_module, ort_optimizer)
    assert_losses_close(ours, theirs, rtol=1e-5)
    reference = clone(model)
    batches = [(X[16 * (s % 4):16 * (s % 4) + 16], Y[16 * (s % 4):16 * (s % 4) + 16]) for s in range(10)]
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    assert_losses_close(ours, torch_losses(reference, torch_opt, torch.nn.functional.cross_entropy, batches),
                        rtol=1e-4)
    ov_module.eval()
    ort_module.eval()
    np.testing.assert_allclose(ov_module(X, Y), ort_module(X, Y), rtol=1e-5)  # the eval loss


@pytest.mark.skipif(not backends.openvino_has_bf16(), reason="this CPU has no bfloat16 arithmetic")
def test_bf16_gradients_as_autocast(mlp_onnx, mlp_artifacts):
    """OpenVINO's bfloat16 hint: gradients near autocast bfloat16's, and training as float32 does.

    The hint runs the float32 graph's elementwise ops in bfloat16 too, not only its products: measured here,
    the second Linear's (``net.2``) gradients are 5.2x (weight: 2.4e-2 against 4.7e-3, norm-relative) and
    5.9x (bias) further from float64 than autocast's, the others 0.8-1.1x. The precision pass (only the
    products lowered) had 0.6-1.51x autocast's error on this MLP (docs/precision.md)."""
    model, _ = mlp_onnx
    state, module, optimizer = _load(mlp_artifacts, precision="bf16")
    assert (module.backend, module.precision) == ("openvino", "bf16")
    module(X, Y)
    ref, auto = _torch_grads(model, double=True), _torch_grads(model, dtype=torch.bfloat16)
    for name, want in ref.items():
        err = _rel(state.parameters[name].grad, want)
        assert err <= 8 * _rel(auto[name], want), (name, err, _rel(auto[name], want))
        assert err > 1e-4, (name, err)  # float32 is near 1e-7: the products did run in bfloat16
    module.lazy_reset_grad()
    _, fp32_module, fp32_optimizer = _load(mlp_artifacts)
    bf16_losses, fp32_losses = _train(module, optimizer, 20), _train(fp32_module, fp32_optimizer, 20)
    assert bf16_losses[-1] < 0.9 * bf16_losses[0]
    assert abs(bf16_losses[-1] - fp32_losses[-1]) <= 0.02 * fp32_losses[-1], (bf16_losses, fp32_losses)


def test_backend_choice_and_errors(mlp_artifacts, monkeypatch):
    state = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        Module(mlp_artifacts.training_model, state, backend="tpu")
    with pytest.raises(ValueError, match="unknown precision 'int4'"):
        Module(mlp_artifacts.training_model, state, precision="int4")
    monkeypatch.setenv(backends.BACKEND_ENV, "openvino")
    assert Module(mlp_artifacts.training_model, state).backend == "openvino"
    monkeypatch.delenv(backends.BACKEND_ENV)
    assert Module(mlp_artifacts.training_model, state).backend == "onnxruntime"


def test_bf16_on_onnxruntime_warns_once_and_runs_float32(mlp_artifacts, monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    state = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    with pytest.warns(RuntimeWarning, match="no bfloat16 arithmetic: running float32"):
        module = Module(mlp_artifacts.training_model, state, backend="onnxruntime", precision="bf16")
    assert (module.backend, module.precision) == ("onnxruntime", "fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Module(mlp_artifacts.training_model, CheckpointState.load_checkpoint(mlp_artifacts.checkpoint),
               backend="onnxruntime", precision="bf16")


def test_missing_openvino(mlp_artifacts, monkeypatch):
    """Without the package: naming the backend is an error; asking for bf16 warns and runs float32."""
    monkeypatch.setattr(backends, "openvino_installed", lambda: False)
    monkeypatch.setattr(backends, "_warned", set())
    state = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    with pytest.raises(ImportError, match=r"pip install 'onnxtrain\[openvino\]'"):
        Module(mlp_artifacts.training_model, state, backend="openvino")
    with pytest.warns(RuntimeWarning, match="OpenVINO, which is not installed: running float32"):
        module = Module(mlp_artifacts.training_model, state, precision="bf16")
    assert (module.backend, module.precision) == ("onnxruntime", "fp32")


def test_bf16_artifacts_run_in_bf16(mlp_onnx, tmp_path):
    """generate_artifacts(precision="bf16"): float32 graphs marked bf16, which Module runs so by default."""
    model, path = mlp_onnx
    params = [n for n, _ in model.named_parameters()]
    paths = generate(path, tmp_path, requires_grad=params, loss="crossentropy", optimizer="adamw", precision="bf16")
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, paths.eval_model)
    expected = ("openvino", "bf16") if backends.openvino_has_bf16() else ("onnxruntime", "fp32")
    assert (module.backend, module.precision) == expected
    assert Module(paths.training_model, CheckpointState.load_checkpoint(paths.checkpoint),
                  precision="fp32").backend == "onnxruntime"
    with pytest.raises(ValueError, match="unknown precision 'fp8' for artifacts"):
        generate(path, tmp_path / "fp8", requires_grad=params, loss="crossentropy", precision="fp8")


def test_graph_openvino_cannot_read_runs_on_onnxruntime(monkeypatch):
    """A ReduceSum whose axes have a run-time length (the gradient engine's un-broadcast where sizes are
    unknown): OpenVINO refuses it; that graph runs on onnxruntime in float32, with a warning naming it."""
    from onnx import TensorProto, helper

    monkeypatch.setattr(backends, "_warned", set())
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Shape", ["y"], ["t"]),
             helper.make_node("Equal", ["s", "t"], ["same"]), helper.make_node("Not", ["same"], ["differs"]),
             helper.make_node("NonZero", ["differs"], ["nz"]),
             helper.make_node("Constant", [], ["flat"], value=helper.make_tensor("flat", TensorProto.INT64, [1], [-1])),
             helper.make_node("Reshape", ["nz", "flat"], ["axes"]),
             helper.make_node("ReduceSum", ["y", "axes"], ["out"], keepdims=1, noop_with_empty_axes=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b"]),
                                           helper.make_tensor_value_info("y", TensorProto.FLOAT, ["c", "d"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with pytest.warns(RuntimeWarning, match=r"OpenVINO cannot convert a graph \(ReduceSum.*onnxruntime in float32"):
        session = backends.create_session(model.SerializeToString(), "openvino", "bf16")
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    (out,) = session.run(None, {"x": np.zeros((1, 3), np.float32), "y": y})
    np.testing.assert_array_equal(out, y.sum(axis=0, keepdims=True))


def _xw_session():
    """An OpenVINO session of ``y = x @ w``, x [n, 3] (n dynamic), w [3, 2]."""
    from onnx import TensorProto, helper

    from onnxtrain.runtime.openvino import OpenVINOSession

    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
                               helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return OpenVINOSession(model.SerializeToString())


def test_openvino_requests_are_reused_with_fresh_results():
    """Calls that leave their outputs to the runtime share the session's idle infer requests: each call's
    results are its own (copied out), shapes may change between calls, a binding with an output in the
    caller's memory keeps its own request, and an input left unbound is an error, not the last call's value."""
    session = _xw_session()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    xs = [rng.standard_normal((n, 3)).astype(np.float32) for n in (4, 4, 7, 1)]
    results = [session.run(None, {"x": x, "w": w})[0] for x in xs]
    assert len(session._idle) == 1  # one request served every call
    for x, y in zip(xs, results):
        np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-6)
    out = np.zeros((4, 2), np.float32)
    binding = session.io_binding()
    binding.bind_cpu_input("x", xs[0])
    binding.bind_cpu_input("w", w)
    binding.bind_ortvalue_output("y", out)
    session.run_with_iobinding(binding)
    np.testing.assert_allclose(out, xs[0] @ w, rtol=1e-5, atol=1e-6)
    assert len(session._idle) == 1 and binding._request is not session._idle[0]
    np.testing.assert_allclose(session.run(None, {"x": xs[1], "w": w})[0], xs[1] @ w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, xs[0] @ w, rtol=1e-5, atol=1e-6)  # the pooled call did not write there
    unbound = session.io_binding()
    unbound.bind_cpu_input("x", xs[0])
    unbound.bind_output("y")
    with pytest.raises(ValueError, match=r"inputs \['w'\] are not bound"):
        session.run_with_iobinding(unbound)


def test_openvino_run_arrays_reads_each_call_s_arrays():
    """``run_arrays`` (ORTModule's path) leaves an input set on the pooled request when the call passes that very
    array again (a parameter's): the request still reads it in place, so an update in place shows; an input that
    is another array (a new one, one of another shape, or the old one after a binding set others on the request)
    is the one read."""
    session = _xw_session()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    x = rng.standard_normal((4, 3)).astype(np.float32)

    def check(x, w):
        (y,) = session.run_arrays([x, w])
        np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-6)

    check(x, w)
    w += 1.0  # the optimizer's update, in place
    check(x.copy(), w)
    check(x, w.copy())  # another array with the same values
    other = rng.standard_normal((3, 2)).astype(np.float32)
    check(x, other)
    check(rng.standard_normal((7, 3)).astype(np.float32), w)
    # A binding's run on the same pooled request sets its own tensors there: w is set again after it.
    (y,) = session.run(None, {"x": x, "w": other})
    np.testing.assert_allclose(y, x @ other, rtol=1e-5, atol=1e-6)
    assert len(session._idle) == 1
    check(x, w)
    for _ in range(3):  # arrays dropped after their call: each call's own is read, not the freed one's memory
        check(x, rng.standard_normal((3, 2)).astype(np.float32))


def test_openvino_binding_sets_on_its_request_only_what_was_bound_since():
    """A binding with an output in the caller's memory keeps its request, which holds its tensors between
    runs: a run sets only what was bound since the last one (the batch, not every parameter again), and
    reads a bound input updated in place anew and a rebound one, of another shape too."""
    from onnx import TensorProto, helper

    from onnxtrain.runtime.openvino import OpenVINOSession

    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]),
                               helper.make_node("Constant", [], ["axes"], value_ints=[0]),
                               helper.make_node("ReduceSum", ["y", "axes"], ["s"], keepdims=0)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
                               helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = OpenVINOSession(model.SerializeToString())
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    xs = [rng.standard_normal((n, 3)).astype(np.float32) for n in (4, 4, 5)]
    s = np.zeros(2, np.float32)
    binding = session.io_binding()
    binding.bind_cpu_input("w", w)
    binding.bind_ortvalue_output("s", s)
    set_names = []

    class Counting:  # the binding's own request, counting what a run sets on it
        def __init__(self, request):
            self.request = request

        def set_tensor(self, name, tensor):
            set_names.append(name)
            self.request.set_tensor(name, tensor)

        def __getattr__(self, name):
            return getattr(self.request, name)

    for step, x in enumerate(xs):
        binding.bind_cpu_input("x", x)  # the batch, every call
        binding.bind_output("y")
        if step == 1:
            w *= -2.0  # a parameter updated in place, not rebound
        session.run_with_iobinding(binding)
        if step == 0:  # every tensor went to the new request
            binding._request = Counting(binding._request)
        else:
            assert set_names == ["x"]
        set_names.clear()
        y = binding.get_outputs()[1].numpy()
        np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(s, (x @ w).sum(axis=0), rtol=1e-5, atol=1e-5)


def test_torch_session_on_openvino_reads_and_returns_tensors():
    """TorchSession's numpy path on OpenVINO: a parameter updated in place is read anew, a non-contiguous
    input is read as its values, outputs are torch tensors of their own (equal to torch's result)."""
    from onnx import TensorProto, helper

    from onnxtrain.runtime.session import TorchSession

    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["r"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
                                    helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2]),
                               helper.make_tensor_value_info("r", TensorProto.FLOAT, ["n", 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = TorchSession(model, torch.device("cpu"), backend="openvino")
    assert session._arrays is not None  # the numpy path, not OrtValues
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 2))
    x = torch.randn(3, 5).t()  # not contiguous
    y, r = session.run([x, w])
    torch.testing.assert_close(y, x @ w.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r, torch.relu(x @ w.detach()), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        w.mul_(-2)
    y2, _ = session.run([x, w])
    torch.testing.assert_close(y2, x @ w.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, -y2 / 2, rtol=1e-5, atol=1e-6)  # the first call's output is its own


def test_bf16_artifacts_keep_layer_norm_row_sums(tmp_path):
    """In bf16 artifacts LayerNorm's weight and bias gradients stay ReduceSum (OpenVINO runs a MatMul by ones in
    bfloat16, the ReduceSum in float32); the linear layer's bias sum is a product in both."""
    import onnx

    from tests.ondevice.helpers import export

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    path = export(model, (torch.randn(4, 16),), tmp_path / "m.onnx", ["x"])
    params = [n for n, _ in model.named_parameters()]
    counts = {}
    for precision in ("fp32", "bf16"):
        paths = generate(path, tmp_path / precision, requires_grad=params, loss="crossentropy", precision=precision)
        counts[precision] = sum(n.op_type == "ReduceSum" and "CrossEntropyLoss_Grad" not in n.name  # its count
                                for n in onnx.load(paths.training_model).graph.node)
    assert counts == {"fp32": 0, "bf16": 2}, counts


def _cnn_artifacts(tmp_path, **kwargs):
    from tests.ondevice.helpers import CNN, export

    torch.manual_seed(7)
    model = CNN()
    path = export(clone(model), (torch.randn(2, 1, 8, 8),), tmp_path / "cnn.onnx", ["x"])
    return model, generate(path, tmp_path, requires_grad=[n for n, _ in model.named_parameters()],
                           loss="crossentropy", optimizer="adamw", **kwargs)


def test_a_convolution_weight_gradient_is_refused_when_the_module_is_made(tmp_path):
    """OpenVINO's CPU plugin compiles no convolution with a kernel of dynamic size, and float32 artifacts' weight
    gradients are such convolutions. Before, ``Module(..., backend="openvino")`` was made and the first training
    call failed with OpenVINO's own error; now the module is not made, with an error naming the node and saying what
    to do, before the state is bound: the same state then trains on onnxruntime."""
    _, paths = _cnn_artifacts(tmp_path)
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    before = {name: p.data.copy() for name, p in state.parameters.items()}
    with pytest.raises(ValueError, match=r"kernel of dynamic size, which '[^']*Conv[^']*'.*Generate the artifacts "
                                         r"with precision='bf16' .* or run these on backend='onnxruntime'$"):
        Module(paths.training_model, state, paths.eval_model, backend="openvino", precision="fp32")
    for name, p in state.parameters.items():
        np.testing.assert_array_equal(p.data, before[name])
    module = Module(paths.training_model, state, paths.eval_model)
    x = RNG.standard_normal((8, 1, 8, 8)).astype(np.float32)
    assert np.isfinite(float(module(x, RNG.integers(0, 4, 8).astype(np.int64))))


@pytest.mark.skipif(not backends.openvino_has_bf16(), reason="this CPU has no bfloat16 arithmetic")
def test_bf16_artifacts_of_a_convolution_model_train_on_openvino(tmp_path):
    """bf16 artifacts (run on OpenVINO) write the weight gradients as products over input windows
    (passes/conv_patches.py), which the plugin compiles: before, the module failed at its first training call.
    Each gradient's error against float64, summed over 8 batches, at most 2x eager autocast's (measured 0.86-1.37x
    over three sets of batches). Summed, because with ReLU and MaxPool one batch's ratio is dominated by the few
    entries whose comparison bf16 rounding flips (0.05-25x on single batches, as in test_families_bf16.py).
    Then the loss goes down."""
    model, paths = _cnn_artifacts(tmp_path, precision="bf16")
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, paths.eval_model)
    assert (module.backend, module.precision) == ("openvino", "bf16")
    rng = np.random.default_rng(0)
    sq = {}  # name -> [ours, eager autocast's] squared errors against float64, float64's squared norm: summed
    for _ in range(8):
        x, y = rng.standard_normal((16, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, 16).astype(np.int64)
        module(x, y)
        grads = {}
        for autocast in (False, True):
            reference, inputs = clone(model), torch.from_numpy(x)
            if not autocast:
                reference, inputs = reference.double(), inputs.double()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = reference(inputs)
            torch.nn.functional.cross_entropy(logits.float() if autocast else logits, torch.from_numpy(y)).backward()
            grads[autocast] = {n: p.grad.double().numpy() for n, p in reference.named_parameters()}
        for name, want in grads[False].items():
            acc = sq.setdefault(name, [0.0, 0.0, 0.0])
            acc[0] += float(np.square(state.parameters[name].grad - want).sum())
            acc[1] += float(np.square(grads[True][name] - want).sum())
            acc[2] += float(np.square(want).sum())
        module.lazy_reset_grad()
    for name, (ours, eager, norm) in sq.items():
        assert ours <= 4 * eager, (name, (ours / eager) ** 0.5)  # squared: 2x the error
        assert ours > 1e-8 * norm, name  # 1e-4 relative: float32 is near 1e-7, so the products did run in bf16
    optimizer = Optimizer(paths.optimizer_model, module)
    optimizer.set_learning_rate(1e-2)
    losses = []
    for _ in range(20):
        losses.append(float(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
    assert losses[-1] < 0.7 * losses[0], losses


class _ExactHead(torch.nn.Module):
    """Logits exact in bfloat16: inputs of -1, 0 and 1, an identity layer and an output layer of multiples of 1/8
    (the identity puts a product under the loss gradient's product, as in a real model). ``seq``: logits
    [N, C, L], the loss over ``N * L`` samples."""

    def __init__(self, seq: bool, hidden=32, classes=40):
        super().__init__()
        self.seq = seq
        self.hidden = torch.nn.Linear(hidden, hidden, bias=False)
        self.head = torch.nn.Linear(hidden, classes, bias=False)
        with torch.no_grad():
            self.hidden.weight.copy_(torch.eye(hidden))
            g = torch.Generator().manual_seed(0)
            self.head.weight.copy_(torch.randint(-1, 2, (classes, hidden), generator=g).float() / 8)

    def forward(self, x):
        logits = self.head(self.hidden(x))
        return logits.transpose(1, 2) if self.seq else logits


@pytest.mark.skipif(not backends.openvino_has_bf16(), reason="this CPU has no bfloat16 arithmetic")
@pytest.mark.parametrize("seq", [False, True], ids=["rows", "sequence"])
def test_default_cross_entropy_scale_stays_float32_on_bf16(seq, tmp_path):
    """CrossEntropyLoss() (no class weights, no ignore_index: one scale 1/27 for the batch's 27 samples) on the
    bf16 artifacts: every float node of the loss gradient runs float32 on OpenVINO, and the output layer's weight
    gradient is float64's loss gradient, rounded to bfloat16 where the product reads it, times the exact input.
    Before: the plugin rewrote the scale's Divide (rows) and the per-row Unsqueeze (sequence) into nodes of its
    own that ran bfloat16, and every gradient came out 1.0014x float64's."""
    from onnxtrain import artifacts
    from tests.ondevice.helpers import export

    model = _ExactHead(seq)
    shape = (9, 3, 32) if seq else (27, 32)
    x = torch.randint(-1, 2, shape, generator=torch.Generator().manual_seed(1)).float()
    y = torch.randint(0, 40, shape[:-1], generator=torch.Generator().manual_seed(2))
    export(model, (x,), tmp_path / "m.onnx", ["x"])
    paths = artifacts.generate_artifacts(str(tmp_path / "m.onnx"), requires_grad=["head.weight", "hidden.weight"],
                                         loss=artifacts.CrossEntropyLoss(), artifact_directory=tmp_path / "a",
                                         precision="bf16")
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, paths.eval_model, backend="openvino", precision="bf16")
    module(x.numpy(), y.numpy())
    runtime = [(op.get_rt_info()["originalLayersNames"].astype(str), op.get_rt_info()["runtimePrecision"].astype(str))
               for op in module._train.session._compile().get_runtime_model().get_ordered_ops()]
    loss_grad = [(name, p) for name, p in runtime if "SoftmaxCrossEntropyLoss_Grad" in name or "Power" in name]
    assert loss_grad and all(p not in ("bf16", "f16") for _, p in loss_grad), loss_grad
    assert any(p == "bf16" for name, p in runtime if "weight_grad" in name)  # the products do run bfloat16
    double = model.double()
    h = double.hidden(x.double()).detach()
    logits = double.head(h).detach()
    logits = (logits.transpose(1, 2) if seq else logits).requires_grad_()
    torch.nn.functional.cross_entropy(logits, y).backward()
    dlogits = logits.grad.float().bfloat16().double()
    if seq:
        dlogits, h = dlogits.transpose(1, 2).flatten(0, 1), h.flatten(0, 1)
    want = (dlogits.T @ h).numpy()
    got = state.parameters["head.weight"].grad.astype(np.float64)
    factor = float(np.vdot(got, want) / np.vdot(want, want))
    assert _rel(got, want) < 1e-4 and abs(factor - 1) < 1e-5, (_rel(got, want), factor)  # before: 1.0014
