"""The flat buffers of a training run: per element type, one vector of trainable parameters, one of
gradients and one per optimizer state, each parameter a view into them (docs/format.md, "Flat layout").

The vectors are zero-padded to whole chunks, the optimizer graph's layout (:mod:`onnxtrain.utils.chunks`).
Parameters and optimizer states have two copies: an optimizer graph that updates row by row writes the live copy
in place (the other is never touched: its pages are never faulted in), any other reads one copy and writes the
other, then the two swap (``current`` flips; ``ondevice/optimizer.py``).

This object owns the gradients' state too: after :meth:`reset_grad` they count as zero, and whoever
reads them next (a training step or an optimizer step) asks this object how. An embedding's gradient that the
runtime adds row by row (:meth:`add_rows`, training model format 4) is cleared by the rows it wrote, not whole.
"""

from __future__ import annotations

import numpy as np

from onnxtrain.utils.chunks import chunking, padded_size


class FlatLayout:
    """Where each trainable parameter sits: per element type (in first-seen order), an offset range."""

    def __init__(self, names: list[str], shapes: dict[str, tuple[int, ...]], dtypes: dict[str, np.dtype]):
        self.names = list(names)
        self.shapes = {n: tuple(shapes[n]) for n in names}
        self.dtypes: list[str] = []
        self.slices: dict[str, tuple[str, int, int]] = {}
        sizes: dict[str, int] = {}
        for n in names:
            key = np.dtype(dtypes[n]).name
            if key not in sizes:
                sizes[key] = 0
                self.dtypes.append(key)
            size = int(np.prod(self.shapes[n], dtype=np.int64))
            self.slices[n] = (key, sizes[key], sizes[key] + size)
            sizes[key] += size
        self.sizes = sizes

    def rows(self, key: str) -> tuple[int, int]:
        """The [chunks, chunk] shape of the ``key`` vector in the optimizer graph."""
        return chunking(self.sizes[key])

    def new_flat(self) -> dict[str, np.ndarray]:
        return {k: np.zeros(padded_size(self.sizes[k]), dtype=k) for k in self.dtypes}

    def views(self, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: flat[k][lo:hi].reshape(self.shapes[n]) for n, (k, lo, hi) in self.slices.items()}


class _DoubleBuffer:
    """Two copies of a set of flat vectors; ``views[i]`` maps names to views into copy ``i``."""

    def __init__(self, layout: FlatLayout):
        self.flats = (layout.new_flat(), layout.new_flat())
        self.views = tuple(layout.views(f) for f in self.flats)


