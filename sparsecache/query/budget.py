"""Recomputation set by time (#79): the recompute ratio that spends a fraction of full prefill's
predicted time to first token.

A scorer's cost is a fixed part (read, decode, the scoring pass) plus a part proportional to the
tokens it recomputes, so a constant ratio spends a different share of full prefill's time at every
context length: at 1,100 tokens on 2 CPU cores r = 0.1 uses under 0.4x, at 300 tokens nearly all
of it. `--ttft-budget B` asks for the ratio whose predicted TTFT is B times full prefill's.

The cost model, for a context of n tokens on one device (milliseconds, fitted):

    full(n)     = a_full  + p·n + q·n²              prefill of the whole context (q: its attention)
    store(n, r) = a_store + s·n + r·g·(p·n + q·n²)   read, decode, score, then recompute r·n tokens,
                                                    each g times as costly as an average prefill token

so r(n) = (B·full(n) − store(n, 0)) / (g·(p·n + q·n²)), clipped to [0, 1]. Where even r = 0 costs more than
full prefill (store(n, 0) ≥ full(n)), prefilling is cheaper: the cheap-context rule's case.

Constants come from timings (`Costs.fit`): the defaults are fitted from `measured_costs.json`, timed on
2 CPU cores for four model sizes (135M to 3B compute parameters) and on one H100 for two (3B and 8B); a model
gets the nearest size's on its kind of device (on a GPU, none below half the smallest), scaled by
its compute parameters (a_full, p, a_store) and its K/V values per token (s: reading, decoding and
scoring the context). `calibrate` refits them on
the store's own machine; where a device kind has neither, no budget applies (the method's own
ratio), and the answer says so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

# The measured timings the constants are fitted from live in data, each with its provenance (machine,
# date, command, JSON): `measured_costs.json` beside this module. A model is predicted from the measured
# size nearest its compute parameters on its kind of device, scaled (`Costs.scaled`); beyond the largest,
# scaled from it. `sparsecache calibrate` refits them on a store's own machine.
MEASURED_FILE = Path(__file__).with_name("measured_costs.json")


def load_measured(path: Path = MEASURED_FILE) -> tuple[tuple[dict, ...], dict]:
    """(every measured entry, the reference entry: the default model's) from `path`."""
    data = json.loads(path.read_text())
    entries = tuple({**m, "full": [tuple(x) for x in m["full"]], "store": [tuple(x) for x in m["store"]]}
                    for m in data["measured"])
    return entries, next(m for m in entries if m["name"] == data["reference"])


MEASURED, REFERENCE = load_measured()


@dataclass(frozen=True)
class Costs:
    """The cost model's constants (milliseconds; see the module docstring)."""

    a_full: float
    p: float  # ms per context token of full prefill's matrix products (and of a recomputed token's)
    a_store: float
    s: float  # ms per context token of the store path before recomputation
    q: float = 0.0  # ms per context token squared: prefill's attention (0 where fitted on fewer than four lengths)
    g: float = 1.0  # a recomputed token's cost against a prefilled one's (1 where fitted on one ratio)

    def variable(self, n: int) -> float:
        """Full prefill's cost that grows with the context: what recomputing all of it costs."""
        return self.p * n + self.q * n * n

    def full(self, n: int) -> float:
        return self.a_full + self.variable(n)

    def store(self, n: int, r: float) -> float:
        return self.a_store + self.s * n + r * self.g * self.variable(n)

    def ratio(self, n: int, budget: float) -> float | None:
        """The recompute ratio whose predicted TTFT is `budget` x full prefill's at n context
        tokens, in [0, 1]; None where the store path costs more than full prefill even at r = 0."""
        if n <= 0 or self.store(n, 0.0) >= self.full(n):
            return None
        r = (budget * self.full(n) - self.store(n, 0.0)) / (self.g * self.variable(n))
        return min(1.0, max(0.0, r))

    def crossover(self, r: float) -> int | None:
        """The context tokens from which the store path at recompute ratio r is predicted faster than
        full prefill (below them prefilling is cheaper: the cheap-context rule); 0 where it is faster at
        any length, None where it never stays faster (recomputation dearer than prefill: r·g > 1)."""
        import math

        k = 1.0 - r * self.g  # full(n) - store(n, r) = k·q·n² + (k·p - s)·n + (a_full - a_store)
        k = 0.0 if abs(k) < 1e-9 else k  # r·g = 1 within rounding: recomputation costs what prefill does
        a, b, c = k * self.q, k * self.p - self.s, self.a_full - self.a_store
        if a < 0 or (a == 0 and b <= 0):
            return 0 if a == 0 and b == 0 and c > 0 else None
        if a == 0:
            return max(0, math.ceil(-c / b))
        disc = b * b - 4 * a * c
        return 0 if disc < 0 else max(0, math.ceil((-b + math.sqrt(disc)) / (2 * a)))

    def scaled(self, compute_parameters: int, kv_values: int, reference: dict = REFERENCE) -> "Costs":
        """These constants (measured on `reference`'s model) for a model of other sizes."""
        c = compute_parameters / reference["compute_parameters"]
        return Costs(self.a_full * c, self.p * c, self.a_store * c, self.s * kv_values / reference["kv_values"],
                     self.q * kv_values / reference["kv_values"], self.g)  # attention scales with the K/V width

    @classmethod
    def fit(cls, full: list[tuple[int, float]], store: list[tuple[int, float, float]]) -> "Costs":
        """Non-negative least squares on relative errors (timings vary by a factor, not by
        milliseconds, and a 300-token context must count as much as an 8,000-token one; no part of a
        cost shrinks as the context grows, so no constant is negative, even where noise on a busy
        machine makes a longer context time faster): through full prefill's (n, ms) a_full, p and q
        from four or more context lengths (q = 0 from fewer); through the store path's (n, r, ms)
        a_store, s and g from two or more ratios (g = 1 from one)."""
        import numpy as np
        from scipy.optimize import nnls

        n_full, t_full = (np.array(x, dtype=float) for x in zip(*full))
        if len(set(n_full)) < 2 or len({n for n, _, _ in store}) < 2:
            raise ValueError("fitting the cost model needs two or more context lengths of each")
        cols = [np.ones_like(n_full), n_full] + ([n_full * n_full] if len(set(n_full)) >= 4 else [])
        coef = [float(c) for c in nnls(np.stack(cols, 1) / t_full[:, None], np.ones_like(t_full))[0]]
        a_full, p, q = coef[0], coef[1], coef[2] if len(coef) == 3 else 0.0
        n, r, t = (np.array(x, dtype=float) for x in zip(*store))
        var = p * n + q * n * n
        if len(set(r)) >= 2 and var.any():
            a_store, s, g = nnls(np.stack([np.ones_like(n), n, r * var], 1) / t[:, None], np.ones_like(t))[0]
        else:  # one ratio (or nothing that grows to recompute): g = 1, the rest after recomputation
            g = 1.0
            a_store, s = nnls(np.stack([np.ones_like(n), n], 1) / t[:, None], 1.0 - r * var / t)[0]
        return cls(a_full, p, float(a_store), float(s), q, float(g))

    def rescaled(self, full: list[tuple[int, float]], store: list[tuple[int, float, float]]) -> "Costs":
        """These constants fitted to one machine's timings by two factors: full prefill's part by
        the ratio of its measured to its predicted times, the store path's by the same for what is
        left once its recomputation is taken out. What `calibrate` does with the few context lengths
        a store's own questions have (a full `fit` needs a spread of lengths)."""
        alpha = sum(t for _, t in full) / max(sum(self.full(n) for n, _ in full), 1e-9)
        c = Costs(self.a_full * alpha, self.p * alpha, self.a_store, self.s, self.q * alpha, self.g)
        rest = sum(t - r * c.g * c.variable(n) for n, r, t in store)
        beta = max(rest, 0.0) / max(sum(c.a_store + c.s * n for n, _, _ in store), 1e-9)
        return Costs(c.a_full, c.p, c.a_store * beta, c.s * beta, c.q, c.g)

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=None)  # a fit per (device, model shape): once a process
def default_costs(device_type: str, compute_parameters: int, kv_values: int) -> Costs | None:
    """The constants measured on this kind of device for the size nearest the model's (by compute
    parameters, on a log scale), scaled to the model; None where the device kind has none, and on a
    GPU for a model under half the smallest size measured there (its launch-bound fixed costs would
    be scaled down with the parameters; the cheap rule's GPU_TOKENS applies instead)."""
    import math

    sizes = [m for m in MEASURED if m["device"] == device_type]
    if not sizes or (device_type != "cpu" and compute_parameters < min(m["compute_parameters"] for m in sizes) / 2):
        return None  # a GPU's fixed costs are launch-bound: they do not shrink with a smaller model
    near = min(sizes, key=lambda m: abs(math.log(max(compute_parameters, 1) / m["compute_parameters"])))
    return _measured(near["name"]).scaled(compute_parameters, kv_values, near)


