"""Checkpoint state in memory: parameters, requires-grad flags, optimizer state and properties.

Once a Module trains a state, its trainable parameters live in the flat buffers
(:class:`~onnxtrain.ondevice.buffers.FlatBuffers`) that the sessions read and write; this class reads
them from there, so it never holds a stale copy.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, MutableMapping

import numpy as np

from onnxtrain.ondevice import checkpoint as ckpt
from onnxtrain.ondevice.buffers import FlatBuffers, FlatLayout


class Parameter:
    """One checkpoint parameter: ``data`` and ``grad`` read as numpy copies; assigning ``data`` copies in."""

    def __init__(self, state: CheckpointState, name: str):
        self._state = state
        self.name = name

    @property
    def requires_grad(self) -> bool:
        """Whether this parameter is trained."""
        return self._state.requires_grad(self.name)

    @property
    def data(self) -> np.ndarray:
        """A copy of the parameter's values; assign an array of the same shape and dtype to change them."""
        return self._state.array(self.name).copy()

    @data.setter
    def data(self, value) -> None:
        target = self._state.array(self.name)
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
        buffers = self._state.buffers
        if buffers is None or buffers.grads_are_zero():
            return np.zeros_like(self._state.array(self.name))
        return buffers.grad_views[self.name].copy()

    def __repr__(self) -> str:
        array = self._state.array(self.name)
        return f"Parameter({self.name!r}, shape={list(array.shape)}, dtype={array.dtype}, requires_grad={self.requires_grad})"


class _Parameters(Mapping):
    def __init__(self, state: CheckpointState):
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        if name not in self._state.names():
            raise KeyError(f"no parameter {name!r} in the checkpoint (it has {self._state.names()[:10]})")
        return Parameter(self._state, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state.names())

    def __len__(self) -> int:
        return len(self._state.names())


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
        self._arrays: dict[str, np.ndarray] = dict(data.parameters)  # frozen ones, and all until bound
        self._requires_grad = dict(data.requires_grad)
        self._saved_optimizer_states = {k: dict(v) for k, v in data.optimizer_states.items()}
        self.optimizer_step = data.optimizer_step
        self.learning_rate = data.learning_rate
        self._nominal = data.nominal
        self._properties = _Properties(data.properties)
        self.buffers: FlatBuffers | None = None  # set by the first Module
        # fp16 loss scaling: 0-d arrays the sessions read (and the optimizer updates) in place
        self._loss_scale: tuple[np.ndarray, np.ndarray] | None = None
        if data.loss_scale is not None:
            self.set_loss_scale(data.loss_scale.scale, data.loss_scale.good_steps)

    @staticmethod
    def load_checkpoint(checkpoint_uri: str | os.PathLike) -> CheckpointState:
        """Read a checkpoint file (as written by generate_artifacts or save_checkpoint)."""
        return CheckpointState(ckpt.load(checkpoint_uri))

    @staticmethod
    def save_checkpoint(state: CheckpointState, checkpoint_uri: str | os.PathLike,
                        include_optimizer_state: bool = False) -> None:
        """Write ``state`` atomically; the optimizer state (step, learning rate, moments) only if asked."""
        if not isinstance(state, CheckpointState):
            raise TypeError(f"save_checkpoint needs a CheckpointState, got {type(state).__name__}")
        ckpt.save(state.to_data(), checkpoint_uri, include_optimizer_state=include_optimizer_state)

    def to_data(self) -> ckpt.CheckpointData:
        """The state as plain arrays and values (views of the live buffers, not copies)."""
        return ckpt.CheckpointData(
            parameters={n: self.array(n) for n in self.names()}, requires_grad=dict(self._requires_grad),
            optimizer_states=self.optimizer_states(), optimizer_step=self.optimizer_step,
            learning_rate=self.learning_rate, properties=dict(self._properties), nominal=False,
            loss_scale=None if self._loss_scale is None else ckpt.LossScaleState(
                float(self._loss_scale[0]), int(self._loss_scale[1])))

    # -- reading ------------------------------------------------------------------------------
    @property
    def parameters(self) -> Mapping[str, Parameter]:
        """The checkpoint's parameters by name, as :class:`Parameter` objects (read and assign ``.data``)."""
        return _Parameters(self)

    @property
    def properties(self) -> MutableMapping:
        """User properties saved with the checkpoint (ints, floats and strings), e.g. the epoch."""
        return self._properties

    @property
    def is_nominal(self) -> bool:
        """Loaded from a nominal checkpoint: parameters are zeros until data is copied in."""
        return self._nominal

    def names(self) -> list[str]:
        """Every parameter's name, in checkpoint order."""
        return list(self._arrays)

    def requires_grad(self, name: str) -> bool:
        """Whether the parameter ``name`` is trained (False: kept in the checkpoint, frozen)."""
        return self._requires_grad[name]

    def array(self, name: str) -> np.ndarray:
        """The live array of parameter ``name`` (a view into the flat buffers once a Module trains it)."""
        if self.buffers is not None and name in self.buffers.layout.slices:
            return self.buffers.param_views()[name]
        return self._arrays[name]

    def optimizer_states(self) -> dict[str, dict[str, np.ndarray]]:
        """param -> state name -> array: the live buffers once an Optimizer runs, else as loaded."""
        if self.buffers is not None and self.buffers.state_names():
            return self.buffers.state_views()
        return self._saved_optimizer_states

    @property
    def loss_scale(self) -> float | None:
        """fp16 artifacts: the current loss scale (as ``GradScaler.get_scale()``); else None."""
        return None if self._loss_scale is None else float(self._loss_scale[0])

    @property
    def loss_scale_arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The live (scale, good-step count) 0-d arrays the sessions bind, or None without loss scaling."""
        return self._loss_scale

    def set_loss_scale(self, scale: float, good_steps: int = 0) -> None:
        """Set the loss scale and the count of good steps since it last changed (in place once bound)."""
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"the loss scale must be a finite number > 0, got {scale}")
        if self._loss_scale is None:
            self._loss_scale = (np.zeros((), np.float32), np.zeros((), np.int64))
        self._loss_scale[0][...] = scale
        self._loss_scale[1][...] = int(good_steps)

    # -- binding to a Module -------------------------------------------------------------------
    def bind(self, trainable: list[str]) -> FlatBuffers:
        """Move the trainable parameters into flat buffers, once per state; later Modules share them."""
        if self.buffers is not None:
            if self.buffers.layout.names != trainable:
                raise ValueError("this CheckpointState is already used by a Module with other trainable "
                                 f"parameters ({self.buffers.layout.names[:5]}...); load one state per Module")
            return self.buffers
        layout = FlatLayout(trainable, {n: self._arrays[n].shape for n in trainable},
                            {n: self._arrays[n].dtype for n in trainable})
        self.buffers = FlatBuffers(layout, self._arrays)
        return self.buffers

    def add_optimizer_states(self, names: list[str]) -> None:
        """Give the bound buffers the optimizer states ``names``, filled from the loaded checkpoint."""
        if self.buffers is None:
            raise RuntimeError("the optimizer states need a Module bound to this state first")
        self.buffers.add_states(names, self._saved_optimizer_states)
