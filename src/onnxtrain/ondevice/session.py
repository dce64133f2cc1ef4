"""onnxruntime sessions for the on-device runtime: creation (one function), metadata, buffer binding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnxtrain.ondevice.format import LOSS_SCALE
from onnxtrain.ondevice.inputs import InputChecker
from onnxtrain.runtime import backends

ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
}


def create_session(uri, session_options: ort.SessionOptions, device: str, what: str, backend: str = "onnxruntime",
                   precision: str = "fp32", disabled_optimizers=()) -> ort.InferenceSession:
    """The one place the runtime creates a session (``what``: "training model", ...): onnxruntime's, or one
    with its interface on another backend (:mod:`onnxtrain.runtime.backends`; ``backend`` and ``precision``
    as :func:`~onnxtrain.runtime.backends.resolve` gives them)."""
    path = Path(uri)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path} (generate_artifacts writes it)")
    providers = _providers(device)
    try:
        return backends.create_session(path, backend, precision, session_options, providers, disabled_optimizers)
    except Exception as exc:
        raise ValueError(f"{backend} cannot load the {what} {path}: {exc}{_what_to_do(exc)}") from exc


def _what_to_do(exc: Exception) -> str:
    """The way out of a refusal the artifacts can avoid: float32 artifacts keep a convolution's weight gradient as
    a convolution whose kernel is the output gradient, which OpenVINO's CPU plugin does not compile."""
    from onnxtrain.runtime.openvino import DynamicKernelError

    if not isinstance(exc, DynamicKernelError):
        return ""
    return (". Generate the artifacts with precision='bf16' (their convolution weight gradients are products over "
            "input windows, which OpenVINO compiles) or run these on backend='onnxruntime'")


def _providers(device: str) -> list[str]:
    if device != "cpu":
        raise ValueError(f"device {device!r} is not supported by the on-device runtime yet; use device='cpu'")
    return ["CPUExecutionProvider"]


def read_metadata(session: ort.InferenceSession, key: str, path, what: str) -> dict:
    """The JSON description stored under ``key`` in the model's metadata; a clear error if absent."""
    raw = session.get_modelmeta().custom_metadata_map.get(key)
    if raw is None:
        raise ValueError(f"{path} is not an onnxtrain {what} (metadata {key!r} missing); "
                         "generate it with onnxtrain.artifacts.generate_artifacts")
    return json.loads(raw)


def ortvalue(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue sharing ``array``'s memory (CPU). It does not keep ``array`` alive: the caller must."""
    return ort.OrtValue.ortvalue_from_numpy(array)


class Runner:
    """One training or eval session: binds the user inputs (checked first) and the outputs per call.

    Parameters are bound once per binding by the caller (:meth:`new_binding`), so a call copies only
    the batch.
    """

    def __init__(self, session: ort.InferenceSession, meta: dict, uri):
        self.session = session
        self.uri = uri
        self.user_inputs = meta["user_inputs"]
        self.outputs = meta["outputs"]
        # Training models of format 4: the ids and rows of the embedding gradients the runtime adds itself
        self.row_outputs = [name for entry in meta.get("row_gradients", {}).values()
                            for pair in zip(entry["ids"], entry["rows"]) for name in pair]
        self.params = meta["trainable"] + meta["frozen"] + ([LOSS_SCALE] if meta.get("loss_scaling") else [])
        self.input_types = {i.name: ORT_TYPES.get(i.type) for i in session.get_inputs()}
        self.checker = InputChecker(session, self.user_inputs, meta.get("input_checks", {}))
        self._keep: list = []  # OrtValues share numpy memory and do not keep it alive: we do

    def new_binding(self, arrays: dict[str, np.ndarray], outputs: dict[str, np.ndarray] | None = None) -> ort.IOBinding:
        """A binding with ``arrays`` (parameter name -> array) as inputs and ``outputs`` (output name ->
        array) written in place; the model's own outputs are bound first, so they come first (then the row
        outputs)."""
        binding = self.session.io_binding()
        for name in self.params:
            value = ortvalue(arrays[name])
            self._keep.append(value)
            binding.bind_ortvalue_input(name, value)
        for name in self.outputs + self.row_outputs:
            binding.bind_output(name, "cpu")
        for name, array in (outputs or {}).items():
            value = ortvalue(array)
            self._keep.append(value)
            binding.bind_ortvalue_output(name, value)
        return binding

    def _bind_inputs(self, binding: ort.IOBinding, inputs) -> None:
        if len(inputs) != len(self.user_inputs):
            raise TypeError(f"the model takes {len(self.user_inputs)} inputs {self.user_inputs} (model inputs, then "
                            f"loss inputs), got {len(inputs)}")
        arrays = {}
        for name, value in zip(self.user_inputs, inputs):
            if isinstance(value, ort.OrtValue):
                arrays[name] = value
                continue
            expected = self.input_types.get(name)
            array = np.asarray(value)
            if expected is not None and array.dtype != expected:
                if not np.can_cast(array.dtype, expected, casting="same_kind"):
                    raise TypeError(f"input {name!r} must be {np.dtype(expected).name}, got {array.dtype}")
                array = array.astype(expected)
            arrays[name] = np.ascontiguousarray(array)
        self.checker.check(arrays)
        for name, array in arrays.items():
            if isinstance(array, ort.OrtValue):
                binding.bind_ortvalue_input(name, array)
            else:
                binding.bind_cpu_input(name, array)

    def run(self, binding: ort.IOBinding, inputs) -> list[np.ndarray]:
        """The model's outputs, then its row outputs (:attr:`row_outputs`)."""
        self._bind_inputs(binding, inputs)
        for name in self.outputs + self.row_outputs:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        values = binding.get_outputs()
        return [values[i].numpy() for i in range(len(self.outputs) + len(self.row_outputs))]
