"""The on-device training runtime: onnxruntime and numpy only (no torch, no onnx on the training path).

    state = CheckpointState.load_checkpoint("artifacts/checkpoint")
    model = Module("artifacts/training_model.onnx", state, "artifacts/eval_model.onnx")
    optimizer = Optimizer("artifacts/optimizer_model.onnx", model)
    for x, y in batches:
        loss = model(x, y)          # forward + backward; gradients add up until lazy_reset_grad()
        optimizer.step()
        model.lazy_reset_grad()

Memory: the trainable parameters of each element type live in one flat numpy vector, each parameter a
view into it; gradients and optimizer states likewise. Those vectors are bound to the onnxruntime
sessions once, as OrtValues sharing their memory (IO binding), so a training step copies nothing but
the batch: the training session writes gradients straight into the gradient vectors and the optimizer
session writes the new parameters and states over the old ones.

Gradient accumulation runs in the runtime rather than in the graph: after ``lazy_reset_grad`` the next
step writes the gradients in place (no extra work at all in the usual one-step-per-update loop); a step
that accumulates writes into a scratch vector and adds it in place. An in-graph accumulator would add
an extra pass over every gradient on every step, and standard ONNX has no in-place op to do it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnxtrain.ondevice import checkpoint as ckpt
from onnxtrain.runtime import backends
from onnxtrain.utils.chunks import chunking, padded_size
from onnxtrain.utils.ort_options import for_training

TRAINING_METADATA_KEY = "onnxtrain.training"  # the artifacts writer imports these two
# Bumped when training models from earlier versions train differently; older ones get a warning.
# 2: embedding (Gather) gradients by ScatterElements, exact with repeated ids on several threads
# (1 used ScatterND, whose CPU kernel may lose updates then).
TRAINING_MODEL_FORMAT = 2
OPTIMIZER_METADATA_KEY = "onnxtrain.optimizer"

_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
}


# -------------------------------------------------------------------------------------------------
# Checkpoint state
# -------------------------------------------------------------------------------------------------


class Parameter:
    """One checkpoint parameter: ``data`` and ``grad`` read as numpy copies; assigning ``data`` copies in."""

    def __init__(self, state: CheckpointState, name: str):
        self._state = state
        self.name = name

    @property
    def requires_grad(self) -> bool:
        return self._state._requires_grad[self.name]

    @property
    def data(self) -> np.ndarray:
        return self._state._arrays[self.name].copy()

    @data.setter
    def data(self, value) -> None:
        target = self._state._arrays[self.name]
        value = np.asarray(value)
        if value.shape != target.shape:
            raise ValueError(f"parameter {self.name!r} has shape {list(target.shape)}; cannot assign an array of "
                             f"shape {list(value.shape)}")
        np.copyto(target, value, casting="same_kind")

    @property
    def grad(self) -> np.ndarray | None:
        """The accumulated gradient (zeros after ``lazy_reset_grad``), or None for a frozen parameter."""
        if not self.requires_grad:
            return None
        grads = self._state._grads
        if grads is None or self._state._grads_stale:
            return np.zeros_like(self._state._arrays[self.name])
        return grads[self.name].copy()

    def __repr__(self) -> str:
        array = self._state._arrays[self.name]
        return f"Parameter({self.name!r}, shape={list(array.shape)}, dtype={array.dtype}, requires_grad={self.requires_grad})"


class _Parameters(Mapping):
    def __init__(self, state: CheckpointState):
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        if name not in self._state._arrays:
            raise KeyError(f"no parameter {name!r} in the checkpoint (it has {list(self._state._arrays)[:10]})")
        return Parameter(self._state, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state._arrays)

    def __len__(self) -> int:
        return len(self._state._arrays)


class _Properties(MutableMapping):
    """The property bag: str keys; int, float or str values (checked on assignment)."""

    def __init__(self, values: dict):
        self._values = dict(values)

    def __getitem__(self, key):
        return self._values[key]

    def __setitem__(self, key, value):
        ckpt._check_property(key, value)
        self._values[key] = value

    def __delitem__(self, key):
        del self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __repr__(self):
        return repr(self._values)


class CheckpointState:
    """Parameters, gradients, optimizer state and properties: everything a checkpoint file holds."""

    def __init__(self, data: ckpt.CheckpointData):
        self._arrays: dict[str, np.ndarray] = dict(data.parameters)
        self._requires_grad = dict(data.requires_grad)
        self._optimizer_states = {k: dict(v) for k, v in data.optimizer_states.items()}
        self._optimizer_step = data.optimizer_step
        self._learning_rate = data.learning_rate
        self._nominal = data.nominal
        self._properties = _Properties(data.properties)
        self._grads: dict[str, np.ndarray] | None = None
        self._grads_stale = True  # gradients count as zero until a training step writes them
        self._layout: _FlatLayout | None = None

    @staticmethod
    def load_checkpoint(checkpoint_uri: str | os.PathLike) -> CheckpointState:
        return CheckpointState(ckpt.load(checkpoint_uri))

    @staticmethod
    def save_checkpoint(state: CheckpointState, checkpoint_uri: str | os.PathLike,
                        include_optimizer_state: bool = False) -> None:
        """Write ``state`` atomically; the optimizer state (step, learning rate, moments) only if asked."""
        if not isinstance(state, CheckpointState):
            raise TypeError(f"save_checkpoint needs a CheckpointState, got {type(state).__name__}")
        data = ckpt.CheckpointData(
            parameters=state._arrays, requires_grad=state._requires_grad,
            optimizer_states=state._optimizer_states, optimizer_step=state._optimizer_step,
            learning_rate=state._learning_rate, properties=dict(state._properties), nominal=False)
        ckpt.save(data, checkpoint_uri, include_optimizer_state=include_optimizer_state)

    @property
    def parameters(self) -> Mapping[str, Parameter]:
        return _Parameters(self)

    @property
    def properties(self) -> MutableMapping:
        return self._properties

    @property
    def is_nominal(self) -> bool:
        """Loaded from a nominal checkpoint: parameters are zeros until data is copied in."""
        return self._nominal

    def _flatten(self, trainable: list[str]) -> _FlatLayout:
        """Put the trainable parameters (and their gradients) into flat vectors, once per state."""
        if self._layout is not None:
            if self._layout.names != trainable:
                raise ValueError("this CheckpointState is already used by a Module with other trainable "
                                 f"parameters ({self._layout.names[:5]}...); load one state per Module")
            return self._layout
        self._layout = _FlatLayout(trainable, self._arrays)
        self._grads = self._layout.views(self._layout.grads)
        self._arrays.update(self._layout.views(self._layout.params))
        return self._layout


class _FlatLayout:
    """Per element type, one flat vector of parameters and one of gradients; names map to views."""

    def __init__(self, names: list[str], arrays: dict[str, np.ndarray]):
        self.names = list(names)
        self.shapes = {n: arrays[n].shape for n in names}
        self.dtypes: list[str] = []
        self.slices: dict[str, tuple[str, int, int]] = {}
        sizes: dict[str, int] = {}
        for n in names:
            key = arrays[n].dtype.name
            if key not in sizes:
                sizes[key] = 0
                self.dtypes.append(key)
            self.slices[n] = (key, sizes[key], sizes[key] + arrays[n].size)
            sizes[key] += arrays[n].size
        self.sizes = sizes
        # Zero-padded to whole chunks, the optimizer graph's layout (onnxtrain.utils.chunks).
        self.params = {k: np.zeros(padded_size(sizes[k]), dtype=k) for k in self.dtypes}
        self.grads = {k: np.zeros(padded_size(sizes[k]), dtype=k) for k in self.dtypes}
        for n in names:
            key, lo, hi = self.slices[n]
            self.params[key][lo:hi] = arrays[n].reshape(-1)

    def views(self, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: flat[k][lo:hi].reshape(self.shapes[n]) for n, (k, lo, hi) in self.slices.items()}

    def new_flat(self, fill=0) -> dict[str, np.ndarray]:
        return {k: np.full(v.size, fill, dtype=k) for k, v in self.params.items()}


# -------------------------------------------------------------------------------------------------
# Sessions
# -------------------------------------------------------------------------------------------------


def _session(uri, session_options, device: str, what: str, backend: str = "onnxruntime",
             precision: str = "fp32") -> ort.InferenceSession:
    """A session for the model at ``uri``: onnxruntime's, or one with its interface on another backend."""
    path = Path(uri)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path} (generate_artifacts writes it)")
    providers = _providers(device)
    try:
        return backends.create_session(path, backend, precision, session_options, providers)
    except Exception as exc:
        raise ValueError(f"{backend} cannot load the {what} {path}: {exc}") from exc


