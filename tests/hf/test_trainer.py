"""ORTTrainer end to end on tiny random-weight BERT, GPT-2, Llama and T5, against plain transformers.Trainer."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import onnxruntime
import pytest
import torch
import transformers

from onnxtrain.hf import ORTTrainer, ORTTrainingArguments
from tests.hf.helpers import (
    accuracy,
    bert_classifier,
    classification_dataset,
    gpt2_lm,
    llama_lm,
    lm_dataset,
    losses,
    run_in_ort,
    t5_seq2seq,
    train_args,
)


def _reference_losses(model, dataset, tmp_path, **overrides):
    """Plain transformers.Trainer with torch AdamW on the same model, data and arguments."""
    overrides.setdefault("optim", "adamw_torch")
    trainer = transformers.Trainer(model=model, train_dataset=dataset,
                                   args=train_args(transformers.TrainingArguments, tmp_path / "reference", **overrides))
    trainer.train()
    return losses(trainer)


def _assert_runs_in_ortmodule(trainer):
    from onnxtrain import ORTModule

    inner = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    assert isinstance(inner, ORTModule), f"the training loop ran {type(inner).__name__}, not ORTModule"
    assert inner.fallback_reason is None and inner.export_count > 0
    assert not isinstance(trainer.model, ORTModule)  # Trainer.model stays the plain transformers model


def _assert_same_weights(a, b, atol=1e-5):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def _check_train_eval_save_resume(tmp_path, what, make_model, dataset, feature, compute_metrics,
                                  preprocess_logits_for_metrics=None, metric="eval_accuracy", full=True):
    args = dict(optim="adamw_ort_fused", weight_decay=0.01, eval_strategy="steps", eval_steps=5,
                save_strategy="steps", save_steps=5)
    eval_dataset = dataset.select(range(16))

    def make_trainer(output_dir, model):
        return ORTTrainer(model=model, args=train_args(ORTTrainingArguments, output_dir, **args),
                          train_dataset=dataset, eval_dataset=eval_dataset, feature=feature,
                          compute_metrics=compute_metrics,
                          preprocess_logits_for_metrics=preprocess_logits_for_metrics)

    trainer = make_trainer(tmp_path / "ort", make_model())
    run_in_ort(what, trainer.train)
    _assert_runs_in_ortmodule(trainer)

    # The loss falls, and the first steps match plain Trainer (torch AdamW, dropout off).
    ort_losses = losses(trainer)
    assert len(ort_losses) == 10
    assert np.mean(ort_losses[-3:]) < ort_losses[0], ort_losses
    reference = _reference_losses(make_model(), dataset, tmp_path, weight_decay=0.01)
    np.testing.assert_allclose(ort_losses[:5], reference[:5], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(ort_losses, reference, atol=2e-3, rtol=2e-3)

    # Evaluation through ORTModule gives plain Trainer's loss and metric on the trained weights.
    metrics = run_in_ort(what, trainer.evaluate)
    plain_eval = transformers.Trainer(
        model=trainer.model, args=train_args(transformers.TrainingArguments, tmp_path / "plain_eval"),
        eval_dataset=eval_dataset, compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics).evaluate()
    assert metrics[metric] == pytest.approx(plain_eval[metric], abs=1e-6)
    assert metrics["eval_loss"] == pytest.approx(plain_eval["eval_loss"], abs=1e-4)
    assert [e for e in trainer.state.log_history if metric in e], "no evaluation was logged during training"
    if not full:
        return trainer

    # save_model writes a plain transformers model that from_pretrained loads.
    trainer.save_model(tmp_path / "saved")
    reloaded = type(trainer.model).from_pretrained(tmp_path / "saved")
    _assert_same_weights(reloaded, trainer.model, atol=0)

    # Resuming from the step-5 checkpoint ends on the same weights as the uninterrupted run.
    checkpoint = tmp_path / "ort" / "checkpoint-5"
    assert (checkpoint / "optimizer.pt").is_file()
    resumed = make_trainer(tmp_path / "resumed", make_model(seed=123))
    run_in_ort(what, resumed.train, resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 10
    np.testing.assert_allclose(losses(resumed)[-5:], ort_losses[-5:], atol=1e-4, rtol=1e-4)
    _assert_same_weights(resumed.model, trainer.model, atol=1e-4)
    return trainer


def test_bert_train_and_evaluate_match_plain_trainer(tmp_path):
    _check_train_eval_save_resume(tmp_path, "BERT", bert_classifier, classification_dataset(),
                                  "sequence-classification", accuracy, full=False)


def test_bert_sequence_classification(tmp_path):
    dataset = classification_dataset()
    trainer = _check_train_eval_save_resume(tmp_path, "BERT", bert_classifier, dataset,
                                            "sequence-classification", accuracy)

    # The exported inference model reproduces the trained model's logits in onnxruntime.
    path = trainer.export_onnx(tmp_path / "bert.onnx")
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    batch = dataset.select(range(3))[:]  # a batch size not seen at export: the batch axis is dynamic
    feeds = {name: np.asarray(batch[name], dtype=np.int64) for name in ("input_ids", "attention_mask")}
    assert sorted(i.name for i in session.get_inputs()) == sorted(feeds)
    (logits,) = session.run(["logits"], feeds)
    with torch.no_grad():
        trainer.model.eval()
        expected = trainer.model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits
    np.testing.assert_allclose(logits, expected.numpy(), atol=1e-4)


def _next_token_accuracy(eval_prediction):
    predictions, labels = eval_prediction.predictions, eval_prediction.label_ids
    return {"accuracy": float((predictions[:, :-1] == labels[:, 1:]).mean())}


def _argmax_logits(logits, labels):
    return logits.argmax(-1)


def test_gpt2_causal_lm(tmp_path):
    _check_train_eval_save_resume(tmp_path, "GPT-2", gpt2_lm, lm_dataset(), "causal-lm", _next_token_accuracy,
                                  preprocess_logits_for_metrics=_argmax_logits)


def test_llama_with_its_default_cache_trains_and_evaluates_like_plain_trainer(tmp_path):
    _check_train_eval_save_resume(tmp_path, "Llama", llama_lm, lm_dataset(), "causal-lm", _next_token_accuracy,
                                  preprocess_logits_for_metrics=_argmax_logits, full=False)


def test_t5_with_its_default_cache_trains_and_evaluates_like_plain_trainer(tmp_path):
    """T5 returns an EncoderDecoderCache with use_cache on (its default), which ORTModule cannot carry: ORTTrainer
    turns the cache off in the loops' calls, so the model trains and evaluates in ORTModule (it fell back)."""
    assert t5_seq2seq().config.use_cache
    dataset = lm_dataset()
    trainer = ORTTrainer(model=t5_seq2seq(), train_dataset=dataset, eval_dataset=dataset.select(range(16)),
                         args=train_args(ORTTrainingArguments, tmp_path / "ort", optim="adamw_torch"))
    run_in_ort("T5", trainer.train)
    _assert_runs_in_ortmodule(trainer)
    ort_losses = losses(trainer)
    assert len(ort_losses) == 10 and np.mean(ort_losses[-3:]) < ort_losses[0], ort_losses
    np.testing.assert_allclose(ort_losses, _reference_losses(t5_seq2seq(), dataset, tmp_path), atol=2e-3, rtol=2e-3)
    metrics = run_in_ort("T5", trainer.evaluate)
    plain = transformers.Trainer(model=trainer.model, eval_dataset=dataset.select(range(16)),
                                 args=train_args(transformers.TrainingArguments, tmp_path / "plain_eval")).evaluate()
    assert metrics["eval_loss"] == pytest.approx(plain["eval_loss"], abs=1e-4)


