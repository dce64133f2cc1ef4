"""User-facing switches of ORTModule: :class:`DebugOptions`, :class:`LogLevel` and the environment.

Environment variables (read when an ORTModule is created):

- ``ONNXTRAIN_FALLBACK=0`` turns the fallback to PyTorch off: an export or graph-building error is raised
  instead of warned about. ``DebugOptions(fallback=...)`` overrides it.
- ``ONNXTRAIN_VERIFY=1`` runs the first batch of every new graph through PyTorch eager too and compares
  outputs and gradients; on a difference the module falls back to PyTorch, naming the first one.
  ``DebugOptions(verify=...)`` overrides it.
- ``ONNXTRAIN_LOG_LEVEL=VERBOSE|INFO|WARNING|ERROR|FATAL`` sets the default log level: onnxtrain's
  messages at that level go to stderr (:mod:`onnxtrain.utils.logs`), and VERBOSE also lets the exporter's
  and onnxruntime's own output through.
- ``ONNXTRAIN_BACKWARD_STAGES=N`` (default 4, or 8 under a recompute budget; read when training graphs
  are built) runs each backward graph as up to N onnxruntime sessions in turn, so that the forward's
  stashed activations are freed as backward goes instead of when it ends. 1 runs it whole. A stage is cut only where it frees at least
  ``MIN_STAGE_BYTES`` of stash, so small models run whole anyway.
- ``ORTMODULE_MEMORY_OPT_LEVEL`` and ``ORTMODULE_MEMORY_OPT_CONFIG`` (ONNX Runtime Training's; read when
  training graphs are built) pick what backward recomputes instead of keeping from forward, where
  ``DebugOptions(recompute=...)`` does not: see :mod:`onnxtrain.passes.recompute`.
- ``ONNXTRAIN_EXPORT_PROCESS=spawn|in-process|auto`` (read at a schema's first export; default ``auto``): where
  the export and the training graphs are made, in a child process or here; ``auto`` makes them in the child
  where a memory budget is set. ``DebugOptions(export_process=...)`` overrides it.
- ``ONNXTRAIN_FUSED_STEP=0`` (read when training graphs are built) turns off the one-call forward +
  backward that OpenVINO runs when a scalar loss is the only output that can take a gradient
  (:mod:`onnxtrain.ortmodule.fused`); the forward and backward graphs then run as on onnxruntime.
- ``ONNXTRAIN_ONE_OMP_THREAD=0`` (read once, at the first use) keeps torch's thread count for
  onnxtrain's torch work between OpenVINO calls (the backward's glue, ``FusedAdam``'s update), which otherwise
  runs at one OpenMP thread so that no idle torch worker spins into the next call
  (:mod:`onnxtrain.runtime.torch_threads`).
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from onnxtrain.passes.recompute import Recompute
from onnxtrain.passes.recompute import from_env as recompute_from_env
from onnxtrain.utils.logs import set_level as set_log_level

FALLBACK_ENV = "ONNXTRAIN_FALLBACK"
VERIFY_ENV = "ONNXTRAIN_VERIFY"
LOG_LEVEL_ENV = "ONNXTRAIN_LOG_LEVEL"
BACKWARD_STAGES_ENV = "ONNXTRAIN_BACKWARD_STAGES"
DEFAULT_BACKWARD_STAGES = 4
# Under a recompute budget: onnxruntime runs a stage's nodes in its own order, and may run a recomputed
# clone long before the gradient node that reads it (passes/recompute.py places it just before); a stage
# cut keeps it from running before its stage. BERT-small at 4x batch, budget 0: the largest backward stage
# peaks 88 MB above the RSS between steps with 8 stages, 124 MB with 4 (no change at budgets 1.0 and 0.5).
RECOMPUTE_BACKWARD_STAGES = 8
MIN_STAGE_BYTES = 4 << 20
FUSED_STEP_ENV = "ONNXTRAIN_FUSED_STEP"
TORCH_DROPOUT_ENV = "ONNXTRAIN_TORCH_DROPOUT"
ATTENTION_FLOAT32_ENV = "ONNXTRAIN_BF16_ATTENTION_FLOAT32"
_FALSE = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}


class LogLevel(enum.IntEnum):
    """How much ORTModule, the exporter and onnxruntime say. Values are onnxruntime's severities."""

    VERBOSE = 0
    INFO = 1
    WARNING = 2
    ERROR = 3
    FATAL = 4

    @property
    def python_level(self) -> int:
        """The matching level of Python's ``logging`` (VERBOSE is DEBUG)."""
        return {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}[
            int(self)
        ]


def _env_switch(name: str, default: bool, meaning: str) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise ValueError(f"{name}={raw!r}: {meaning}")


def _env_fallback() -> bool:
    return _env_switch(FALLBACK_ENV, True, "use 1 (fall back to PyTorch, the default) or 0 (raise)")


def _env_verify() -> bool:
    return _env_switch(VERIFY_ENV, False, "use 1 (check the first batch of each graph against eager) or 0 "
                                          "(the default)")


def _env_log_level() -> LogLevel:
    raw = os.environ.get(LOG_LEVEL_ENV)
    if not raw:
        return LogLevel.WARNING
    try:
        return LogLevel[raw.strip().upper()]
    except KeyError:
        raise ValueError(f"{LOG_LEVEL_ENV}={raw!r}: use one of {[m.name for m in LogLevel]}") from None


