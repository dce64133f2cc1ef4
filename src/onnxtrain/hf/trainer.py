"""ORTTrainer: ``transformers.Trainer`` whose training and evaluation loops run the model through ORTModule.

How it plugs into Trainer (transformers 5.x):

- ``_wrap_model`` is where Trainer wraps its model for the loops (``model_wrapped``). ORTTrainer wraps the
  model in ``ORTModule`` there, before DataParallel/DDP (``accelerator.prepare_model``), so ``Trainer.model``
  stays the plain ``PreTrainedModel``: checkpoints, ``save_model`` and ``from_pretrained`` see the usual
  weights and names, and ORTModule reads and updates those same parameter tensors.
- ``get_optimizer_cls_and_kwargs`` adds ``optim="adamw_ort_fused"`` (``onnxtrain.optim.FusedAdam``); every
  other optimizer name goes to Trainer unchanged.
- With ``use_module_with_loss``, ``compute_loss`` itself is wrapped in a module and exported, so the loss
  (label smoothing and ``compute_loss_func`` included) is computed inside the ONNX graph.
- With ``deepspeed=`` (ZeRO stages 1-3), Trainer hands ``self.model`` to ``accelerator.prepare``, which calls
  ``deepspeed.initialize``; ORTTrainer's accelerator hands it the ORTModule instead, so the DeepSpeed engine
  wraps the ORTModule (``docs/distributed.md``) and ``Trainer.model`` stays the plain model.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import is_sagemaker_mp_enabled

from onnxtrain.hf.features import Feature, resolve_feature
from onnxtrain.hf.training_args import ORT_OPTIMIZERS, ORTTrainingArguments
from onnxtrain.optim import AdamWMode, FusedAdam

__all__ = ["ORTTrainer"]


class ORTTrainer(Trainer):
    """A ``transformers.Trainer`` that trains and evaluates the model with onnxtrain's ORTModule.

    Takes every argument ``Trainer`` takes, plus ``feature`` (see :mod:`onnxtrain.hf.features`): the task
    the model is trained for, e.g. ``"sequence-classification"`` or ``"causal-lm"``. It is checked against
    the model's class and chooses the outputs of :meth:`export_onnx`; left out, it is inferred from the
    model's class. ``args`` may be
    :class:`ORTTrainingArguments` (for ``optim="adamw_ort_fused"`` and the ONNX options) or plain
    ``TrainingArguments``.
    """

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None, *trainer_args,
                 feature: str | None = None, **trainer_kwargs):
        if args is None:
            args = ORTTrainingArguments(output_dir="trainer_output")
        self.feature: Feature = resolve_feature(feature, model)
        self._ort_modules: dict[str, nn.Module] = {}
        self._warned_unsupported = False
        super().__init__(model, args, *trainer_args, **trainer_kwargs)

    # ---- optimizer -------------------------------------------------------------------------------------

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: TrainingArguments, model: nn.Module | None = None) -> tuple[Any, Any]:
        """As ``Trainer.get_optimizer_cls_and_kwargs``, plus ``optim="adamw_ort_fused"``."""
        if getattr(args.optim, "value", args.optim) not in ORT_OPTIMIZERS:
            return Trainer.get_optimizer_cls_and_kwargs(args, model)
        kwargs = {
            "lr": args.learning_rate,
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
            "adam_w_mode": AdamWMode.ADAMW_TORCH,
        }
        for key, value in _parse_optim_args(args.optim_args).items():
            if key == "adam_w_mode":
                try:
                    kwargs["adam_w_mode"] = AdamWMode[value.upper()]
                except KeyError:
                    modes = ", ".join(m.name.lower() for m in AdamWMode)
                    raise ValueError(f"optim_args: unknown adam_w_mode {value!r}; use one of {modes}.") from None
            elif key == "bias_correction":
                if value.lower() not in ("true", "false"):
                    raise ValueError(f"optim_args: bias_correction must be true or false, got {value!r}.")
                kwargs["bias_correction"] = value.lower() == "true"
            else:
                raise ValueError(
                    f"optim_args: {key!r} is not an option of optim='adamw_ort_fused'; it takes adam_w_mode "
                    "and bias_correction (learning rate, betas, epsilon and weight decay come from the "
                    "TrainingArguments fields)."
                )
        return FusedAdam, kwargs

    # ---- running the model through ORTModule -----------------------------------------------------------

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        if self._runs_in_ort(model):
            return model  # a later train()/evaluate() call: already wrapped
        if model is not self.model or self.is_deepspeed_enabled:  # DeepSpeed: see create_accelerator_and_postprocess
            return super()._wrap_model(model, training, dataloader)
        unsupported = self._unsupported_wrapper()
        if unsupported is not None:
            if not self._warned_unsupported:
                warnings.warn(f"ORTTrainer: {unsupported} wraps the model itself; the model runs in PyTorch, "
                              "not ORTModule. Turn it off to train in onnxruntime.", UserWarning, stacklevel=2)
                self._warned_unsupported = True
            return super()._wrap_model(model, training, dataloader)
        ort_module = self._ort_module("loss" if training and self._arg("use_module_with_loss") else "model")
        wrapped = super()._wrap_model(ort_module, training, dataloader)
        if training and wrapped is ort_module:
            # Trainer lets accelerate place the model and wrap it in DDP when it is unwrapped; it skips
            # that for a wrapped model, so do it here for the ORTModule.
            wrapped = self.accelerator.prepare_model(ort_module)
        return wrapped

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Trainer's, plus ``use_cache=False`` where the model runs in ORTModule and its forward takes it: the
        loops never read a key/value cache (Trainer drops it from evaluation outputs), and one ORTModule cannot
        carry (T5's ``EncoderDecoderCache``, returned with Trainer's ``use_cache=False`` too) made the model fall
        back to PyTorch. The loss and the outputs the loops read are the same either way."""
        inputs = super()._prepare_inputs(inputs)
        if self._ort_modules and "use_cache" not in inputs and _returns_cache(self.model):
            inputs = {**inputs, "use_cache": False}
        return inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss_module = self._ort_modules.get("loss")
        if loss_module is not None and self.accelerator.unwrap_model(model) is loss_module:
            if return_outputs:
                raise ValueError(
                    "ORTTrainer: use_module_with_loss=True computes only the loss inside the graph, but the "
                    "outputs were asked for; set use_module_with_loss=False to get the model outputs."
                )
            if num_items_in_batch is None:
                return model(**inputs)
            return model(**inputs, num_items_in_batch=num_items_in_batch)
        smoother = self.label_smoother
        if smoother is None or not self._runs_in_ort(model):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        # Trainer decides whether label smoothing shifts the labels from the unwrapped model's class name,
        # which is "ORTModule" here; decide from the transformers model instead.
        self.label_smoother = _LabelSmootherFor(smoother, self.model)
        try:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        finally:
            self.label_smoother = smoother

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled:
            if self._arg("use_module_with_loss"):
                raise ValueError("ORTTrainer: use_module_with_loss=True is not supported with DeepSpeed yet; set it "
                                 "to False (the model runs in ORTModule inside DeepSpeed, the loss in PyTorch).")
            self.accelerator.prepare = _PrepareORTModule(self, self.accelerator.prepare)

    def _unsupported_wrapper(self) -> str | None:
        if self.is_fsdp_enabled or self.is_fsdp_xla_enabled:
            return "FSDP"
        if is_sagemaker_mp_enabled():
            return "SageMaker model parallel"
        return None

    def _runs_in_ort(self, model: nn.Module) -> bool:
        inner = self.accelerator.unwrap_model(model)
        return any(inner is m for m in self._ort_modules.values())

    def _ort_module(self, kind: str) -> nn.Module:
        """The ORTModule around ``self.model`` ("model") or around its loss ("loss"), made once per model."""
        ort_module = self._ort_modules.get(kind)
        target = None if ort_module is None else ort_module.module
        if kind == "loss" and target is not None:
            target = target.model
        if target is not self.model:
            ORTModule, debug_options = _ortmodule_api(self.args, type(self.model).__name__, kind)
            inner = self.model if kind == "model" else _ModuleWithLoss(self.model, super().compute_loss)
            ort_module = ORTModule(inner, debug_options=debug_options)
            self._ort_modules[kind] = ort_module
        return ort_module

    def _arg(self, name: str):
        """An ORTTrainingArguments field, with its default when ``args`` is a plain TrainingArguments."""
        return getattr(self.args, name, ORTTrainingArguments.__dataclass_fields__[name].default)

    # ---- inference export ------------------------------------------------------------------------------

    def export_onnx(self, path: str | os.PathLike, inputs: dict[str, torch.Tensor] | None = None,
                    check: bool = True, atol: float = 1e-4) -> str:
        """Write an ONNX inference model of the current (trained) weights to ``path``; return the path.

        The model takes the inputs of a batch of the eval (or else train) dataset, minus ``labels``, with
        dynamic batch and sequence axes, and returns the outputs of ``feature`` (``logits`` for the
        classification and language-model features, ``last_hidden_state`` for ``"default"``). Pass
        ``inputs`` (a dict of tensors) to choose the inputs yourself. With ``check``, onnxruntime runs the
        exported model on those inputs and the outputs must match the PyTorch model within ``atol``.
        """
        import onnxruntime as ort

        path = os.fspath(path)
        model = self.accelerator.unwrap_model(self.model)
        if inputs is None:
            inputs = self._sample_inference_inputs()
        inputs = {k: v.to(self.args.device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        inputs.pop("labels", None)
        if not inputs:
            raise ValueError("ORTTrainer.export_onnx: no tensor inputs to export with; pass inputs={name: tensor}.")
        wrapper = _InferenceModel(model, self.feature.outputs, tuple(inputs))
        was_training = model.training
        wrapper.eval()
        try:
            with torch.no_grad():
                expected = wrapper(*inputs.values())
            if self.args.should_save:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                # Batch and sequence axes are dynamic; forward(*tensors) takes them as one varargs tuple.
                dynamic = (tuple({i: torch.export.Dim.DYNAMIC for i in range(min(t.dim(), 2))}
                                 for t in inputs.values()),)
                torch.onnx.export(wrapper, tuple(inputs.values()), path, input_names=list(inputs),
                                  output_names=list(self.feature.outputs), dynamic_shapes=dynamic, dynamo=True,
                                  external_data=False, verbose=False)
        finally:
            model.train(was_training)
        if check and self.args.should_save:
            session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            feeds = {i.name: inputs[i.name].cpu().numpy() for i in session.get_inputs()}
            for name, got, want in zip(self.feature.outputs, session.run(None, feeds), expected):
                diff = float(abs(torch.from_numpy(got) - want.cpu()).max())
                if diff > atol:
                    raise RuntimeError(
                        f"ORTTrainer.export_onnx: onnxruntime output {name!r} of {path} differs from the "
                        f"PyTorch model by {diff:.3g} (> atol={atol}); the export is not faithful. Report this "
                        "with the model class, or pass check=False to keep the file anyway."
                    )
        return path

    def _sample_inference_inputs(self) -> dict[str, torch.Tensor]:
        if self.eval_dataset is not None and not isinstance(self.eval_dataset, dict):
            loader = self.get_eval_dataloader()
        elif self.train_dataset is not None:
            loader = self.get_train_dataloader()
        else:
            raise ValueError("ORTTrainer.export_onnx: no dataset to take example inputs from; pass inputs=.")
        return dict(next(iter(loader)))


class _PrepareORTModule:
    """``accelerator.prepare`` that gives DeepSpeed the ORTModule around ``trainer.model``: Trainer passes
    ``self.model`` (the plain model) to it when DeepSpeed is on, and deepspeed.initialize wraps what it gets."""

    def __init__(self, trainer: ORTTrainer, prepare):
        self.trainer, self.prepare = trainer, prepare

    def __call__(self, *args, **kwargs):
        model = self.trainer.model
        return self.prepare(*(self.trainer._ort_module("model") if a is model else a for a in args), **kwargs)


class _ModuleWithLoss(nn.Module):
    """``model`` plus Trainer's loss computation, so that ORTModule exports the loss into the graph."""

    def __init__(self, model: nn.Module, compute_loss):
        super().__init__()
        self.model = model
        self._compute_loss = compute_loss  # a bound Trainer method: not a submodule, holds no parameters

    def forward(self, num_items_in_batch=None, **inputs):
        return self._compute_loss(self.model, inputs, num_items_in_batch=num_items_in_batch)


class _LabelSmootherFor:
    """Trainer's label smoother, shifting the labels as Trainer would for ``model`` (causal LMs)."""

    def __init__(self, smoother, model: nn.Module):
        self.smoother = smoother
        self.shift = model._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()

    def __call__(self, model_output, labels, shift_labels=False, num_items_in_batch=None):
        return self.smoother(model_output, labels, shift_labels=self.shift, num_items_in_batch=num_items_in_batch)


class _InferenceModel(nn.Module):
    """Positional tensors in, the feature's outputs out: the signature of the exported inference model."""

    def __init__(self, model: nn.Module, outputs: tuple[str, ...], input_names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.outputs = outputs
        self.input_names = input_names

    def forward(self, *tensors):
        kwargs = dict(zip(self.input_names, tensors))
        if getattr(getattr(self.model, "config", None), "use_cache", False):
            kwargs["use_cache"] = False  # no past key/values in the exported graph
        result = self.model(**kwargs, return_dict=True)
        missing = [name for name in self.outputs if name not in result]
        if missing:
            raise ValueError(
                f"ORTTrainer.export_onnx: {type(self.model).__name__} returned {list(result.keys())}, without "
                f"{missing}; pass the feature= that matches the model."
            )
        return tuple(result[name] for name in self.outputs)


def _returns_cache(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``use_cache``. Its config is no guide: Trainer sets ``config.use_cache``
    to ``TrainingArguments.use_cache`` (False), but T5's encoder and decoder read copies of the config, and return
    a cache still."""
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read: leave the call as the user's
        return False


def _parse_optim_args(optim_args: str | None) -> dict[str, str]:
    if not optim_args:
        return {}
    pairs = {}
    for item in optim_args.replace(" ", "").split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"optim_args: expected key=value pairs separated by commas, got {optim_args!r}.")
        pairs[key] = value
    return pairs


def _ortmodule_api(args: TrainingArguments, model_name: str, kind: str):
    """ORTModule and the DebugOptions built from the arguments; a clear error when ORTModule is missing."""
    try:
        from onnxtrain import DebugOptions, LogLevel, ORTModule
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"ORTTrainer needs onnxtrain.ORTModule, which could not be imported ({error}); check the onnxtrain "
            "installation (pip install 'onnxtrain[hf]')."
        ) from error
    level = getattr(args, "onnx_log_level", "WARNING")
    if level not in LogLevel.__members__:
        raise ValueError(f"ORTTrainer: onnx_log_level={level!r} is not one of {', '.join(LogLevel.__members__)}.")
    save_onnx = bool(getattr(args, "save_onnx", False))
    prefix = getattr(args, "onnx_prefix", None) or model_name
    debug_options = DebugOptions(
        log_level=LogLevel[level],
        save_onnx=save_onnx,
        onnx_prefix=f"{prefix}_with_loss" if kind == "loss" else prefix,
        save_path=args.output_dir if save_onnx else "",
    )
    return ORTModule, debug_options
