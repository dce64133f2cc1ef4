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

``ONNXTRAIN_CPU_ARENA`` (read when the shared arena is made): ``1`` (the default: one shared arena, which
keeps its high-water mark), ``release`` (the arena grows by what each request needs, kSameAsRequested, so
that whole regions come free, and ORTModule's training step starts and ends by handing its free regions
back to the system, ``release_arena``: the RSS between steps is then what stays alive, as without an
arena, while inside a step freed buffers are reused instead of mapped afresh; docs/memory.md), ``backward``
(the same, but ORTModule's forward graph runs without an arena: only the backward graph's stages reuse freed
buffers, so the forward's transients never sit idle beside the stash; docs/memory.md, "The arena in backward
only"), ``0`` (no arena: onnxruntime allocates each buffer from the C heap, as torch does on the CPU, and
memory a step frees can go back to the system with glibc, for buffers above its mmap threshold).
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
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
        config = RELEASE_ARENA_CONFIG if _arena_setting() in HANDED_BACK else {}
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(config))
        return True
    except Exception as exc:  # noqa: BLE001 - already registered by someone else is fine, all else: own arenas
        if "already" in str(exc).lower():
            return True
        logger.warning("onnxruntime refused a shared CPU arena (%s); each session keeps its own", exc)
        return False


# A region per request (ArenaExtendStrategy kSameAsRequested), so that whole regions come free to be handed
# back (a run making three 200 MB values, its output kept: the default's doubling regions gave back 184 of
# the 590 MB held after the first run and nothing after the second; this, 393, all but the output). Tried:
# "max_dead_bytes_per_chunk": 0 (split every larger free chunk) aborts onnxruntime 1.32 ("Could not find
# Region") in BERT-small's first step.
# The default arena (``ONNXTRAIN_CPU_ARENA=1``) keeps onnxruntime's settings.
RELEASE_ARENA_CONFIG = {"arena_extend_strategy": 1}
ARENA_ENV = "ONNXTRAIN_CPU_ARENA"
ARENA_VALUES = ("1", "release", "backward", "0")
HANDED_BACK = ("release", "backward")  # the settings whose arena a training step hands back as it starts and ends


def _arena_setting() -> str:
    arena = os.environ.get(ARENA_ENV, "1").strip()
    if arena not in ARENA_VALUES:
        raise ValueError(f"{ARENA_ENV}={arena!r}: use 1 (one shared CPU arena, the default), release (the same, "
                         "handed back to the system as each training step starts and ends), backward (as release, "
                         "for the backward graph only) or 0 (no arena)")
    return arena


def release_step_memory() -> bool:
    """Whether a training step starts and ends by handing the shared arena's free memory back to the system
    (``ONNXTRAIN_CPU_ARENA=release`` or ``backward``)."""
    return _arena_setting() in HANDED_BACK and shared_cpu_arena()


def forward_without_arena() -> bool:
    """Whether ORTModule's forward graph runs without an arena (``ONNXTRAIN_CPU_ARENA=backward``): its
    transients go back to the system as they are freed, and only backward's stages reuse freed buffers."""
    return _arena_setting() == "backward"


@functools.cache
def _shrinking_run() -> tuple[ort.InferenceSession, ort.RunOptions, dict]:
    import onnx  # here: the on-device runtime imports this module, and only onnxruntime and numpy

    f = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "release_arena",
                                   [onnx.helper.make_tensor_value_info("x", f, [1])],
                                   [onnx.helper.make_tensor_value_info("y", f, [1])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=8)
    options = use_shared_arena(ort.SessionOptions())
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    run_options = ort.RunOptions()
    run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return session, run_options, {"x": np.zeros(1, np.float32)}


def release_arena() -> None:
    """Hand the shared arena's free regions back to the system. onnxruntime shrinks an arena only as a run
    ends (its ``memory.enable_memory_arena_shrinkage`` run option), and the last run of a step still holds
    its inputs then: so a one-value run on the shared arena does it, after the step has dropped them (a few
    microseconds)."""
    session, run_options, feeds = _shrinking_run()
    session.run(None, feeds, run_options)


def use_shared_arena(options: ort.SessionOptions, arena: bool = True) -> ort.SessionOptions:
    """Make ``options`` take CPU memory from the shared arena, without memory patterns (no arena at all
    where ``ONNXTRAIN_CPU_ARENA=0`` or ``arena`` is False)."""
    options.enable_mem_pattern = False
    if not arena or _arena_setting() == "0":
        options.enable_cpu_mem_arena = False
        return options
    if shared_cpu_arena():
        options.add_session_config_entry("session.use_env_allocators", "1")
    return options


def no_spinning(options: ort.SessionOptions) -> ort.SessionOptions:
    """Idle worker threads sleep instead of spinning."""
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def for_training(options: ort.SessionOptions | None = None, arena: bool = True) -> ort.SessionOptions:
    """``options`` (or new ones) set up for sessions that take turns: shared arena (none where ``arena`` is
    False), no spinning."""
    return no_spinning(use_shared_arena(options if options is not None else ort.SessionOptions(), arena))
