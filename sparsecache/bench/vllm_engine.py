"""`bench vllm`: vLLM with `SparsecacheConnector` against what a vLLM user has without it, in one engine and one run.

1. Time to first token for k retrieved chunks (of >= `min_chunk_tokens` tokens each), median of
   `repeats` single-request `generate(max_tokens=1)` calls after one warm-up:
   - `full`: vLLM prefills the whole prompt;
   - `prefix-warm`: the same prompt a second time with vLLM's prefix cache warm: the best a user
     gets without us, and only for a context seen before in the same order;
   - `raw`: the connector injects exact fp16 KV per chunk (TurboRAG/LMCache-style files);
   - `none`: the connector injects the store's decoded codes as they are;
   - `METHOD:R`: the connector blends: R of the chunk tokens selected and recomputed through vLLM's
     own layers.
2. The RULER-style needle suite (`bench ruler`'s tasks, `trials` each, k = 8) for NEEDLE_CONFIGS, each
   cell's trials submitted as one batch (each request with its own prefix-cache salt).
3. Throughput: `concurrent` RAG requests at k = 8 (different chunk sets) submitted at once: requests/s
   and the mean of vLLM's own first-token latency per request.
4. Fidelity (`fidelity=W`, alone: the engine's connector serves W/store): `bench fidelity`'s questions at
   k, answered greedily by vLLM's own full prefill and by the connector (`default`: its default blend;
   `none`); agreement is `bench fidelity`'s first-sentence comparison, against vLLM's full prefill and
   against our loop's answer of the same configuration (from `loop_results`).

Every finished row is saved to `out` at once; a rerun with the same `out` skips what is there. The engine
runs in this process: the CLI sets ENGINE_ENV before vLLM is imported.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..durable import write_atomic
from ..errors import ConfigError
from ..measure.machine import cpu_model

# k = 32 chunks of ~500 tokens exceed the default model's 8,192 positions: TTFT is a matter of
# compute, so vLLM is allowed the longer length (answers there are not judged; needles use k = 8).
# vLLM logs to stderr, so that stdout holds the command's output alone (--json: one JSON object).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
TTFT_QUESTION = "Summarise what these passages say about the subject they share."
BLENDS = ("infoflow:0.15", "infoflow:0.25", "a3:0.15", "cacheblend:0.15", "cacheclip:0.15")
CONFIGS = ("full", "prefix-warm", "raw", "none", *BLENDS)
NEEDLE_CONFIGS = ("full", "none", *BLENDS)
THROUGHPUT_CONFIGS = ("full", "none", "infoflow:0.25")
FIDELITY_CONFIGS = ("full", "default", "none")
SECTIONS = ("ttft", "needle", "throughput")
# our loop's label for a configuration's answers (`bench fidelity`'s rows)
LOOP_LABELS = {"full": "full", "default": "infoflow:0.25", "none": "none"}


@dataclass(frozen=True)
class VllmBench:
    """What `bench vllm` measures (see the module docstring)."""

    sections: tuple[str, ...] = SECTIONS
    corpus: Path | None = None  # documents encoded into the store first (long chunks for TTFT and throughput)
    ruler: Path | None = None  # the needle section's suite directory (made when missing)
    ks: tuple[int, ...] = (2, 8, 32)
    repeats: int = 2
    configs: tuple[str, ...] = CONFIGS
    warmup_full: bool = True
    trials: int = 20
    concurrent: int = 8
    min_chunk_tokens: int = 480
    max_model_len: int = 20480
    fidelity: Path | None = None  # a `bench fidelity` workdir: the fidelity section alone, on its store
    fidelity_k: int = 8
    loop_results: Path | None = field(default=None)
    ttft_questions: int = 5

    def __post_init__(self):
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise ConfigError(f"--sections must be among {', '.join(SECTIONS)}, got {', '.join(sorted(unknown))}")
        if "needle" in self.sections and self.fidelity is None and self.ruler is None:
            raise ConfigError("the needle section needs --ruler DIR (the suite is made there when missing)")
        if self.repeats < 1 or not self.ks or min(self.ks) < 1:
            raise ConfigError("--repeats and every k must be >= 1")


def bench_vllm(store: Path | None, out: Path, cfg: VllmBench, progress=lambda message: None) -> dict:
    """Run `cfg`'s sections on an engine over `store` (with `cfg.fidelity`, over that workdir's store),
    saving to `out` (JSON) as rows finish. ENGINE_ENV must be in the environment before vLLM is imported."""
    from ..vllm.serving import RagPrompts

    out = Path(out)
    if cfg.fidelity is None:
        if store is None:
            raise ConfigError("a store is needed (or --fidelity W, whose store is W/store)")
        ensure_store(Path(store), cfg)
    else:
        store = cfg.fidelity / "store"
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update({"cpu": cpu_model(), "threads": os.environ.get("OMP_NUM_THREADS"), "date": time.strftime("%Y-%m-%d"),
                   "vllm": __import__("vllm").__version__})

    def save(**section):
        result.update(section)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(result, indent=1))

    llm = make_engine(Path(store), cfg.max_model_len)
    rag = RagPrompts(store)
    if cfg.fidelity is not None:
        loop = json.loads(cfg.loop_results.read_text())["rows"] if cfg.loop_results and cfg.loop_results.exists() \
            else []
        rows = fidelity(llm, rag, cfg.fidelity, cfg.fidelity_k, FIDELITY_CONFIGS, loop, result.get("fidelity", []),
                        lambda rows: save(fidelity=rows))
        save(fidelity=rows, fidelity_summary=fidelity_summary(rows))
        if "fidelity_ttft" not in result and cfg.ttft_questions:
            save(fidelity_ttft=fidelity_ttft(llm, rag, cfg.fidelity, cfg.fidelity_k, cfg.ttft_questions,
                                             FIDELITY_CONFIGS, 1))
        return result
    if "ttft" in cfg.sections:
        ttft_table(llm, rag, cfg, result.get("ttft", []), lambda rows: save(ttft=rows))
        progress(f"ttft: {len(result.get('ttft', []))} rows")
    if "needle" in cfg.sections:
        save(needle=needle_suite(llm, rag, cfg.ruler, NEEDLE_CONFIGS, result.get("needle", []),
                                 lambda rows: save(needle=rows)))
    if "throughput" in cfg.sections and "throughput" not in result:
        save(throughput=throughput(llm, rag, cfg.concurrent, THROUGHPUT_CONFIGS, cfg.min_chunk_tokens))
    return result


def ensure_store(store: Path, cfg: "VllmBench") -> None:
    """The corpus (`cfg.corpus`, where given) and, for the needle section, the RULER-style suite's documents
    in the store; encode-corpus runs in a subprocess, as a nightly job would, and only encodes what is new.
    Then, for the `raw` configuration, the exact fp16 KV files of the long chunks, made (once) by the same
    code as `query --method raw`."""
    sources = [str(cfg.corpus)] if cfg.corpus else []
    if "needle" in cfg.sections:
        from transformers import AutoTokenizer

        from .ruler import TASKS, make_suite

        if not (cfg.ruler / "trials.json").exists():
            make_suite(AutoTokenizer.from_pretrained(str(store_model(store))), cfg.ruler, TASKS, cfg.trials, 8, 200)
        sources.append(str(cfg.ruler / "corpus.jsonl"))
    if sources:
        subprocess.run([sys.executable, "-m", "sparsecache.cli.main", "encode-corpus", *sources, "--store", str(store)],
                       check=True, stdout=sys.stderr)  # stdout is the command's own (--json)
    if "raw" in cfg.configs and "ttft" in cfg.sections:
        subprocess.run([sys.executable, "-c", "import sys; from sparsecache.query.session import Session; "
                        "s = Session(sys.argv[1]); s.raw_files([c.id for c in s.store.chunks() "
                        "if c.token_length >= int(sys.argv[2])])", str(store), str(cfg.min_chunk_tokens)], check=True,
                       stdout=sys.stderr)


def store_model(store: Path) -> Path:
    """The directory of the model `store` was encoded with (its packaged model, or the path it records)."""
    from ..model.gguf import for_recorded, model_dir
    from ..store import open_backend
    from ..store.layout import root_attrs

    return model_dir(for_recorded("default", root_attrs(open_backend(store))["model"]))


def make_engine(store: Path, max_model_len: int):
    """vLLM's in-process engine over the store's model, fp32 and eager, prefix caching on, with the
    connector on `store`."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    cfg = KVTransferConfig(kv_connector="SparsecacheConnector", kv_connector_module_path="sparsecache.vllm",
                           kv_role="kv_consumer", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"store": str(store)})
    return LLM(str(store_model(store)), dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
               enable_prefix_caching=True, max_model_len=max_model_len, max_num_batched_tokens=max_model_len,
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


def long_chunks(rag, min_tokens: int) -> list:
    """The store's chunks of at least `min_tokens` tokens (the TTFT and throughput sections' contexts)."""
    chunks = sorted((c for c in rag.store.chunks() if c.token_length >= min_tokens), key=lambda c: c.id)
    if not chunks:
        raise ConfigError(f"the store has no chunk of >= {min_tokens} tokens (--min-chunk-tokens)")
    return chunks


def ttft_table(llm, rag, cfg: "VllmBench", rows: list[dict], save) -> list[dict]:
    """TTFT rows of every (k, configuration) not in `rows` yet, each saved as it is measured;
    without `cfg.warmup_full`, vLLM's full prefill is timed once cold (minutes at k = 32)."""
    chunks = long_chunks(rag, cfg.min_chunk_tokens)
    ks, repeats, configs, warmup_full = cfg.ks, cfg.repeats, cfg.configs, cfg.warmup_full
    if max(ks) > len(chunks):
        raise ConfigError(f"k = {max(ks)} needs {max(ks)} chunks of >= {cfg.min_chunk_tokens} tokens; the store has "
                          f"{len(chunks)}")
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
            save(rows)
    return rows


def needle_suite(llm, rag, ruler: Path, configs, done: list[dict], save) -> list[dict]:
    """Every configuration on every task's trials of the RULER-style suite, as `bench ruler` grades them."""
    from ..measure.stats import wilson
    from .ruler import load_suite

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
            save(rows)
    return rows


def throughput(llm, rag, n: int, configs, min_tokens: int) -> list[dict]:
    """`n` requests at k = 8, each over its own 8 chunks, submitted together (max_tokens 16)."""
    chunks = long_chunks(rag, min_tokens)
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
    return rows


def fidelity(llm, rag, workdir: Path, k: int, configs, loop: list[dict], done: list[dict], save,
             batch: int = 20, max_new_tokens: int = 24) -> list[dict]:
    """`bench fidelity`'s k-chunk questions through vLLM, `batch` requests submitted together
    (each with its own prefix-cache salt) and saved as they finish: a rerun resumes."""
    from ..measure.answers import answer_span, contains
    from ..measure.suite import chunk_ids_by_doc, load_suite

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
    return rows


def fidelity_summary(rows: list[dict]) -> list[dict]:
    """Per configuration: agreement with vLLM's full prefill and with our loop's answer of the
    same configuration (Wilson 95% intervals), accuracy against the truth."""
    from ..measure.stats import wilson

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
    return out


def fidelity_ttft(llm, rag, workdir: Path, k: int, n: int, configs, repeats: int) -> list[dict]:
    """Single-request TTFT (as the ttft section measures it) of the first n questions."""
    from ..measure.suite import chunk_ids_by_doc, load_suite

    ids = chunk_ids_by_doc(rag.store)
    rows = []
    for q in load_suite(workdir)[k][:n]:
        req = rag.request(q.question, chunks=[ids[d] for d in q.chunk_docs])
        for config in configs:
            r = measure(llm, req, config, repeats)
            rows.append({"question": q.id, "config": config, "context_tokens": req.context_tokens,
                         **{key: round(v, 1) for key, v in r.items()}})
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
