"""`Stopwatch`: time per named step (of a query, in milliseconds; of an encode, in seconds),
CUDA-synchronised."""

from __future__ import annotations

import time

import torch


class Stopwatch(dict):
    """Time per named step, summed over its spans: milliseconds, or seconds with unit=1.0;
    synchronises CUDA at each step's start and end so a step's time is its own (an encode's
    forward and OMP hand their results to the host anyway, so there it adds no wait)."""

    def __init__(self, device="cpu", unit: float = 1e3):
        super().__init__()
        self.device, self.unit = torch.device(device), unit

    def __missing__(self, name: str) -> float:
        return 0.0  # a step not (yet) timed took no time; reading it records nothing

    def step(self, name: str):
        watch = self

        class _Step:
            def __enter__(self):
                _sync(watch.device)
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                _sync(watch.device)
                watch[name] += watch.unit * (time.perf_counter() - self.t)

        return _Step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
