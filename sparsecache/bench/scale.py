"""`sparsecache bench scale`: what a store's metadata and index cost as the corpus grows.

No model: a store is laid out by the real `Writer` with synthetic chunks (one token each, codes
of a 2-atom dictionary that is never decoded, one chunk per document) and synthetic unit
embeddings, so what is measured is exactly the part that grows with the number of chunks: the
chunk table, the manifest, the FAISS index, and the reader that opens them. Per size N:

- `build_s`, `writer_peak_gb`: the first encode of N chunks (append, commit, publish);
- `open_s`: a reader's `KVStore.open` to its first search answered; `reader_peak_gb` its peak;
- `search_p50_ms` / `search_p99_ms` over `queries` searches right after opening (the page
  cache holding what the build left there), `search_warm_p50_ms` / `_p99_ms` over the same
  searches again, and `recall_at_8` against exact inner-product search of the live embeddings;
- `warm_up_s`: `KVStore.warm` reading the index files and the chunk-table columns a search
  reads once (what `serve` does in the background at start), then `search_warmed_p50_ms` /
  `_p99_ms` over as many new queries (a serving process's steady state), split into the
  FAISS search (`search_warmed_index_ms_p50` / `_p99`) and reading the hits' chunk-table rows
  (`search_warmed_rows_ms_p50` / `_p99`);
- `publish_1pct_s`, `publish_bytes`: a nightly run that changes 1% of the documents (their chunks
  appended anew, the version published); `publish_delete_1pct_s` / `_bytes`: one that deletes 1%.
  Bytes are what the publish wrote (new or rewritten files of the store), not the store's size.

Each phase runs in its own process, so a peak is that phase's alone (`ru_maxrss`).
Embeddings: `clustered` (default; unit vectors around 1,024 random centres, as sentence
embeddings cluster by topic, queries near a stored chunk) or `random` (uniform on the sphere:
the worst case for any approximate index, where the nearest neighbour is barely nearer than
the rest).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DIM = 384  # the default embedder's
BATCH = 100_000  # chunks per append
CENTRES = 1024


@dataclass(frozen=True)
class ScaleConfig:
    sizes: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000, 10_000_000)
    queries: int = 200
    embeddings: str = "clustered"  # or "random"
    index: str = "auto"
    seed: int = 0


class _SyntheticDictionary:
    """The dictionary copy a store keeps (`store.layout.DictionaryCopy`): 2 atoms, never decoded."""

    def __init__(self):
        from ..codec.config import DictConfig

        self.config = DictConfig(atoms=2, sparsity=1, layers_per_signal=1)
        self.model = {"name": "synthetic", "layers": 1, "m": 2}

    def fingerprint(self) -> str:
        return "synthetic-000000"

    def save(self, directory) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dictionary.json").write_text(json.dumps({"synthetic": True}))
        return out


def embeddings(n: int, kind: str, seed: int) -> np.ndarray:
    """n unit vectors [n, DIM] float32 (see the module docstring); the same for the same seed."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        x = rng.standard_normal((n, DIM), dtype=np.float32)
    elif kind == "clustered":
        centres = np.random.default_rng(12345).standard_normal((CENTRES, DIM), dtype=np.float32)
        x = centres[rng.integers(0, CENTRES, n)] * 0.35 + rng.standard_normal((n, DIM), dtype=np.float32) / 20
    else:
        raise ValueError(f"embeddings must be 'clustered' or 'random', got {kind!r}")
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def _rows(ids: np.ndarray, tag: str) -> list[dict]:
    return [{"chunk_id": f"{tag}{i:012x}", "doc_id": f"doc/{i:09d}", "content_hash": f"{tag}{i:x}", "text": "",
             "meta": "", "ordinal": 0, "token_length": 1} for i in ids.tolist()]


