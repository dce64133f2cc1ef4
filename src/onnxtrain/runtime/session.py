"""An onnxruntime ``InferenceSession`` that takes and returns torch tensors without copies.

Inputs are bound as OrtValues that share the tensors' memory (DLPack); outputs are allocated by
onnxruntime on the inputs' device and handed back as torch tensors sharing that memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch

from onnxtrain.runtime import backends, torch_threads
from onnxtrain.runtime.dlpack import to_ortvalue, to_torch
from onnxtrain.utils.ort_options import for_training

logger = logging.getLogger("onnxtrain.runtime")


def providers_for(device: torch.device) -> list:
    """Execution providers for tensors on ``device``: CUDA where the tensors live on a GPU, else CPU."""
    available = ort.get_available_providers()
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise RuntimeError(
                "the module is on a CUDA device but onnxruntime has no CUDAExecutionProvider; install "
                "onnxruntime-gpu or move the module to the CPU"
            )
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def session_options(threads: int | None = None, log_severity: int = 3,
                    optimized_model_path: str | None = None, arena: bool = True) -> ort.SessionOptions:
    """Options for training graphs: as many intra-op threads as torch uses, sequential execution, and
    :func:`onnxtrain.utils.ort_options.for_training` (one shared arena, none where ``arena`` is False; idle
    threads sleep, since they would otherwise take cores from the other session and from torch's ops running
    in between)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads if threads is not None else torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = log_severity
    for_training(options, arena)
    if optimized_model_path:
        options.optimized_model_filepath = optimized_model_path
    return options


# The dtypes whose tensors numpy can view (bfloat16 cannot): those take OpenVINO's numpy path.
_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool}


# OpenVINO's arrays also take bfloat16 (numpy has none): as its int16 bits, typed bf16 by the session
_ARRAY_DTYPES = _NUMPY_DTYPES | {torch.bfloat16}


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (of a contiguous copy if it is not contiguous); a bfloat16
    tensor's as int16 (:meth:`onnxtrain.runtime.openvino.OpenVINOSession.run_arrays` reads it as bf16)."""
    tensor = tensor.detach().contiguous()
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


class OutputShapeError(RuntimeError):
    """onnxruntime returned an output whose rank or fixed sizes differ from the graph's declared shape
    (shape inference got it wrong): a graph that takes that value as an input would refuse it."""


def declared_shapes(model: onnx.ModelProto, values=None) -> list[list[int | str | None] | None]:
    """Each graph output's (or each of ``values``') declared shape: a size per axis (its symbol's name where
    symbolic, None where neither), or None if unknown."""
    shapes = []
    for output in model.graph.output if values is None else values:
        tensor = output.type.tensor_type
        if not tensor.HasField("shape"):
            shapes.append(None)
            continue
        shapes.append([d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim])
    return shapes


def _bound_sizes(shapes, tensors) -> tuple[dict[str, int], dict[str, set[int]]]:
    """(the size each symbol of the graph inputs' declared shapes has in ``tensors``, the symbols the inputs give
    two or more sizes, with those sizes)."""
    sizes: dict[str, int] = {}
    clash: dict[str, set[int]] = {}
    for shape, tensor in zip(shapes, tensors):
        if shape is None or not isinstance(tensor, torch.Tensor) or tensor.dim() != len(shape):
            continue
        for d, n in zip(shape, tensor.shape):
            if isinstance(d, str):
                if sizes.setdefault(d, n) != n:
                    clash.setdefault(d, {sizes[d]}).add(n)
    return {d: n for d, n in sizes.items() if d not in clash}, clash


