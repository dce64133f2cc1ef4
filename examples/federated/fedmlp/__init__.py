"""The federated MLP example: data (numpy), model and artifacts (onnx, on the workstation), Flower apps."""
