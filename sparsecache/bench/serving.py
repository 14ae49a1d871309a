"""`bench serve`: `sparsecache serve` against `vllm serve` with full prefill of the same retrieved chunks.

For each level of concurrent clients, each client sends its share of distinct questions one after
another (streaming, greedy, `max_tokens` each); TTFT is measured at the client from the moment it
starts a request to the first content token, so the baseline's client-side retrieval (`RagPrompts`:
the same chunks, laid out the same way, sent as token ids to /v1/completions) counts as the server's
retrieval does. Both servers run the store's model in fp32, eager, with vLLM's default prefix caching,
one after the other on the same machine, bound to 127.0.0.1. Every (server, level) row is saved to
`out` as it is made, and a rerun with the same `out` skips the rows already there.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..durable import write_atomic
from ..errors import ConfigError
from ..measure.machine import cpu_model

SERVERS = ("sparsecache", "vllm")
ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
ENGINE_ARGS = ("--max-model-len", "8192", "--enforce-eager")
EXAMPLE = "Which RFC does the uuid module follow?"
TEMPLATES = {"stdlib": ("What does the {} module do?", "How do I use {} in a program?", "Give an example of using {}."),
             "pydoc": ("Explain {} in Python.", "How do {} work in Python?", "Give an example of {} in Python.")}


@dataclass(frozen=True)
class ServeBench:
    """What `bench serve` measures: `requests[i]` requests at `clients[i]` concurrent clients, per server."""

    clients: tuple[int, ...] = (1, 4, 16)
    requests: tuple[int, ...] = (8, 16, 32)
    top_k: int = 8
    max_tokens: int = 16
    servers: tuple[str, ...] = SERVERS
    port: int = 0  # 0: a free port
    engine_args: tuple[str, ...] = ENGINE_ARGS  # vLLM options both servers get
    start_timeout_s: float = 600

    def __post_init__(self):
        if len(self.clients) != len(self.requests) or not self.clients:
            raise ConfigError("--clients and --requests need one value each per level")
        if any(c < 1 for c in self.clients) or any(n < c for c, n in zip(self.clients, self.requests)):
            raise ConfigError("each level needs >= 1 client and at least as many requests as clients")
        unknown = set(self.servers) - set(SERVERS)
        if unknown or not self.servers:
            raise ConfigError(f"--servers must be among {', '.join(SERVERS)}")


def questions(store) -> list[str]:
    """Distinct questions about the store's documents (the demo corpus: Python's documentation), a few
    phrasings each, interleaved so that consecutive questions are about different documents."""
    docs = sorted({c.doc_id for c in store.chunks()})
    out = []
    for i in range(3):
        for doc in docs:
            kind, _, name = doc.partition(":")
            out.append(TEMPLATES.get(kind, TEMPLATES["pydoc"])[i].format(name.replace("-", " ")))
    return out


def bench_serve(store: str | Path, out: str | Path, cfg: ServeBench = ServeBench()) -> dict:
    """Measure `cfg`'s levels on each server over `store`, saving to `out` (JSON) row by row."""
    import openai

    from ..model.gguf import for_recorded, model_dir
    from ..vllm.serving import RagPrompts

    out = Path(out)
    rag = RagPrompts(store)
    qs = questions(rag.store)
    if sum(cfg.requests) >= len(qs):
        raise ConfigError(f"the store's {len(qs)} questions are too few for --requests "
                          f"{','.join(map(str, cfg.requests))} (each level asks new ones, and one warms up)")
    name = rag.store.attrs["model"]["name"]
    port = cfg.port or _free_port()
    result = json.loads(out.read_text()) if out.exists() else {"rows": []}
    result.update({"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "top_k": cfg.top_k,
                   "max_tokens": cfg.max_tokens, "store_version": rag.store.version,
                   "vllm": __import__("vllm").__version__, "threads": os.environ.get("OMP_NUM_THREADS")})
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=900, max_retries=0)
    model = model_dir(for_recorded("default", rag.store.attrs["model"]))  # the store's own model
    commands = {
        "sparsecache": [sys.executable, "-m", "sparsecache.cli.main", "serve", str(store), "--host", "127.0.0.1",
                        "--port", str(port), "--top-k", str(cfg.top_k), "--", *cfg.engine_args],
        "vllm": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                 "--served-model-name", name, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                 *cfg.engine_args],
    }

    def ask_sparsecache(q):
        t0 = time.perf_counter()
        return first_token_s(client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": q}], max_tokens=cfg.max_tokens, temperature=0,
            stream=True, extra_body={"sparsecache": {"top_k": cfg.top_k}}), t0)

    def ask_vllm(q):
        t0 = time.perf_counter()
        req = rag.request(q, top_k=cfg.top_k)  # the client retrieves and lays out, as sparsecache serve does
        return first_token_s(client.completions.create(model=name, prompt=req.prompt_token_ids,
                                                        max_tokens=cfg.max_tokens, temperature=0, stream=True), t0)

    asks = {"sparsecache": ask_sparsecache, "vllm": ask_vllm}
    for server in cfg.servers:
        todo = [(c, n) for c, n in zip(cfg.clients, cfg.requests)
                if not any(r["server"] == server and r["clients"] == c for r in result["rows"])]
        if not todo:
            continue
        proc = start(commands[server], port, out.with_suffix(f".{server}.log"), cfg.start_timeout_s)
        try:
            asks[server](qs[-1])  # warm-up (a question no level asks)
            if server == "sparsecache" and "example" not in result:  # the README's example, as served
                r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": EXAMPLE}],
                                                   max_tokens=64, temperature=0)
                result["example"] = {"question": EXAMPLE, "answer": r.choices[0].message.content,
                                     "sparsecache": r.model_extra["sparsecache"]}
            for clients, n in todo:
                # each level asks questions no other level asks: a prompt seen before would be answered
                # from vLLM's prefix cache (both servers have it on), which is not what is measured
                at = sum(m for c, m in zip(cfg.clients, cfg.requests) if c < clients)
                row = {"server": server, **run_level(asks[server], qs[at:at + n], clients)}
                result["rows"].append(row)
                out.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(out, json.dumps(result, indent=1))
        finally:
            stop(proc)
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log: Path, timeout_s: float) -> subprocess.Popen:
    """Start a server and wait (at most `timeout_s`) until its /health answers."""
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"server not healthy in {timeout_s:g} s (its log: {log})")
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
        proc.wait(timeout=60)


