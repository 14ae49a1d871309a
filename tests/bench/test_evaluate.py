"""The fidelity tally's arithmetic: intervals over passages, not tokens."""
import math
import statistics

import pytest
import torch

from sparsecache.bench.evaluate import Tally


def add_passage(tally: Tally, p: float, tokens: int = 8, agree: int | None = None) -> None:
    """A passage of `tokens` target tokens (id 0) that the exact model gives probability 1/2 and
    the reconstructed one p (1/3 < p < 0.49), so Δnll = log(1/2) - log p per token; the first
    `agree` tokens keep the exact argmax (0), the others move it to token 1."""
    agree = tokens if agree is None else agree
    exact = torch.tensor([[0.5, 0.25, 0.25]]).repeat(tokens, 1)
    rec = torch.tensor([[p, (1 - p) / 2, (1 - p) / 2]] * agree + [[p, 1 - p - 0.01, 0.01]] * (tokens - agree))
    tally.add_logits(exact.log(), rec.log(), torch.zeros(tokens, dtype=torch.long))


def test_interval_is_the_passage_standard_error():
    tally = Tally(n_layers=1)
    ps = [0.45, 0.40, 0.48, 0.35, 0.44]
    for p in ps:
        add_passage(tally, p)
    r = tally.report()
    d = [math.log(0.5) - math.log(p) for p in ps]  # per-token Δnll of each passage
    m, se = statistics.mean(d), statistics.stdev(d) / math.sqrt(len(d))
    assert r["ppl_reconstructed"] / r["ppl_exact"] - 1 == pytest.approx(math.expm1(m), rel=1e-4)
    assert r["ppl_change_ci95"] == pytest.approx([math.expm1(m - 1.96 * se), math.expm1(m + 1.96 * se)], rel=1e-4)


def test_identical_passages_have_no_spread_and_one_passage_no_interval():
    one = Tally(n_layers=1)
    add_passage(one, 0.4)
    assert one.report()["ppl_change_ci95"] is None and one.report()["top1_ci95"] is None
    same = Tally(n_layers=1)
    for _ in range(3):
        add_passage(same, 0.4, agree=6)
    lo, hi = same.report()["ppl_change_ci95"]
    assert lo == pytest.approx(hi) and lo == pytest.approx(0.5 / 0.4 - 1, rel=1e-4)
    assert same.report()["top1_ci95"] == pytest.approx([6 / 8, 6 / 8])


def test_top1_interval_clusters_by_passage():
    """Two passages, one all agreeing and one all disagreeing: 50% agreement, and the interval
    is as wide as two clusters make it (a token-level binomial would claim ±12 points)."""
    tally = Tally(n_layers=1)
    add_passage(tally, 0.4, tokens=32, agree=32)
    add_passage(tally, 0.4, tokens=32, agree=0)
    lo, hi = tally.report()["top1_ci95"]
    assert tally.report()["top1_agreement"] == 0.5
    assert lo == 0.0 and hi == 1.0
