"""When does Cake's load/recompute overlap pay? TTFT of `none`, `infoflow` and `cake` (the
two threads left to meet, the closed-form split, and fixed splits) for k chunks of 480–512
tokens, with the store warm and with its files evicted from the page cache before each query,
or (`--s3`) with the store copied to a moto S3 server on 127.0.0.1, read over HTTP.

    python scripts/experiments/measure_cake.py --store W/store --out docs/benchmarks/cake-cpu.json
    python scripts/experiments/measure_cake.py --store W/store --s3 --out docs/benchmarks/cake-s3.json

The store is `bench store`'s (or any with >= max(k) chunks of >= 480 tokens). The closed-form
split comes from this run's own rates: decode = context tokens ÷ (read + transfer +
reconstruct) of `none`, prefill = context tokens ÷ the prefill time of `full`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sparsecache.measure.machine import cpu_model, drop_page_cache
from sparsecache.testing import moto_copy
from sparsecache.query.overlap import cake_split
from sparsecache.query.session import Session

QUESTION = "Summarise what these sections say about special method names."


def median_ttft(session, ids, repeats: int, cold: bool, **cfg) -> dict:
    answers = []
    session.query(QUESTION, chunks=ids, max_new_tokens=1, prefill_under=0, **cfg)  # warm-up (model, codec, caches)
    for _ in range(repeats):
        if cold:
            drop_page_cache([session.store.backend.local_root / "data"])
        answers.append(session.query(QUESTION, chunks=ids, max_new_tokens=1, prefill_under=0, **cfg))
    a = sorted(answers, key=lambda a: a.timings_ms["ttft"])[len(answers) // 2]
    return {"ttft": a.timings_ms["ttft"], "recomputed_tokens": a.recomputed_tokens,
            "context_tokens": a.context_tokens, **{k: a.timings_ms[k] for k in ("read", "transfer", "reconstruct",
                                                                                 "select", "recompute", "prefill")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ks", default="8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--s3", action="store_true", help="read the store from a moto S3 copy (needs the s3 extra)")
    args = ap.parse_args()
    if args.s3:
        with moto_copy(args.store) as url:
            measure(args, Session(url, device=args.device), ("s3",))
    else:
        measure(args, Session(args.store, device=args.device), ("warm", "cold"))


def measure(args, s: Session, caches: tuple[str, ...]) -> None:
    long = sorted((c for c in s.store.chunks() if c.token_length >= 480), key=lambda c: c.id)
    rows = []
    for k in map(int, args.ks.split(",")):
        chunks = long[:k]
        ids = [c.id for c in chunks]
        prefix = len(s.store.prefix()[0])
        full = median_ttft(s, ids, 1, False, method="full")
        none = median_ttft(s, ids, args.repeats, False, method="none")
        tokens = full["context_tokens"] - prefix
        decode_rate = tokens / ((none["read"] + none["transfer"] + none["reconstruct"]) / 1e3)
        prefill_rate = tokens / (full["prefill"] / 1e3)
        n_tokens = cake_split(tokens, decode_rate, prefill_rate)
        lengths = [c.token_length for c in chunks]
        closed = max(n for n in range(k + 1) if sum(lengths[:n]) <= n_tokens)  # as Rates.split
        splits = sorted({0, 1, 2, k // 8, closed})
        for cache in caches:
            cold = cache == "cold"
            runs = {"full": full if not cold else median_ttft(s, ids, 1, True, method="full"),
                    "none": none if not cold else median_ttft(s, ids, args.repeats, True, method="none"),
                    "infoflow": median_ttft(s, ids, args.repeats, cold, method="infoflow"),
                    "cake (threads meet)": median_ttft(s, ids, args.repeats, cold, method="cake")}
            for n in splits:
                runs[f"cake split {n}"] = median_ttft(s, ids, args.repeats, cold, method="cake", cake_split=n)
            for name, r in runs.items():
                rows.append({"k": k, "page_cache": cache, "method": name, **r})
                print(f"k={k} {cache} {name:<22} ttft {r['ttft']:8.1f} ms  recomputed {r['recomputed_tokens']}",
                      file=sys.stderr, flush=True)
        rows.append({"k": k, "closed_form": {"decode_tokens_per_s": round(decode_rate), "prefill_tokens_per_s":
                                             round(prefill_rate), "split_tokens": n_tokens, "split_chunks": closed}})
    gpu = torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else None
    Path(args.out).write_text(json.dumps({"cpu": cpu_model(), "gpu": gpu, "device": str(s.device),
                                          "store": s.store.backend.url, "question": QUESTION, "rows": rows},
                                         indent=1))


if __name__ == "__main__":
    main()
