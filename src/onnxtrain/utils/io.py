"""Atomic file writes and model loading shared by the artifacts, checkpoints and the CLI."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx

from onnxtrain.utils.atomic import atomic_path, error_naming, mode_for, write_bytes_atomic  # noqa: F401  (re-exported)

# Protobuf cannot serialize a message of 2 GiB or more; larger models go to external data.
_PROTO_LIMIT = 2**31 - 1


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Save ``model`` to ``path`` atomically; models over 2 GB keep their weights in ``<name>.data``.

    For external data both files are written into a staging folder beside ``path`` and renamed into
    place, data first, so that the model file never points at a missing or partial data file.
    """
    path = Path(path)
    if model.ByteSize() < _PROTO_LIMIT:
        write_bytes_atomic(model.SerializeToString(), path)
        return
    data_name = path.name + ".data"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    except OSError as exc:
        raise error_naming(exc, path) from exc
    try:
        onnx.save_model(model, str(staging / path.name), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        for name in (data_name, path.name):  # data first: the model never points at a missing file
            os.chmod(staging / name, mode_for(path.with_name(name)))
            os.replace(staging / name, path.with_name(name))
    except OSError as exc:
        raise error_naming(exc, path) from exc
    finally:
        for p in staging.iterdir():
            p.unlink()
        staging.rmdir()


def load_model(model: onnx.ModelProto | str | os.PathLike, load_external_data: bool = True) -> onnx.ModelProto:
    """Return a ModelProto for a proto or a path, with a clear error for a missing or unreadable file."""
    if isinstance(model, onnx.ModelProto):
        return model
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(f"ONNX model not found: {path}")
    try:
        return onnx.load(str(path), load_external_data=load_external_data)
    except Exception as exc:  # protobuf DecodeError and friends
        raise ValueError(f"{path} is not a readable ONNX model: {exc}") from exc