def _providers(device: str) -> list[str]:
    if device != "cpu":
        raise ValueError(f"device {device!r} is not supported by the on-device runtime yet; use device='cpu'")
    return ["CPUExecutionProvider"]


def _metadata(session: ort.InferenceSession, key: str, path, what: str) -> dict:
    raw = session.get_modelmeta().custom_metadata_map.get(key)
    if raw is None:
        raise ValueError(f"{path} is not an onnxtrain {what} (metadata {key!r} missing); "
                         "generate it with onnxtrain.artifacts.generate_artifacts")
    return json.loads(raw)


def _ortvalue(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue sharing ``array``'s memory (CPU). It does not keep ``array`` alive: the caller must."""
    return ort.OrtValue.ortvalue_from_numpy(array)


class _Runner:
    """One session with the parameters bound once; binds the user inputs and outputs per call."""

    def __init__(self, session: ort.InferenceSession, meta: dict, state: CheckpointState):
        self.session = session
        self.user_inputs = meta["user_inputs"]
        self.outputs = meta["outputs"]
        self.input_types = {i.name: _ORT_TYPES.get(i.type) for i in session.get_inputs()}
        self._keep: list = []
        self.binding = self._new_binding(state, meta["trainable"] + meta["frozen"])

    def _new_binding(self, state: CheckpointState, params: list[str]) -> ort.IOBinding:
        binding = self.session.io_binding()
        for name in params:
            value = _ortvalue(state._arrays[name])
            self._keep.append(value)
            binding.bind_ortvalue_input(name, value)
        for name in self.outputs:  # first, so that they come first in get_outputs()
            binding.bind_output(name, "cpu")
        return binding

    def bind_inputs(self, binding: ort.IOBinding, inputs) -> None:
        if len(inputs) != len(self.user_inputs):
            raise TypeError(f"the model takes {len(self.user_inputs)} inputs {self.user_inputs} (model inputs, then "
                            f"loss inputs), got {len(inputs)}")
        for name, value in zip(self.user_inputs, inputs):
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
                continue
            expected = self.input_types.get(name)
            array = np.asarray(value)
            if expected is not None and array.dtype != expected:
                if not np.can_cast(array.dtype, expected, casting="same_kind"):
                    raise TypeError(f"input {name!r} must be {np.dtype(expected).name}, got {array.dtype}")
                array = array.astype(expected)
            binding.bind_cpu_input(name, np.ascontiguousarray(array))

    def run(self, binding: ort.IOBinding, inputs) -> list[np.ndarray]:
        self.bind_inputs(binding, inputs)
        for name in self.outputs:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        values = binding.get_outputs()
        return [values[i].numpy() for i in range(len(self.outputs))]


# -------------------------------------------------------------------------------------------------
# Module
# -------------------------------------------------------------------------------------------------


class Module:
    """The training and eval models over one CheckpointState, as ``onnxruntime.training.api.Module``.

    ``session_options`` serve the training, eval and optimizer sessions. By default
    (:func:`onnxtrain.utils.ort_options.for_training`) they share one CPU arena, use no memory patterns
    and let idle threads sleep, since the sessions take turns; options you pass are used as they are.

    ``backend`` ("onnxruntime", "openvino", or None for the ``ONNXTRAIN_BACKEND`` env var, else the one the
    precision needs) runs the training and eval models; ``precision="bf16"`` runs their products in bfloat16
    on OpenVINO (:mod:`onnxtrain.runtime.backends`: where that cannot run, a warning and float32). The
    optimizer model always runs on onnxruntime, in float32.
    """

    def __init__(self, train_model_uri: str | os.PathLike, state: CheckpointState,
                 eval_model_uri: str | os.PathLike | None = None, device: str = "cpu",
                 session_options: ort.SessionOptions | None = None, backend: str | None = None,
                 precision: str | None = None):
        if not isinstance(state, CheckpointState):
            raise TypeError(f"state must be a CheckpointState, got {type(state).__name__}")
        self._state = state
        self._device = device
        self.backend, self.precision = backends.resolve(backend, precision, device)
        if session_options is None:
            session_options = for_training()
        self._session_options = session_options
        session = _session(train_model_uri, session_options, device, "training model", self.backend,
                           self.precision)
        meta = _metadata(session, TRAINING_METADATA_KEY, train_model_uri, "training model")
        if meta.get("kind") != "training":
            raise ValueError(f"{train_model_uri} is the {meta.get('kind')} model; pass training_model.onnx as "
                             "train_model_uri (and the eval model as eval_model_uri)")
        self._meta = meta
        if meta.get("format", 1) < TRAINING_MODEL_FORMAT:
            warnings.warn(
                f"{train_model_uri} was generated by an earlier onnxtrain whose embedding (Gather) gradients "
                "can lose updates when token ids repeat and onnxruntime runs on several threads; generate "
                "the artifacts again with onnxtrain.artifacts.generate_artifacts", UserWarning, stacklevel=2)
        self._check_state(meta, session, train_model_uri)
        self._layout = state._flatten(meta["trainable"])
        self._train = _Runner(session, meta, state)
        self._grad_names = dict(zip(meta["trainable"], meta["gradients"]))
        self._bind_grads(self._train.binding, self._layout.grads)
        self._scratch: tuple[ort.IOBinding, dict[str, np.ndarray]] | None = None
        self._eval: _Runner | None = None
        self._eval_uri = eval_model_uri
        if eval_model_uri is not None:
            eval_session = _session(eval_model_uri, session_options, device, "eval model", self.backend,
                                    self.precision)
            eval_meta = _metadata(eval_session, TRAINING_METADATA_KEY, eval_model_uri, "eval model")
            self._eval = _Runner(eval_session, eval_meta, state)
        self.training = True

    def _check_state(self, meta: dict, session: ort.InferenceSession, uri) -> None:
        state = self._state
        missing = [n for n in meta["trainable"] + meta["frozen"] if n not in state._arrays]
        if missing:
            raise ValueError(f"the checkpoint lacks parameters {missing[:10]} that {uri} needs; use the checkpoint "
                             "generated with this training model")
        inputs = {i.name: i for i in session.get_inputs()}
        for name in meta["trainable"] + meta["frozen"]:
            want = inputs[name].shape
            have = state._arrays[name].shape
            if len(want) != len(have) or any(isinstance(w, int) and w != h for w, h in zip(want, have)):
                raise ValueError(f"parameter {name!r} has shape {list(have)} in the checkpoint but {want} in {uri}")
        not_trainable = [n for n in meta["trainable"] if not state._requires_grad.get(n)]
        if not_trainable:
            raise ValueError(f"{uri} trains {not_trainable[:10]}, which the checkpoint marks requires_grad=False")

    def _bind_grads(self, binding: ort.IOBinding, flat: dict[str, np.ndarray]) -> None:
        for name, view in self._layout.views(flat).items():
            value = _ortvalue(view)
            self._train._keep.append(value)
            binding.bind_ortvalue_output(self._grad_names[name], value)

    # -- modes --------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        self.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    # -- steps --------------------------------------------------------------------------------
    def __call__(self, *inputs):
        if self.training:
            outputs = self._train_step(inputs)
        else:
            if self._eval is None:
                raise RuntimeError("this Module was created without eval_model_uri; pass it to run in eval mode")
            outputs = self._eval.run(self._eval.binding, inputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def _train_step(self, inputs) -> list[np.ndarray]:
        state = self._state
        if state._grads_stale:  # write the gradients in place
            outputs = self._train.run(self._train.binding, inputs)
            state._grads_stale = False
            return outputs
        binding, scratch = self._scratch_binding()
        outputs = self._train.run(binding, inputs)
        for key, flat in self._layout.grads.items():
            np.add(flat, scratch[key], out=flat)
        return outputs

    def _scratch_binding(self):
        if self._scratch is None:
            binding = self._train._new_binding(self._state, self._meta["trainable"] + self._meta["frozen"])
            scratch = self._layout.new_flat()
            self._bind_grads(binding, scratch)
            self._scratch = (binding, scratch)
        return self._scratch

    def lazy_reset_grad(self) -> None:
        """Gradients count as zero from now: the next training step overwrites them instead of adding."""
        self._state._grads_stale = True

    # -- introspection ------------------------------------------------------------------------
    def input_names(self) -> list[str]:
        runner = self._train if self.training or self._eval is None else self._eval
        return list(runner.user_inputs)

    def output_names(self) -> list[str]:
        runner = self._train if self.training or self._eval is None else self._eval
        return list(runner.outputs)

    # -- parameters as one buffer -------------------------------------------------------------
    def _param_names(self, trainable_only: bool) -> list[str]:
        return [n for n in self._state._arrays if not trainable_only or self._state._requires_grad[n]]

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        return int(sum(self._state._arrays[n].size for n in self._param_names(trainable_only)))

    def get_contiguous_parameters(self, trainable_only: bool = False) -> ort.OrtValue:
        """A copy of the parameters (checkpoint order) in one flat OrtValue."""
        names = self._param_names(trainable_only)
        dtypes = {self._state._arrays[n].dtype for n in names}
        if len(dtypes) > 1:
            raise TypeError(f"the parameters have several element types {sorted(map(str, dtypes))}; "
                            "one contiguous buffer needs one")
        flat = np.concatenate([self._state._arrays[n].reshape(-1) for n in names])
        value = ort.OrtValue.ortvalue_from_shape_and_type(flat.shape, flat.dtype)  # owns its memory
        value.update_inplace(flat)
        return value

    def copy_buffer_to_parameters(self, buffer, trainable_only: bool = True) -> None:
        """Copy a flat buffer (OrtValue or numpy, as from get_contiguous_parameters) into the parameters."""
        flat = buffer.numpy() if isinstance(buffer, ort.OrtValue) else np.asarray(buffer)
        flat = flat.reshape(-1)
        size = self.get_parameters_size(trainable_only)
        if flat.size != size:
            raise ValueError(f"the buffer has {flat.size} elements; the {'trainable ' if trainable_only else ''}"
                             f"parameters have {size}")
        pos = 0
        for name in self._param_names(trainable_only):
            target = self._state._arrays[name]
            np.copyto(target, flat[pos:pos + target.size].reshape(target.shape), casting="same_kind")
            pos += target.size

    # -- export -------------------------------------------------------------------------------
    def export_model_for_inferencing(self, inference_model_uri: str | os.PathLike,
                                     graph_output_names: list[str]) -> None:
        """Write the eval model with the current parameters baked in, returning ``graph_output_names``."""
        if self._eval_uri is None:
            raise RuntimeError("export_model_for_inferencing needs the eval model; pass eval_model_uri to Module")
        from onnxtrain.ondevice.export import (
            export_inference_model,  # imports onnx: export only
        )

        export_inference_model(self._eval_uri, self._state._arrays, graph_output_names, inference_model_uri)


# -------------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedulers
# -------------------------------------------------------------------------------------------------


class Optimizer:
    """Runs the optimizer model over the module's parameters: one session call per step, in place."""

    def __init__(self, optimizer_uri: str | os.PathLike, module: Module):
        if not isinstance(module, Module):
            raise TypeError(f"Optimizer needs a Module, got {type(module).__name__}")
        self._module = module
        state = module._state
        self._state = state
        session = _session(optimizer_uri, module._session_options, module._device, "optimizer model")
        meta = _metadata(session, OPTIMIZER_METADATA_KEY, optimizer_uri, "optimizer model")
        self._session = session
        self._meta = meta
        layout = module._layout
        self._check_layout(meta, layout, optimizer_uri)
        self._states = self._load_states(meta["states"], layout)
        self._lr = np.array(state._learning_rate if state._learning_rate is not None
                            else meta["hyperparameters"]["lr"], dtype=np.float32)
        self._step = np.array(state._optimizer_step, dtype=np.int64)
        state._learning_rate = float(self._lr)
        self._binding, self._keep = self._bind(layout)

    @staticmethod
    def _check_layout(meta: dict, layout: _FlatLayout, uri) -> None:
        names = [p["name"] for g in meta["groups"] for p in g["params"]]
        if names != layout.names:
            raise ValueError(f"{uri} updates parameters {names[:5]}... but the module trains {layout.names[:5]}...; "
                             "use the optimizer model generated with this training model")
        for group in meta["groups"]:
            expected = list(chunking(layout.sizes[group["dtype"]]))
            if [group.get("chunks"), group.get("chunk")] != expected:
                raise ValueError(f"{uri} lays the {group['dtype']} parameters out in chunks "
                                 f"{[group.get('chunks'), group.get('chunk')]}, this runtime in {expected}; "
                                 "generate the artifacts again with this version of onnxtrain")

    def _load_states(self, names: list[str], layout: _FlatLayout) -> dict[str, dict[str, np.ndarray]]:
        states = {s: layout.new_flat() for s in names}
        saved = self._state._optimizer_states
        for s, flat in states.items():
            views = layout.views(flat)
            for pname, view in views.items():
                if pname in saved and s in saved[pname]:
                    src = saved[pname][s]
                    if src.shape != view.shape:
                        raise ValueError(f"the checkpoint's optimizer state {s!r} of {pname!r} has shape "
                                         f"{list(src.shape)}, the parameter {list(view.shape)}")
                    view[...] = src
                self._state._optimizer_states.setdefault(pname, {})[s] = view
        return states

    def _bind(self, layout: _FlatLayout):
        binding = self._session.io_binding()
        keep = [_ortvalue(self._lr), _ortvalue(self._step)]
        binding.bind_ortvalue_input("learning_rate", keep[0])
        binding.bind_ortvalue_input("step", keep[1])
        for key in layout.dtypes:
            pairs = [("params", layout.params[key]), ("gradients", layout.grads[key])]
            pairs += [(s, self._states[s][key]) for s in self._meta["states"]]
            rows = chunking(layout.sizes[key])
            for prefix, array in pairs:
                value = _ortvalue(array.reshape(rows))  # a view: the graph updates the vectors in place
                keep.append(value)
                binding.bind_ortvalue_input(f"{prefix}.{key}", value)
                if prefix != "gradients":  # updated in place
                    binding.bind_ortvalue_output(f"{prefix}.{key}.out", value)
        return binding, keep

    def step(self) -> None:
        """Update every trainable parameter with the accumulated gradients."""
        if self._state._grads_stale:  # reset since the last training step: the gradients are zero
            for flat in self._module._layout.grads.values():
                flat.fill(0)
            self._state._grads_stale = False
        self._step += 1
        self._session.run_with_iobinding(self._binding)
        self._state._optimizer_step = int(self._step)

    def set_learning_rate(self, learning_rate: float) -> None:
        self._lr[...] = learning_rate
        self._state._learning_rate = float(learning_rate)

    def get_learning_rate(self) -> float:
        return float(self._lr)


class LinearLRScheduler:
    """Linear warmup from 0 to ``initial_lr`` over ``warmup_step_count`` steps, then linear decay to 0 at
    ``total_step_count`` (as ONNX Runtime Training and transformers' get_linear_schedule_with_warmup)."""

    def __init__(self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int, initial_lr: float):
        if warmup_step_count < 0 or total_step_count < warmup_step_count:
            raise ValueError(f"need 0 <= warmup_step_count <= total_step_count, got {warmup_step_count}, "
                             f"{total_step_count}")
        self._optimizer = optimizer
        self._warmup = warmup_step_count
        self._total = total_step_count
        self._initial_lr = initial_lr
        self._step = 0
        optimizer.set_learning_rate(initial_lr * self._factor(0))

    def _factor(self, step: int) -> float:
        if step < self._warmup:
            return step / max(1, self._warmup)
        return max(0.0, (self._total - step) / max(1, self._total - self._warmup))

    def step(self) -> None:
        self._step += 1
        self._optimizer.set_learning_rate(self._initial_lr * self._factor(self._step))


__all__ = ["CheckpointState", "LinearLRScheduler", "Module", "Optimizer", "Parameter"]
