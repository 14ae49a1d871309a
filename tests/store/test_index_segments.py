"""A store's FAISS index as segments: capped in size, a mostly-deleted segment rebuilt over its
live rows, the others untouched, and search over the segments answering as exact search over
the live chunks. Synthetic stores (`bench.scale`'s builder): no model."""

from __future__ import annotations

import builtins
from pathlib import Path

import numpy as np
import pytest

from sparsecache.bench.scale import ScaleConfig, append_documents, build_store, embeddings
from sparsecache.kvstore.index import FaissIndexer, build_index, index_kind, index_to_bytes, load_index_bytes
from sparsecache.kvstore import KVStore
from sparsecache.store import Writer, verify
from sparsecache.store import writer as writer_mod
from sparsecache.store import read_manifest

CFG = ScaleConfig(index="flat")


def _exact(store: KVStore, q: np.ndarray, k: int = 8) -> list[int]:
    rows = store.live_rows()
    emb = store.group["embeddings"][: store.manifest.chunks][rows]
    return rows[np.argsort(-(emb @ q), kind="stable")[:k]].tolist()


def _publish(path, deleted: list[str]) -> None:
    with Writer(path) as w:
        w.begin()
        w.publish({}, deleted, FaissIndexer(CFG.index), "test")


def test_segments_are_capped_rebuilt_when_mostly_dead_and_searched_as_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "INDEX_SEGMENT_ROWS", 1000)
    path = tmp_path / "store"
    build_store(str(path), 2500, CFG)
    first = read_manifest(path).index_segments
    assert [(r["lo"], r["hi"], r["rows"]) for r in first] == [(0, 1000, 1000), (1000, 2000, 1000), (2000, 2500, 500)]

    with Writer(path) as w:  # 40 new chunks: a small segment of their own (500 > 2 x 40: no merge)
        w.begin()
        w.publish(append_documents(w, np.arange(3000, 3040), "n", CFG, 9), (), FaissIndexer(CFG.index), "test")
    second = read_manifest(path).index_segments
    assert second[:3] == first and [(r["lo"], r["hi"], r["rows"]) for r in second[3:]] == [(2500, 2540, 40)]

    # 60% of the first segment's rows deleted: it is rebuilt over the 400 left; 10% of the second's:
    # kept as it is, the dead rows filtered when searching
    _publish(path, [f"doc/{i:09d}" for i in (*range(0, 600), *range(1000, 1100))])
    third = read_manifest(path).index_segments
    assert third[0]["rows"] == 400 and (third[0]["lo"], third[0]["hi"]) == (0, 1000) and third[0] != first[0]
    assert third[1:] == second[1:]
    assert verify(path, None, FaissIndexer(), None)["ok"]  # every live row in one segment, none outside its range

    store = KVStore.open(path)
    fetched, opened = [], []
    real = store.backend.fetch_file
    store.backend.fetch_file = lambda key: fetched.append(key) or real(key)
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **kw: opened.append(Path(f)) or real_open(f, *a, **kw))
    store.warm(background=False)  # every segment's file read once, through the backend
    monkeypatch.undo()
    assert fetched == [p["key"] for p in store.manifest.index_pieces()] and len(fetched) == 4
    # and the chunk-table columns a search's hits are read from: every file of each, nothing else
    gen = Path(path) / "data" / store.manifest.generation
    table = {"chunk_id_utf8", "chunk_id_ends", "doc_id_utf8", "doc_id_ends", "ordinal", "token_offset", "token_length"}
    read = [f for f in opened if gen in f.parents]
    assert {f.relative_to(gen).parts[0] for f in read} == table
    assert sorted(read) == sorted(f for a in table for f in (gen / a).rglob("*") if f.is_file())
    assert set(opened) - set(read) == {real(k) for k in fetched}
    t = store.warm()
    t.join(timeout=60)
    assert not t.is_alive()
    q = embeddings(20, "clustered", 4)
    for x in q:
        got = [c.row for c, _ in store.search(x, 8)]
        assert got == _exact(store, x)
        assert not set(got) & (set(range(600)) | set(range(1000, 1100)))


@pytest.mark.parametrize("kind", ["ivf-f16", "ivf-sq8"])
def test_ivf_kinds_answer_with_row_ids_and_close_to_exact(kind):
    x = embeddings(5000, "clustered", 1)
    ids = np.arange(5000, dtype=np.int64) * 3 + 1
    index = load_index_bytes(index_to_bytes(build_index(x, ids, kind)))
    assert index_kind(index) == kind and index.ntotal == 5000
    scores, got = index.search(x[:50], 1)
    assert (got[:, 0] == ids[:50]).mean() >= 0.98 and np.all(np.abs(scores[:, 0] - 1) < 0.02)
