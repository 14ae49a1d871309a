"""#79 item 4: the two-chunk questions of #69's dev entity suite (i5-dev), their contexts placed
(both needed chunks among retrieval's look-alikes, at fixed ranks) instead of retrieval's top k.
Same corpus and stores as i5-dev; one-chunk questions left out (their contexts would not change)."""
import json, shutil, sys
from pathlib import Path
from dataclasses import replace
from sparsecache.bench.fidelity import retrieved, CONTEXTS
from sparsecache.measure.suite import load_suite, save_suite
from sparsecache.model.kvmodel import load_model
from sparsecache.query.session import Session

src, dst, n = Path("i5-dev"), Path("s2c-dev"), int(sys.argv[1])
dst.mkdir(exist_ok=True)
shutil.copy(src / "corpus.jsonl", dst / "corpus.jsonl")
for s in ("store", "store-wrapped"):
    if not (dst / s).exists():
        shutil.copytree(src / s, dst / s)
settings = json.loads((src / "suite.json").read_text())
settings["contexts"] = CONTEXTS["placed"]
suite = load_suite(src)
two = {k: [q for q in qs if len(q.docs) > 1][:n] for k, qs in suite.items()}
session = Session(dst / "store", load_model("default"), "cpu")
placed = retrieved(session, two, place_needed=True)
for q in placed[8][:3]:
    print(q.id, q.docs, q.needed, q.chunks)
save_suite(dst, placed)
(dst / "suite.json").write_text(json.dumps(settings))
print(len(placed[8]), "two-chunk questions placed")
