"""The example page's artifacts: a small classifier of 2-D points into 3 classes (logits as an extra output,
for accuracy), written to web/example/artifacts/. Needs torch (export) once; the page itself needs none.

    PYTHONPATH=src python web/example/make_artifacts.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from onnxtrain import artifacts

OUT = Path(__file__).parent / "artifacts"


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                       torch.nn.Tanh(), torch.nn.Linear(32, 3))

    def forward(self, x):
        return self.net(x)


def main() -> None:
    torch.manual_seed(0)
    model = Classifier().eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "classifier.onnx"
        program = torch.onnx.export(model, (torch.randn(32, 2),), dynamo=True, input_names=["x"],
                                    output_names=["logits"], dynamic_shapes=({0: "batch"},), optimize=False)
        program.save(str(path))
        OUT.mkdir(exist_ok=True)
        artifacts.generate_artifacts(path, requires_grad=[n for n, _ in model.named_parameters()],
                                     loss="crossentropy", optimizer=artifacts.AdamW(lr=2e-2),
                                     additional_output_names=["logits"], artifact_directory=OUT, overwrite=True)
    print(f"wrote {sorted(p.name for p in OUT.iterdir())}")


if __name__ == "__main__":
    main()
