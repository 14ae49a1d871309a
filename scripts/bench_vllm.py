"""vLLM + SparsecacheConnector against what a vLLM user has without it, in one engine and one run.

1. Time to first token for k retrieved chunks of ~500 tokens (a store built by encode-corpus):
   - `full`: vLLM prefills the whole prompt (prefix cache emptied first);
   - `prefix-warm`: the same prompt a second time with vLLM's prefix cache warm: the best a
     user gets today without us, and only for a context seen before in the same order;
   - `raw`: the connector injects exact fp16 KV per chunk (TurboRAG/LMCache-style files);
   - `none`: the connector decodes the store's codes (sync, then layerwise);
   - `tail-chunk` / `tail-auto`: the connector leaves the last chunk, or the closed-form
     split's N tokens (from the decode and prefill rates measured here at k = 8), to vLLM.
2. Needle accuracy (the `bench passkey` task: a 6-digit number for a key in one of k = 8
   chunks) of every configuration on the same trials.

    OMP_NUM_THREADS=2 python scripts/bench_vllm.py --store W/store --corpus W/corpus --passkey W/passkey \
        --out docs/benchmarks/vllm-cpu.json --plot docs/vllm.png

(W/corpus: `python -c "from sparsecache.bench.suite import bench_corpus; bench_corpus('W/corpus')"`.)
The store is built or brought up to date with `sparsecache encode-corpus` in a subprocess. Each TTFT is
the median of --repeats single-request `generate(max_tokens=1)` calls after one warm-up.
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

from sparsecache.bench.suite import cpu_model

# k = 32 chunks of ~500 tokens exceed the default model's 8,192 positions: TTFT is a matter of
# compute, so vLLM is allowed the longer length (answers there are not judged; needles use k = 8).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
TTFT_QUESTION = "Summarise what these passages say about the subject they share."


def ensure_stores(store: Path, corpus: Path, work: Path, trials: int, k: int) -> None:
    """One store holds both tasks (the engine's connector serves one store): the long-chunk
    corpus and the passkey documents. encode-corpus runs in a subprocess, as a nightly job would,
    and only encodes what is new."""
    from transformers import AutoTokenizer

    from sparsecache.model import default_model_dir
    from sparsecache.bench.passkey import make_task

    if not (work / "trials.json").exists():
        make_task(AutoTokenizer.from_pretrained(default_model_dir()), work, trials, k, 200, 1)
    subprocess.run(["sparsecache", "encode-corpus", str(corpus), str(work / "corpus.jsonl"), "--store", str(store)],
                   check=True)
    # the exact fp16 KV files of the `raw` configuration, made (once) by the same code as `query --method raw`
    subprocess.run([sys.executable, "-c", "import sys; from sparsecache.session import Session; s = Session(sys.argv[1]); "
                    "s.raw_files([c.id for c in s.store.chunks()])", str(store)], check=True)


def make_engine(store: Path):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from sparsecache.model import default_model_dir

    cfg = KVTransferConfig(kv_connector="SparsecacheConnector", kv_connector_module_path="sparsecache.vllm",
                           kv_role="kv_consumer", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"store": str(store)})
    return LLM(str(default_model_dir()), dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
               enable_prefix_caching=True, max_model_len=20480, max_num_batched_tokens=20480,
               disable_log_stats=False, kv_transfer_config=cfg)


def counters(llm) -> dict:
    return {m.name.removeprefix("vllm:sparsecache_"): m.value for m in llm.get_metrics() if "sparsecache" in m.name}


def run(llm, req, params, max_tokens: int = 1):
    """(seconds, generated text, counter deltas) of one request."""
    from vllm import SamplingParams

    before = counters(llm)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0,
                        extra_args=None if params is None else {"kv_transfer_params": params})
    t = time.perf_counter()
    out = llm.generate([req.vllm_prompt()], sp, use_tqdm=False)[0]
    dt = time.perf_counter() - t
    after = counters(llm)
    return dt, out.outputs[0].text, {k: after[k] - before.get(k, 0) for k in after}


def params_for(req, config: str, tails: dict) -> dict | None:
    """kv_transfer_params of one configuration (None: vLLM alone)."""
    if config in ("full", "prefix-warm"):
        return None
    p = {"chunks": req.kv_transfer_params["sparsecache"]["chunks"], "source": "raw" if config == "raw" else "codes"}
    if config == "tail-chunk":
        p["recompute_tail"] = "chunk"
    if config == "tail-auto":
        p["recompute_tail"] = tails["auto"]
    return {"sparsecache": p}


CONFIGS = ("full", "prefix-warm", "raw", "none", "none-layerwise", "tail-chunk", "tail-auto")


def measure(llm, req, config: str, tails: dict, repeats: int) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    worker.layerwise = config == "none-layerwise"
    params = params_for(req, "none" if config == "none-layerwise" else config, tails)
    times, deltas = [], []
    for i in range(repeats + 1):
        llm.reset_prefix_cache()
        if config == "prefix-warm":
            run(llm, req, None)  # the same prompt seen once before
        dt, _, delta = run(llm, req, params)
        if i:  # the first is a warm-up
            times.append(dt)
            deltas.append(delta)
    worker.layerwise = False
    d = deltas[-1]
    if params is not None and (d.get("fallbacks") or not d.get("tokens")):
        raise RuntimeError(f"{config}: the connector did not serve the request ({d})")
    return {"ttft_ms": 1e3 * statistics.median(times), "injected_tokens": d.get("tokens", 0),
            "decode_ms": d.get("decode_ms", 0)}


def ttft_table(llm, store, ks, repeats) -> tuple[list[dict], dict]:
    from sparsecache.serving import RagPrompts
    from sparsecache.overlap import tail_split

    rag = RagPrompts(store)
    chunks = sorted((c for c in rag.store.chunks() if c.token_length >= 480), key=lambda c: c.id)
    rows, tails = [], {}
    for k in ks:
        req = rag.request(TTFT_QUESTION, chunks=[c.id for c in chunks[:k]])
        q = len(req.prompt_token_ids) - req.context_tokens
        base = {c: measure(llm, req, c, {"auto": 0}, repeats) for c in ("full", "none")}
        # rates of this k: prefill of the whole prompt, and the connector's read + decode + write
        rp = len(req.prompt_token_ids) / (base["full"]["ttft_ms"] / 1e3)
        rd = base["none"]["injected_tokens"] / (base["none"]["decode_ms"] / 1e3)
        tails = {"auto": tail_split(req.context_tokens, q, rd, rp), "rates": {"prefill": rp, "decode": rd}}
        for config in CONFIGS:
            r = base.get(config) or measure(llm, req, config, tails, repeats)
            rows.append({"k": k, "config": config, "context_tokens": req.context_tokens, "question_tokens": q,
                         "tail_auto": tails["auto"], "prefill_tokens_per_s": round(rp), "decode_tokens_per_s": round(rd),
                         **{key: round(v, 1) for key, v in r.items()}})
            print(f"k={k:<3} {config:>15} ttft {r['ttft_ms']:8.0f} ms  injected {r['injected_tokens']}", flush=True)
    return rows, tails


def needle_accuracy(llm, store: Path, work: Path, tails_auto_ratio: float) -> list[dict]:
    """Every configuration on the same passkey trials; tail-auto leaves the same fraction of the
    context to vLLM as the closed-form split chose at k = 8."""
    from sparsecache.bench.passkey import ANSWER_PREFIX, load_trials
    from sparsecache.serving import RagPrompts

    rag = RagPrompts(store)
    ids = {c.doc_id: c.id for c in rag.store.chunks() if c.doc_id.startswith(("filler-", "needle-"))}
    trials = load_trials(work)
    rows = []
    for config in ("full", "raw", "none", "tail-chunk", "tail-auto"):
        correct = 0
        for t in trials:
            req = rag.request(t.question, chunks=[ids[d] for d in t.chunk_docs],
                              answer_prefix=ANSWER_PREFIX.format(key=t.key))
            tails = {"auto": int(round(tails_auto_ratio * req.context_tokens))}
            llm.reset_prefix_cache()
            _, text, delta = run(llm, req, params_for(req, config, tails), max_tokens=12)
            if config != "full" and delta.get("fallbacks"):
                raise RuntimeError(f"{config}: fell back on a passkey trial")
            correct += t.value in text
        n = len(trials)
        p = correct / n
        half = 1.96 * (p * (1 - p) / n) ** 0.5
        rows.append({"config": config, "accuracy": p, "ci95": round(half, 3), "trials": n})
        print(f"needle {config:>12} accuracy {p:.3f} ± {half:.3f} ({n} trials)", flush=True)
    return rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for config in CONFIGS:
        pts = [(r["k"], r["ttft_ms"]) for r in rows if r["config"] == config]
        ax.plot(*zip(*pts), marker="o", label=config)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("retrieved chunks k (~500 tokens each)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("vLLM (CPU) with and without SparsecacheConnector")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, required=True, help="the store (made or brought up to date)")
    ap.add_argument("--corpus", type=Path, required=True,
                    help="documents giving >= max(ks) chunks of >= 480 tokens (e.g. bench store's corpus)")
    ap.add_argument("--passkey", type=Path, required=True, help="passkey work directory (made when missing)")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    os.environ.update(ENGINE_ENV)
    ensure_stores(args.store, args.corpus, args.passkey, args.trials, 8)
    llm = make_engine(args.store)
    rows, tails = ttft_table(llm, args.store, args.ks, args.repeats)
    k8 = next(r for r in rows if r["k"] == (8 if 8 in args.ks else args.ks[0]))
    ratio = k8["tail_auto"] / k8["context_tokens"]
    needles = needle_accuracy(llm, args.store, args.passkey, ratio)
    result = {"device": "cpu", "cpu": cpu_model(), "threads": os.environ.get("OMP_NUM_THREADS"),
              "date": time.strftime("%Y-%m-%d"), "vllm": __import__("vllm").__version__, "ttft": rows,
              "tail_auto_ratio_from_k8": round(ratio, 4), "needle": needles}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    sys.exit(main())
