"""``Optimizer``: runs the optimizer model over a Module's flat buffers, one step at a time.

Where the model's rows are symbolic (an update row by row, elementwise: AdamW or SGD without clipping or loss
scaling), the step writes the new values over the live copy of the parameters and states, in place: each output
``<input>.out`` is bound to its input's buffer. That relies on two things, which tests/ondevice/test_optimizer_rows.py
checks bitwise against the double-buffered update (AdamW and SGD; onnxruntime and OpenVINO training calls): in the
model's ``Scan`` body every node reading an input's chunk comes before the node writing that chunk of the output of
its name, or is that node, elementwise (AdamW: ``exp_avg * beta1`` before the new ``exp_avg``; SGD's weight decay
reads the parameter again in the ``Sub`` that writes it), and onnxruntime's ``Scan`` runs the chunks in order on
slices of the bound buffers. Written in place, a step streams 135 MB less through memory on BERT-small (no second
copy of each vector to fetch before writing it) and that copy is never touched. Other models (fixed rows) read the
live copy and write the other one, then the copies swap: no buffer is bound as both an input and an output.

Row by row, and where the session may use two threads, a step is calls on ranges of the rows, taken in turn by two
threads at once (onnxruntime's ``Scan`` runs one chunk after another, and splitting each elementwise node between
two threads gained nothing; concurrent runs of one session are what onnxruntime promises), each call on one
thread. The ranges shrink as they go (:func:`_cuts`: each a third of the rows left, down to one row), so that a
thread the system holds back leaves its ranges to the other instead of the step waiting for its half, and the
thread that ends first waits for at most one row of the other's.
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


def _row_by_row(session: ort.InferenceSession, meta: dict) -> bool:
    """Whether the model declares its rows symbolic: written so only where each row's update is elementwise over
    that row (an AdamW or SGD ``Scan`` without clipping or loss scaling, :func:`onnxtrain.blocks.optim.build_optimizer_model`)."""
    flat = [i for i in session.get_inputs() if len(i.shape or ()) == 2]
    symbolic = bool(flat) and all(not isinstance(i.shape[0], int) for i in flat)
    return (symbolic and meta.get("loss_scaling") is None
            and meta["hyperparameters"].get("max_grad_norm") is None)


def _threads(options: ort.SessionOptions) -> int:
    return getattr(options, "intra_op_num_threads", 0) or os.cpu_count() or 1


def _cuts(rows: int) -> list[int]:
    """Where the ranges of ``rows`` rows begin, and the last ends: each range a third of the rows left (at least one
    row), so the ranges shrink to one row at the end and the thread that ends first waits for at most one row of the
    other's. BERT-small's 43 rows: 15, 10, 6, 4, 3, 2, 1, 1, 1 (the optimizer call, written in place, 11.3-11.6 ms
    against 11.9-12.2 with 8 equal ranges, where the first thread to end waited for part of the other's last range:
    BENCHMARKS.md)."""
    cuts = [0]
    while cuts[-1] < rows:
        cuts.append(cuts[-1] + -(-(rows - cuts[-1]) // 3))
    return cuts


def _ranges(layout: FlatLayout, ranged: bool) -> list[dict[str, slice]]:
    """The ranges a step runs, each a slice of the rows of every vector: one range of all rows, or (``ranged``) cut
    by :func:`_cuts` on the vector of fewest rows and in proportion on the others, so each range has a row of each."""
    rows = {key: layout.rows(key)[0] for key in layout.dtypes}
    fewest = min(rows.values())
    cuts = _cuts(fewest) if ranged else [0, fewest]
    return [{key: slice(n * lo // fewest, n * hi // fewest) for key, n in rows.items()}
            for lo, hi in zip(cuts, cuts[1:])]


IN_PLACE = True  # False: row-by-row updates too write the other copy and swap (the reference the tests compare with)


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
        # Row by row, the update is written in place (see the module's docstring), and from two threads if it may
        # use them, on ranges of the rows
        row_by_row = _row_by_row(session, meta)
        self._in_place = IN_PLACE and row_by_row
        ranged = row_by_row and _threads(module.session_options) >= 2
        if ranged:  # the ranges are the threads: each call runs on one (no second pool splitting its nodes)
            options = module.session_options
            previous, options.intra_op_num_threads = options.intra_op_num_threads, 1
            try:
                session = create_session(optimizer_uri, options, module.device, "optimizer model")
            finally:
                options.intra_op_num_threads = previous
            self._session = session
        ranges = _ranges(buffers.layout, ranged)
        self._bindings = [[self._bind(buffers, src, rows) for rows in ranges] for src in (0, 1)]
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="onnxtrain-optimizer") if len(ranges) > 1 else None

    def _bind(self, buffers: FlatBuffers, src: int, ranges: dict[str, slice]) -> ort.IOBinding:
        """Read copy ``src`` of the parameters and states, write copy ``1 - src`` (copy ``src`` itself in place): the
        rows ``ranges[key]`` of each element type's vectors."""
        dst = src if self._in_place else 1 - src
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
            rows, mine = layout.rows(key), ranges[key]
            vectors = [(PARAMS, buffers.params(src)[key], buffers.params(dst)[key])]
            vectors += [(s, buffers.states(s, src)[key], buffers.states(s, dst)[key]) for s in self._meta["states"]]
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
        if not self._in_place:
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
