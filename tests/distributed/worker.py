"""Run by the two-process tests under torchrun: train tiny BERT 5 steps under a distributed wrapper.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.distributed.worker \
        WRAPPER KIND OUT.json

WRAPPER is zero1, zero2, zero3 (``deepspeed.initialize``), fsdp2 (``fully_shard`` on the whole model) or
fsdp2_layers (``fully_shard`` on each encoder layer, then on the whole model); KIND is "eager" or "ort" (the
same model in ORTModule, inside the wrapper; "ort_fallback": the same, with DeepSpeed's ZeRO-3 Linear Function
undeclared, so that the ORTModule falls back to PyTorch inside ZeRO-3). Each rank trains on its own batches; rank 0 writes the losses
(of rank 0's batches), the full parameters after the last step, and ORTModule's fallback reason, if any.
Under ZeRO-3, the ORTModule is also called once past DeepSpeed's hooks, on its partitions: the error it
raises (instead of feeding them to onnxruntime) is written as "unhooked".
"""

import faulthandler
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.hf.helpers import VOCAB, bert_classifier  # noqa: E402

STEPS, BATCH, SEQ, LR = 5, 4, 16, 1e-3


def batches(rank: int):
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
        mask = (torch.arange(SEQ) < torch.randint(8, SEQ + 1, (BATCH, 1), generator=generator)).long()
        yield {"input_ids": ids * mask, "attention_mask": mask,
               "labels": (ids[:, 0] >= VOCAB // 2).long()}


def deepspeed_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told otherwise
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # a torch optimizer, not DeepSpeed's JIT-built ones
        "steps_per_print": 10**9,
    }


def model_for(kind: str) -> torch.nn.Module:
    model = bert_classifier()
    if kind.startswith("ort"):
        from onnxtrain import ORTModule

        if kind == "ort_fallback":
            from onnxtrain.capture import custom_backward

            custom_backward.FORWARD_GRADIENT.discard("deepspeed.runtime.zero.linear.LinearFunctionForZeroStage3")

        model = ORTModule(model)
    return model


def run_deepspeed(stage: int, kind: str):
    import deepspeed

    model = model_for(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(stage))
    unhooked = None
    if stage == 3 and kind.startswith("ort"):
        try:
            type(model).forward(model, **next(batches(dist.get_rank())))  # not model(...): no DeepSpeed hooks
        except RuntimeError as error:
            unhooked = str(error)
    losses = []
    for batch in batches(dist.get_rank()):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        flat = torch.cat([p.detach().flatten().clone() for p in params])
    return losses, flat, engine.module, unhooked


def run_fsdp2(kind: str, layers: bool):
    from torch.distributed.fsdp import fully_shard

    model = model_for(kind)
    if layers:
        bert = model.module if kind == "ort" else model
        for layer in bert.bert.encoder.layer:
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches(dist.get_rank()):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    flat = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
    return losses, flat, model, None


def main(wrapper: str, kind: str, output_json: str):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if wrapper.startswith("zero"):
        losses, flat, module, unhooked = run_deepspeed(int(wrapper[-1]), kind)
    else:
        losses, flat, module, unhooked = run_fsdp2(kind, layers=wrapper == "fsdp2_layers")
    finish(output_json, lambda: {"losses": losses, "weights": flat.tolist(), "module": type(module).__name__,
                                 "fallback": getattr(module, "fallback_reason", None), "unhooked": unhooked})


def finish(output_json: str, record) -> None:
    """Rank 0 writes ``record()`` (plus the world size) to OUTPUT_JSON; every rank then waits and exits at once."""
    if dist.get_rank() == 0:
        with open(output_json, "w") as f:
            json.dump({**record(), "world_size": dist.get_world_size()}, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see tests/hf/ddp_train.py: tearing down the process group at exit has hung a rank


if __name__ == "__main__":
    faulthandler.dump_traceback_later(240, exit=True)
    main(*sys.argv[1:4])
