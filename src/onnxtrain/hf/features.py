"""The ``feature=`` of ORTTrainer: which task the model is trained for.

The name comes from Optimum's ORTTrainer (and its ONNX exporter's "features"). Here it does two things:
it checks that the model's class fits the task (a ``BertForMaskedLM`` given ``feature="sequence-classification"``
is a mistake worth an error before hours of training), and it names the outputs of the inference model that
``ORTTrainer.export_onnx`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.models.auto import modeling_auto

__all__ = ["FEATURES", "Feature", "resolve_feature"]


@dataclass(frozen=True)
class Feature:
    name: str
    outputs: tuple[str, ...]  # ModelOutput fields the exported inference model returns, in order
    mapping: str  # name of the transformers auto mapping that lists the model classes for this task


FEATURES = {
    f.name: f
    for f in (
        Feature("default", ("last_hidden_state",), "MODEL_MAPPING_NAMES"),
        Feature("sequence-classification", ("logits",), "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
        Feature("token-classification", ("logits",), "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
        Feature("question-answering", ("start_logits", "end_logits"), "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
        Feature("multiple-choice", ("logits",), "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES"),
        Feature("masked-lm", ("logits",), "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
        Feature("causal-lm", ("logits",), "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    )
}

# Task names of the Hugging Face Hub and of optimum-cli, accepted as synonyms.
_ALIASES = {
    "feature-extraction": "default",
    "text-classification": "sequence-classification",
    "fill-mask": "masked-lm",
    "text-generation": "causal-lm",
}


def _model_classes(feature: Feature) -> set[str]:
    names = set()
    for value in getattr(modeling_auto, feature.mapping).values():
        names.update(value if isinstance(value, (list, tuple)) else (value,))
    return names


def _features_of(model) -> list[str]:
    return [f.name for f in FEATURES.values() if type(model).__name__ in _model_classes(f)]


def resolve_feature(feature: str | None, model=None) -> Feature:
    """The :class:`Feature` called ``feature``, checked against ``model``'s class when one is given.

    A model class that transformers lists for other tasks but not for this one is an error; a class that it
    does not list at all (a custom model) is accepted for any feature. ``None`` picks the feature that
    transformers lists the model's class for, and ``"default"`` for classes it does not list.
    """
    if feature is None:
        fits = [] if model is None else _features_of(model)
        return FEATURES[fits[0] if fits else "default"]
    name = _ALIASES.get(feature, feature)
    if name not in FEATURES:
        raise ValueError(
            f"ORTTrainer: unknown feature {feature!r}; use one of {', '.join(FEATURES)} "
            f"(or the task names {', '.join(_ALIASES)})."
        )
    resolved = FEATURES[name]
    if model is not None:
        class_name = type(model).__name__
        fits = _features_of(model)
        if fits and name not in fits:
            raise ValueError(
                f"ORTTrainer: feature={feature!r} does not fit the model {class_name}, which transformers "
                f"lists for {', '.join(repr(f) for f in fits)}; pass one of those as feature=, or load the "
                f"model class for {name!r}."
            )
    return resolved