def test_loss_in_graph_with_gradient_accumulation_and_label_smoothing(tmp_path):
    dataset = classification_dataset()
    args = dict(gradient_accumulation_steps=2, label_smoothing_factor=0.1, max_steps=4)
    trainer = ORTTrainer(
        model=bert_classifier(), train_dataset=dataset, feature="sequence-classification",
        args=train_args(ORTTrainingArguments, tmp_path / "ort", use_module_with_loss=True, save_onnx=True,
                        onnx_prefix="tiny_bert", **args))
    run_in_ort("BERT with the loss in the graph", trainer.train)
    _assert_runs_in_ortmodule(trainer)
    reference = _reference_losses(bert_classifier(), dataset, tmp_path, **args)
    np.testing.assert_allclose(losses(trainer), reference, atol=1e-4, rtol=1e-4)
    saved = [f for f in os.listdir(tmp_path / "ort") if f.startswith("tiny_bert") and f.endswith(".onnx")]
    assert saved, f"save_onnx wrote no tiny_bert*.onnx in {os.listdir(tmp_path / 'ort')}"


def test_early_stopping_callback(tmp_path):
    # No evaluation can improve on the first by the threshold, so both trainers stop after patience + 1 evals.
    def make(cls, args_cls, output_dir):
        return cls(model=bert_classifier(), train_dataset=classification_dataset(),
                   eval_dataset=classification_dataset(n=8, seed=1),
                   args=train_args(args_cls, output_dir, eval_strategy="steps", eval_steps=1,
                                   save_strategy="steps", save_steps=1, metric_for_best_model="eval_loss",
                                   load_best_model_at_end=True, save_total_limit=2),
                   callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=2,
                                                                 early_stopping_threshold=10.0)])

    trainer = make(ORTTrainer, ORTTrainingArguments, tmp_path / "ort")
    run_in_ort("BERT", trainer.train)
    _assert_runs_in_ortmodule(trainer)
    reference = make(transformers.Trainer, transformers.TrainingArguments, tmp_path / "reference")
    reference.train()
    assert trainer.state.global_step == reference.state.global_step == 3
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    _assert_same_weights(trainer.model, reference.model, atol=1e-4)  # the best (step-1) weights were reloaded


