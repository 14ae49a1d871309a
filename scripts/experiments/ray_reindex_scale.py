"""Issue #53 item 6: a nightly re-index on Ray into a store whose index is large costs the
driver what the run appended, not a rebuild of the corpus's index.

Per corpus size N (documents of one short chunk each, in one JSONL file):

1. a first encode, in one process (the store and its HNSW/IVF index at N chunks);
2. `changed` documents edited, the re-index run with `workers` Ray actors (a local cluster):
   the driver's phases (`EncodeReport.seconds`: scan, plan, the actors' encode, `index+publish`)
   and the bytes the publish wrote under `index/`;
3. what the driver would pay to rebuild the whole index instead (the store's live embeddings
   through the same `FaissIndexer`, timed here), so the two are side by side at each N.

The model is a random 4-layer Llama (m = 32, the default model's tokenizer) and the dictionary
random unit atoms, as in the tests: what is measured here grows with the number of chunks, not
with the model (a real model's encode of a large corpus on this CPU would take days), and the
actors run the real encode path (model forward, OMP, the default embedder).

    python scripts/experiments/ray_reindex_scale.py --work /tmp/rr --sizes 10000,100000 \
        --out docs/benchmarks/ray-reindex-scale.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
         "kestrel", "lagoon", "meadow", "nectar", "onyx", "prairie", "quartz", "raven", "sierra", "tundra")


def text(i: int, edit: int = 0) -> str:
    w = [WORDS[(i * 7 + j * 3 + edit) % len(WORDS)] for j in range(6)]
    return (f"Record {i}{'-r' + str(edit) if edit else ''}: the {w[0]} {w[1]} shipment left bin {i % 97} "
            f"of the {w[2]} depot on day {i % 365}, bound for {w[3]} {w[4]} by way of {w[5]}.")


def write_corpus(path: Path, n: int, edited: set[int], edit: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i:08d}", "text": text(i, edit if i in edited else 0)}) + "\n")


def index_bytes(store: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (store / "index").glob("*.faiss")}


def full_rebuild_s(store: Path) -> tuple[float, int, str]:
    """Seconds to build the whole live index again, as the driver did before indexes had segments."""
    from sparsecache.kvstore.index import FaissIndexer
    from sparsecache.store.reader import Store

    s = Store.open(str(store))
    rows = s.live_rows()
    emb = s.group["embeddings"]
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        kind = FaissIndexer("auto").write(lambda pos: emb[int(rows[pos[0]]): int(rows[pos[-1]]) + 1][rows[pos] - rows[pos[0]]],
                                          rows, emb.shape[1], Path(tmp) / "all.faiss")
        return time.perf_counter() - t, len(rows), kind


def measure(work: Path, n: int, changed: int, workers: int, model_dir: Path, dictionary, model) -> dict:
    import ray

    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.store import StoreConfig

    corpus, store = work / f"corpus-{n}.jsonl", work / f"store-{n}"
    edited = set(np.random.default_rng(n).choice(n, changed, replace=False).tolist())
    row = {"chunks": n, "changed_documents": changed, "workers": workers}
    if not (store / "manifests").exists():
        write_corpus(corpus, n, set(), 0)
        t = time.perf_counter()
        r = encode_with([str(corpus)], str(store), dictionary, model, StoreConfig(chunk_tokens=64),
                        EncodeOptions(progress=True, batch_tokens=32768, model=str(model_dir)))
        row["first_encode_s"] = round(time.perf_counter() - t, 1)
        row["first_encode_phases_s"] = {k: round(v, 2) for k, v in r.seconds.items()}
    for edit in (1, 2):  # the second re-index is the one reported: Ray's start-up paid once before
        write_corpus(corpus, n, edited, edit)
        before = index_bytes(store)
        t = time.perf_counter()
        r = encode_with([str(corpus)], str(store), dictionary, model, StoreConfig(chunk_tokens=64),
                        EncodeOptions(progress=False, workers=workers, model=str(model_dir)))
        wall = time.perf_counter() - t
    after = index_bytes(store)
    ray.shutdown()
    row.update({"reindex_wall_s": round(wall, 2), "reindex_documents": r.documents,
                "reindex_phases_s": {k: round(v, 3) for k, v in r.seconds.items()},
                "driver_index_publish_s": round(r.seconds.get("index+publish", float("nan")), 3),
                "index_bytes_written": sum(v for k, v in after.items() if k not in before),
                "index_bytes_total": sum(after.values()), "index_segments": len(after)})
    s, rows, kind = full_rebuild_s(store)
    row.update({"full_rebuild_s": round(s, 2), "full_rebuild_rows": rows, "full_rebuild_kind": kind})
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--changed", type=int, default=100, help="documents edited per re-index (the same at every size)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    from sparsecache.measure.machine import cpu_model
    from sparsecache.model import load_model
    from sparsecache.testing import tiny_dictionary, write_tiny_llama

    a.work.mkdir(parents=True, exist_ok=True)
    model_dir = a.work / "tiny-llama"
    if not (model_dir / "config.json").exists():
        write_tiny_llama(model_dir)
    model = load_model(str(model_dir))
    dictionary = tiny_dictionary(model.fingerprint())
    rows = [measure(a.work, int(n), a.changed, a.workers, model_dir, dictionary, model) for n in a.sizes.split(",")]
    report = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'chunks':>8} {'re-index wall':>14} {'driver index+publish':>21} {'index bytes written':>20} {'full rebuild':>13}")
    for r in rows:
        print(f"{r['chunks']:>8} {r['reindex_wall_s']:>13.1f}s {r['driver_index_publish_s']:>20.2f}s "
              f"{r['index_bytes_written']:>20,} {r['full_rebuild_s']:>12.1f}s ({r['full_rebuild_kind']})")


if __name__ == "__main__":
    main()
