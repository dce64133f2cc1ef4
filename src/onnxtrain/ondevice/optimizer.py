"""``Optimizer``: runs the optimizer model over a Module's flat buffers, one session call per step.

The optimizer model reads the live copy of the parameters and states and writes the other copy
(its outputs ``<input>.out`` are distinct buffers); then the copies swap. One binding per direction
is made once, so a step binds nothing.
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort

from onnxtrain.ondevice.buffers import FlatBuffers, FlatLayout
from onnxtrain.ondevice.format import (
    GOOD_STEPS,
    GRADIENTS,
    LEARNING_RATE,
    LOSS_SCALE,
    OPTIMIZER_METADATA_KEY,
    PARAMS,
    STEP,
    flat_name,
    updated_name,
)
from onnxtrain.ondevice.module import Module
from onnxtrain.ondevice.session import create_session, ortvalue, read_metadata


def check_layout(meta: dict, layout: FlatLayout, uri) -> None:
    """The optimizer model must update the module's trainable parameters, in its flat layout."""
    names = [p["name"] for g in meta["groups"] for p in g["params"]]
    if names != layout.names:
        raise ValueError(f"{uri} updates parameters {names[:5]}... but the module trains {layout.names[:5]}...; "
                         "use the optimizer model generated with this training model")
    for group in meta["groups"]:
        expected = list(layout.rows(group["dtype"]))
        if [group.get("chunks"), group.get("chunk")] != expected:
            raise ValueError(f"{uri} lays the {group['dtype']} parameters out in chunks "
                             f"{[group.get('chunks'), group.get('chunk')]}, this runtime in {expected}; "
                             "generate the artifacts again with this version of onnxtrain")


class Optimizer:
    """Runs the optimizer model over the module's parameters: one session call per step."""

    def __init__(self, optimizer_uri: str | os.PathLike, module: Module):
        if not isinstance(module, Module):
            raise TypeError(f"Optimizer needs a Module, got {type(module).__name__}")
        state = module._state
        self._state = state
        session = create_session(optimizer_uri, module.session_options, module.device, "optimizer model")
        meta = read_metadata(session, OPTIMIZER_METADATA_KEY, optimizer_uri, "optimizer model")
        self._session = session
        self._meta = meta
        buffers = module.buffers
        check_layout(meta, buffers.layout, optimizer_uri)
        state.add_optimizer_states(meta["states"])
        self._buffers = buffers
        self._lr = np.array(state.learning_rate if state.learning_rate is not None
                            else meta["hyperparameters"]["lr"], dtype=np.float32)
        self._step = np.array(state.optimizer_step, dtype=np.int64)
        state.learning_rate = float(self._lr)
        self._keep: list[ort.OrtValue] = []
        self._scaling = None  # fp16: (live scale, live count), (new scale, new count)
        if meta.get("loss_scaling") is not None:
            if state.loss_scale is None:
                state.set_loss_scale(meta["loss_scaling"]["init_scale"])
            live = state.loss_scale_arrays
            self._scaling = (live, (np.zeros_like(live[0]), np.zeros_like(live[1])))
        self._bindings = [self._bind(buffers, src) for src in (0, 1)]

    def _bind(self, buffers: FlatBuffers, src: int) -> ort.IOBinding:
        """Read copy ``src`` of the parameters and states, write copy ``1 - src``."""
        binding = self._session.io_binding()
        for name, array in ((LEARNING_RATE, self._lr), (STEP, self._step)):
            value = ortvalue(array)
            self._keep.append(value)
            binding.bind_ortvalue_input(name, value)
        if self._scaling is not None:
            for name, live, new in zip((LOSS_SCALE, GOOD_STEPS), *self._scaling):
                values = ortvalue(live), ortvalue(new)
                self._keep += values
                binding.bind_ortvalue_input(name, values[0])
                binding.bind_ortvalue_output(updated_name(name), values[1])
        layout = buffers.layout
        for key in layout.dtypes:
            rows = layout.rows(key)
            vectors = [(PARAMS, buffers.params(src)[key], buffers.params(1 - src)[key])]
            vectors += [(s, buffers.states(s, src)[key], buffers.states(s, 1 - src)[key]) for s in self._meta["states"]]
            grads = ortvalue(buffers.grads[key].reshape(rows))
            self._keep.append(grads)
            binding.bind_ortvalue_input(flat_name(GRADIENTS, key), grads)
            for prefix, old, new in vectors:
                name = flat_name(prefix, key)
                old_value, new_value = ortvalue(old.reshape(rows)), ortvalue(new.reshape(rows))
                self._keep += [old_value, new_value]
                binding.bind_ortvalue_input(name, old_value)
                binding.bind_ortvalue_output(updated_name(name), new_value)
        return binding

    def step(self) -> None:
        """Update every trainable parameter with the accumulated gradients."""
        self._buffers.grads_for_update()  # zero-filled if reset since the last training step
        self._step += 1
        self._session.run_with_iobinding(self._bindings[self._buffers.current])
        self._buffers.swap()
        if self._scaling is not None:
            (scale, good), (new_scale, new_good) = self._scaling
            if new_scale < scale:  # an inf/NaN gradient: the model kept everything; the step was not taken
                self._step -= 1
            scale[...], good[...] = new_scale, new_good
        self._state.optimizer_step = int(self._step)

    def set_learning_rate(self, learning_rate: float) -> None:
        """Set the learning rate of the next steps."""
        self._lr[...] = learning_rate
        self._state.learning_rate = float(learning_rate)

    def get_learning_rate(self) -> float:
        """The learning rate of the next step."""
        return float(self._lr)