class TorchSession:
    """Run an ONNX model on torch tensors: ``outputs = session.run(inputs)`` in graph input order."""

    def __init__(self, model: onnx.ModelProto, device: torch.device, options: ort.SessionOptions | None = None,
                 backend: str = "onnxruntime", precision: str = "fp32", static_shapes: int = 0,
                 dynamic_model: onnx.ModelProto | None = None):
        """``backend`` and ``precision`` as :func:`onnxtrain.runtime.backends.resolve` gives them: OpenVINO
        reads the tensors' memory through the same OrtValues, and its outputs reach torch by DLPack.
        ``static_shapes``, ``dynamic_model``: OpenVINO's compiles per input shapes
        (:class:`onnxtrain.runtime.openvino.OpenVINOSession`)."""
        self.device = torch.device(device)
        self.backend, self.precision = backend, precision
        options = options or session_options()
        if backend == "onnxruntime" and precision == "fp32":
            self._session = ort.InferenceSession(model.SerializeToString(), sess_options=options,
                                                 providers=providers_for(self.device))
        else:  # OpenVINO's threads unpinned: torch's OpenMP workers share the cores and spin after each of
            # torch's parallel ops (the optimizer's); a pinned thread waited out the spin on its core (the
            # MLP's forward call right after the optimizer: about twice its time after a pause; docs/precision.md)
            static = {"static_shapes": static_shapes, "dynamic_model": dynamic_model.SerializeToString()
                      if dynamic_model is not None else None} if backend == "openvino" and static_shapes else {}
            self._session = backends.create_session(model.SerializeToString(), backend, precision, options,
                                                    pin_threads=False, **static)
            if backend == "openvino" and self.device.type == "cpu":
                torch_threads.note_graph_threads()  # onnxtrain's torch work between calls opens no OpenMP team
        self.input_names = [i.name for i in self._session.get_inputs()]
        # OpenVINO drops a graph input no node reads (a buffer the forward does not use, as Llama's
        # original_inv_freq): callers pass every graph input, and those are left out here.
        graph_inputs = [i.name for i in model.graph.input]
        self._num_inputs = len(graph_inputs)
        self._read = (None if self.input_names == graph_inputs
                      else [graph_inputs.index(name) for name in self.input_names])
        self.output_names = [o.name for o in self._session.get_outputs()]
        # OpenVINO hands bfloat16 outputs to numpy as float16 arrays of the same bits: viewed back here.
        self._bfloat16 = [k for k, o in enumerate(self._session.get_outputs()) if o.type == "tensor(bfloat16)"]
        self.output_shapes = declared_shapes(model)
        self.input_shapes = declared_shapes(model, model.graph.input)
        self.runs = 0  # runs that returned outputs its callers accepted (ORTModule counts them)
        self._ort_device = "cuda" if self.device.type == "cuda" else "cpu"
        self._device_id = self.device.index or 0
        # Parameters are the same tensors, in the same memory, at every step (optimizers update them in
        # place): their OrtValues are made once. Keyed by position, checked by object and memory. Only a
        # contiguous parameter is kept: the value of any other is a copy, which would not see the update.
        self._param_values: dict[int, tuple[tuple, ort.OrtValue | np.ndarray]] = {}
        # OpenVINO reads numpy views of the tensors and its outputs become tensors by torch.from_numpy.
        self._arrays = getattr(self._session, "run_arrays", None)

    def _input_value(self, position: int, tensor: torch.Tensor, convert=to_ortvalue):
        if not isinstance(tensor, torch.nn.Parameter) or not tensor.is_contiguous():
            return convert(tensor)
        key = (id(tensor), tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device,
               convert)
        cached = self._param_values.get(position)
        if cached is None or cached[0] != key:
            cached = (key, convert(tensor))
            self._param_values[position] = cached
        return cached[1]

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(inputs) != self._num_inputs:
            raise ValueError(f"the graph takes {self._num_inputs} inputs, got {len(inputs)}")
        if self._read is not None:
            inputs = [inputs[k] for k in self._read]
        if self._arrays is not None and all(t.dtype in _ARRAY_DTYPES for t in inputs):
            arrays = [self._input_value(k, t, _to_numpy) for k, t in enumerate(inputs)]
            return self._bfloat16_views([torch.from_numpy(a) for a in self._arrays(arrays)])
        binding = self._session.io_binding()
        keep = []  # the OrtValues must outlive the run
        for position, (name, tensor) in enumerate(zip(self.input_names, inputs)):
            value = self._input_value(position, tensor)
            keep.append(value)
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, self._ort_device, self._device_id)
        self._session.run_with_iobinding(binding)
        return self._bfloat16_views([to_torch(v) for v in binding.get_outputs()])

    def _bfloat16_views(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        for k in self._bfloat16:
            if outputs[k].dtype != torch.bfloat16:
                outputs[k] = outputs[k].view(torch.bfloat16)
        return outputs

    def check_output_shapes(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] = ()) -> None:
        """Raise :class:`OutputShapeError` where an output's rank or a fixed size is not the declared one, or a
        size the declared shape names by a symbol of the graph inputs' (``inputs``, in graph order) is not the
        size that input has: OpenVINO's CPU plugin returned ``(0, 0)`` for ``[s95, s85]`` where the input was
        ``(5, 5)`` (the OpInfo sweep under autocast bf16, ``_unsafe_masked_index_put_accumulate``); or where the
        inputs give one symbol of the declared shapes two sizes: the graph was made for sizes that are equal there
        (``tensordot`` of ``(2, 2, 1)`` and ``(2, 1, 2)`` exported with one symbol for an axis of 2 and one of 1:
        OpenVINO computed another value from them, onnxruntime's kernels refused them; the OpInfo sweep under
        autocast bf16), on OpenVINO, which follows the declared shapes."""
        bound, clash = _bound_sizes(self.input_shapes, inputs)
        if clash and self.backend == "openvino":  # onnxruntime's kernels do not follow declared shapes: expand_as
            # and broadcast_tensors samples with such inputs compute eager's values there (the float32 OpInfo sweep)
            symbol, sizes = next(iter(clash.items()))
            raise OutputShapeError(
                f"the graph's inputs give its size {symbol!r} the sizes {sorted(sizes)}, where the graph declares "
                "them one size (it was made for inputs whose sizes are equal there)")
        for name, shape, tensor in zip(self.output_names, self.output_shapes, outputs):
            if shape is None:
                continue
            want = [bound.get(d) if isinstance(d, str) else d for d in shape]
            if len(want) != tensor.dim() or any(d is not None and d != n for d, n in zip(want, tensor.shape)):
                raise OutputShapeError(
                    f"graph output {name!r} has shape {list(tensor.shape)} where the graph declares "
                    f"{['?' if d is None else d for d in shape]} (shape inference disagrees with the backend's "
                    "kernels; the backward graph would refuse it)")
