"""The machine a figure was measured on, and what a measurement does to it: the CPU's name,
the device's GEMM rate, a dropped page cache, a median of repeats, a competing load."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch


def gemm_rate(device, n: int | None = None, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n×n matrix product on `device` (fp32 unless `dtype`): the machine's compute yardstick.
    n is 2048 on a CPU and 8192 on a GPU, where 2048 is too small to fill it (an H100 ran it at 256
    TFLOP/s in bf16 while an 8B model's prefill reached 456)."""
    dev = torch.device(device)
    n = n or (8192 if dev.type == "cuda" else 2048)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a @ b
    return 2 * n ** 3 / median_time(lambda: (a @ b, sync()), repeats)


def copy_rate(device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s moved (read and written) by copying `nbytes` of float32 on `device`: its memory yardstick."""
    dev = torch.device(device)
    src = torch.empty(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    return 2 * nbytes / median_time(lambda: (dst.copy_(src), sync()), repeats)


def drop_page_cache(paths) -> None:
    """Evict files from the OS page cache (posix_fadvise DONTNEED), so the next read comes from disk."""
    from pathlib import Path

    for p in paths:
        for f in ([Path(p)] if Path(p).is_file() else Path(p).rglob("*")):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages cannot be dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def median_time(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def cpu_model() -> str:
    """lscpu's model name (timings differ between AVX2 and AVX-512 machines)."""
    import platform
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")),
                platform.processor())


# Another job on the same cores: torch matrix products on as many threads as there are cores,
# with OpenMP's default (spinning) workers, as most CPU jobs run.
COMPETING_LOAD = "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"


@contextlib.contextmanager
def competing_load():
    """Run `COMPETING_LOAD` in a child process for the duration of the block."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    child = subprocess.Popen([sys.executable, "-c", COMPETING_LOAD], env=env)
    try:
        time.sleep(2.0)  # torch imported and multiplying before the first measurement
        yield child
    finally:
        child.kill()
        child.wait(timeout=30)
