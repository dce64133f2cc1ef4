"""onnxtrain's own torch work at one OpenMP thread where OpenVINO's threads run the graphs, so that no idle
torch worker spins on the cores a graph call then needs.

PyTorch's CPU wheels run their parallel ops on libgomp's worker team. After each parallel region an idle worker
spins (GOMP_SPINCOUNT: about 3.5 ms of CPU after an ``add_`` over 1M floats) before it sleeps, and libgomp reads
``OMP_WAIT_POLICY`` only when it loads, before onnxtrain can act. In an ORTModule step on OpenVINO the torch work
between two graph calls is onnxtrain's own (the backward's embedding rows, :class:`onnxtrain.optim.FusedAdam`'s
update): run at one OpenMP thread, it opens no team, so no worker spins into the next call (BERT-small's fused
call: the spin took 2.5-3 ms of its wall time and 7 ms of CPU; docs/precision.md). On a loaded machine the team
does worse: a worker that cannot get a core holds every parallel region at its barrier.

The thread count is OpenMP's per-thread setting (``omp_set_num_threads`` on the calling thread, restored after),
which ``at::get_num_threads()`` reads: other threads and torch's own setting are untouched. The ops run so are
elementwise or add rows in index order (AdamW's kernel, ``index_add_``, fills, scales), whose results do not
depend on how the elements are split among threads. Ending the
team instead (OpenMP 5's ``omp_pause_resource_all``) was measured and not kept: the next parallel region creates
its threads again, and a new thread waited 4-8 ms for a core when both were busy. Nor is the team the user's own
ops leave (the MLP's ``F.cross_entropy`` and its backward, ``torch.optim.AdamW``'s loop) ended before each graph
call: the user's first region after the call then waits for its new thread behind OpenVINO's spinning worker
(about 2 ms), and the MLP's step was slower (docs/precision.md, twenty-first session).

Only libgomp is driven: its functions are looked up through ``libtorch_cpu`` (the runtime torch calls) and must
lie in a file named ``libgomp*`` (``/proc/self/maps``). Anywhere else (another OpenMP runtime, torch's native
pool, not Linux) :func:`one_thread` changes nothing. ``ONNXTRAIN_ONE_OMP_THREAD=0`` (read at the first use)
turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("onnxtrain.runtime")

ONE_THREAD_ENV = "ONNXTRAIN_ONE_OMP_THREAD"

_omp = None  # (omp_set_num_threads, omp_get_max_threads) of torch's libgomp, or False where there is none
_graph_calls = False  # whether this process runs graphs on OpenVINO's threads (set by TorchSession)
enabled = True  # False runs everything as before (benchmarks compare both in one process)


def note_graph_threads() -> None:
    """Record that graph calls on another thread pool (OpenVINO's) follow torch work in this process."""
    global _graph_calls
    _graph_calls = True


@contextlib.contextmanager
def one_thread(only_with_graph_calls: bool = False) -> Iterator[None]:
    """Run the block's torch ops at one OpenMP thread on this thread (others untouched), where torch runs on
    libgomp; ``only_with_graph_calls``: only once this process runs graphs on OpenVINO (a user of
    :class:`onnxtrain.optim.FusedAdam` in eager PyTorch keeps its two threads)."""
    omp = _functions() if enabled and (_graph_calls or not only_with_graph_calls) else False
    if not omp:
        yield
        return
    set_threads, max_threads = omp
    import torch

    torch.get_num_threads()  # torch's first use on a thread sets the thread's count: done before, not inside
    before = max_threads()
    if before == 1:
        yield
        return
    set_threads(1)
    try:
        yield
    finally:
        set_threads(before)


def _functions():
    global _omp
    if _omp is None:
        _omp, reason = _resolve()
        logger.debug("onnxtrain's torch work between graph calls %s",
                     "at one OpenMP thread" if _omp else f"at torch's threads: {reason}")
    return _omp


def _resolve():
    """``((omp_set_num_threads, omp_get_max_threads), None)`` of the libgomp torch calls, else ``(False, why)``."""
    if os.environ.get(ONE_THREAD_ENV, "").strip().lower() in {"0", "false", "no", "off"}:
        return False, f"{ONE_THREAD_ENV}=0"
    if not sys.platform.startswith("linux"):
        return False, f"not on Linux ({sys.platform})"
    import torch

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False, "torch's parallel backend is not OpenMP"
    try:
        torch_cpu = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"),
                                mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        # dlsym through libtorch_cpu's handle: the OpenMP runtime it is linked to
        set_threads, max_threads = torch_cpu.omp_set_num_threads, torch_cpu.omp_get_max_threads
    except (OSError, AttributeError) as exc:
        return False, f"no OpenMP functions reachable from libtorch_cpu ({exc})"
    library = mapped_file(ctypes.cast(set_threads, ctypes.c_void_p).value)
    if library is None or not os.path.basename(library).startswith("libgomp"):
        return False, f"torch's OpenMP runtime is not libgomp ({library})"
    set_threads.argtypes, set_threads.restype = [ctypes.c_int], None
    max_threads.argtypes, max_threads.restype = [], ctypes.c_int
    return (set_threads, max_threads), None


def mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return fields[5].strip() if len(fields) == 6 else None
    except OSError:
        return None
    return None
