"""OpenVINO behind onnxruntime's session interface (the part :mod:`onnxtrain.runtime.backends` names).

``OpenVINOSession(model, precision="bf16")`` reads an ONNX model with OpenVINO's ONNX frontend and compiles it
for the CPU; with "bf16" the ``INFERENCE_PRECISION_HINT`` runs the float32 graph's products in bfloat16.
Memory: every bound input, and every output bound to a preallocated array or OrtValue, is an ``ov.Tensor``
sharing that memory (no copy in or out: parameters and gradient vectors are bound once); an output left to
the runtime (``bind_output(name, "cpu")``) is copied out of the request after each run, since the request
reuses its buffers. A binding whose outputs are all left to the runtime (ORTModule makes one per call) runs
on an infer request taken from the session's idle ones and put back after the run: a new request per call
allocated its intermediate and output memory afresh, and the page faults of that memory took a quarter of
the MLP's backward call (docs/precision.md). ``run_arrays`` (ORTModule's path) does not set an input again on a
request that reads that very array, still alive, from its last run (a parameter's array, which the caller keeps):
the request holds no reference to an array it reads, so every other input is set anew before each run.
OpenVINO is imported on first use; torch and onnx are not imported at all.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from types import SimpleNamespace

import numpy as np

_NUMPY_OF = {  # onnxruntime's type strings, which the callers use
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
}
_ORT_TYPE_OF_OV = {"f32": "tensor(float)", "f64": "tensor(double)", "f16": "tensor(float16)",
                   "bf16": "tensor(bfloat16)", "i64": "tensor(int64)", "i32": "tensor(int32)",
                   "i16": "tensor(int16)", "i8": "tensor(int8)", "u8": "tensor(uint8)", "boolean": "tensor(bool)"}
_ORT_TYPE_OF_NUMPY = {np.dtype(v): k for k, v in _NUMPY_OF.items()}
_HINTS = {"fp32": "f32", "bf16": "bf16"}


@functools.cache
def core():
    """One ``openvino.Core`` per process (it holds the loaded plugins)."""
    import openvino as ov

    return ov.Core()


class OpenVINOReadError(ValueError):
    """OpenVINO's ONNX front end cannot convert the model (an op or an input shape it does not support)."""


#: ONNX ops, and OpenVINO's, that its CPU plugin compiles only with a kernel (input 1) of static size (2026.4:
#: "Doesn't support dynamic weights shape"). A convolution's weight gradient is one, its kernel the output
#: gradient: :mod:`onnxtrain.passes.conv_patches` writes those as products over input windows.
KERNEL_OPS = ("Conv", "ConvTranspose")
_OV_KERNEL_OPS = ("Convolution", "GroupConvolution", "ConvolutionBackpropData", "GroupConvolutionBackpropData")


def dynamic_kernel(graph) -> str | None:
    """Why OpenVINO's CPU plugin cannot compile ``graph`` (an ``onnx_ir`` graph): its first convolution whose
    kernel has a size not fixed in the graph, named; None if there is none. For a caller that must decide
    before anything runs (ORTModule builds its training graphs before the first call; OpenVINO compiles them
    lazily, with the first call's shapes). A size is fixed as OpenVINO reads the graph (what
    :func:`_read_dynamic_kernel` finds on the model it read): stated in full, or the kernel is a constant (an
    initializer, a ``Constant``, or computed from constants only, whose shapes OpenVINO infers), stated or not."""
    constant = _constant_values(graph)
    for node in graph.all_nodes():
        if node.op_type in KERNEL_OPS and node.domain in ("", "ai.onnx") and len(node.inputs) > 1:
            kernel = node.inputs[1]
            shape = kernel.shape if kernel is not None else None
            fixed = shape is not None and all(isinstance(d, int) for d in shape)
            if not fixed and kernel not in constant:
                return _kernel_refusal(node.name or node.op_type)
    return None