def backward_stages(budget: bool = False) -> int:
    """``$ONNXTRAIN_BACKWARD_STAGES``, else the default, the larger one where ``budget`` (the graphs recompute
    to a budget; see the module docstring)."""
    raw = os.environ.get(BACKWARD_STAGES_ENV, "").strip()
    if not raw:
        return RECOMPUTE_BACKWARD_STAGES if budget else DEFAULT_BACKWARD_STAGES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{BACKWARD_STAGES_ENV}={raw!r}: use a whole number of stages, 1 or more (1: one graph)")
    return value


def fused_step() -> bool:
    """``$ONNXTRAIN_FUSED_STEP``, else on (see the module docstring)."""
    return _env_switch(FUSED_STEP_ENV, True, "use 1 (one OpenVINO call for forward and gradients, the default) "
                                            "or 0 (the forward and backward graphs)")


def torch_dropout() -> bool:
    """``$ONNXTRAIN_TORCH_DROPOUT``, else on: dropout's masks drawn by torch as eager draws them
    (:mod:`onnxtrain.passes.dropout_masks`), and a graph with other random draws refused (ORTModule falls back);
    0 keeps onnxruntime's ``Dropout`` and runs other random ops on onnxruntime's draws (OpenVINO, which converts
    no training-mode ``Dropout``, always gets the masks from torch)."""
    return _env_switch(TORCH_DROPOUT_ENV, True, "use 1 (dropout masks drawn by torch, eager's; the default) or 0 "
                                                "(onnxruntime's Dropout, on the onnxruntime backend)")


def attention_float32() -> bool:
    """``$ONNXTRAIN_BF16_ATTENTION_FLOAT32``, else on: a forward whose attention eager computes in float32 under
    autocast bf16 (PyTorch's math kernel, taken with dropout_p > 0: the configs' default attention dropout) runs on
    the graphs in ``graphs.PRODUCTS_BF16``; 0 falls back to PyTorch there. On by default since its fused call is
    compiled for the batch's sizes (``graphs.STATIC_SHAPES``): a default-width BERT (``benchmarks/hf_first_run.py``)
    ran faster than Trainer in it, where the fallback runs at eager's speed (docs/precision.md)."""
    return _env_switch(ATTENTION_FLOAT32_ENV, True, "use 1 (the products in bf16, attention float32, OpenVINO at "
                                                    "f32; the default) or 0 (fall back to PyTorch)")


@dataclass
class DebugOptions:
    """Debugging switches for :class:`ORTModule`.

    ``save_onnx=True`` writes, for every input schema, the exported graph and the inference, training
    (forward + gradients), forward and backward graphs to ``save_path`` as
    ``<onnx_prefix>_<schema>_<kind>.onnx``. ``fallback`` (default: ``$ONNXTRAIN_FALLBACK``, else on) runs the
    module in PyTorch, with a warning, when it cannot be exported or differentiated. ``verify`` (default:
    ``$ONNXTRAIN_VERIFY``, else off) checks the first batch of every new graph against PyTorch eager
    (outputs and gradients) and falls back, naming the first difference, where they disagree.

    ``recompute``: how much of the forward values backward reads is kept in memory and how much is
    recomputed in backward (:mod:`onnxtrain.passes.recompute`): None for ``$ORTMODULE_MEMORY_OPT_LEVEL`` /
    ``$ORTMODULE_MEMORY_OPT_CONFIG`` if set, else the default plan (cheap pointwise ops only); a fraction
    of the stashed bytes to keep at most (``0.5``; ``0.0``: recompute all it can), a number of bytes, a
    string (``"0.5"``, ``"300MB"``, ``"off"``), or a ``Recompute``. The plan is logged at INFO.

    ``export_process``: ``"spawn"`` makes each input schema's first export and its training graphs in a child
    process, so that the exporter's modules (about 67 MB for BERT-small) never load where the model trains
    (:mod:`onnxtrain.ortmodule.export_process`; the first call takes a few seconds more); ``"in-process"``
    exports here; ``"auto"``: in the child where ``recompute`` (or ``$ORTMODULE_MEMORY_OPT_*``) asks for memory
    savings, here otherwise; None (default): ``$ONNXTRAIN_EXPORT_PROCESS`` (the same three values; ``0`` is
    ``in-process``), else ``"auto"``. One INFO line says where each first export ran and why.
    """

    log_level: LogLevel = field(default_factory=_env_log_level)
    save_onnx: bool = False
    onnx_prefix: str = ""
    save_path: str = ""
    fallback: bool | None = None
    verify: bool | None = None
    recompute: float | int | str | Recompute | None = None
    export_process: str | None = None

    def __post_init__(self):
        if isinstance(self.log_level, str):
            self.log_level = LogLevel[self.log_level.upper()]
        self.log_level = LogLevel(self.log_level)
        set_log_level(self.log_level.python_level)  # prints on stderr without the user configuring logging
        if self.save_onnx and not self.onnx_prefix:
            raise ValueError("DebugOptions(save_onnx=True) needs an onnx_prefix naming the saved files")
        if self.fallback is None:
            self.fallback = _env_fallback()
        if self.verify is None:
            self.verify = _env_verify()
        if self.recompute is not None:
            self.recompute = Recompute.of(self.recompute)  # a bad value fails here, not at the first step
        if self.export_process is not None:
            from onnxtrain.ortmodule.export_process import check

            self.export_process = check(self.export_process, "DebugOptions(export_process=...)")

    def recompute_plan(self) -> Recompute:
        """The recompute plan for graphs built now: the option, else the environment's, else the default."""
        if self.recompute is not None:
            return self.recompute
        return recompute_from_env() or Recompute()

    @property
    def save_dir(self) -> Path:
        """The folder ``save_onnx`` writes to (``save_path``, default the current folder)."""
        return Path(self.save_path or ".")
