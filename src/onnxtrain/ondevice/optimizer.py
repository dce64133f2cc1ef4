"""``Optimizer``: runs the optimizer model over a Module's flat buffers, one step at a time.

The optimizer model reads the live copy of the parameters and states and writes the other copy
(its outputs ``<input>.out`` are distinct buffers); then the copies swap. One binding per direction
is made once, so a step binds nothing. Where the model's rows are symbolic (an update row by row: no clipping,
no loss scaling) and the session may use two threads, a step is calls on ranges of the rows, taken in turn by
two threads at once (onnxruntime's ``Scan`` runs one chunk after another, and splitting each elementwise node
between two threads gained nothing; concurrent runs of one session are what onnxruntime promises), each call
on one thread: up to 8 ranges, so that a thread the system holds back leaves its ranges to the other instead of
the step waiting for its half.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

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


def _parts(session: ort.InferenceSession, meta: dict, layout: FlatLayout, options: ort.SessionOptions) -> int:
    """Into how many ranges of rows a step cuts the update (1: one call): up to 8 where the model declares its
    rows symbolic (written so only where each row's update reads only that row), each range gets a row of every
    vector, and the session may use more than one thread."""
    flat = [i for i in session.get_inputs() if len(i.shape or ()) == 2]
    symbolic = bool(flat) and all(not isinstance(i.shape[0], int) for i in flat)
    threads = getattr(options, "intra_op_num_threads", 0) or os.cpu_count() or 1
    if not symbolic or threads < 2 or meta.get("loss_scaling") is not None:
        return 1
    if meta["hyperparameters"].get("max_grad_norm") is not None:
        return 1
    return max(1, min([_RANGES] + [layout.rows(key)[0] for key in layout.dtypes]))


_RANGES = 8


class Optimizer:
    """Runs the optimizer model over the module's parameters: one session call per step, or calls on ranges of
    the rows from two threads (see the module's docstring)."""

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
        parts = _parts(session, meta, buffers.layout, module.session_options)
        if parts > 1:  # the ranges are the threads: each call runs on one (no second pool splitting its nodes)
            options = module.session_options
            previous, options.intra_op_num_threads = options.intra_op_num_threads, 1
            try:
                session = create_session(optimizer_uri, options, module.device, "optimizer model")
            finally:
                options.intra_op_num_threads = previous
            self._session = session
        self._bindings = [[self._bind(buffers, src, part, parts) for part in range(parts)] for src in (0, 1)]
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="onnxtrain-optimizer") if parts > 1 else None

    def _bind(self, buffers: FlatBuffers, src: int, part: int = 0, parts: int = 1) -> ort.IOBinding:
        """Read copy ``src`` of the parameters and states, write copy ``1 - src``: rows ``part`` of ``parts``."""
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
            mine = slice(rows[0] * part // parts, rows[0] * (part + 1) // parts)
            vectors = [(PARAMS, buffers.params(src)[key], buffers.params(1 - src)[key])]
            vectors += [(s, buffers.states(s, src)[key], buffers.states(s, 1 - src)[key]) for s in self._meta["states"]]
            grads = ortvalue(buffers.grads[key].reshape(rows)[mine])
            self._keep.append(grads)
            binding.bind_ortvalue_input(flat_name(GRADIENTS, key), grads)
            for prefix, old, new in vectors:
                name = flat_name(prefix, key)
                old_value, new_value = ortvalue(old.reshape(rows)[mine]), ortvalue(new.reshape(rows)[mine])
                self._keep += [old_value, new_value]
                binding.bind_ortvalue_input(name, old_value)
                binding.bind_ortvalue_output(updated_name(name), new_value)
        return binding

    def step(self) -> None:
        """Update every trainable parameter with the accumulated gradients."""
        self._buffers.grads_for_update()  # zero-filled if reset since the last training step
        self._step += 1
        bindings = self._bindings[self._buffers.current]
        if self._worker is None:
            self._session.run_with_iobinding(bindings[0])
        else:
            ranges = iter(bindings)  # both threads take the next range (next() on a list iterator is atomic)
            other = self._worker.submit(self._run_all, ranges)
            try:
                self._run_all(ranges)
            finally:
                other.result()  # every range has ended (or raised) before anything is swapped
        self._buffers.swap()
        if self._scaling is not None:
            (scale, good), (new_scale, new_good) = self._scaling
            if new_scale < scale:  # an inf/NaN gradient: the model kept everything; the step was not taken
                self._step -= 1
            scale[...], good[...] = new_scale, new_good
        self._state.optimizer_step = int(self._step)

    def _run_all(self, bindings) -> None:
        for binding in bindings:
            self._session.run_with_iobinding(binding)

    def set_learning_rate(self, learning_rate: float) -> None:
        """Set the learning rate of the next steps."""
        self._lr[...] = learning_rate
        self._state.learning_rate = float(learning_rate)

    def get_learning_rate(self) -> float:
        """The learning rate of the next step."""
        return float(self._lr)