def _constant_values(graph) -> set:
    """The values of ``graph`` (subgraphs included) that hold constants: initializers that are not graph inputs,
    ``Constant`` outputs, and the outputs of nodes all of whose inputs are such (graph order: a node read
    before its inputs' producers is not counted, which only refuses more)."""
    constant = {v for v in graph.initializers.values() if not v.is_graph_input()}
    for node in graph.all_nodes():
        inputs = [v for v in node.inputs if v is not None]
        if (node.op_type == "Constant" and not inputs) or (inputs and all(v in constant for v in inputs)
                                                           and not node.op_type.startswith("Random")):
            constant.update(node.outputs)
    return constant


def _kernel_refusal(name: str) -> str:
    return (f"its CPU plugin has no convolution with a kernel of dynamic size, which {name!r} is (a training "
            "graph's convolution weight gradient is one: its kernel is the output gradient)")


def _read_dynamic_kernel(model) -> str | None:
    """:func:`dynamic_kernel` of a model OpenVINO has read (its own ops and shapes)."""
    for op in model.get_ordered_ops():
        if op.get_type_name() in _OV_KERNEL_OPS and op.input(1).get_partial_shape().is_dynamic:
            return _kernel_refusal(op.get_friendly_name())
    return None


def _read_dynamic_rank(model) -> str | None:
    """Why the CPU plugin cannot compile a model OpenVINO has read: its first op (not a graph input, whose rank the
    first run gives) with an output of unknown rank, named; None if there is none. The plugin has no node of
    dynamic rank (2026.4: "CPU plug-in doesn't support Squeeze operation with dynamic rank"). Meaningful only where
    every graph input has its rank: an unknown one makes the ops after it unknown until the first run."""
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Parameter":
            continue
        if any(op.get_output_partial_shape(k).rank.is_dynamic for k in range(op.get_output_size())):
            return (f"its CPU plugin has no op of dynamic rank, which {op.get_type_name()} "
                    f"{op.get_friendly_name()!r} is (its output's rank depends on the input's sizes)")
    return None


def _read_antialias(model) -> str | None:
    """Why the CPU plugin would compute a model OpenVINO has read otherwise than ONNX defines it: an antialiased
    ``Interpolate`` (``Resize(antialias=1)``, PyTorch's ``interpolate(..., antialias=True)``), named. Its output
    was 1.5-3.9 norm-relative from PyTorch's, in float32 too (openvino 2026.4; the OpInfo sweep under autocast
    bf16, ``_upsample_bilinear2d_aa``)."""
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Interpolate" and op.get_attributes().get("antialias"):
            return (f"its Interpolate {op.get_friendly_name()!r} is antialiased, which its CPU plugin computes "
                    "otherwise than onnxruntime and PyTorch")
    return None


def refusal(model: bytes) -> str | None:
    """Why OpenVINO's CPU plugin would not compile ``model`` (an ONNX model's bytes whose graph inputs all have
    their ranks), found without compiling it: a convolution kernel of dynamic size, an op of dynamic rank or an
    antialiased Interpolate, named;
    None if neither, or if OpenVINO cannot read the model (a session on it runs on onnxruntime:
    :func:`onnxtrain.runtime.backends.create_session`). For ORTModule, which must decide before the first training
    step about graphs it compiles later (a backward graph on its first use, taking the forward's values)."""
    try:
        read = core().read_model(model)
    except Exception:  # noqa: BLE001 - what cannot be read is not compiled on OpenVINO at all
        return None
    return _read_dynamic_kernel(read) or _read_dynamic_rank(read) or _read_antialias(read)


class OpenVINOCompileError(ValueError):
    """OpenVINO's CPU plugin cannot compile the model: the reason on one line, naming the op where OpenVINO does."""


class DynamicKernelError(OpenVINOCompileError):
    """The model has a convolution whose kernel has a size not fixed in the graph (:func:`dynamic_kernel`)."""


def one_line(exc: Exception) -> str:
    """OpenVINO's error on one line: its own message without the source locations it stacks before it."""
    lines = [line.strip() for line in str(exc).splitlines()]
    kept = [line for line in lines if line and not line.startswith(("Exception from ", "Check '"))]
    return " ".join(kept or lines[-1:] or [type(exc).__name__])


