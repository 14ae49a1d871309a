"""The query path on a GPU: where recomputation's time goes, and what bfloat16 changes.

    python scripts/experiments/gpu_query.py profile --store bench-store/store --out profile.txt
    python scripts/experiments/gpu_query.py agree --work bench-fidelity-gpu --limit 40 --out agree.json

`profile`: infoflow r = 0.15 at k = 2 and 32 (a `bench store` store's chunks of >= 480
tokens, as `bench ttft` takes them), float32 and bfloat16: the TTFT breakdown of each, then
torch.profiler over the recompute-bearing queries (top operators by GPU and by CPU time,
kernel launches per query).

`agree`: the fidelity suite (`bench fidelity`'s questions, k = 8) answered in float32 (the
reference, `bench fidelity`'s own run) and again in bfloat16; bf16's rows are compared with
float32's full prefill, so `same_answer` says whether bf16 gives the reference answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sparsecache  # noqa: E402,F401  (before torch: its OpenMP workers then sleep between operations)
import torch  # noqa: E402

from sparsecache.query.session import Session  # noqa: E402

QUESTION = "How do I read a file line by line?"


def profile(args) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    out = open(args.out, "w")
    for dtype in ("float32", "bfloat16"):
        s = Session(args.store, args.model, args.device, dtype=dtype)
        chunks = sorted((c for c in s.store.chunks() if c.token_length >= 480), key=lambda c: c.id)
        for k in args.k:
            ids = [c.id for c in chunks[:k]]
            run = lambda: s.query(QUESTION, chunks=ids, method="infoflow", recompute_ratio=0.15,  # noqa: E731
                                  max_new_tokens=1, prefill_under=0)
            for _ in range(2):
                run()  # warm-up: kernels compiled and chosen, caches allocated
            answers = [run() for _ in range(3)]
            t = sorted(answers, key=lambda a: a.timings_ms["ttft"])[1].timings_ms
            print(f"== {dtype} k={k} infoflow r=0.15, median of 3: " + json.dumps(t), file=out, flush=True)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device.type == "cuda" else [])
            with torch_profile(activities=acts) as prof:
                for _ in range(2):
                    run()
            events = prof.key_averages()
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                 "cudaLaunchKernelExC", "cuLaunchKernelEx"))
            print(f"kernel launches per query: {launches / 2:.0f}", file=out)
            print(events.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60), file=out)
            print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60), file=out,
                  flush=True)
        del s
        torch.cuda.empty_cache()


def agree(args) -> None:
    from sparsecache.measure.suite import load_suite
    from sparsecache.bench.fidelity import run_fidelity, summarise
    from sparsecache.query.spec import parse_methods
    from sparsecache.bench.suite import bench_fidelity

    work = Path(args.work)
    methods = parse_methods(args.methods)
    t0 = time.perf_counter()
    bench_fidelity(work, (8,), 100, methods, args.device, args.limit, args.model)  # float32: the reference
    fp32 = json.loads((work / "results.json").read_text())["rows"]
    seeded = work / "results-bf16.json"
    if not seeded.exists():  # bf16's rows compare with float32's full prefill
        seeded.write_text(json.dumps({"rows": [r for r in fp32 if r["label"] == "full"]}))
    print(f"float32 done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    half = Session(work / "store", args.model, args.device, dtype="bfloat16")
    suite = {8: load_suite(work)[8][: args.limit]}
    rows = run_fidelity(half, suite, {"full:bf16": {"method": "full"}, **methods}, seeded)
    asked = {q.id for q in suite[8]}
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "questions": len(asked), "rows": []}
    for label in ("full", *methods):
        ref = [r for r in fp32 if r["label"] == label and r["question"] in asked]
        got = [r for r in rows if r["label"] == ("full:bf16" if label == "full" else label)
               and r["question"] in asked]
        by_q = {r["question"]: r for r in ref}
        same_text = sum(r["answer"] == by_q[r["question"]]["answer"] for r in got if r["question"] in by_q)
        result["rows"].append({"label": label, "float32": summarise(ref) if ref else None,
                               "bfloat16": summarise(got) if got else None,
                               "bf16_same_text_as_fp32_same_method": same_text / max(1, len(got))})
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in result["rows"]:
        f, b = r["float32"] or {}, r["bfloat16"] or {}
        print(f"{r['label']:>16}  fp32: same {f.get('same_answer', 1.0):.2f} correct {f.get('correct', 0):.2f} "
              f"ttft {f.get('ttft_ms', 0):.0f} ms | bf16: same-as-fp32-full {b.get('same_answer', 0):.2f} correct "
              f"{b.get('correct', 0):.2f} ttft {b.get('ttft_ms', 0):.0f} ms | bf16 text = fp32 text "
              f"{r['bf16_same_text_as_fp32_same_method']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("profile")
    a.add_argument("--store", default="bench-store/store")
    a.add_argument("--k", type=int, nargs="+", default=[2, 32])
    a.add_argument("--out", default="profile-recompute.txt")
    b = sub.add_parser("agree")
    b.add_argument("--work", default="bench-fidelity-gpu")
    b.add_argument("--limit", type=int, default=40)
    b.add_argument("--methods", default="none,infoflow:0.25")
    b.add_argument("--out", default="dtype-agreement.json")
    for x in (a, b):
        x.add_argument("--device", default="cuda")
        x.add_argument("--model", default="default")
    args = p.parse_args()
    {"profile": profile, "agree": agree}[args.cmd](args)


if __name__ == "__main__":
    main()
