"""#94 item 5: twochunk-2026-12-06/prepare.py for any model and workdir: the first N two-chunk questions of SRC's
suite with their contexts placed, into DST (same corpus and stores).
Usage: python prepare_model.py SRC DST N MODEL"""
import json, shutil, sys
from pathlib import Path
from sparsecache.bench.fidelity import retrieved, CONTEXTS
from sparsecache.measure.suite import load_suite, save_suite
from sparsecache.model.kvmodel import load_model
from sparsecache.query.session import Session

src, dst, n, name = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dst.mkdir(exist_ok=True)
shutil.copy(src / "corpus.jsonl", dst / "corpus.jsonl")
for s in ("store", "store-wrapped"):
    if (src / s).exists() and not (dst / s).exists():  # a plain-store model (Qwen) has no store-wrapped
        shutil.copytree(src / s, dst / s)
settings = json.loads((src / "suite.json").read_text())
settings["contexts"] = CONTEXTS["placed"]
suite = load_suite(src)
two = {k: [q for q in qs if len(q.docs) > 1][:n] for k, qs in suite.items()}
session = Session(dst / "store", load_model(name), "cpu")
placed = retrieved(session, two, place_needed=True)
for q in placed[8][:3]:
    print(q.id, q.docs, q.needed, q.chunks)
save_suite(dst, placed)
(dst / "suite.json").write_text(json.dumps(settings))
print(len(placed[8]), "two-chunk questions placed")