@functools.lru_cache(maxsize=None)
def _measured(name: str) -> Costs:
    m = next(m for m in MEASURED if m["name"] == name)
    return Costs.fit(m["full"], m["store"])


def costs_for(records: Mapping, device_type: str, model_config) -> Costs | None:
    """What --ttft-budget predicts with for a model (its HF config) on a kind of device: `calibrate`'s
    refit where the store version's calibration `records` ({device kind: record}) have one for it, else
    the device kind's measured constants scaled to the model; None where there are neither."""
    from ..model.kvmodel import compute_parameters, kv_values
    from .config import device_record

    record = device_record(records, device_type) or {}
    if record.get("costs"):
        return Costs(**record["costs"])
    return default_costs(device_type.split(":")[0], compute_parameters(model_config), kv_values(model_config))


def budgeted(cfg, context_tokens: int, costs: Costs | None, fixed: int = 0):
    """`cfg` (a QueryConfig) with the recompute ratio its `ttft_budget` buys at `context_tokens` (prefix
    and chunks), where it names a budget and no ratio, its method recomputes and there are `costs`;
    else `cfg` as it is (the method's own ratio). `fixed`: tokens every query recomputes whatever the
    method chooses (a linked wrapper's trailers): the budget pays for them first."""
    if cfg.ttft_budget is None or cfg.recompute_ratio is not None or cfg.spec is None or not cfg.spec.recomputes:
        return cfg
    r = None if costs is None else costs.ratio(context_tokens, cfg.ttft_budget)
    if r is None:
        return cfg
    return dataclasses.replace(cfg, recompute_ratio=round(max(0.0, r - fixed / context_tokens), 4))
