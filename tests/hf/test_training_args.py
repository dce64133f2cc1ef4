"""ORTTrainingArguments, features and the adamw_ort_fused optimizer inside a plain transformers.Trainer.

None of these needs ORTModule: they check the arguments and the optimizer plumbing against plain Trainer.
"""

import pickle

import pytest
import torch
import transformers

from onnxtrain.hf import ORTTrainer, ORTTrainingArguments
from onnxtrain.hf.features import resolve_feature
from onnxtrain.optim import AdamWMode, FusedAdam
from tests.hf.helpers import (
    bert_classifier,
    classification_dataset,
    gpt2_lm,
    losses,
    train_args,
)


def test_adamw_ort_fused_is_accepted_and_serialized(tmp_path):
    args = train_args(ORTTrainingArguments, tmp_path, optim="adamw_ort_fused", onnx_log_level="info")
    assert args.optim == "adamw_ort_fused"
    assert args.onnx_log_level == "INFO"
    assert '"optim": "adamw_ort_fused"' in args.to_json_string()
    assert pickle.loads(pickle.dumps(args)).optim == "adamw_ort_fused"  # Trainer saves training_args.bin
    # Plain TrainingArguments still rejects it, so nothing was patched globally.
    with pytest.raises(ValueError, match="adamw_ort_fused"):
        transformers.TrainingArguments(output_dir=str(tmp_path), optim="adamw_ort_fused", report_to=[])


def test_other_optimizers_and_set_optimizer(tmp_path):
    args = train_args(ORTTrainingArguments, tmp_path, optim="adamw_torch")
    assert args.optim == transformers.training_args.OptimizerNames.ADAMW_TORCH
    args.set_optimizer("adamw_ort_fused", learning_rate=1e-3)
    assert args.optim == "adamw_ort_fused" and args.learning_rate == 1e-3
    args.set_optimizer("sgd")
    assert args.optim == transformers.training_args.OptimizerNames.SGD


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(onnx_log_level="LOUD"), "onnx_log_level='LOUD' is not a log level; use one of VERBOSE"),
        (dict(onnx_prefix="bert"), "onnx_prefix is set but save_onnx is False"),
        (dict(optim="adamw_ort_fusd"), "adamw_ort_fusd"),
    ],
)
def test_invalid_arguments_are_named(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        train_args(ORTTrainingArguments, tmp_path, **overrides)


def test_optimizer_cls_and_kwargs(tmp_path):
    args = train_args(ORTTrainingArguments, tmp_path, optim="adamw_ort_fused", adam_beta1=0.8, adam_epsilon=1e-7,
                      optim_args="adam_w_mode=adamw_transformers, bias_correction=false")
    cls, kwargs = ORTTrainer.get_optimizer_cls_and_kwargs(args)
    assert cls is FusedAdam
    assert kwargs == dict(lr=args.learning_rate, betas=(0.8, 0.999), eps=1e-7,
                          adam_w_mode=AdamWMode.ADAMW_TRANSFORMERS, bias_correction=False)
    # Any other optimizer is Trainer's business.
    plain = train_args(ORTTrainingArguments, tmp_path, optim="adamw_torch")
    assert ORTTrainer.get_optimizer_cls_and_kwargs(plain)[0] is torch.optim.AdamW
    with pytest.raises(ValueError, match="'momentum' is not an option of optim='adamw_ort_fused'"):
        ORTTrainer.get_optimizer_cls_and_kwargs(
            train_args(ORTTrainingArguments, tmp_path, optim="adamw_ort_fused", optim_args="momentum=0.9"))
    with pytest.raises(ValueError, match="unknown adam_w_mode 'adamw'; use one of adam_l2_regularization"):
        ORTTrainer.get_optimizer_cls_and_kwargs(
            train_args(ORTTrainingArguments, tmp_path, optim="adamw_ort_fused", optim_args="adam_w_mode=adamw"))


def test_fused_adam_in_trainer_matches_adamw_torch(tmp_path):
    # The optimizer ORTTrainer builds for adamw_ort_fused, given to a plain Trainer: same losses and weights
    # as Trainer's own adamw_torch, with Trainer's weight-decay groups and linear LR schedule.
    data = classification_dataset()
    common = dict(weight_decay=0.1, warmup_steps=2)
    fused_args = train_args(ORTTrainingArguments, tmp_path / "fused", optim="adamw_ort_fused", **common)
    fused = transformers.Trainer(model=bert_classifier(), args=fused_args, train_dataset=data,
                                 optimizer_cls_and_kwargs=ORTTrainer.get_optimizer_cls_and_kwargs(fused_args))
    fused.train()
    reference = transformers.Trainer(
        model=bert_classifier(), train_dataset=data,
        args=train_args(transformers.TrainingArguments, tmp_path / "ref", optim="adamw_torch", **common))
    reference.train()
    assert isinstance(fused.optimizer.optimizer, FusedAdam)  # accelerate wraps the optimizer
    assert [g["weight_decay"] for g in fused.optimizer.param_groups] == [0.1, 0.0]
    torch.testing.assert_close(losses(fused), losses(reference), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(fused.model.named_parameters(), reference.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_feature_is_checked_against_the_model():
    assert resolve_feature("sequence-classification", bert_classifier()).outputs == ("logits",)
    assert resolve_feature("text-generation", gpt2_lm()).name == "causal-lm"
    with pytest.raises(ValueError, match="feature='causal-lm' does not fit the model BertForSequenceClassification"):
        resolve_feature("causal-lm", bert_classifier())
    with pytest.raises(ValueError, match="unknown feature 'sentiment'; use one of default, sequence-classification"):
        resolve_feature("sentiment")
    assert resolve_feature("causal-lm", torch.nn.Linear(2, 2)).name == "causal-lm"  # custom models: no check
    assert resolve_feature(None, gpt2_lm()).name == "causal-lm"
    assert resolve_feature(None, torch.nn.Linear(2, 2)).name == "default"


def test_trainer_rejects_a_mismatched_feature(tmp_path):
    with pytest.raises(ValueError, match="does not fit the model GPT2LMHeadModel"):
        ORTTrainer(model=gpt2_lm(), args=train_args(ORTTrainingArguments, tmp_path),
                   feature="sequence-classification")
