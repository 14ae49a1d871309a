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

So the pool is started here, once per process, and the thread's count put back. Later
kernel calls leave the count alone (numba passes its own per region), on every thread.
"""

from __future__ import annotations

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
        _launch_threads()
        put_back(before)
        _started = True


def put_back(threads: int) -> bool:
    """Set this thread's OpenMP thread count to `threads` again if something changed it; True if
    it had changed."""
    import torch

    if torch.get_num_threads() == threads:
        return False
    torch._C.set_num_threads(threads)  # torch._C's: vLLM's CPU worker makes torch.set_num_threads a no-op
    return True
