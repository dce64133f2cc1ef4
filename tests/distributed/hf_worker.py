"""Run by test_distributed.py under torchrun: tiny BERT, 5 steps of ORTTrainer or Trainer with DeepSpeed.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.distributed.hf_worker \
        STAGE KIND OUT.json

KIND is "ort" (ORTTrainer, ORTTrainingArguments) or "eager" (transformers.Trainer). Rank 0 writes the logged
losses, the full parameters after training, what wraps the model and ORTModule's fallback reason, if any.
"""

import faulthandler
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

from onnxtrain.hf import ORTTrainer, ORTTrainingArguments  # noqa: E402
from tests.distributed.worker import finish  # noqa: E402
from tests.hf.helpers import bert_classifier, classification_dataset, losses, train_args  # noqa: E402


def main(stage, kind, output_json):
    torch.set_num_threads(1)
    ort = kind == "ort"
    trainer_cls, args_cls = (ORTTrainer, ORTTrainingArguments) if ort else (transformers.Trainer,
                                                                           transformers.TrainingArguments)
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": int(stage)},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    args = train_args(args_cls, output_json + ".out", per_device_train_batch_size=4, max_steps=5,
                      optim="adamw_torch", deepspeed=config)
    trainer = trainer_cls(model=bert_classifier(), args=args, train_dataset=classification_dataset())
    trainer.train()
    params = list(trainer.model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=int(stage) == 3):
        flat = torch.cat([p.detach().flatten().clone() for p in params])
    inner = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    finish(output_json, lambda: {"losses": losses(trainer), "weights": flat.tolist(),
                                 "wrapped": type(trainer.model_wrapped).__name__, "module": type(inner).__name__,
                                 "fallback": getattr(inner, "fallback_reason", None)})


if __name__ == "__main__":
    faulthandler.dump_traceback_later(240, exit=True)
    main(*sys.argv[1:4])
