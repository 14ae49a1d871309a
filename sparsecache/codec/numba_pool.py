"""numba's thread pool, started without changing the starting thread's OpenMP thread count.

The CPU kernels (`_omp_cpu`, `_decode_cpu`) are numba `parallel=True` functions. numba's
`omp` threading layer runs on the OpenMP runtime torch already loaded (one libgomp per
process), and starting its pool sets the starting thread's OpenMP thread count to numba's
own (`NUMBA_NUM_THREADS`, taken from the CPU affinity the process had when numba was
imported). Where the two differ, torch's next parallel operation on that thread runs with
another thread count than the one planned. vLLM's CPU worker is such a place: under its
default thread binding the worker is pinned to fewer CPUs than the OpenMP threads it plans
(numba sees 1, OpenMP holds 2), the connector's first decode dropped the count from 2 to 1,
and vLLM's attention, which checks the count against the one its metadata was built with,
aborted the engine ("Check failed: input->metadata->thread_num == thread_num (2 vs. 1)").

Starting the pool also turns on nested parallelism in that runtime (`omp_set_nested` /
`omp_set_max_active_levels`, so that a numba kernel may run inside another parallel region; ours
never do). torch's operations, some of which open a parallel region inside another, then start
a second team of threads on cores the first team holds: after numba's first kernel the encode's
bfloat16 forward ran 1.5x slower (29 -> 43-49 s on the demo corpus, float32's 50 -> 55 s), and
with `OMP_WAIT_POLICY=ACTIVE` it did not finish at all (BENCHMARKS.md, "The CPU encode's OMP,
phase by phase").

So the pool is started here, once per process, and the thread's count and the runtime's nesting
put back. Later kernel calls leave both alone (numba passes its own count per region), on every
thread.
"""

from __future__ import annotations

import ctypes
import threading

_lock = threading.Lock()
_started = False


def start() -> None:
    """Start numba's pool now, if it is not running, keeping this thread's OpenMP thread count."""
    global _started
    if _started:
        return
    with _lock:
        if _started:
            return
        import torch
        from numba.np.ufunc.parallel import _launch_threads

        before = torch.get_num_threads()
        runtime = openmp_runtime()
        nesting = _nesting(runtime)
        _launch_threads()
        put_back(before)
        if nesting is not None:
            runtime.omp_set_max_active_levels(nesting[0])
            runtime.omp_set_nested(nesting[1])
        _started = True


def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime in the process's global symbol scope (torch's libgomp, the one numba's
    `omp` layer binds to), or None where there is none to reach (another platform)."""
    try:
        lib = ctypes.CDLL(None)
        for name in ("omp_get_nested", "omp_set_nested", "omp_get_max_active_levels", "omp_set_max_active_levels"):
            getattr(lib, name)
    except (OSError, AttributeError):
        return None
    return lib


def _nesting(runtime: ctypes.CDLL | None) -> tuple[int, int] | None:
    """(max active levels, nested) of this thread in `runtime`, or None without a runtime."""
    return None if runtime is None else (runtime.omp_get_max_active_levels(), runtime.omp_get_nested())


def put_back(threads: int) -> bool:
    """Set this thread's OpenMP thread count to `threads` again if something changed it; True if
    it had changed."""
    import torch

    if torch.get_num_threads() == threads:
        return False
    torch._C.set_num_threads(threads)  # torch._C's: vLLM's CPU worker makes torch.set_num_threads a no-op
    return True
