"""`sparsecache serve` against `vllm serve` with full prefill of the same retrieved chunks, one run.

For 1, 4 and 16 concurrent clients, each client sends its share of distinct questions one
after another (streaming chat completions, greedy, --max-tokens each); TTFT is measured at the
client from the moment it starts a request to the first content token, so the baseline's
client-side retrieval (RagPrompts: the same chunks, laid out the same way, sent as token ids
to /v1/completions) counts as the server's retrieval does. Both servers run the same model in
fp32, eager, with vLLM's default prefix caching, one after the other on the same machine.

    OMP_NUM_THREADS=2 python scripts/experiments/bench_serve.py --store demo.store --out docs/benchmarks/serve-cpu.json \
        --plot docs/serve.png

Saves after every (server, concurrency) cell; a rerun with the same --out skips finished cells.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sparsecache.measure.machine import cpu_model

ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
ENGINE_ARGS = ["--max-model-len", "8192", "--enforce-eager"]
EXAMPLE = "Which RFC does the uuid module follow?"


TEMPLATES = {"stdlib": ("What does the {} module do?", "How do I use {} in a program?", "Give an example of using {}."),
             "pydoc": ("Explain {} in Python.", "How do {} work in Python?", "Give an example of {} in Python.")}


def questions(store) -> list[str]:
    """Distinct questions about the store's documents (the demo corpus: Python's documentation),
    a few phrasings each, interleaved so that consecutive questions are about different documents."""
    docs = sorted({c.doc_id for c in store.chunks()})
    out = []
    for i in range(3):
        for doc in docs:
            kind, _, name = doc.partition(":")
            out.append(TEMPLATES.get(kind, TEMPLATES["pydoc"])[i].format(name.replace("-", " ")))
    return out


def start(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server not healthy in 600 s")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_level(ask, qs: list[str], clients: int) -> dict:
    """`clients` threads share `qs`, each asking its share in turn; TTFT and wall time."""
    shares = [qs[i::clients] for i in range(clients)]

    def client(share):
        return [ask(q) for q in share]

    t = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        ttfts = [x for part in pool.map(client, shares) for x in part]
    wall = time.perf_counter() - t
    q = statistics.quantiles(ttfts, n=20, method="inclusive")
    return {"clients": clients, "requests": len(ttfts), "wall_s": round(wall, 2),
            "requests_per_s": round(len(ttfts) / wall, 4), "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1),
            "ttft_p95_ms": round(1e3 * q[18], 1), "ttft_mean_ms": round(1e3 * statistics.mean(ttfts), 1)}


def first_token_s(stream, t0: float) -> float:
    ttft = None
    for event in stream:
        if ttft is None and event.choices and (getattr(event.choices[0], "delta", None) and event.choices[0].delta.content
                                               or getattr(event.choices[0], "text", None)):
            ttft = time.perf_counter() - t0
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 16, 32], help="requests per level, in order")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--servers", nargs="+", default=["sparsecache", "vllm"])
    args = ap.parse_args()
    import openai

    from sparsecache.model.gguf import default_model_dir
    from sparsecache.vllm.serving import RagPrompts

    rag = RagPrompts(args.store)
    qs = questions(rag.store)
    name = rag.store.attrs["model"]["name"]
    result = json.loads(args.out.read_text()) if args.out.exists() else {"rows": []}
    result.update({"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "top_k": args.top_k,
                   "max_tokens": args.max_tokens, "store_version": rag.store.version,
                   "vllm": __import__("vllm").__version__, "threads": os.environ.get("OMP_NUM_THREADS")})
    base = f"http://127.0.0.1:{args.port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="-", timeout=900, max_retries=0)
    commands = {
        "sparsecache": [sys.executable, "-m", "sparsecache.cli.main", "serve", str(args.store), "--port", str(args.port),
                        "--top-k", str(args.top_k), "--", *ENGINE_ARGS],
        "vllm": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(default_model_dir()),
                 "--served-model-name", name, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(args.port),
                 *ENGINE_ARGS],
    }

    def ask_sparsecache(q):
        t0 = time.perf_counter()
        return first_token_s(client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": q}], max_tokens=args.max_tokens, temperature=0,
            stream=True, extra_body={"sparsecache": {"top_k": args.top_k}}), t0)

    def ask_vllm(q):
        t0 = time.perf_counter()
        req = rag.request(q, top_k=args.top_k)  # the client retrieves and lays out, as sparsecache serve does
        return first_token_s(client.completions.create(model=name, prompt=req.prompt_token_ids,
                                                        max_tokens=args.max_tokens, temperature=0, stream=True), t0)

    asks = {"sparsecache": ask_sparsecache, "vllm": ask_vllm}
    for server in args.servers:
        todo = [(c, n) for c, n in zip(args.clients, args.requests)
                if not any(r["server"] == server and r["clients"] == c for r in result["rows"])]
        if not todo:
            continue
        proc = start(commands[server], args.port, args.out.with_suffix(f".{server}.log"))
        try:
            asks[server](qs[-1])  # warm-up (a question no level asks)
            if server == "sparsecache" and "example" not in result:  # the README's example, as served
                r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": EXAMPLE}],
                                                   max_tokens=64, temperature=0)
                result["example"] = {"question": EXAMPLE, "answer": r.choices[0].message.content,
                                     "sparsecache": r.model_extra["sparsecache"]}
            for clients, n in todo:
                # each level asks questions no other level asks: a prompt seen before would be
                # answered from vLLM's prefix cache (both servers have it on), which is not what is measured
                start_at = sum(m for c, m in zip(args.clients, args.requests) if c < clients)
                level = qs[start_at:start_at + n]
                if len(level) < n or start_at + n >= len(qs):
                    raise SystemExit(f"{len(qs)} questions are too few for --requests {args.requests}")
                row = {"server": server, **run_level(asks[server], level, clients)}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1))
        finally:
            stop(proc)
    if args.plot:
        plot(result["rows"], args.plot)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for server, style in (("sparsecache", "-o"), ("vllm", "--s")):
        part = sorted((r for r in rows if r["server"] == server), key=lambda r: r["clients"])
        if not part:
            continue
        label = "sparsecache serve" if server == "sparsecache" else "vllm serve (full prefill)"
        xs = [r["clients"] for r in part]
        a.plot(xs, [r["requests_per_s"] for r in part], style, label=label)
        b.plot(xs, [r["ttft_p50_ms"] / 1e3 for r in part], style, label=f"{label} p50")
        b.plot(xs, [r["ttft_p95_ms"] / 1e3 for r in part], style, alpha=0.4, label=f"{label} p95")
    for ax, y in ((a, "requests/s"), (b, "TTFT (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(y)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    b.set_yscale("log")
    fig.suptitle("RAG serving on the demo store, k = 8 (CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
