"""The artifact format's names, defined once (stdlib only): metadata keys, versions and graph I/O names.

docs/format.md describes the whole contract; the artifact writer, the optimizer block and the runtime
import these names from here.
"""

from __future__ import annotations

# Model metadata (custom_metadata_map) holding the JSON description of a training or eval model.
TRAINING_METADATA_KEY = "onnxtrain.training"
# Bumped when training models from earlier versions train differently; older ones get a warning.
# 2: embedding (Gather) gradients by ScatterElements, exact with repeated ids on several threads
# (1 used ScatterND, whose CPU kernel may lose updates then).
TRAINING_MODEL_FORMAT = 2
# 3: fp16 artifacts with dynamic loss scaling: the training model takes a ``loss_scale`` input and its
# metadata a ``loss_scaling`` object. Only such models are format 3; a reader must refuse a format above
# the ones it knows.
LOSS_SCALING_FORMAT = 3
# 4: bf16 artifacts whose embedding gradients the runtime adds: the training model returns each such gradient's
# token ids and rows (metadata ``row_gradients``) instead of scattering them into a table of zeros.
ROW_GRADIENTS_FORMAT = 4
# The newest format this runtime trains; it refuses a model of a format above it.
NEWEST_FORMAT = 4
# Model metadata holding the optimizer model's layout and hyperparameters.
OPTIMIZER_METADATA_KEY = "onnxtrain.optimizer"

# The optimizer model's scalar inputs.
LEARNING_RATE = "learning_rate"
STEP = "step"
# Loss scaling (fp16): the scale (float32 scalar, a training and an optimizer model input) and the count of
# good steps since the scale last changed (int64 scalar, an optimizer model input); both updated by the
# optimizer model as outputs ``loss_scale.out`` and ``good_steps.out``.
LOSS_SCALE = "loss_scale"
GOOD_STEPS = "good_steps"
# Its per-element-type flat vectors: ``params.<dtype>``, ``gradients.<dtype>``, ``<state>.<dtype>``.
PARAMS = "params"
GRADIENTS = "gradients"
# An updated vector is the output named after its input plus this suffix (``params.float32.out``).
OUTPUT_SUFFIX = ".out"


def flat_name(prefix: str, dtype: str) -> str:
    """The optimizer model's input holding the flat ``prefix`` vector of element type ``dtype``."""
    return f"{prefix}.{dtype}"


def updated_name(input_name: str) -> str:
    """The optimizer model's output holding the new value of ``input_name``."""
    return input_name + OUTPUT_SUFFIX
