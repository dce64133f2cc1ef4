"""The onnxtrain checkpoint file: one self-describing binary file, numpy only.

Layout (all integers little-endian; the full specification is in docs/ondevice.md)::

    offset  size  field
    0       8     magic  b"OTCKPT\\r\\n"   (the CR LF catches text-mode corruption)
    8       4     format version (uint32), currently 1
    12      4     CRC-32 of the header bytes (uint32)
    16      8     header length H in bytes (uint64)
    24      H     header: UTF-8 JSON (tensor table, requires-grad flags, optimizer step, properties)
    ...           zero padding to a multiple of 64, then the tensor data region; each tensor starts at
                  a multiple of 64 bytes from the region start, at the offset the header gives

The header records the data region's length, so a truncated file is detected before any tensor is
read, and each tensor's CRC-32, so a damaged one is named. Files are written to a temporary file
beside the target and renamed over it: a reader never sees a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnxtrain.utils.atomic import atomic_path

MAGIC = b"OTCKPT\r\n"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sII Q")  # magic, version, header crc, header length
_MAX_HEADER = 1 << 31

# Element types a checkpoint may hold, by their stable names in the file.
DTYPES = {
    "float32": np.float32, "float64": np.float64, "float16": np.float16,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "bool": np.bool_,
}
# bfloat16 has no numpy type: it is stored and returned as its raw uint16 bits.
_NAME_OF = {np.dtype(v): k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """The file is not an onnxtrain checkpoint, is truncated or damaged, or cannot be represented."""


@dataclass
class LossScaleState:
    """fp16 loss scaling's state (as ``torch.amp.GradScaler``'s ``scale`` and ``growth_tracker``)."""

    scale: float
    good_steps: int = 0


@dataclass
class CheckpointData:
    """Everything one checkpoint file holds, as plain numpy and Python values."""

    parameters: dict[str, np.ndarray] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    optimizer_states: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # param -> state
    optimizer_step: int = 0
    learning_rate: float | None = None
    properties: dict[str, int | float | str] = field(default_factory=dict)
    nominal: bool = False  # names, shapes and types only; ``parameters`` hold zeros after loading
    loss_scale: LossScaleState | None = None  # fp16 artifacts only


def _dtype_name(array: np.ndarray, what: str) -> str:
    name = _NAME_OF.get(array.dtype)
    if name is None:
        raise CheckpointError(f"{what} has element type {array.dtype}, which a checkpoint cannot hold "
                              f"(supported: {', '.join(DTYPES)})")
    return name


def _check_property(name, value) -> dict:
    if not isinstance(name, str):
        raise CheckpointError(f"property names must be strings, got {name!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str, np.integer, np.floating)):
        raise CheckpointError(f"property {name!r} is a {type(value).__name__}; properties hold int, float or str")
    if isinstance(value, (int, np.integer)):
        return {"type": "int", "value": int(value)}
    if isinstance(value, (float, np.floating)):
        return {"type": "float", "value": repr(float(value))}  # repr keeps inf/nan and every bit
    return {"type": "str", "value": value}


def _read_property(name: str, entry: dict):
    kind, value = entry.get("type"), entry.get("value")
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "str":
        return str(value)
    raise CheckpointError(f"property {name!r} has unknown type {kind!r}")


class _Tensors:
    """Collects tensors for writing: assigns aligned offsets and records the table entries."""

    def __init__(self, nominal: bool):
        self.nominal = nominal
        self.arrays: list[tuple[int, np.ndarray]] = []
        self.size = 0

    def add(self, array: np.ndarray, what: str) -> dict:
        array = np.asarray(array)
        entry = {"dtype": _dtype_name(array, what), "shape": list(array.shape)}
        if self.nominal:
            return entry
        array = np.ascontiguousarray(array)
        offset = -(-self.size // ALIGN) * ALIGN
        self.arrays.append((offset, array))
        self.size = offset + array.nbytes
        entry.update(offset=offset, nbytes=array.nbytes, crc32=zlib.crc32(array.data.cast("B")) if array.nbytes else 0)
        return entry


def _header(data: CheckpointData, include_optimizer_state: bool) -> tuple[dict, _Tensors]:
    tensors = _Tensors(data.nominal)
    params = []
    for name, array in data.parameters.items():
        entry = {"name": name, "requires_grad": bool(data.requires_grad.get(name, False))}
        entry.update(tensors.add(array, f"parameter {name!r}"))
        params.append(entry)
    header = {
        "format": "onnxtrain.checkpoint",
        "version": FORMAT_VERSION,
        "nominal": data.nominal,
        "parameters": params,
        "properties": {k: _check_property(k, v) for k, v in data.properties.items()},
    }
    if include_optimizer_state and not data.nominal:
        states = {}
        for pname, state in data.optimizer_states.items():
            states[pname] = {k: tensors.add(v, f"optimizer state {k!r} of {pname!r}") for k, v in state.items()}
        header["optimizer"] = {"step": int(data.optimizer_step), "learning_rate": data.learning_rate,
                               "states": states}
    if data.loss_scale is not None:
        header["loss_scale"] = {"scale": float(data.loss_scale.scale), "good_steps": int(data.loss_scale.good_steps)}
    header["data_size"] = tensors.size
    return header, tensors


def save(data: CheckpointData, path: str | os.PathLike, include_optimizer_state: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file beside it, fsynced, then renamed)."""
    header, tensors = _header(data, include_optimizer_state)
    blob = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, zlib.crc32(blob), len(blob))
    start = -(-(len(prefix) + len(blob)) // ALIGN) * ALIGN
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(prefix)
        f.write(blob)
        f.write(b"\0" * (start - len(prefix) - len(blob)))
        pos = 0
        for offset, array in tensors.arrays:
            f.write(b"\0" * (offset - pos))
            f.write(array.data.cast("B") if array.nbytes else b"")
            pos = offset + array.nbytes


def _read_header(f, path: Path, file_size: int) -> tuple[dict, int]:
    raw = f.read(_PREFIX.size)
    if not raw:
        raise CheckpointError(f"{path} is empty: not an onnxtrain checkpoint (an interrupted copy?)")
    if len(raw) < _PREFIX.size or not raw.startswith(MAGIC):
        if raw[:8] == MAGIC[: len(raw[:8])] and len(raw) < _PREFIX.size:
            raise CheckpointError(f"{path} is truncated: it ends inside the checkpoint prefix ({len(raw)} bytes)")
        raise CheckpointError(f"{path} is not an onnxtrain checkpoint (it does not start with {MAGIC!r}); "
                              "pass the checkpoint written by generate_artifacts or save_checkpoint")
    _, version, crc, length = _PREFIX.unpack(raw)
    if version > FORMAT_VERSION or version < 1:
        raise CheckpointError(f"{path} uses checkpoint format version {version}; this onnxtrain reads "
                              f"versions 1 to {FORMAT_VERSION}. Upgrade onnxtrain to read it.")
    if length > min(_MAX_HEADER, file_size - _PREFIX.size):
        raise CheckpointError(f"{path} is truncated or damaged: its header claims {length} bytes but the file "
                              f"has {file_size} bytes")
    blob = f.read(length)
    if zlib.crc32(blob) != crc:
        raise CheckpointError(f"{path} is damaged: the header checksum does not match")
    try:
        header = json.loads(blob.decode("utf-8"))
    except ValueError as exc:
        raise CheckpointError(f"{path} is damaged: its header is not valid JSON ({exc})") from exc
    if header.get("format") != "onnxtrain.checkpoint":
        raise CheckpointError(f"{path} is not an onnxtrain checkpoint (header format {header.get('format')!r})")
    start = -(-(_PREFIX.size + length) // ALIGN) * ALIGN
    expected = start + int(header.get("data_size", 0))
    if file_size < expected:
        raise CheckpointError(f"{path} is truncated: {file_size} bytes, the header describes {expected}. "
                              "It was probably copied or downloaded incompletely; use an intact copy.")
    return header, start


def _read_tensor(f, path: Path, start: int, entry: dict, what: str, nominal: bool) -> np.ndarray:
    dtype = DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise CheckpointError(f"{path}: {what} has unknown element type {entry.get('dtype')!r}")
    shape = tuple(int(d) for d in entry["shape"])
    array = np.empty(shape, dtype=dtype) if not nominal else np.zeros(shape, dtype=dtype)
    if nominal:
        return array
    if int(entry["nbytes"]) != array.nbytes:
        raise CheckpointError(f"{path}: {what} has {entry['nbytes']} bytes of data for shape {list(shape)} "
                              f"{entry['dtype']} ({array.nbytes} expected); the file is damaged")
    f.seek(start + int(entry["offset"]))
    view = array.reshape(-1).view(np.uint8) if array.nbytes else b""
    if array.nbytes and f.readinto(view) != array.nbytes:
        raise CheckpointError(f"{path} is truncated inside {what}")
    if array.nbytes and zlib.crc32(view) != int(entry["crc32"]):
        raise CheckpointError(f"{path} is damaged: the checksum of {what} does not match")
    return array


def load(path: str | os.PathLike) -> CheckpointData:
    """Read a checkpoint; a missing, foreign, truncated or damaged file raises a clear error."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; pass the checkpoint file inside it "
                              "(generate_artifacts writes <artifact_directory>/checkpoint)")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        header, start = _read_header(f, path, size)
        nominal = bool(header.get("nominal", False))
        data = CheckpointData(nominal=nominal)
        try:
            for entry in header["parameters"]:
                name = entry["name"]
                data.parameters[name] = _read_tensor(f, path, start, entry, f"parameter {name!r}", nominal)
                data.requires_grad[name] = bool(entry["requires_grad"])
            data.properties = {k: _read_property(k, v) for k, v in header.get("properties", {}).items()}
            if header.get("loss_scale") is not None:
                entry = header["loss_scale"]
                data.loss_scale = LossScaleState(float(entry["scale"]), int(entry["good_steps"]))
            optim = header.get("optimizer")
            if optim is not None:
                data.optimizer_step = int(optim["step"])
                data.learning_rate = optim.get("learning_rate")
                for pname, states in optim["states"].items():
                    data.optimizer_states[pname] = {
                        k: _read_tensor(f, path, start, e, f"optimizer state {k!r} of {pname!r}", False)
                        for k, e in states.items()}
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path} is damaged: malformed header entry ({exc!r})") from exc
    return data
