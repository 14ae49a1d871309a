"""Scale-out figures for BENCHMARKS.md (issue: stores on object storage, encode on Ray).

1. Encode throughput of the same corpus, in the same run: one process vs Ray with 1 and 2
   CPU actors (local cluster), Ray's fixed cost (cluster start, actor start-up) separated
   from the encode itself.
2. Query-time read latency of 32 retrieved chunks: the local store vs the same store on a
   moto S3 server on 127.0.0.1 (warm), with the bytes and objects fetched.

    python scripts/experiments/bench_scaleout.py --tokens 6000 --out docs/benchmarks/scaleout-cpu.json

Prints a table and writes the JSON. Needs the s3 and ray extras (and moto[server]).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from sparsecache.measure.machine import cpu_model
from sparsecache.testing import moto_copy


def encode_runs(work: Path, tokens: int, device: str) -> list[dict]:
    """The same corpus encoded three ways into fresh stores; seconds per phase for each."""
    from sparsecache.codec.dictionary import Dictionary, default_dictionary
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.model import load_model
    from sparsecache.store import StoreConfig

    corpus = work / "corpus"
    _corpus(corpus, tokens)
    model = load_model(device=device)
    d = Dictionary.load(default_dictionary())
    rows = []
    for label, workers in (("1 process", 0), ("ray, 1 actor", 1), ("ray, 2 actors", 2)):
        t = time.perf_counter()
        r = encode_with([str(corpus)], work / f"store-{workers}", d, model, StoreConfig(),
                        EncodeOptions(device=device, progress=False, workers=workers))
        wall = time.perf_counter() - t
        s = r.seconds
        ray_fixed = s.get("ray start", 0.0)
        rows.append({"run": label, "workers": workers, "tokens": r.tokens, "wall_s": round(wall, 1),
                     "seconds": s, "worker_seconds": {k: round(v, 1) for k, v in r.worker_seconds.items()},
                     "ray_start_s": round(ray_fixed, 1),
                     "tokens_per_s_end_to_end": round(r.tokens / wall, 1),
                     "tokens_per_s_without_ray_start": round(r.tokens / (wall - ray_fixed), 1)})
        print(rows[-1])
        if workers:
            import ray

            ray.shutdown()  # the next run starts its own cluster, as the CLI would
    return rows


def _corpus(out: Path, tokens: int) -> None:
    """Held-out Python documentation as .txt files, about `tokens` tokens (4 characters each)."""
    from sparsecache.text.documents import builtin_documents

    out.mkdir(parents=True)
    chars = 0
    for i, d in enumerate(sorted(builtin_documents("heldout"), key=lambda d: d.name)):
        if chars >= 4 * tokens:
            break
        (out / f"{i:03d}.txt").write_text(d.text)
        chars += len(d.text)


def read_latency(store_path: Path, n_chunks: int, repeats: int) -> dict:
    """Median time to read the codes of `n_chunks` chunks, local vs S3 (moto), warm."""
    from sparsecache.store import Store

    with moto_copy(store_path) as url:
        out = {}
        for name, where in (("local", store_path), ("s3 (moto, 127.0.0.1)", url)):
            s = Store.open(where)
            ids = [c.id for c in s.chunks()]
            pick = [ids[i] for i in np.random.default_rng(0).permutation(len(ids))[:n_chunks]]  # same chunks
            s.read_codes(pick)  # warm: open arrays, page cache / connection pool
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                codes = s.read_codes(pick)
                times.append(time.perf_counter() - t)
            objects = _objects_touched(s, pick)
            out[name] = {"chunks": len(pick), "median_ms": round(1e3 * float(np.median(times)), 2),
                         "bytes_returned": int(codes.nbytes), "objects_fetched": objects[0],
                         "bytes_fetched": objects[1]}
            print(name, out[name])
        return out


def _objects_touched(s, ids) -> tuple[int, int]:
    """How many chunk objects a read of `ids` fetches, and their bytes."""
    from sparsecache.store import CODE_ARRAYS
    from sparsecache.store.reader import chunk_key

    keys = set()
    for name in (*CODE_ARRAYS, "tokens"):
        arr, axis = s.array(name), 0 if name == "tokens" else 1
        step = arr.chunks[axis]
        keys |= {f"{s.data}/{name}/{chunk_key(arr, i, axis)}"
                 for a, b in s.spans(ids) for i in range(a // step, (b - 1) // step + 1)}
    return len(keys), sum(len(raw) for raw in s.backend.get_many(sorted(keys)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--read-store", default=None, help="a store with >= 32 chunks for the read test "
                    "(default: the 1-process store this run encodes)")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="docs/benchmarks/scaleout-cpu.json")
    ap.add_argument("--skip-encode", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="scaleout-"))
    result = {"machine": cpu_model(), "cores": __import__("os").cpu_count(), "device": a.device}
    if not a.skip_encode:
        result["encode"] = encode_runs(work, a.tokens, a.device)
    result["read"] = read_latency(Path(a.read_store) if a.read_store else work / "store-0", a.chunks, a.repeats)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
