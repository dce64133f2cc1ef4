"""generate_artifacts: the models' interfaces, losses against torch.nn, custom losses, the error cases, the CLI."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState, Module
from onnxtrain.cli import main as cli_main
from tests.ondevice.helpers import MLP, export, generate

PARAMS = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias", "net.4.weight", "net.4.bias"]


def test_model_interfaces(mlp_onnx, tmp_path):
    _, path = mlp_onnx
    paths = generate(path, tmp_path, requires_grad=PARAMS[2:], frozen_params=PARAMS[:2], loss="crossentropy",
                     optimizer="adamw", additional_output_names=["logits"], prefix="p_")
    assert paths.training_model.name == "p_training_model.onnx" and paths.checkpoint.name == "p_checkpoint"
    training = onnx.load(str(paths.training_model))
    evaluation = onnx.load(str(paths.eval_model))
    assert [i.name for i in training.graph.input] == ["x", "labels", *PARAMS[2:], *PARAMS[:2]]
    assert [o.name for o in training.graph.output] == ["loss", "logits", *(f"{n}_grad" for n in PARAMS[2:])]
    assert [i.name for i in evaluation.graph.input] == [i.name for i in training.graph.input]
    assert [o.name for o in evaluation.graph.output] == ["loss", "logits"]
    assert not training.graph.initializer or all(t.name not in PARAMS for t in training.graph.initializer)
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    assert list(state.parameters) == PARAMS[2:] + PARAMS[:2]
    assert [state.parameters[n].requires_grad for n in state.parameters] == [True] * 4 + [False] * 2
    module = Module(paths.training_model, state, paths.eval_model)
    assert module.input_names() == ["x", "labels"] and module.output_names() == ["loss", "logits"]
    meta = json.loads({p.key: p.value for p in onnx.load(str(paths.optimizer_model)).metadata_props}
                      ["onnxtrain.optimizer"])
    assert meta["hyperparameters"]["betas"] == [0.9, 0.999] and meta["hyperparameters"]["weight_decay"] == 0.01
    assert meta["hyperparameters"]["eps"] == 1e-8 and meta["hyperparameters"]["bias_correction"] is True


def _one_step(paths, x, target):
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state)
    loss = module(x, target)
    return float(loss), {n: state.parameters[n].grad for n in state.parameters}


def _torch_step(model, loss_fn, x, target):
    model.zero_grad()
    loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(target))
    loss.backward()
    return loss.item(), {n: p.grad.numpy() for n, p in model.named_parameters()}


def _assert_step_matches(ours, theirs):
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
    for name, grad in theirs[1].items():
        np.testing.assert_allclose(ours[1][name], grad, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("loss, torch_loss, target", [
    (artifacts.BCEWithLogitsLoss(pos_weight=np.array([1.0, 2.0, 0.5, 1.0, 3.0], np.float32)),
     torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])), "binary"),
    (artifacts.LossType.L1Loss, torch.nn.L1Loss(), "float"),
    (artifacts.MSELoss(reduction="sum"), torch.nn.MSELoss(reduction="sum"), "float"),
    (artifacts.CrossEntropyLoss(weight=np.array([1.0, 2.0, 1.0, 0.5, 1.0], np.float32), ignore_index=1),
     torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 1.0, 0.5, 1.0]), ignore_index=1), "class"),
])
def test_builtin_losses_match_torch(mlp_onnx, tmp_path, loss, torch_loss, target):
    model, path = mlp_onnx
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    t = {"binary": lambda: rng.integers(0, 2, (8, 5)).astype(np.float32),
         "float": lambda: rng.standard_normal((8, 5)).astype(np.float32),
         "class": lambda: rng.integers(0, 5, 8).astype(np.int64)}[target]()
    paths = generate(path, tmp_path, requires_grad=PARAMS, loss=loss)
    assert paths.optimizer_model is None  # optimizer=None: none written
    _assert_step_matches(_one_step(paths, x, t), _torch_step(model, torch_loss, x, t))


class HuberLoss(artifacts.Loss):
    """The documented way to write a custom loss: declare the extra inputs, build from ops."""

    def __init__(self, delta):
        self.delta = delta

    def inputs(self, output):
        return [artifacts.LossInput.like(output, "target")]

    def build(self, op, output, target):
        err = op.Abs(op.Sub(output, target))
        delta = op.scalar(self.delta, like=output)
        quad = op.Min(err, delta)
        half = op.scalar(0.5, like=output)
        return op.ReduceMean(op.Add(op.Mul(half, op.Mul(quad, quad)), op.Mul(delta, op.Sub(err, quad))), keepdims=0)


def test_custom_loss_block_matches_torch(mlp_onnx, tmp_path):
    model, path = mlp_onnx
    rng = np.random.default_rng(1)
    x, t = rng.standard_normal((8, 16)).astype(np.float32), 0.3 * rng.standard_normal((8, 5)).astype(np.float32)
    paths = generate(path, tmp_path, requires_grad=PARAMS, loss=HuberLoss(0.1), optimizer="sgd")
    _assert_step_matches(_one_step(paths, x, t), _torch_step(model, torch.nn.HuberLoss(delta=0.1), x, t))


def test_model_that_outputs_its_own_loss(tmp_path):
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x, y):
            return ((self.fc(x) - y) ** 2).mean()

    torch.manual_seed(0)
    model = WithLoss()
    path = export(model, (torch.randn(3, 4), torch.randn(3, 1)), tmp_path / "wl.onnx", ["x", "y"])
    paths = generate(path, tmp_path, requires_grad=["fc.weight", "fc.bias"], loss=None, optimizer="sgd")
    x, y = np.ones((3, 4), np.float32), np.zeros((3, 1), np.float32)
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    loss = Module(paths.training_model, state)(x, y)
    model(torch.from_numpy(x), torch.from_numpy(y)).backward()
    assert float(loss) == pytest.approx(float(model(torch.from_numpy(x), torch.from_numpy(y))), rel=1e-6)
    np.testing.assert_allclose(state.parameters["fc.weight"].grad, model.fc.weight.grad.numpy(), rtol=1e-5)


def test_a_model_marking_stop_gradients_trains_like_torch_detach(tmp_path):
    """An ONNX model may mark values with onnxtrain's StopGradient: no gradient flows through them, and
    the generated models hold plain Identity nodes (any ONNX runtime can run them)."""
    from onnx import TensorProto, helper

    from onnxtrain.autodiff.registry import ONNXTRAIN_DOMAIN, STOP_GRADIENT

    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"]), helper.make_node("MatMul", ["x", "w2"], ["h2"]),
             helper.make_node(STOP_GRADIENT, ["h2"], ["s"], domain=ONNXTRAIN_DOMAIN),
             helper.make_node("Mul", ["h1", "s"], ["a"]), helper.make_node("Add", ["a", "h2"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 3])],
                              [onnx.numpy_helper.from_array(w1, "w1"), onnx.numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                   helper.make_opsetid(ONNXTRAIN_DOMAIN, 1)])
    onnx.save(model, tmp_path / "sg.onnx")
    paths = generate(tmp_path / "sg.onnx", tmp_path, requires_grad=["w1", "w2"], loss="mse")
    for path in (paths.training_model, paths.eval_model):
        assert STOP_GRADIENT not in {n.op_type for n in onnx.load(str(path)).graph.node}
    x, target = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    ours = _one_step(paths, x, target)
    t1, t2 = torch.tensor(w1, requires_grad=True), torch.tensor(w2, requires_grad=True)
    tx = torch.from_numpy(x)
    h2 = tx @ t2
    loss = torch.nn.functional.mse_loss((tx @ t1) * h2.detach() + h2, torch.from_numpy(target))
    loss.backward()
    _assert_step_matches(ours, (loss.item(), {"w1": t1.grad.numpy(), "w2": t2.grad.numpy()}))


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    ({"requires_grad": PARAMS, "frozen_params": ["net.0.bias"]}, ValueError, "in both requires_grad and frozen_params"),
    ({"requires_grad": ["net.0.weight", "nope"]}, KeyError, r"nope: not initializers"),
    ({"frozen_params": ["missing"], "requires_grad": ["net.0.bias"]}, KeyError, "missing"),
    ({"requires_grad": None}, ValueError, "no trainable floating-point initializer"),
    ({"requires_grad": ["net.0.bias", "net.0.bias"]}, ValueError, "requires_grad names repeat"),
    ({"requires_grad": PARAMS, "loss": "hinge"}, ValueError, "unknown loss 'hinge'"),
    ({"requires_grad": PARAMS, "optimizer": "lamb"}, ValueError, "unknown optimizer 'lamb'"),
    ({"requires_grad": PARAMS, "loss": None}, ValueError, "must be a float scalar"),
    ({"requires_grad": PARAMS, "additional_output_names": ["nowhere"]}, KeyError, "nowhere"),
    ({"requires_grad": PARAMS, "loss_input_names": ["probs"]}, KeyError, "not outputs of the model"),
])
def test_bad_arguments_are_clear_errors(mlp_onnx, tmp_path, kwargs, error, match):
    _, path = mlp_onnx
    kwargs = {"loss": "crossentropy", **kwargs}
    with pytest.raises(error, match=match):
        artifacts.generate_artifacts(path, artifact_directory=tmp_path, **kwargs)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_no_float_initializer_is_an_error(tmp_path):
    node = onnx.helper.make_node("Add", ["x", "k"], ["y"])
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.INT64, [2])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [2])],
                                   [onnx.numpy_helper.from_array(np.array([1, 2], np.int64), "k")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    with pytest.raises(ValueError, match="no trainable floating-point initializer"):
        artifacts.generate_artifacts(model, artifact_directory=tmp_path, loss="mse")
    with pytest.raises(TypeError, match="not floating-point"):
        artifacts.generate_artifacts(model, requires_grad=["k"], artifact_directory=tmp_path, loss="mse")


def test_missing_model_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.onnx"):
        artifacts.generate_artifacts(tmp_path / "nope.onnx", requires_grad=["w"], artifact_directory=tmp_path)


def test_runtime_errors_name_the_problem(mlp_artifacts, tmp_path):
    state = CheckpointState.load_checkpoint(mlp_artifacts.checkpoint)
    module = Module(mlp_artifacts.training_model, state)
    with pytest.raises(TypeError, match=r"takes 2 inputs \['x', 'labels'\]"):
        module(np.zeros((2, 16), np.float32))
    with pytest.raises(TypeError, match="input 'labels' must be int64"):
        module(np.zeros((2, 16), np.float32), np.zeros(2, np.float32))
    module.eval()
    with pytest.raises(RuntimeError, match="eval_model_uri"):
        module(np.zeros((2, 16), np.float32), np.zeros(2, np.int64))
    with pytest.raises(FileNotFoundError, match="training model not found"):
        Module(tmp_path / "none.onnx", state)
    with pytest.raises(ValueError, match="not an onnxtrain training model"):
        Module(mlp_artifacts.optimizer_model, state)
    with pytest.raises(ValueError, match="is the eval model; pass training_model.onnx"):
        Module(mlp_artifacts.eval_model, state)


def test_checkpoint_from_another_model_is_rejected(mlp_artifacts, tmp_path):
    torch.manual_seed(0)
    other = MLP((16, 8, 8, 5))
    path = export(other, (torch.randn(2, 16),), tmp_path / "other.onnx", ["x"])
    paths = generate(path, tmp_path / "other", requires_grad=PARAMS, loss="crossentropy")
    with pytest.raises(ValueError, match=r"'net.0.weight' has shape \[8, 16\] in the checkpoint but \[32, 16\]"):
        Module(mlp_artifacts.training_model, CheckpointState.load_checkpoint(paths.checkpoint))
    paths = generate(path, tmp_path / "fewer", requires_grad=PARAMS[:2], loss="crossentropy")
    with pytest.raises(ValueError, match=r"the checkpoint lacks parameters \['net.2.weight'"):
        Module(mlp_artifacts.training_model, CheckpointState.load_checkpoint(paths.checkpoint))


# -- CLI ------------------------------------------------------------------------------------------


def test_cli_artifacts(mlp_onnx, tmp_path, capsys):
    _, path = mlp_onnx
    rc = cli_main(["artifacts", str(path), "--requires-grad", *PARAMS[2:], "--frozen", *PARAMS[:2],
                   "--loss", "crossentropy", "--optimizer", "adamw", "-o", str(tmp_path / "out")])
    assert rc == 0
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["checkpoint", "eval_model.onnx", "optimizer_model.onnx", "training_model.onnx"]
    assert "wrote" in capsys.readouterr().out
    state = CheckpointState.load_checkpoint(tmp_path / "out" / "checkpoint")
    assert [n for n in state.parameters if state.parameters[n].requires_grad] == PARAMS[2:]
    rc = cli_main(["artifacts", str(path), "--requires-grad", "bogus", "--loss", "mse", "-o", str(tmp_path / "x")])
    assert rc == 1
    assert "bogus" in capsys.readouterr().err


def test_model_with_external_data(mlp_onnx, tmp_path):
    """Models over 2 GB come with their weights in a separate file; the same path is exercised here."""
    model, path = mlp_onnx
    proto = onnx.load(str(path))
    onnx.save_model(proto, str(tmp_path / "ext.onnx"), save_as_external_data=True, location="ext.onnx.data",
                    size_threshold=0)
    paths = generate(tmp_path / "ext.onnx", tmp_path / "out", requires_grad=PARAMS, loss="crossentropy")
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(state.parameters[name].data, p.detach().numpy())


def test_module_default_session_options_suit_alternating_sessions():
    """Training and optimizer sessions take turns: no spinning threads, one arena, no memory patterns."""
    from onnxtrain.utils.ort_options import for_training

    options = for_training()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert options.get_session_config_entry("session.use_env_allocators") == "1"
    assert options.enable_mem_pattern is False


def test_the_training_session_runs_in_graph_order_and_the_callers_options_are_kept(mlp_artifacts):
    """onnxruntime's default order runs backward work late, keeping what it reads alive, and its memory
    reuse plan holds freed buffers for later values (BERT-small at 4x batch, activation memory 480 MB
    with both, 376 MB without); the training session runs in the graph's (priority-based) order without
    memory reuse, and the options the caller passed keep their own settings."""
    import onnxruntime as ort

    from onnxtrain.api import CheckpointState, Module
    from onnxtrain.utils.ort_options import for_training

    options = for_training()
    assert options.execution_order == ort.ExecutionOrder.DEFAULT
    module = Module(mlp_artifacts.training_model, CheckpointState.load_checkpoint(mlp_artifacts.checkpoint),
                    mlp_artifacts.eval_model, session_options=options)
    trained = module._train.session.get_session_options()
    assert trained.execution_order == ort.ExecutionOrder.PRIORITY_BASED and not trained.enable_mem_reuse
    evaluated = module._eval.session.get_session_options()
    assert evaluated.execution_order == ort.ExecutionOrder.DEFAULT and evaluated.enable_mem_reuse
    assert options.execution_order == ort.ExecutionOrder.DEFAULT and options.enable_mem_reuse
