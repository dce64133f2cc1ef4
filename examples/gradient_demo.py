"""Differentiate an ONNX model with onnxtrain and check the result against PyTorch autograd.

    python examples/gradient_demo.py
"""

import argparse

import numpy as np
import onnxruntime as ort
import torch

from onnxtrain.autodiff import gradient_model


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    x = torch.randn(4, 8)
    onnx_model = torch.onnx.export(model, (x,), dynamo=True, verbose=False).model_proto
    params = [name for name, _ in model.named_parameters()]
    out_name = onnx_model.graph.output[0].name

    grad_model = gradient_model(onnx_model, wrt=params, outputs=[out_name])
    sess = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    seed = np.ones((4, 3), np.float32)
    results = dict(zip([o.name for o in sess.get_outputs()],
                       sess.run(None, {sess.get_inputs()[0].name: x.numpy(), f"{out_name}_grad": seed})))

    model(x).backward(torch.from_numpy(seed))
    print(f"{'parameter':<12} {'shape':<10} {'max |onnxtrain - torch|':>24}")
    for name, p in model.named_parameters():
        diff = np.abs(results[f"{name}_grad"] - p.grad.numpy()).max()
        print(f"{name:<12} {str(tuple(p.shape)):<10} {diff:>24.2e}")


if __name__ == "__main__":
    main()
