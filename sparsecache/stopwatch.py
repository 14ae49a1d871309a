"""`Stopwatch`: milliseconds per named step of a query, CUDA-synchronised."""

from __future__ import annotations

import time

import torch


class Stopwatch(dict):
    """Milliseconds per named step; synchronises CUDA so a step's time is its own."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)

    def step(self, name: str):
        watch = self

        class _Step:
            def __enter__(self):
                _sync(watch.device)
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                _sync(watch.device)
                watch[name] = watch.get(name, 0.0) + 1e3 * (time.perf_counter() - self.t)

        return _Step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