def append_documents(w, ids: np.ndarray, tag: str, cfg: ScaleConfig, seed: int):
    """Append one chunk per document id in `ids` (ascending; one token, zero codes, a synthetic
    embedding, made batch by batch: 10M embeddings at once would be 15 GB); the documents'
    table (columns, as the writer keeps it: 10M entries as dicts would be ~5 GB)."""
    from ..codec.codes import Codes, index_row_bytes
    from ..store.doctable import DocTable

    d = _SyntheticDictionary().config
    rb = index_row_bytes(d, w.attrs()["config"]["index_coding"])
    first, offsets = [], []
    for lo in range(0, len(ids), BATCH):
        part = ids[lo: lo + BATCH]
        n = len(part)
        codes = Codes(np.zeros((1, n, rb), np.uint8), np.zeros((1, n, 1), np.uint8))
        emb = embeddings(n, cfg.embeddings, seed * 1_000_003 + lo)
        offsets.append(w.tokens + np.arange(n))
        first.append(w.append(_rows(part, tag), np.zeros(n, np.int32), codes, codes, emb) + np.arange(n))
        w.commit({}, w.tokens, w.chunks)
    rows, offsets = (np.concatenate(x) if x else np.zeros(0, np.int64) for x in (first, offsets))
    digits = ids.astype("S9")
    return DocTable(np.char.add(b"doc/", np.char.zfill(digits, 9)), np.char.add(tag.encode(), digits),
                    {"first": rows, "count": np.ones_like(rows), "tokens": np.ones_like(rows),
                     "token_offset": offsets})


def build_store(path: str, n: int, cfg: ScaleConfig) -> dict:
    from ..kvstore.index import FaissIndexer
    from ..store import StoreConfig, Writer

    t0 = time.perf_counter()
    with Writer(path) as w:
        w.create(StoreConfig(coef_dtype="float16"), _SyntheticDictionary(), {"name": "synthetic", "layers": 1, "m": 2},
                 [0], (np.zeros((1, 1, 2), np.float32), np.zeros((1, 1, 2), np.float32)), DIM, FaissIndexer(cfg.index))
        w.begin()
        w.publish(append_documents(w, np.arange(n), "a", cfg, cfg.seed), (), FaissIndexer(cfg.index), "scale: build")
    return {"build_s": time.perf_counter() - t0}