class FlatBuffers:
    """The trainable parameters, their gradients and the optimizer states of one CheckpointState."""

    def __init__(self, layout: FlatLayout, arrays: dict[str, np.ndarray]):
        self.layout = layout
        self.current = 0  # which copy of the parameters and states is the live one
        self._params = _DoubleBuffer(layout)
        for name, view in self._params.views[0].items():
            view[...] = arrays[name]
        self.grads = layout.new_flat()
        self.grad_views = layout.views(self.grads)
        self._states: dict[str, _DoubleBuffer] = {}
        self._grads_zero = True  # gradients count as zero until a training step writes them
        # Per parameter whose gradient add_rows writes: its rows written since its vector was last all zeros.
        self._rows_written: dict[str, np.ndarray] = {}

    # -- parameters and optimizer states -------------------------------------------------------
    def params(self, copy: int | None = None) -> dict[str, np.ndarray]:
        """Per element type, the flat parameter vector (the live copy unless ``copy`` is given)."""
        return self._params.flats[self.current if copy is None else copy]

    def param_views(self, copy: int | None = None) -> dict[str, np.ndarray]:
        return self._params.views[self.current if copy is None else copy]

    def add_states(self, names: list[str], saved: dict[str, dict[str, np.ndarray]]) -> None:
        """Allocate the optimizer states ``names``, filled from ``saved`` (param -> state -> array) or zeros."""
        for s in names:
            if s in self._states:
                continue
            buffer = _DoubleBuffer(self.layout)
            for pname, view in buffer.views[self.current].items():
                src = saved.get(pname, {}).get(s)
                if src is not None:
                    if src.shape != view.shape:
                        raise ValueError(f"the checkpoint's optimizer state {s!r} of {pname!r} has shape "
                                         f"{list(src.shape)}, the parameter {list(view.shape)}")
                    view[...] = src
            self._states[s] = buffer

    def state_names(self) -> list[str]:
        return list(self._states)

    def states(self, name: str, copy: int | None = None) -> dict[str, np.ndarray]:
        return self._states[name].flats[self.current if copy is None else copy]

    def state_views(self, copy: int | None = None) -> dict[str, dict[str, np.ndarray]]:
        """param -> state -> view into the live (or the given) copy."""
        copy = self.current if copy is None else copy
        out: dict[str, dict[str, np.ndarray]] = {n: {} for n in self.layout.names}
        for s, buffer in self._states.items():
            for pname, view in buffer.views[copy].items():
                out[pname][s] = view
        return out

    def swap(self) -> None:
        """The optimizer wrote the other copy: it becomes the live one."""
        self.current ^= 1

    # -- gradients ---------------------------------------------------------------------------
    def reset_grad(self) -> None:
        """Gradients count as zero from now; nothing is written until they are read."""
        self._grads_zero = True

    def grads_are_zero(self) -> bool:
        return self._grads_zero

    def grads_written(self) -> None:
        """A training step wrote (or added into) the gradient vectors."""
        self._grads_zero = False

    def grads_for_update(self) -> dict[str, np.ndarray]:
        """The gradient vectors, zero-filled first if they were reset since the last training step."""
        if self._grads_zero:
            for flat in self.grads.values():
                flat.fill(0)
            self._rows_written.clear()
            self._grads_zero = False
        return self.grads

    def add_rows(self, name: str, ids: np.ndarray, rows: np.ndarray, into_zeros: bool) -> None:
        """Add ``rows[i]`` into row ``ids[i]`` of ``name``'s gradient, as ``ScatterElements`` with ``reduction="add"``
        (the rows of a repeated id in their order); ``into_zeros``: into zeros instead of the gradient there (only
        the rows this method wrote since the vector was last zero-filled are cleared, not the whole table)."""
        view = self.grad_views[name]
        ids, sums = sum_rows(ids, rows, len(view))
        written = self._rows_written.pop(name, None)
        if into_zeros:  # every row is zero once those written are: write the sums (0 + s: -0.0 becomes 0.0, as added)
            if written is not None:
                view[written] = 0
            written = None
            view[ids] = np.add(sums, 0.0, out=sums)  # sums: sum_rows' own array (no gather of the old rows)
        else:
            view[ids] += sums
        self._rows_written[name] = ids if written is None else np.union1d(written, ids)  # ids: sorted, distinct



def sum_rows(ids: np.ndarray, rows: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids of ``ids`` (indices into ``size`` rows; negative ones count from the end, as ONNX's), sorted,
    and for each the sum of its ``rows`` (new arrays where there are ids): added in their order, as a scatter-add adds
    them (the same values), for an id of at most 16 rows; numpy's sum (its own order) for one of more, a run one row at
    a time would take 1-3 ms."""
    ids = ids.reshape(-1)
    if len(ids) != len(rows):
        raise ValueError(f"{len(ids)} ids for {len(rows)} gradient rows")
    if not ids.size:
        return ids, rows
    if ids.min() < -size or ids.max() >= size:
        raise IndexError(f"a row id outside [-{size}, {size}) in an embedding gradient")
    ids = np.where(ids < 0, ids + size, ids)
    order = np.argsort(ids, kind="stable")  # an id's rows stay in their order; the rows are gathered once, below
    ids = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
    if len(starts) == len(ids):
        return ids, rows[order]
    counts = np.diff(np.append(starts, len(ids)))
    sums = rows[order[starts]]
    short = np.flatnonzero(counts <= _FEW)  # token ids, mostly distinct: the k-th rows of the runs that long, in turn
    for k in range(1, int(counts[short].max(initial=1))):
        runs = short[counts[short] > k]
        sums[runs] += rows[order[starts[runs] + k]]
    for run in np.flatnonzero(counts > _FEW):  # a few long runs (a type or position id): numpy's sum each
        sums[run] = rows[order[starts[run]:starts[run] + counts[run]]].sum(axis=0)
    return ids[starts], sums


_FEW = 16
