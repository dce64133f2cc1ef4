"""``Captured``: an exported graph and what feeds and reads it, in a module of its own so that a process which
only receives it (ORTModule's training process under ``ONNXTRAIN_EXPORT_PROCESS=spawn``) never imports the
exporter (:mod:`onnxtrain.capture.export`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from onnxtrain.capture.flatten import Spec


@dataclass
class Captured:
    """The exported graph and what is needed to feed and read it."""

    model: ir.Model | None  # None once the graphs are built in another process (the IR is not sent back)
    output_spec: Spec
    num_outputs: int  # user outputs (the first graph outputs)
    mutated_buffers: list[str]  # buffer names whose new values are the remaining graph outputs
    exporter: str  # "dynamo" or "torchscript"
    static_dims: list[dict[int, int]] = field(default_factory=list)  # per input: axis -> fixed size
    # per input: axis -> (lowest, highest or None) size the graph was traced for (torch.export's range
    # constraints: a Python branch on a size, e.g. ``if x.shape[0] > 4``, bounds it); other sizes re-export
    dim_ranges: list[dict[int, tuple[int, int | None]]] = field(default_factory=list)
