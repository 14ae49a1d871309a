"""What the store's fsyncs cost: the same corpus encoded twice into fresh stores, once as
shipped and once with os.fsync made a no-op, in one process, alternating.

    python scripts/experiments/fsync_cost.py --tokens 20000 --repeats 2 --json docs/benchmarks/fsync-cost-cpu.json

Default model, shipped dictionary, store defaults; the corpus is `bench store`'s (the longest
Python documentation topics). Prints tokens/s and the commit (fsync + pending.json) and
index+publish seconds of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from sparsecache.bench.storage import bench_corpus
from sparsecache.codec.dictionary import Dictionary, default_dictionary
from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import encode_with
from sparsecache.model import load_model
from sparsecache.store import StoreConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", dest="out", default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fsync-cost-"))
    bench_corpus(work / "corpus", a.tokens)
    model, d = load_model(), Dictionary.load(default_dictionary())
    real_fsync, runs = os.fsync, []
    for i in range(a.repeats):
        for fsync in (True, False):
            os.fsync = real_fsync if fsync else (lambda fd: None)
            store = work / f"store-{i}-{fsync}"
            r = encode_with([str(work / "corpus")], store, d, model, StoreConfig(), EncodeOptions(progress=False))
            os.fsync = real_fsync
            row = {"fsync": fsync, "tokens": r.tokens, "tokens_per_s": round(r.tokens_per_s, 2), **r.seconds}
            runs.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(store)
    shutil.rmtree(work)
    if a.out:
        Path(a.out).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
