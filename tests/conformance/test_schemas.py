"""docs/schemas/ describe what the Python writer produces: the checkpoint header and the models' metadata."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jsonschema
import onnxruntime as ort
import pytest

from onnxtrain.ondevice.format import OPTIMIZER_METADATA_KEY, TRAINING_METADATA_KEY

ROOT = Path(__file__).parents[2]
SCHEMAS = ROOT / "docs" / "schemas"
FOLDERS = [ROOT / "tests" / "conformance" / n for n in ("mlp", "cnn", "transformer")] + [ROOT / "web" / "example" / "artifacts"]


def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[16:24])
    return json.loads(raw[24:24 + length])


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_checkpoint_headers_follow_the_schema(folder, tmp_path):
    validator = _validator("checkpoint-header.schema.json")
    for name in ("checkpoint", "expected_checkpoint"):
        if (folder / name).exists():
            validator.validate(_header(folder / name))
    from onnxtrain.ondevice import checkpoint as ckpt

    data = ckpt.load(folder / "checkpoint")
    data.properties = {"epoch": 3, "loss": float("nan"), "note": "x"}
    data.nominal = True
    ckpt.save(data, tmp_path / "nominal")
    validator.validate(_header(tmp_path / "nominal"))
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({**_header(folder / "checkpoint"), "version": 2})


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_model_metadata_follows_the_schema(folder):
    training, optimizer = _validator("training-metadata.schema.json"), _validator("optimizer-metadata.schema.json")
    for name, key, validator in (("training_model.onnx", TRAINING_METADATA_KEY, training),
                                 ("eval_model.onnx", TRAINING_METADATA_KEY, training),
                                 ("optimizer_model.onnx", OPTIMIZER_METADATA_KEY, optimizer)):
        session = ort.InferenceSession(str(folder / name), providers=["CPUExecutionProvider"])
        meta = json.loads(session.get_modelmeta().custom_metadata_map[key])
        validator.validate(meta)
    if (folder / "web").is_dir():  # the train-step model carries both descriptions
        path = folder / "web" / "train_step_model.onnx"
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        both = session.get_modelmeta().custom_metadata_map
        training.validate(json.loads(both[TRAINING_METADATA_KEY]))
        optimizer.validate(json.loads(both[OPTIMIZER_METADATA_KEY]))
        assert json.loads(both[TRAINING_METADATA_KEY])["kind"] == "train_step"
    with pytest.raises(jsonschema.ValidationError, match="'gradients' is a required property"):
        training.validate({"kind": "training", "format": 2, "user_inputs": [], "outputs": ["loss"], "trainable": [],
                           "frozen": []})
