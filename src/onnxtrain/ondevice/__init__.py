"""On-device training: artifacts generation (:mod:`.artifacts`), the checkpoint format
(:mod:`.checkpoint`) and the torch-free runtime (:mod:`.api`).

Nothing is imported here, so that ``onnxtrain.api`` loads the runtime without onnx or the autodiff engine.
"""
