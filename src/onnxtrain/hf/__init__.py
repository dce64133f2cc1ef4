"""Hugging Face Trainer integration: ``ORTTrainer`` and ``ORTTrainingArguments``.

The only onnxtrain package that imports ``transformers``. Switching a Trainer script is two renames::

    from onnxtrain.hf import ORTTrainer, ORTTrainingArguments
    args = ORTTrainingArguments(output_dir="out", optim="adamw_ort_fused", ...)
    trainer = ORTTrainer(model=model, args=args, train_dataset=train_dataset, feature="sequence-classification")
    trainer.train()

See docs/hf.md.
"""

from onnxtrain.hf.features import FEATURES
from onnxtrain.hf.trainer import ORTTrainer
from onnxtrain.hf.training_args import ORTTrainingArguments

__all__ = ["FEATURES", "ORTTrainer", "ORTTrainingArguments"]
