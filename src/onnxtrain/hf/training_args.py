"""ORTTrainingArguments: ``transformers.TrainingArguments`` plus the onnxtrain options."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

__all__ = ["ONNX_LOG_LEVELS", "ORT_OPTIMIZERS", "ORTTrainingArguments"]

#: Optimizer names that ORTTrainer adds to ``transformers.training_args.OptimizerNames``.
ORT_OPTIMIZERS = ("adamw_ort_fused",)

#: Accepted values of ``onnx_log_level`` (ONNX Runtime's severities, most verbose first).
ONNX_LOG_LEVELS = ("VERBOSE", "INFO", "WARNING", "ERROR", "FATAL")


@dataclass
class ORTTrainingArguments(TrainingArguments):
    """``TrainingArguments`` for :class:`onnxtrain.hf.ORTTrainer`.

    Everything ``TrainingArguments`` accepts is accepted and means the same. In addition:

    - ``optim="adamw_ort_fused"`` selects :class:`onnxtrain.optim.FusedAdam` (AdamW with a multi-tensor
      update). Its weight decay mode defaults to ``adamw_torch`` (the same math as ``optim="adamw_torch"``);
      ``optim_args="adam_w_mode=adamw_transformers"`` or ``"adam_w_mode=adam_l2_regularization"`` selects the
      other modes of ONNX Runtime Training's FusedAdam.
    - ``use_module_with_loss``, ``save_onnx``, ``onnx_prefix``, ``onnx_log_level``: see the field help.
    """

    use_module_with_loss: bool = field(
        default=False,
        metadata={
            "help": "Compute the training loss inside the ONNX graph: Trainer.compute_loss (including label "
            "smoothing and compute_loss_func) is exported with the model, so only the scalar loss leaves "
            "onnxruntime during training."
        },
    )
    save_onnx: bool = field(
        default=False,
        metadata={"help": "Save the ONNX training graphs that ORTModule builds, under output_dir."},
    )
    onnx_prefix: str | None = field(
        default=None,
        metadata={"help": "File name prefix of the saved ONNX graphs (needs save_onnx); defaults to the model class."},
    )
    onnx_log_level: str = field(
        default="WARNING",
        metadata={"help": f"Log level of ORTModule and onnxruntime, one of {', '.join(ONNX_LOG_LEVELS)}."},
    )

    def __post_init__(self):
        ort_optim = _ort_optimizer_name(self.optim)
        if ort_optim is not None:
            # TrainingArguments validates `optim` against its enum; validate the rest with a stand-in name
            # and then put ours back, so nothing outside this class changes.
            self.optim = OptimizerNames.ADAMW_TORCH
        super().__post_init__()
        if ort_optim is not None:
            self.optim = ort_optim
        level = str(self.onnx_log_level).upper()
        if level not in ONNX_LOG_LEVELS:
            raise ValueError(
                f"ORTTrainingArguments: onnx_log_level={self.onnx_log_level!r} is not a log level; "
                f"use one of {', '.join(ONNX_LOG_LEVELS)}."
            )
        self.onnx_log_level = level
        if self.onnx_prefix and not self.save_onnx:
            raise ValueError(
                "ORTTrainingArguments: onnx_prefix is set but save_onnx is False; pass save_onnx=True to save "
                "the training graphs, or drop onnx_prefix."
            )

    def set_optimizer(self, name: str = "adamw_torch", *args, **kwargs):
        """As ``TrainingArguments.set_optimizer``, also accepting ``"adamw_ort_fused"``."""
        ort_optim = _ort_optimizer_name(name)
        result = super().set_optimizer("adamw_torch" if ort_optim else name, *args, **kwargs)
        if ort_optim is not None:
            self.optim = ort_optim
        return result


def _ort_optimizer_name(name) -> str | None:
    value = getattr(name, "value", name)
    return value if isinstance(value, str) and value in ORT_OPTIMIZERS else None
