"""`Stopwatch`: time per named step (of a query, in milliseconds; of an encode, in seconds),
CUDA-synchronised."""

from __future__ import annotations

import time

import torch


class Stopwatch(dict):
    """Time per named step, summed over its spans: milliseconds, or seconds with unit=1.0;
    synchronises CUDA so a step's time is its own."""

    def __init__(self, device="cpu", unit: float = 1e3):
        super().__init__()
        self.device, self.unit = torch.device(device), unit

    def step(self, name: str):
        watch = self

        class _Step:
            def __enter__(self):
                _sync(watch.device)
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                _sync(watch.device)
                watch[name] = watch.get(name, 0.0) + watch.unit * (time.perf_counter() - self.t)

        return _Step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
