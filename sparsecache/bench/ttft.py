"""Time to first token of every query method at several k, with its breakdown (`sparsecache bench ttft`)."""

from __future__ import annotations

import contextlib
import sys

from ..errors import StoreError
from ..measure.machine import COMPETING_LOAD, competing_load, drop_page_cache, median_time
from ..query import methods
from ..query.config import DTYPE

TTFT_RATIO = 0.15  # what a scorer recomputes in the per-method TTFT table


TTFT_METHODS = tuple((name, cfg.get("recompute_ratio", 0.0)) for name, cfg in methods.bench_configs(TTFT_RATIO).items()
                     if methods.get(name).in_ttft_bench)


TTFT_QUESTION = "Summarise what these sections say about special method names."


def bench_ttft(store_path, ks=(2, 4, 8, 16, 32), repeats: int = 2, device="cpu", cold: bool = True,
               busy: bool = False, min_tokens: int = 480, dtype: str = DTYPE) -> dict:
    """TTFT breakdown of every method for k chunks of >= `min_tokens` tokens (a `bench
    store` store's are 480–512), in one run.

    Chunks come from a store built by `bench store`; raw KV files are made on first use
    (not timed). Each figure is the median of `repeats` queries after one warm-up (full
    prefill at the largest k runs once: it takes a minute on a CPU). With `cold`, the
    largest k is also run with the store's and raw files evicted from the page cache. With
    `busy`, another CPU-heavy process (`COMPETING_LOAD`) runs throughout.
    """
    with competing_load() if busy else contextlib.nullcontext():
        result = _bench_ttft(store_path, ks, repeats, device, cold, min_tokens, dtype)
    return {**result, "competing_load": COMPETING_LOAD if busy else None, "min_chunk_tokens": min_tokens}


def _bench_ttft(store_path, ks, repeats: int, device, cold: bool, min_tokens: int, dtype: str) -> dict:
    from ..model.kvmodel import load_model, query_dtype
    from ..query.session import STEPS, Session

    model = load_model(device=device, dtype=query_dtype(dtype, device))
    session = Session(store_path, model, device)
    rows = []
    for k in ks:
        rows += measure_ttft(session, model, device, [k], repeats, TTFT_METHODS, min_tokens, last_once=k == max(ks))
        if cold and k == max(ks):
            ids = [c.id for c in _full_chunks(session, k, min_tokens)]
            for method, ratio in (("raw", 0.0), ("none", 0.0), ("a3", 0.15), ("infoflow", 0.15), ("cake", 0.0)):
                def evict():
                    drop_page_cache([session.store.root / "data", session.raw_dir])
                answers = []
                for _ in range(repeats):
                    evict()
                    answers.append(session.query(TTFT_QUESTION, chunks=ids, method=method, recompute_ratio=ratio,
                                                 max_new_tokens=1, prefill_under=0))
                rows.append(_ttft_row(answers, k, method, ratio, "cold", STEPS))
                print(f"k={k:<3} {method:>10} cold ttft {rows[-1]['ttft']:.0f} ms", file=sys.stderr, flush=True)
    q = session.embedder.embed([TTFT_QUESTION])[0]
    retrieve_ms = 1e3 * median_time(lambda: session.retrieve(TTFT_QUESTION, 8), 5)
    return {"device": str(device), "dtype": str(model.dtype).removeprefix("torch."), "question": TTFT_QUESTION,
            "retrieve_top8_ms": retrieve_ms, "rows": rows,
            "cold_method": "posix_fadvise(POSIX_FADV_DONTNEED) on the store's data and the raw files before each query",
            "embed_dim": int(q.shape[0])}


def _full_chunks(session, k: int, min_tokens: int) -> list:
    full = sorted((c for c in session.store.chunks() if c.token_length >= min_tokens), key=lambda c: c.id)
    if k > len(full):
        raise StoreError(f"the store has only {len(full)} chunks of >= {min_tokens} tokens")
    return full[:k]


def measure_ttft(store, model, device, ks, repeats: int, which, min_tokens: int = 480, last_once: bool = True) -> list:
    """Warm TTFT rows of each (method, ratio) in `which` for the first k chunks of >= `min_tokens`
    tokens of `store` (a path or an open Session), at each k: the median of `repeats` queries after
    one warm-up; full prefill at the largest k runs once with `last_once` (a minute on a CPU)."""
    from ..query.session import STEPS, Session

    session = store if isinstance(store, Session) else Session(store, model, device)
    rows = []
    for k in ks:
        ids = [c.id for c in _full_chunks(session, k, min_tokens)]
        for method, ratio in which:
            runs = 1 if (method == "full" and last_once and k == max(ks)) else repeats
            if method != "full":
                session.query(TTFT_QUESTION, chunks=ids, method=method, recompute_ratio=ratio, max_new_tokens=1,
                              prefill_under=0)
            answers = [session.query(TTFT_QUESTION, chunks=ids, method=method, recompute_ratio=ratio,
                                     max_new_tokens=1, prefill_under=0) for _ in range(runs)]
            rows.append(_ttft_row(answers, k, method, ratio, "warm", STEPS))
            print(f"k={k:<3} {method:>10} r={ratio:<4} ttft {rows[-1]['ttft']:.0f} ms", file=sys.stderr, flush=True)
    return rows


def _ttft_row(answers, k: int, method: str, ratio: float, cache: str, steps) -> dict:
    best = sorted(answers, key=lambda a: a.timings_ms["ttft"])[len(answers) // 2]
    return {"k": k, "method": method, "ratio": ratio, "page_cache": cache, "runs": len(answers),
            "context_tokens": best.context_tokens, "recomputed_tokens": best.recomputed_tokens,
            "bytes_read": best.bytes_read, "ttft": best.timings_ms["ttft"],
            **{s: best.timings_ms[s] for s in steps}}


def plot_ttft(result: dict, out) -> None:
    """Left: TTFT vs k per method (log). Right: the breakdown at the largest k (warm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..query.session import STEPS

    rows = [r for r in result["rows"] if r["page_cache"] == "warm"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["k"], r["ttft"]) for r in rows if r["method"] == m)
        a.plot(*zip(*pts), "o-", label=m)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel(f"chunks (>= {result.get('min_chunk_tokens', 480)} tokens each)")
    a.set_ylabel("TTFT (ms, log)")
    a.set_title(f"TTFT vs retrieved chunks ({result['device']})")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    kmax = max(r["k"] for r in rows)
    last = [r for r in rows if r["k"] == kmax]
    bottom = [0.0] * len(last)
    for s in STEPS:
        vals = [r[s] for r in last]
        b.bar([r["method"] for r in last], vals, bottom=bottom, label=s)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_yscale("log")
    b.set_ylabel("ms (stacked, log)")
    b.set_title(f"where the time goes at k={kmax}")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