def _nightly(path: str, n: int, cfg: ScaleConfig, delete: bool) -> dict:
    """Change (or delete) 1% of the documents and publish, as a nightly re-index would."""
    from ..kvstore.index import FaissIndexer
    from ..store import Writer

    rng = np.random.default_rng(cfg.seed + (2 if delete else 1))
    picked = np.sort(rng.choice(n, max(1, n // 100), replace=False))
    t0 = time.perf_counter()
    with Writer(path) as w:
        w.begin()
        if delete:
            w.publish({}, [f"doc/{i:09d}" for i in picked.tolist()], FaissIndexer(cfg.index), "scale: nightly")
        else:
            w.publish(append_documents(w, picked, "c", cfg, cfg.seed + 7), (), FaissIndexer(cfg.index), "scale: nightly")
    return {"s": time.perf_counter() - t0}


def _open_and_search(path: str, cfg: ScaleConfig) -> dict:
    """A reader's side alone: open, first search, then the timed searches (their hits kept)."""
    from ..kvstore.view import KVStore

    q = np.load(Path(path).parent / "queries.npy")
    q, fresh = q[:cfg.queries], q[cfg.queries:]  # a workdir of an earlier run has no second set
    t0 = time.perf_counter()
    s = KVStore.open(path)
    s.search(q[0], 8)
    open_s = time.perf_counter() - t0
    ms, got = _timed_searches(s, q)
    warm_ms, _ = _timed_searches(s, q)  # again: what a serving process sees once the page cache holds what they touch
    out = {"open_s": open_s, "search_p50_ms": float(np.percentile(ms, 50)),
           "search_p99_ms": float(np.percentile(ms, 99)), "search_warm_p50_ms": float(np.percentile(warm_ms, 50)),
           "search_warm_p99_ms": float(np.percentile(warm_ms, 99)), "live_chunks": len(s.live_rows()), "hits": got}
    if len(fresh):  # `serve`'s steady state: every index file read once (`KVStore.warm`), then new queries
        t0 = time.perf_counter()
        s.warm(background=False)
        out["warm_up_s"] = time.perf_counter() - t0
        parts = {}
        fresh_ms, _ = _timed_searches(s, fresh, parts)
        out.update(search_warmed_p50_ms=float(np.percentile(fresh_ms, 50)),
                   search_warmed_p99_ms=float(np.percentile(fresh_ms, 99)),
                   **{f"search_warmed_{k}_p{p}": float(np.percentile(v, p)) for k, v in parts.items() for p in (50, 99)})
    return out


def _timed_searches(s, q: np.ndarray, parts: dict | None = None) -> tuple[np.ndarray, list[list[int]]]:
    """Each query's search time (ms) and the rows it answered with; with `parts`, each search's
    two parts too (`index_ms`: the FAISS segments, `KVStore.search_rows`; `rows_ms`: reading the
    hits' chunk-table rows, `chunks_at`), timed apart."""
    times, got = [], []
    for x in q:
        t = time.perf_counter()
        if parts is None:
            hits = s.search(x, 8)
        else:
            found = s.search_rows(x, 8)
            t1 = time.perf_counter()
            hits = list(zip(s.chunks_at([row for row, _ in found]), [score for _, score in found]))
            parts.setdefault("index_ms", []).append((t1 - t) * 1e3)
            parts.setdefault("rows_ms", []).append((time.perf_counter() - t1) * 1e3)
        times.append(time.perf_counter() - t)
        got.append([c.row for c, _ in hits])
    return np.array(times) * 1e3, got


def _recall(path: str, cfg: ScaleConfig, got: list[list[int]]) -> float:
    """recall@8 of the searches' rows against exact inner-product search of the live embeddings."""
    from ..kvstore.view import KVStore

    q = np.load(Path(path).parent / "queries.npy")[:cfg.queries]
    exact = _exact(KVStore.open(path), q)
    return float(np.mean([len(set(g) & e) / max(1, len(e)) for g, e in zip(got, exact)]))


def _make_queries(path: str, cfg: ScaleConfig) -> None:
    np.save(Path(path).parent / "queries.npy", _queries(path, cfg))


def _queries(path: str, cfg: ScaleConfig) -> np.ndarray:
    """Queries near stored chunks (a stored embedding plus noise), unit length."""
    from ..kvstore.view import KVStore

    rng = np.random.default_rng(cfg.seed + 3)
    s = KVStore.open(path)
    rows = rng.choice(s.live_rows(), 2 * cfg.queries)  # the second half: new queries after `warm`
    x = s.group["embeddings"].get_orthogonal_selection((np.sort(rows), slice(None)))
    x = x + rng.standard_normal(x.shape).astype(np.float32) / 40
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _exact(s, q: np.ndarray) -> list[set[int]]:
    """The 8 nearest live chunks of each query by exact inner product, in blocks (bounded memory)."""
    rows = s.live_rows()
    best = np.full((len(q), 8), -np.inf, np.float32)
    best_rows = np.zeros((len(q), 8), np.int64)
    emb = s.group["embeddings"]
    for lo in range(0, len(rows), 500_000):
        r = rows[lo: lo + 500_000]
        block = emb[int(r[0]): int(r[-1]) + 1][r - r[0]]
        scores = q @ block.T
        scores = np.concatenate([best, scores], 1)
        cand = np.concatenate([best_rows, np.broadcast_to(r, (len(q), len(r)))], 1)
        top = np.argpartition(-scores, 8, axis=1)[:, :8]
        best, best_rows = np.take_along_axis(scores, top, 1), np.take_along_axis(cand, top, 1)
    return [set(r.tolist()) for r in best_rows]


def _bytes(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


def _written(before: dict, after: dict) -> int:
    return sum(size for p, (size, mtime) in after.items() if before.get(p) != (size, mtime))


def in_fresh_process(fn, *args) -> tuple[dict, float]:
    """fn(*args) in a fresh process: (its result, its peak resident memory in GB)."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        out = pool.apply(_peak, (fn, *args))
    return out


def _peak(fn, *args):
    out = fn(*args)
    return out, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KB → GB


def measure(workdir: Path, n: int, cfg: ScaleConfig, progress=print, resume: bool = False) -> dict:
    """Every figure at one size. Each finished phase is recorded in `n<N>/progress.json`; with
    `resume`, a run that stopped (a 10M build takes ~12 minutes) goes on from the phase after."""
    path = workdir / f"n{n}" / "store"
    record = path.parent / "progress.json"
    row = json.loads(record.read_text()) if resume and record.exists() and path.exists() else {}
    if not row:
        shutil.rmtree(path.parent, ignore_errors=True)
        path.parent.mkdir(parents=True)

    def done(phase: str) -> None:
        row.setdefault("_phases", []).append(phase)
        record.write_text(json.dumps(row))

    def todo(phase: str) -> bool:
        return phase not in row.get("_phases", [])

    if todo("build"):
        progress(f"scale: N = {n:,}: building")
        built, writer_peak = in_fresh_process(build_store, str(path), n, cfg)
        row.update({"chunks": n, **built, "writer_peak_gb": writer_peak})
        progress(f"scale: N = {n:,}: built in {built['build_s']:.1f} s; opening and searching")
        in_fresh_process(_make_queries, str(path), cfg)
        done("build")
    if todo("read"):
        read, reader_peak = in_fresh_process(_open_and_search, str(path), cfg)
        read["recall_at_8"] = in_fresh_process(_recall, str(path), cfg, read.pop("hits"))[0]
        row.update({**read, "reader_peak_gb": reader_peak, "store_bytes": sum(s for s, _ in _bytes(path).values())})
        done("read")
    for name, delete in (("publish_1pct", False), ("publish_delete_1pct", True)):
        if todo(name):
            before = _bytes(path)
            out, peak = in_fresh_process(_nightly, str(path), n, cfg, delete)
            row[f"{name}_s"], row[f"{name}_bytes"] = out["s"], _written(before, _bytes(path))
            row[f"{name}_peak_gb"] = peak
            row["writer_peak_gb"] = max(row["writer_peak_gb"], peak)
            progress(f"scale: N = {n:,}: {name} {out['s']:.1f} s, {row[f'{name}_bytes'] / 1e6:.1f} MB written")
            done(name)
    row["publish_bytes"] = row["publish_1pct_bytes"]
    after, reader_peak = in_fresh_process(_open_and_search, str(path), cfg)
    after["recall_at_8"] = in_fresh_process(_recall, str(path), cfg, after.pop("hits"))[0]
    row.update({f"after_{k}": v for k, v in after.items()})
    row["reader_peak_gb"] = max(row["reader_peak_gb"], reader_peak)
    row.pop("_phases", None)
    shutil.rmtree(path.parent, ignore_errors=True)
    return row


def run(workdir: Path, cfg: ScaleConfig, progress=print, resume: bool = False) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in cfg.sizes:
        rows.append(measure(workdir, n, cfg, progress, resume))
        (workdir / "scale.json").write_text(json.dumps(_report(cfg, rows), indent=1))
    return _report(cfg, rows)


def _report(cfg: ScaleConfig, rows: list[dict]) -> dict:
    from ..measure.machine import cpu_model

    machine = {"cpu": cpu_model(), "cores": os.cpu_count(),
               "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    return {"config": {**cfg.__dict__, "sizes": list(cfg.sizes)}, "machine": machine,
            "date": time.strftime("%Y-%m-%d"), "rows": rows}


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    n = [r["chunks"] for r in rows]
    panels = (("open_s", "open → first search (s)"), ("search_p99_ms", "search p99 (ms)"),
              ("recall_at_8", "recall@8"), ("publish_1pct_s", "publish 1% change (s)"),
              ("publish_bytes", "bytes written per publish"), ("reader_peak_gb", "peak memory (GB)"))
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        label = {"reader_peak_gb": "reader", "search_p99_ms": "after opening"}.get(key)
        ax.plot(n, [r[key] for r in rows], "o-", label=label)
        second = {"reader_peak_gb": ("writer_peak_gb", "writer"), "search_p99_ms": ("search_warm_p99_ms", "warm")}
        if key in second and all(second[key][0] in r for r in rows):
            ax.plot(n, [r[second[key][0]] for r in rows], "s--", label=second[key][1])
            ax.legend()
        ax.set_xscale("log")
        if key != "recall_at_8":
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("chunks")
        ax.grid(alpha=0.3)
    fig.suptitle(f"bench scale ({report['config']['embeddings']} embeddings, {report['machine'].get('cpu', '')})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