class OpenVINOSession:
    """A compiled OpenVINO model with ``get_inputs``/``get_outputs``/``get_modelmeta``/``io_binding``/
    ``run_with_iobinding`` as onnxruntime's InferenceSession has them."""

    def __init__(self, model, precision: str = "fp32", threads: int | None = None, pin_threads: bool = True,
                 static_shapes: int = 0, dynamic_model=None):
        """``threads``: OpenVINO's ``INFERENCE_NUM_THREADS`` (None: its own choice). ``pin_threads=False``
        sets ``ENABLE_CPU_PINNING`` off: for a process whose other thread pool (torch's) shares the cores.
        ``static_shapes``: :meth:`run_arrays` compiles the model for each of the first ``static_shapes`` sets of
        input shapes it meets, with every size fixed (the plugin plans static kernels, fuses elementwise ops and
        their conversions, and rounds a bfloat16 product once); other shapes, and the
        binding path, run one compile over dynamic sizes, of ``dynamic_model`` where given (a model with the same
        inputs and outputs: ORTModule's ``PRODUCTS_BF16`` graph whose weight gradients accumulate in float32)."""
        if precision not in _HINTS:
            raise ValueError(f"OpenVINO runs precision 'fp32' or 'bf16', not {precision!r}")
        self.precision = precision
        self._model = self._read(model)
        refused = _read_dynamic_kernel(self._model)  # when made, not at the first run (compiled then)
        if refused is not None:
            raise DynamicKernelError(f"OpenVINO cannot compile the model for the CPU: {refused}")
        self._config = {"INFERENCE_PRECISION_HINT": _HINTS[precision], "PERFORMANCE_HINT": "LATENCY",
                        "NUM_STREAMS": 1}
        if threads:
            self._config["INFERENCE_NUM_THREADS"] = int(threads)
        if not pin_threads:
            self._config["ENABLE_CPU_PINNING"] = False
        self._inputs = [_port(p) for p in self._model.inputs]
        self._outputs = [_port(p) for p in self._model.outputs]
        self._compiled = None
        self._idle: list = []  # infer requests of finished runs, for the next binding (OpenVINOBinding._run)
        # id of a pooled request -> per input position, a weak reference to the array run_arrays last set there
        self._reads: dict[int, list] = {}
        self._static_shapes = int(static_shapes)
        self._static: dict[tuple, object] = {}  # input shapes -> the model compiled for them
        # The idle requests of one static compile (the last shapes run): another's are dropped, with the
        # intermediate memory each holds, when the shapes change
        self._static_idle: tuple[tuple | None, list] = (None, [])
        self._dynamic_source = dynamic_model
        if self._static_shapes:
            return  # compiled on the first run, for its shapes
        if all(not p.get_partial_shape().rank.is_dynamic for p in self._model.inputs):
            self._compile()
        # else: OpenVINO's CPU plugin needs every input's rank; compiled on the first run, from its inputs

    def _read(self, model):
        if isinstance(model, (str, os.PathLike)):
            model = str(model)
        try:
            read = core().read_model(model)
        except Exception as exc:
            raise OpenVINOReadError(f"OpenVINO cannot read the model: {exc}") from exc
        if self.precision == "bf16":  # the loss region stays float32, as under autocast (ONNXTRAIN_OPENVINO_FLOAT32)
            from onnxtrain.runtime.openvino_float32 import keep_float32

            read = keep_float32(read, core())
        return read

    def _compile(self, arrays: dict[str, np.ndarray] | None = None):
        if self._compiled is None:
            model = self._model
            if self._dynamic_source is not None:
                model = self._read(self._dynamic_source)
            if arrays is not None:
                import openvino as ov

                model.reshape({p.get_any_name(): ov.PartialShape.dynamic(arrays[p.get_any_name()].ndim)
                               for p in model.inputs if p.get_partial_shape().rank.is_dynamic})
            self._compiled = self._compile_model(model)
        return self._compiled

    def _compile_model(self, model):
        try:
            return core().compile_model(model, "CPU", self._config)
        except Exception as exc:
            raise OpenVINOCompileError(f"OpenVINO cannot compile the model for the CPU: {one_line(exc)}") from exc

    def _static_request(self, arrays: list[np.ndarray]):
        """An infer request of the model compiled for these arrays' shapes, or None past ``static_shapes``."""
        shapes = tuple(a.shape for a in arrays)
        key, idle = self._static_idle
        if key == shapes and idle:
            return idle.pop()
        compiled = self._static.get(shapes)
        if compiled is None:
            if len(self._static) >= self._static_shapes:
                return None
            import openvino as ov

            model = self._model.clone()
            model.reshape({p.get_any_name(): ov.PartialShape(list(a.shape)) for p, a in zip(model.inputs, arrays)})
            compiled = self._static[shapes] = self._compile_model(model)
        if key != shapes:
            for request in idle:
                self._reads.pop(id(request), None)
            self._static_idle = (shapes, [])
        return compiled.create_infer_request()

    def get_inputs(self) -> list:
        return list(self._inputs)

    def get_outputs(self) -> list:
        return list(self._outputs)

    def get_modelmeta(self):
        """The ONNX model's ``metadata_props`` (OpenVINO keeps them in its ``framework`` runtime info)."""
        info = self._model.get_rt_info()
        framework = info["framework"] if "framework" in list(info.keys()) else {}
        meta = {key: value.astype(str) for key, value in framework.items()}
        return SimpleNamespace(custom_metadata_map=meta)

    def run_arrays(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Run on every input in graph order (C-contiguous arrays, read in place; a bfloat16 input as the int16
        array of its bits) and return every output,
        copied out, in graph order: :class:`onnxtrain.runtime.session.TorchSession`'s path, which needs no
        OrtValues and no binding object."""
        if len(arrays) != len(self._inputs):
            raise ValueError(f"the model takes {len(self._inputs)} inputs, got {len(arrays)}")
        import openvino as ov

        request = self._static_request(arrays) if self._static_shapes else None
        idle = self._static_idle[1] if request is not None else self._idle
        if request is None:
            request = self._idle.pop() if self._idle else self._compile(
                {p.name: a for p, a in zip(self._inputs, arrays)}).create_infer_request()
        # What the request reads from its last run here: an input whose array is this very (live) object is
        # read in place and needs no new tensor. Cleared until the inputs are all set (a failure leaves some unset).
        reads = self._reads.pop(id(request), None) or [None] * len(arrays)
        try:
            for k, (port, array) in enumerate(zip(self._inputs, arrays)):
                if reads[k] is not None and reads[k]() is array:
                    continue
                try:
                    request.set_input_tensor(k, ov.Tensor(array, ov.Shape(list(array.shape)), ov.Type.bf16)
                                             if port.type == "tensor(bfloat16)" and array.dtype == np.int16
                                             else ov.Tensor(array, shared_memory=True))
                except Exception as exc:
                    raise ValueError(f"OpenVINO cannot bind {port.name!r} (shape {list(array.shape)}, "
                                     f"{array.dtype}): {exc}") from exc
                reads[k] = weakref.ref(array)
            self._reads[id(request)] = reads
            request.infer()
            return [np.array(request.get_output_tensor(k).data, copy=True) for k in range(len(self._outputs))]
        finally:
            idle.append(request)

    def io_binding(self) -> OpenVINOBinding:
        return OpenVINOBinding(self)

    def run_with_iobinding(self, binding: OpenVINOBinding) -> None:
        binding._run()

    def run(self, output_names, feeds: dict) -> list[np.ndarray]:
        """As ``InferenceSession.run``: ``feeds`` by name, the outputs (all for None) as new arrays."""
        binding = self.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.asarray(value))
        for name in output_names or [o.name for o in self._outputs]:
            binding.bind_output(name, "cpu")
        binding._run()
        return [v.numpy() for v in binding.get_outputs()]


class OpenVINOBinding:
    """Inputs and outputs of one OpenVINO infer request, bound as onnxruntime's IOBinding binds them."""

    def __init__(self, session: OpenVINOSession):
        self._session = session
        self._request = None  # made on the first run (the model may be compiled then)
        self._tensors: dict[str, object] = {}  # name -> ov.Tensor sharing the bound memory
        self._keep: dict[str, object] = {}  # what the bound ov.Tensors read or write: kept alive
        self._outputs: dict[str, object] = {}  # name -> the bound OrtValue, or None: copied after a run
        self._results: dict[str, _Output] = {}
        # Bound since this binding's own request last took its tensors (all, while it has taken none): a run
        # sets only these on it, not every parameter and gradient again (149 set_tensor calls, 1 ms of CPU a
        # call on on-device BERT-small, where a step rebinds only its batch).
        self._fresh: set[str] | None = None

    def bind_cpu_input(self, name: str, array: np.ndarray) -> None:
        self._set(name, np.require(array, requirements="C"))  # ascontiguousarray would make a 0-d array 1-d

    def bind_ortvalue_input(self, name: str, value) -> None:
        self._set(name, _array_of(value), value)

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0) -> None:
        if device_type != "cpu":
            raise ValueError(f"OpenVINO runs on the CPU here; cannot bind output {name!r} on {device_type!r}")
        self._outputs[name] = None

    def bind_ortvalue_output(self, name: str, value) -> None:
        self._set(name, _array_of(value), value)
        self._outputs[name] = value

    def get_outputs(self) -> list:
        return [value if value is not None else self._results[name] for name, value in self._outputs.items()]

    def _set(self, name: str, array: np.ndarray, owner=None) -> None:
        import openvino as ov

        self._keep[name] = (array, owner)
        self._tensors[name] = ov.Tensor(array, shared_memory=True)
        if self._fresh is not None:
            self._fresh.add(name)

    def _run(self) -> None:
        missing = [p.name for p in self._session._inputs if p.name not in self._tensors]
        if missing:
            raise ValueError(f"inputs {missing} are not bound; the model takes {len(self._session._inputs)} inputs")
        pooled = all(value is None for value in self._outputs.values())  # no output in the caller's memory
        request = self._request
        if request is None:
            if pooled and self._session._idle:
                request = self._session._idle.pop()
                self._session._reads.pop(id(request), None)  # every input is set below
            else:
                arrays = {name: kept[0] for name, kept in self._keep.items()}
                request = self._session._compile(arrays).create_infer_request()
            if not pooled:
                self._request = request  # its outputs are bound to the caller's memory: this binding's own
        try:
            held = request is self._request and self._fresh is not None  # the rest is set on it already
            names = list(self._fresh if held else self._tensors)
            self._fresh = None  # until every one is set
            for name in names:
                tensor = self._tensors[name]
                try:
                    request.set_tensor(name, tensor)
                except Exception as exc:
                    raise ValueError(f"OpenVINO cannot bind {name!r} (shape {list(tensor.shape)}, "
                                     f"{tensor.element_type}): {exc}") from exc
            if request is self._request:
                self._fresh = set()
            request.infer()
            self._results = {name: _Output(np.array(request.get_tensor(name).data, copy=True))
                             for name, value in self._outputs.items() if value is None}
        finally:
            if pooled:  # every input is set again before the next run; outputs are the request's own
                self._session._idle.append(request)


class _Output:
    """A result read as onnxruntime's OrtValue is read: ``numpy()``, ``data_type()``, ``shape()``, DLPack."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def numpy(self) -> np.ndarray:
        return self._array

    def data_type(self) -> str:
        return _ORT_TYPE_OF_NUMPY[self._array.dtype]

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def _port(port):
    dims = [d.get_length() if d.is_static else None for d in port.get_partial_shape()]
    type_name = port.get_element_type().get_type_name()
    return SimpleNamespace(name=port.get_any_name(), type=_ORT_TYPE_OF_OV.get(type_name, type_name), shape=dims)


def _array_of(value) -> np.ndarray:
    """A numpy view of a CPU OrtValue's memory (or the array itself)."""
    if isinstance(value, np.ndarray):
        return value
    if value.device_name().lower() != "cpu":
        raise ValueError("OpenVINO runs on the CPU here; the OrtValue is on " + value.device_name())
    dtype = np.dtype(_NUMPY_OF[value.data_type()])
    shape = tuple(value.shape())
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size == 0:
        return np.empty(shape, dtype)
    buffer = (ctypes.c_byte * size).from_address(value.data_ptr())
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)
