"""``Module``: the training and eval models over one CheckpointState (as onnxruntime.training.api.Module).

Gradient accumulation runs in the runtime rather than in the graph: after ``lazy_reset_grad`` the next
step writes the gradients in place (no extra work at all in the usual one-step-per-update loop); a step
that accumulates writes into a scratch vector and adds it in place. An in-graph accumulator would add
an extra pass over every gradient on every step, and standard ONNX has no in-place op to do it.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnxruntime as ort

from onnxtrain.ondevice.format import (
    LOSS_SCALE,
    NEWEST_FORMAT,
    TRAINING_METADATA_KEY,
    TRAINING_MODEL_FORMAT,
)
from onnxtrain.ondevice.session import Runner, create_session, read_metadata
from onnxtrain.ondevice.state import CheckpointState
from onnxtrain.runtime import backends
from onnxtrain.utils.ort_options import for_training


NO_CSE = ("CommonSubexpressionElimination",)


def check_agreement(state: CheckpointState, meta: dict, session: ort.InferenceSession, uri) -> None:
    """The checkpoint and a model must name the same parameters, with the same shapes and trainability."""
    used = meta["trainable"] + meta["frozen"]
    names = state.names()
    missing = [n for n in used if n not in names]
    if missing:
        raise ValueError(f"the checkpoint lacks parameters {missing[:10]} that {uri} needs; use the checkpoint "
                         "generated with this training model")
    extra = [n for n in names if n not in used]
    if extra:
        raise ValueError(f"the checkpoint has parameters {extra[:10]} that {uri} does not use; it comes from "
                         "other artifacts: use the checkpoint generated with this training model")
    inputs = {i.name: i for i in session.get_inputs()}
    for name in used:
        want = inputs[name].shape
        have = state.array(name).shape
        if len(want) != len(have) or any(isinstance(w, int) and w != h for w, h in zip(want, have)):
            raise ValueError(f"parameter {name!r} has shape {list(have)} in the checkpoint but {want} in {uri}")
    trainable = set(meta["trainable"])
    not_trainable = [n for n in meta["trainable"] if not state.requires_grad(n)]
    if not_trainable:
        raise ValueError(f"{uri} trains {not_trainable[:10]}, which the checkpoint marks requires_grad=False")
    not_frozen = [n for n in names if state.requires_grad(n) and n not in trainable]
    if not_frozen:
        raise ValueError(f"the checkpoint marks {not_frozen[:10]} requires_grad=True, which {uri} keeps frozen")


def check_row_gradients(meta: dict, session: ort.InferenceSession, uri) -> dict[str, dict]:
    """The training metadata's ``row_gradients`` (format 4: parameter -> its gradient's ids and rows outputs, and
    whether a gradient output holds the rest of it), checked against the trainable parameters and the outputs."""
    rows = meta.get("row_gradients", {})
    outputs = {o.name for o in session.get_outputs()}
    for name, entry in rows.items():
        names = list(entry.get("ids", [])) + list(entry.get("rows", []))
        if name not in meta["trainable"] or len(entry.get("ids", [])) != len(entry.get("rows", [])) or not names:
            raise ValueError(f"{uri}: row_gradients names {name!r} with ids {entry.get('ids')} and rows "
                             f"{entry.get('rows')}; it must be a trainable parameter with one ids output per rows output")
        missing = [n for n in names if n not in outputs]
        if missing:
            raise ValueError(f"{uri} lacks the outputs {missing} that its row_gradients name for {name!r}")
    return rows


class Module:
    """The training and eval models over one CheckpointState, as ``onnxruntime.training.api.Module``.

    ``session_options`` serve the training, eval and optimizer sessions. By default
    (:func:`onnxtrain.utils.ort_options.for_training`) they share one CPU arena, use no memory patterns
    and let idle threads sleep, since the sessions take turns; options you pass are used as they are,
    but for the training session's execution order and memory reuse: it runs in the graph's order
    (priority-based) without onnxruntime's buffer reuse plan (docs/memory.md).

    ``backend`` ("onnxruntime", "openvino", or None for the ``ONNXTRAIN_BACKEND`` env var, else the one the
    precision needs) runs the training and eval models; ``precision="bf16"`` runs them in bfloat16 on
    OpenVINO (:mod:`onnxtrain.runtime.backends`; where that cannot run, a warning and float32), and
    ``precision=None`` takes the one the artifacts were generated for. The optimizer model always runs on
    onnxruntime, in float32. See docs/precision.md.
    """

    def __init__(self, train_model_uri: str | os.PathLike, state: CheckpointState,
                 eval_model_uri: str | os.PathLike | None = None, device: str = "cpu",
                 session_options: ort.SessionOptions | None = None, backend: str | None = None,
                 precision: str | None = None):
        if not isinstance(state, CheckpointState):
            raise TypeError(f"state must be a CheckpointState, got {type(state).__name__}")
        self._state = state
        self.device = device
        self.backend, self.precision = backends.resolve(backend, precision, device)
        self.session_options = for_training() if session_options is None else session_options
        # onnxruntime runs the training model in the graph's order (priority-based: the forward, then
        # backward as the artifacts place it; Shape and Size first), not its default order, which runs
        # backward work late and keeps what it reads alive: on-device BERT-small at 4x batch, activation
        # memory 480 -> 388 MB without recompute, CPU time the same (docs/memory.md). With recompute the
        # artifacts' gates keep the clones in their place in that order (passes/order_backward.py).
        # And without its memory reuse plan, which hands a freed buffer to the next value of the same size
        # however much later that value is made, holding the buffer in between: a value freed in forward
        # is held to a gradient of its size in backward. Off, freed memory goes back to the allocator (the
        # arena, or the C heap) at once: 388 -> 376 MB without recompute, 274 -> 224 MB at budget 0.5,
        # 242 -> 168 MB at 0 (docs/memory.md).
        previous = self.session_options.execution_order, self.session_options.enable_mem_reuse
        self.session_options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        self.session_options.enable_mem_reuse = False
        try:
            session = create_session(train_model_uri, self.session_options, device, "training model", self.backend,
                                     self.precision)
            meta = read_metadata(session, TRAINING_METADATA_KEY, train_model_uri, "training model")
            if precision is None and meta.get("precision", "fp32") not in ("fp32", "fp16"):  # as generated: bf16
                chosen = backends.resolve(backend, meta["precision"], device)
                if chosen != (self.backend, self.precision):
                    self.backend, self.precision = chosen
                    session = create_session(train_model_uri, self.session_options, device, "training model",
                                             self.backend, self.precision)
            if meta.get("recomputed") and self.backend == "onnxruntime":
                # onnxruntime's common subexpression elimination would merge the recomputed clones back into
                # the forward nodes they copy (85 of 89 on BERT-small), and the values would stay alive all along
                session = create_session(train_model_uri, self.session_options, device, "training model",
                                         self.backend, self.precision, disabled_optimizers=NO_CSE)
        finally:
            self.session_options.execution_order, self.session_options.enable_mem_reuse = previous
        if meta.get("kind") != "training":
            raise ValueError(f"{train_model_uri} is the {meta.get('kind')} model; pass training_model.onnx as "
                             "train_model_uri (and the eval model as eval_model_uri)")
        if meta.get("format", 1) < TRAINING_MODEL_FORMAT:
            warnings.warn(
                f"{train_model_uri} was generated by an earlier onnxtrain whose embedding (Gather) gradients "
                "can lose updates when token ids repeat and onnxruntime runs on several threads; generate "
                "the artifacts again with onnxtrain.artifacts.generate_artifacts", UserWarning, stacklevel=2)
        if meta.get("format", 1) > NEWEST_FORMAT:
            raise ValueError(f"{train_model_uri} has training model format {meta['format']}; this onnxtrain reads "
                             f"formats up to {NEWEST_FORMAT}: upgrade onnxtrain to train it")
        check_agreement(state, meta, session, train_model_uri)
        self._row_gradients = check_row_gradients(meta, session, train_model_uri)
        self.loss_scaling = meta.get("loss_scaling")  # fp16 artifacts: the GradScaler-like policy
        if self.loss_scaling is not None and state.loss_scale is None:  # a checkpoint without the scale
            state.set_loss_scale(self.loss_scaling["init_scale"])
        self._eval: Runner | None = None
        self._eval_uri = eval_model_uri
        if eval_model_uri is not None:
            eval_session = create_session(eval_model_uri, self.session_options, device, "eval model", self.backend,
                                          self.precision)
            eval_meta = read_metadata(eval_session, TRAINING_METADATA_KEY, eval_model_uri, "eval model")
            check_agreement(state, eval_meta, eval_session, eval_model_uri)
            self._eval = Runner(eval_session, eval_meta, eval_model_uri)
        self.buffers = state.bind(meta["trainable"])
        self._train = Runner(session, meta, train_model_uri)
        self._grad_names = dict(zip(meta["trainable"], meta["gradients"]))
        self._scratch: dict[str, np.ndarray] | None = None
        self._bindings: dict[tuple, ort.IOBinding] = {}
        self.training = True

    # -- bindings: one per (session, live parameter copy, accumulating), made on first use -------
    def _arrays(self, copy: int) -> dict[str, np.ndarray]:
        frozen = {n: self._state.array(n) for n in self._train.params
                  if n not in self.buffers.layout.slices and n != LOSS_SCALE}
        if self.loss_scaling is not None:
            frozen[LOSS_SCALE] = self._state.loss_scale_arrays[0]
        return {**frozen, **self.buffers.param_views(copy)}

    def _binding(self, runner: Runner, accumulate: bool = False) -> ort.IOBinding:
        key = (runner is self._train, self.buffers.current, accumulate)
        if key not in self._bindings:
            outputs = None
            if runner is self._train:
                if accumulate:
                    if self._scratch is None:
                        self._scratch = self.buffers.layout.new_flat()
                    grads = self.buffers.layout.views(self._scratch)
                else:
                    grads = self.buffers.grad_views
                outputs = {self._grad_names[n]: view for n, view in grads.items()
                           if self._row_gradients.get(n, {}).get("base", True)}  # else: rows only (add_rows)
            self._bindings[key] = runner.new_binding(self._arrays(self.buffers.current), outputs)
        return self._bindings[key]

    # -- modes --------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        """Train mode (``mode=True``, calls run forward and backward) or eval mode; returns the module."""
        self.training = mode
        return self

    def eval(self) -> Module:
        """Eval mode: calls run the eval model (no gradients); returns the module."""
        return self.train(False)

    # -- steps --------------------------------------------------------------------------------
    def __call__(self, *inputs):
        if self.training:
            outputs = self._train_step(inputs)
        else:
            if self._eval is None:
                raise RuntimeError("this Module was created without eval_model_uri; pass it to run in eval mode")
            outputs = self._eval.run(self._binding(self._eval), inputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def _train_step(self, inputs) -> list[np.ndarray]:
        buffers = self.buffers
        into_zeros = buffers.grads_are_zero()
        if into_zeros:  # write the gradients in place
            outputs = self._train.run(self._binding(self._train), inputs)
            buffers.grads_written()
        else:
            outputs = self._train.run(self._binding(self._train, accumulate=True), inputs)
            for key, flat in buffers.grads.items():
                np.add(flat, self._scratch[key], out=flat)
        outputs, rows = outputs[:len(self._train.outputs)], iter(outputs[len(self._train.outputs):])
        for name, entry in self._row_gradients.items():  # the embedding gradients left to the runtime (format 4)
            first = into_zeros and not entry.get("base", False)  # into zeros: no output holds the rest
            for k in range(len(entry["ids"])):
                buffers.add_rows(name, next(rows), next(rows), into_zeros=first and k == 0)
        return outputs

    def lazy_reset_grad(self) -> None:
        """Gradients count as zero from now: the next training step overwrites them instead of adding."""
        self.buffers.reset_grad()

    # -- introspection ------------------------------------------------------------------------
    def input_names(self) -> list[str]:
        """The names of the inputs a call takes in the current mode (model inputs, then loss inputs)."""
        runner = self._train if self.training or self._eval is None else self._eval
        return list(runner.user_inputs)

    def output_names(self) -> list[str]:
        """The names of the outputs a call returns in the current mode (the loss first)."""
        runner = self._train if self.training or self._eval is None else self._eval
        return list(runner.outputs)

    # -- parameters as one buffer -------------------------------------------------------------
    def _param_names(self, trainable_only: bool) -> list[str]:
        return [n for n in self._state.names() if not trainable_only or self._state.requires_grad(n)]

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        """The number of parameter elements (trainable ones only, by default)."""
        return int(sum(self._state.array(n).size for n in self._param_names(trainable_only)))

    def get_contiguous_parameters(self, trainable_only: bool = False) -> ort.OrtValue:
        """A copy of the parameters (checkpoint order) in one flat OrtValue."""
        names = self._param_names(trainable_only)
        dtypes = {self._state.array(n).dtype for n in names}
        if len(dtypes) > 1:
            raise TypeError(f"the parameters have several element types {sorted(map(str, dtypes))}; "
                            "one contiguous buffer needs one")
        flat = np.concatenate([self._state.array(n).reshape(-1) for n in names])
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
            target = self._state.array(name)
            np.copyto(target, flat[pos:pos + target.size].reshape(target.shape), casting="same_kind")
            pos += target.size

    # -- export -------------------------------------------------------------------------------
    def export_model_for_inferencing(self, inference_model_uri: str | os.PathLike,
                                     graph_output_names: list[str], merge_adapters: bool = False) -> None:
        """Write the eval model with the current parameters baked in, returning ``graph_output_names``.
        ``merge_adapters=True`` folds LoRA adapters into their base weights (``W + s B A``); by default
        they stay separate initializers, named as in the training model (docs/lora.md)."""
        if self._eval_uri is None:
            raise RuntimeError("export_model_for_inferencing needs the eval model; pass eval_model_uri to Module")
        from onnxtrain.ondevice.export import (
            export_inference_model,  # imports onnx: export only
        )

        arrays = {n: self._state.array(n) for n in self._state.names()}
        export_inference_model(self._eval_uri, arrays, graph_output_names, inference_model_uri,
                               merge_adapters=merge_adapters)
