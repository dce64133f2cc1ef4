"""Run by test_trainer.py under torchrun: train tiny BERT with ORTTrainer (or plain Trainer) on 2 processes.

Rank 0 writes the logged losses and a checksum of the weights to the JSON file given as the last argument;
every rank checks that DDP kept its weights identical to rank 0's.
"""

import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist
import transformers

from onnxtrain.hf import ORTTrainer, ORTTrainingArguments
from tests.hf.helpers import bert_classifier, classification_dataset, losses, train_args


def main(trainer_kind, output_json):
    ort = trainer_kind == "ort"
    trainer_cls, args_cls = (ORTTrainer, ORTTrainingArguments) if ort else (transformers.Trainer,
                                                                           transformers.TrainingArguments)
    args = train_args(args_cls, output_json + f".{trainer_kind}.out", per_device_train_batch_size=4, max_steps=6,
                      optim="adamw_ort_fused" if ort else "adamw_torch")
    trainer = trainer_cls(model=bert_classifier(), args=args, train_dataset=classification_dataset())
    trainer.train()
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), "DDP ranks ended with different weights"
    if dist.get_rank() == 0:
        wrapped = type(trainer.model_wrapped).__name__
        inner = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        result = {"losses": losses(trainer), "weights": flat.tolist(), "wrapped": wrapped,
                  "inner": type(inner).__name__, "fallback": getattr(inner, "fallback_reason", None),
                  "world_size": dist.get_world_size()}
        with open(output_json, "w") as f:
            json.dump(result, f)
    # Both ranks are done with collectives; then leave without tearing anything down. Left to the
    # interpreter, destroying DDP's and the process group's objects once aborted a rank ("terminate
    # called without an active exception") and once hung one, both after a successful run.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(240, exit=True)  # a hung collective prints every rank's stack and exits
    main(sys.argv[1], sys.argv[2])
