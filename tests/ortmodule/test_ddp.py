"""DistributedDataParallel(ORTModule(model)) on 2 CPU processes (gloo) equals one process on the whole batch."""

from __future__ import annotations

import copy
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onnxtrain import ORTModule
from tests.ortmodule import models

STEPS = 5
WORLD = 2


def _batches():
    generator = torch.Generator().manual_seed(3)
    return [models.mlp_batch(8, generator=generator) for _ in range(STEPS)]


def _initial_model():
    torch.manual_seed(0)
    return models.MLP()


def _worker(rank: int, port: int, out_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ONNXTRAIN_FALLBACK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = torch.nn.parallel.DistributedDataParallel(ORTModule(_initial_model()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for batch in _batches():
            shard = {k: v.chunk(WORLD)[rank] for k, v in batch.items()}
            optimizer.zero_grad()
            loss, _ = model(**shard)
            loss.backward()
            optimizer.step()
        if rank == 0:
            torch.save(model.module.state_dict(), out_path)
    finally:
        dist.destroy_process_group()
    # Done and saved: leave without the interpreter's teardown, which once aborted a worker after a
    # successful run ("terminate called without an active exception"; see tests/hf/ddp_train.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_match_single_process(tmp_path):
    out_path = str(tmp_path / "rank0.pt")
    mp.spawn(_worker, args=(_free_port(), out_path), nprocs=WORLD, join=True)
    distributed = torch.load(out_path)

    reference = copy.deepcopy(_initial_model())
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in _batches():
        optimizer.zero_grad()
        loss, _ = reference(**batch)
        loss.backward()
        optimizer.step()
    expected = reference.state_dict()
    assert distributed.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(distributed[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)
