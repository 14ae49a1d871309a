"""The document table as immutable segments: any history of changes reads back as the table a
plain dict would hold, a publish writes what changed (plus log-structured merging), and stores
whose manifests hold the table inline (format ≤ 3) still open, answer and migrate."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsecache.store import open_backend
from sparsecache.store.doctable import DocTable, Segment, appended, read_live, read_segment, resolve, write_live

IDS = st.sampled_from([f"doc/{i}" for i in range(40)] + ["ünïcode/ß", "../x", ""])
ENTRY = st.fixed_dictionaries({"hash": st.text(max_size=8).filter(lambda h: not h.endswith("\0")), "first": st.integers(0, 2**40),
                               "count": st.integers(0, 9), "tokens": st.integers(0, 10**6),
                               "token_offset": st.integers(0, 2**40)})
NIGHT = st.tuples(st.dictionaries(IDS, ENTRY, max_size=12), st.lists(IDS, max_size=6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nights=st.lists(NIGHT, min_size=1, max_size=12))
def test_any_history_of_segments_reads_back_as_the_table(tmp_path_factory, nights):
    backend = open_backend(tmp_path_factory.mktemp("doctable"))
    table: dict[str, dict] = {}
    refs: list[dict] = []
    for upserts, deletes in nights:
        for d in deletes:
            table.pop(d, None)
        table.update(upserts)
        refs = appended(backend, refs, Segment(upserts, deletes))
        assert resolve([read_segment(backend, r) for r in refs]) == table
    assert len(refs) <= 2 + math.log2(1 + sum(len(u) + len(d) for u, d in nights))  # each more than twice the next


WIDE_IDS = st.one_of(IDS, st.text(min_size=1, max_size=30).filter(lambda i: "\0" not in i))


@settings(max_examples=60, deadline=None)
@given(base=st.dictionaries(WIDE_IDS, ENTRY, max_size=20), later=st.dictionaries(WIDE_IDS, ENTRY, max_size=8),
       deleted=st.lists(WIDE_IDS, max_size=6))
def test_the_columnar_table_merges_and_looks_up_as_a_dict_does(base, later, deleted):
    want = {k: v for k, v in base.items() if k not in deleted} | later
    got = DocTable.from_dict(base).then(DocTable.from_dict(later), Segment({}, deleted).deleted)
    assert dict(got.items()) == want and got == want and len(got) == len(want)
    assert list(got) == sorted(want)  # the ids stay sorted, however their widths mix
    probe = sorted(set(want) | set(deleted) | {"absent"})
    assert [p in got for p in probe] == [p in want for p in probe]
    assert [got.get(p) for p in probe] == [want.get(p) for p in probe]
    assert (got.find(probe) >= 0).tolist() == [p in want for p in probe]
    spans = [r for d in want.values() for r in range(d["first"], d["first"] + d["count"])]
    np.testing.assert_array_equal(got.rows(), np.sort(np.array(spans, np.int64)))


def test_ids_ending_with_nul_are_refused():
    with pytest.raises(ValueError, match="NUL"):
        DocTable.from_dict({"a\0": {"hash": "h", "first": 0, "count": 1, "tokens": 1, "token_offset": 0}})


def test_a_nightly_change_writes_a_small_segment_and_merges_log_structured(tmp_path):
    backend = open_backend(tmp_path)
    base = {f"doc/{i}": {"hash": "a", "first": i, "count": 1, "tokens": 3, "token_offset": 3 * i} for i in range(1000)}
    refs = appended(backend, [], Segment(base))
    sizes = []
    for night in range(8):
        change = {f"doc/{i}": {**base[f"doc/{i}"], "hash": f"n{night}"} for i in range(night * 10, night * 10 + 10)}
        refs = appended(backend, refs, Segment(change))
        sizes.append([r["entries"] + r["deleted"] for r in refs])
    assert sizes[:4] == [[1000, 10], [1000, 20], [1000, 30], [1000, 30, 10]]
    assert all(s[0] == 1000 for s in sizes)  # the big base segment is never rewritten by a small change


def test_the_live_bitmap_round_trips(tmp_path):
    backend = open_backend(tmp_path)
    live = np.random.default_rng(0).random(10_007) < 0.9
    key = write_live(backend, live)
    np.testing.assert_array_equal(read_live(backend, key, len(live)), np.flatnonzero(live))
    assert write_live(backend, live) == key  # content-addressed: the same bits, the same piece


def _inline(store) -> None:
    """Rewrite every manifest the way format 3 kept it: the document table inline, no pieces."""
    import shutil

    from sparsecache.store import read_manifest

    for path in sorted((store / "manifests").glob("v*.json")):
        m = read_manifest(store, int(path.stem[1:]))
        raw = json.loads(path.read_text())
        for key in ("segments", "live", "n_documents", "live_chunks", "live_tokens"):
            raw.pop(key)
        raw.update(format=3, documents=dict(m.documents.items()))
        path.write_text(json.dumps(raw))
    shutil.rmtree(store / "meta")


def test_a_store_with_inline_manifests_opens_answers_and_migrates_on_the_next_publish(
        tiny_model, tiny_dictionary, embedder, corpus_dir, tmp_path):
    from support.stores import assert_same_live_chunks

    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.kvstore import KVStore, verify
    from sparsecache.store import StoreConfig, read_manifest

    def build(store):
        encode_with([str(corpus_dir)], store, tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=64),
                    EncodeOptions(batch_tokens=256, progress=False), embedder=embedder)

    store, fresh = tmp_path / "old", tmp_path / "fresh"
    build(store)
    before = KVStore.open(store)
    want = [(c.id, c.doc_id) for c in before.chunks()]
    q = embedder.embed(["gardens"])[0]
    hits = [(c.id, round(s, 5)) for c, s in before.search(q, 3)]
    _inline(store)
    old = KVStore.open(store)
    assert not old.manifest.segments and [(c.id, c.doc_id) for c in old.chunks()] == want
    assert [(c.id, round(s, 5)) for c, s in old.search(q, 3)] == hits
    assert verify(store)["ok"] and old.info()["documents"] == len(old.manifest.documents)
    (corpus_dir / "added.txt").write_text("A document the nightly run adds.\n\nIt has two paragraphs.\n")
    build(store)  # the next publish writes the table as segments
    m = read_manifest(store)
    assert m.segments and m.live and "documents" not in json.loads((store / "manifests" / f"v{m.version:06d}.json").read_text())
    build(fresh)
    assert_same_live_chunks(store, fresh)
    assert verify(store)["ok"]


def test_publishing_changes_and_deletions_keeps_the_table_counts_and_live_rows_a_dict_would(tmp_path):
    """`Writer.publish(changed, deleted)` against a dict model over nights of upserts (new rows),
    deletions, an id both deleted and changed (the change wins), an entry republished as it
    is (no change) and a deletion of an id the store never had."""
    from sparsecache.bench.scale import ScaleConfig, append_documents, build_store
    from sparsecache.kvstore.index import FaissIndexer
    from sparsecache.store import Writer, read_manifest, verify

    cfg = ScaleConfig(index="flat")
    path = tmp_path / "store"
    build_store(str(path), 300, cfg)
    model = dict(read_manifest(path).documents.items())
    rng = np.random.default_rng(5)
    for night in range(6):
        with Writer(path) as w:
            w.begin()
            fresh = np.sort(rng.choice(400, 20, replace=False))  # ids < 300 exist, the others are new
            changed = dict(append_documents(w, fresh, f"n{night}", cfg, night).items())
            gone = [f"doc/{i:09d}" for i in rng.choice(400, 15, replace=False)] + ["never/there"]
            both = next(iter(changed))
            same = next(k for k in model if k not in changed and k not in gone)
            w.publish({**changed, same: model[same]}, [*gone, both], FaissIndexer(cfg.index), "test")
        for d in gone:
            if d != both:
                model.pop(d, None)
        model.update(changed)
        m = read_manifest(path)
        assert dict(m.documents.items()) == model
        assert (m.n_documents, m.live_chunks, m.live_tokens) == \
            (len(model), sum(d["count"] for d in model.values()), sum(d["tokens"] for d in model.values()))
        rows = sorted(r for d in model.values() for r in range(d["first"], d["first"] + d["count"]))
        np.testing.assert_array_equal(m.live_rows(), rows)
    assert verify(path, None, FaissIndexer(), None)["ok"]


class _Base:
    """What `doctable.updated` reads of a base version: its table, its live rows and counts."""

    def __init__(self, table: dict[str, dict], chunks: int):
        self.documents = DocTable.from_dict(table)
        self.segments = [{"key": "any"}]  # segmented: the new table is a change to this one
        self.rows = self.documents.rows()
        self.live_tokens = sum(e["tokens"] for e in table.values())
        self.n_documents = len(table)

    def live_rows(self):
        return self.rows


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sets(st.integers(0, 11), max_size=5), st.sets(st.integers(0, 11), max_size=4)),
                min_size=1, max_size=6))
def test_a_publishs_set_algebra_is_a_plain_dicts(nights):
    """`updated` (the set algebra a publish runs: #96 moved it out of the writer) gives the live rows,
    tokens and document count a plain dict of the live documents gives, night after night."""
    from sparsecache.store.doctable import updated

    table: dict[str, dict] = {}
    chunks = 0
    for night, (changed_ids, deleted_ids) in enumerate(nights):
        changed = {}
        for i in sorted(changed_ids):  # re-encoded or new: rows appended after everything so far
            changed[f"d{i}"] = {"hash": f"h{night}", "first": chunks, "count": 1 + i % 3, "tokens": 10 * (1 + i % 3),
                                "token_offset": 0}
            chunks += 1 + i % 3
        deleted = [f"d{i}" for i in deleted_ids]
        base = _Base(table, chunks) if table else None
        u = updated(changed, deleted, chunks, base)
        table = {k: v for k, v in {**table, **changed}.items() if k not in set(deleted) - set(changed)}
        want = np.zeros(chunks, bool)
        for e in table.values():
            want[e["first"]:e["first"] + e["count"]] = True
        assert np.array_equal(u.live, want)
        assert u.live_tokens == sum(e["tokens"] for e in table.values()) and u.n_documents == len(table)
        read = resolve([Segment(base.documents), u.segment]) if base else u.segment.entries  # as a reader reads it
        assert {k: (e["hash"], e["first"]) for k, e in read.items()} == \
            {k: (e["hash"], e["first"]) for k, e in table.items()}
