"""Run a graph cut into stages (:mod:`onnxtrain.passes.stage_graph`), dropping inputs as they are used up.

``StagedSession.run`` takes a list and empties it: the caller hands its references over, so that a value
read for the last time in stage ``j`` is freed before stage ``j + 1`` runs.
"""

from __future__ import annotations

import torch

from onnxtrain.passes.stage_graph import StagedGraph
from onnxtrain.runtime.session import TorchSession


class StagedSession:
    """Same inputs and outputs as the uncut graph; see the module docstring."""

    def __init__(self, staged: StagedGraph, make_session):
        self.staged = staged
        self.sessions: list[TorchSession] = [make_session(stage.model) for stage in staged.stages]
        self.input_names = list(staged.inputs)
        self.output_names = list(staged.outputs)

    @property
    def num_stages(self) -> int:
        return len(self.sessions)

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(inputs) != len(self.input_names):
            raise ValueError(f"the graph takes {len(self.input_names)} inputs, got {len(inputs)}")
        values = dict(zip(self.input_names, inputs))
        inputs.clear()  # from here on, `values` holds the only references we were given
        wanted = set(self.output_names)
        results = {name: values[name] for name in self.output_names if name in values}
        for stage, session in zip(self.staged.stages, self.sessions):
            outputs = session.run([values[name] for name in stage.inputs])
            for name, tensor in zip(stage.outputs, outputs):
                values[name] = tensor
                if name in wanted:
                    results[name] = tensor
            for name in stage.release:
                del values[name]
        return [results[name] for name in self.output_names]
