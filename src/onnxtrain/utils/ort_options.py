"""onnxruntime session settings for training, shared by ORTModule and the on-device runtime (no torch).

Training alternates between sessions (forward and backward graphs; training and optimizer graphs).

Threads: onnxruntime's idle worker threads spin by default, waiting for the next run of their own
session; while another session runs, they take cores from it (and from torch's ops in between). On
these 2-core machines, on-device BERT-small steps took 157-159 ms with spinning and 110-133 ms without.

Memory: each onnxruntime session otherwise grows a CPU arena of its own and never gives it back: memory that
the forward graph freed could not serve the backward graph (or the optimizer graph), and vice versa.
And a memory pattern (one block per run for all intermediate values, recorded on the first run and
allocated from the second on) leaves the first run's chunks idle beside it. Measured here: GPT-2-small
under ORTModule, steady RSS 2.09 -> 1.48 GB; on-device BERT-small, peak RSS 509 -> 393 MB; neither slower.

``ONNXTRAIN_CPU_ARENA=0`` turns the arena off: onnxruntime then allocates each buffer from the C heap, as
torch does on the CPU, and memory a step frees can go back to the system (with glibc, for buffers above its
mmap threshold). ``benchmarks/memory_bench.py`` measures activation memory so (docs/memory.md).
"""

from __future__ import annotations

import functools
import logging
import os

import onnxruntime as ort

logger = logging.getLogger("onnxtrain.runtime")


@functools.cache
def shared_cpu_arena() -> bool:
    """Register, once per process, one onnxruntime CPU arena for every session that opts in.

    Returns whether an environment allocator is in place (ours, or one registered before us); False only
    if onnxruntime refused it, and then each session keeps its own arena.
    """
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    try:
        ort.create_and_register_allocator(info, ort.OrtArenaCfg({}))
        return True
    except Exception as exc:  # noqa: BLE001 - already registered by someone else is fine, all else: own arenas
        if "already" in str(exc).lower():
            return True
        logger.warning("onnxruntime refused a shared CPU arena (%s); each session keeps its own", exc)
        return False


ARENA_ENV = "ONNXTRAIN_CPU_ARENA"


def use_shared_arena(options: ort.SessionOptions) -> ort.SessionOptions:
    """Make ``options`` take CPU memory from the shared arena, without memory patterns (no arena at all
    where ``ONNXTRAIN_CPU_ARENA=0``)."""
    options.enable_mem_pattern = False
    arena = os.environ.get(ARENA_ENV, "1").strip()
    if arena not in ("0", "1"):
        raise ValueError(f"{ARENA_ENV}={arena!r}: use 1 (one shared CPU arena, the default) or 0 (no arena)")
    if arena == "0":
        options.enable_cpu_mem_arena = False
        return options
    if shared_cpu_arena():
        options.add_session_config_entry("session.use_env_allocators", "1")
    return options


def no_spinning(options: ort.SessionOptions) -> ort.SessionOptions:
    """Idle worker threads sleep instead of spinning."""
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def for_training(options: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """``options`` (or new ones) set up for sessions that take turns: shared arena, no spinning."""
    return no_spinning(use_shared_arena(options if options is not None else ort.SessionOptions()))
