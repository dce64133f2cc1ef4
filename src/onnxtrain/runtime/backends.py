"""Which engine runs a graph, and in which precision: onnxruntime (the default) or OpenVINO.

A backend makes a session from a model (a path or the model's bytes). Sessions have the part of
``onnxruntime.InferenceSession``'s interface that onnxtrain's runtimes use: ``get_inputs()``, ``get_outputs()``,
``get_modelmeta().custom_metadata_map``, ``io_binding()`` (``bind_ortvalue_input``, ``bind_cpu_input``,
``bind_output``, ``bind_ortvalue_output``, ``get_outputs``) and ``run_with_iobinding``. For onnxruntime that is
the InferenceSession itself; :class:`onnxtrain.runtime.openvino.OpenVINOSession` gives it over OpenVINO, with
inputs and preallocated outputs sharing memory with the caller's arrays.

Precision: "fp32" runs the graph as it is. "bf16" on CPU runs its float32 matmul-class products in bfloat16,
which onnxruntime's CPU provider cannot do (no bfloat16 kernel for MatMul, Add or Mul) and OpenVINO does on
CPUs with bfloat16 instructions (its ``INFERENCE_PRECISION_HINT``, on the float32 graph; the accumulations
stay float32). When the precision needs a backend that is missing (no ``openvino`` package, or a CPU
without bfloat16) onnxtrain warns once and runs float32; naming a backend that is not installed is an error.
This module imports neither torch nor onnx (the on-device runtime uses it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

BACKENDS = ("onnxruntime", "openvino")
PRECISIONS = ("fp32", "bf16")
BACKEND_ENV = "ONNXTRAIN_BACKEND"
_PRECISION_NAMES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
_warned: set[str] = set()


def normalize_precision(precision: str | None) -> str:
    """"fp32" or "bf16" for the names of float32 and bfloat16 (None is float32); else a ValueError."""
    if precision is None:
        return "fp32"
    name = _PRECISION_NAMES.get(str(precision).lower())
    if name is None:
        raise ValueError(f"unknown precision {precision!r}; the runtime runs {sorted(_PRECISION_NAMES)}")
    return name


def openvino_installed() -> bool:
    return importlib.util.find_spec("openvino") is not None


@functools.cache
def openvino_has_bf16() -> bool:
    """OpenVINO is installed and its CPU plugin reports bfloat16 arithmetic (e.g. AVX512-BF16 or AMX)."""
    if not openvino_installed():
        return False
    from onnxtrain.runtime.openvino import core

    return "BF16" in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def resolve(backend: str | None, precision: str | None, device: str = "cpu") -> tuple[str, str]:
    """The (backend, precision) that will run: ``backend`` None means the ``ONNXTRAIN_BACKEND`` env var, else
    onnxruntime for float32 and OpenVINO for bf16 on CPU. A precision that cannot run where asked warns once
    and gives "fp32"; a backend that is unknown or not installed raises."""
    precision = normalize_precision(precision)
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or None
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if backend == "openvino":
        if not openvino_installed():
            raise ImportError("backend 'openvino' needs the openvino package: pip install 'onnxtrain[openvino]'")
        if device != "cpu":
            raise ValueError(f"backend 'openvino' runs on the CPU here, not on {device!r}")
    if precision == "fp32":
        return backend or "onnxruntime", precision
    if device == "cpu":
        if backend == "onnxruntime":
            _warn_once("onnxruntime-bf16", "onnxruntime's CPU provider has no bfloat16 arithmetic: running float32 "
                       "(backend='openvino' runs bfloat16 on CPU)")
            return backend, "fp32"
        if not openvino_installed():
            _warn_once("no-openvino", "bfloat16 on CPU runs on OpenVINO, which is not installed: running float32 "
                       "(pip install 'onnxtrain[openvino]')")
            return "onnxruntime", "fp32"
        if not openvino_has_bf16():
            _warn_once("no-bf16-cpu", "this CPU has no bfloat16 arithmetic (OpenVINO reports none): running float32")
            return "openvino" if backend == "openvino" else "onnxruntime", "fp32"
        return "openvino", precision
    return backend or "onnxruntime", precision


def create_session(model, backend: str = "onnxruntime", precision: str = "fp32", session_options=None,
                   providers=None, disabled_optimizers=(), pin_threads: bool = True, **openvino):
    """A session for ``model`` (a path or the model's bytes) on a resolved backend and precision
    (:func:`resolve`). ``session_options`` (an ``onnxruntime.SessionOptions``) also give OpenVINO its
    thread count; ``disabled_optimizers``: onnxruntime graph transformers not to run; ``pin_threads=False``:
    OpenVINO does not pin its threads to cores (:class:`onnxtrain.runtime.openvino.OpenVINOSession`), whose
    ``static_shapes`` and ``dynamic_model`` ``openvino`` may give."""
    if backend == "openvino":
        from onnxtrain.runtime.openvino import OpenVINOReadError, OpenVINOSession

        threads = getattr(session_options, "intra_op_num_threads", 0) or None
        try:
            return OpenVINOSession(model, precision=precision, threads=threads, pin_threads=pin_threads, **openvino)
        except OpenVINOReadError as exc:  # this graph only: the others keep running on OpenVINO
            reason = _failed_ops(str(exc))
            _warn_once(f"openvino-read:{reason}", f"OpenVINO cannot convert a graph ({reason}): that graph runs "
                       "on onnxruntime in float32")
            backend, precision = "onnxruntime", "fp32"
    if backend != "onnxruntime":
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if precision != "fp32":
        raise ValueError(f"onnxruntime runs the graph's own types here; precision {precision!r} needs resolve()")
    import onnxruntime as ort

    if isinstance(model, os.PathLike):
        model = str(model)
    extra = {"disabled_optimizers": list(disabled_optimizers)} if disabled_optimizers else {}
    return ort.InferenceSession(model, sess_options=session_options, providers=providers or ["CPUExecutionProvider"],
                                **extra)


def _failed_ops(message: str) -> str:
    """The short reason in OpenVINO's conversion report: the ops it failed on and why, on one line."""
    lines = [line.strip() for line in message.splitlines()]
    failed = [line.removeprefix("-- Conversion is failed for:").strip() for line in lines
              if line.startswith("-- Conversion is failed for:")]
    why = next((line for line in lines if "needs to be known" in line or "is not supported" in line), "")
    return "; ".join(filter(None, [", ".join(failed), why])) or (lines[-1] if lines else message)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