def run_level(ask, qs: list[str], clients: int) -> dict:
    """`clients` threads share `qs`, each asking its share in turn; TTFT and wall time."""
    shares = [qs[i::clients] for i in range(clients)]

    def client(share):
        return [ask(q) for q in share]

    t = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        ttfts = [x for part in pool.map(client, shares) for x in part]
    wall = time.perf_counter() - t
    q = statistics.quantiles(ttfts, n=20, method="inclusive") if len(ttfts) > 1 else [ttfts[0]] * 19
    return {"clients": clients, "requests": len(ttfts), "wall_s": round(wall, 2),
            "requests_per_s": round(len(ttfts) / wall, 4), "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1),
            "ttft_p95_ms": round(1e3 * q[18], 1), "ttft_mean_ms": round(1e3 * statistics.mean(ttfts), 1)}


def first_token_s(stream, t0: float) -> float | None:
    """Seconds from `t0` to a streamed response's first content (the stream read to its end)."""
    ttft = None
    for event in stream:
        if ttft is None and event.choices and (getattr(event.choices[0], "delta", None) and event.choices[0].delta.content
                                               or getattr(event.choices[0], "text", None)):
            ttft = time.perf_counter() - t0
    return ttft


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
    fig.suptitle("RAG serving over a store (sparsecache serve against vllm serve)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