def _torchrun(script_args):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "tests.hf.ddp_train", *script_args]
    # A session of its own, so that a timeout kills torchrun's workers too.
    process = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    assert process.returncode == 0, f"torchrun failed ({process.returncode}):\n{output[-8000:]}"


def test_torchrun_data_parallel_matches_plain_trainer(tmp_path):
    _torchrun(["ort", str(tmp_path / "ort.json")])
    _torchrun(["plain", str(tmp_path / "plain.json")])
    ort, plain = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("ort", "plain"))
    assert not ort["fallback"], f"ORTModule falls back on BERT under DDP: {ort['fallback']}"
    assert ort["world_size"] == 2
    assert ort["wrapped"] == "DistributedDataParallel" and ort["inner"] == "ORTModule"
    np.testing.assert_allclose(ort["losses"], plain["losses"], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(ort["weights"], plain["weights"], atol=1e-4)


def test_gpt2_label_smoothing_shifts_labels_like_trainer(tmp_path):
    # Trainer shifts the labels of causal LMs before label smoothing; the model it sees here is an ORTModule.
    dataset = lm_dataset()
    args = dict(label_smoothing_factor=0.1, max_steps=3)
    trainer = ORTTrainer(model=gpt2_lm(), train_dataset=dataset,
                         args=train_args(ORTTrainingArguments, tmp_path / "ort", **args))
    run_in_ort("GPT-2", trainer.train)
    _assert_runs_in_ortmodule(trainer)
    reference = _reference_losses(gpt2_lm(), dataset, tmp_path, **args)
    assert losses(trainer)[0] == pytest.approx(reference[0], abs=1e-5)  # before any update
    np.testing.assert_allclose(losses(trainer), reference, atol=1e-4, rtol=1e-4)
