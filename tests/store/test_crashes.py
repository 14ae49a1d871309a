"""Crashes of an encode, in two parts: (1) fault injection in-process at every failpoint of the
writer, interleaved with corpus changes; (2) an `encode-corpus` process killed with SIGKILL at
exact points (and at a random moment), rerun, and compared with an uninterrupted build: same
live chunks, same codes, same documents.

The property (README, "Crash safety"): whatever sequence of crashes and corpus changes
(documents added, changed, deleted, renamed) happens between runs, the store after the final
successful run holds exactly the live chunks a fresh encode of the final corpus holds: the
same (document, ordinal) → text, tokens and codes, no chunk live twice, none lost, an index
with one vector per live chunk, and extents that never move backwards.

Crashes are injected in-process (`failpoints.crash_at`), which leaves the same state on disk
as a kill -9 at that point (nothing in the write path cleans up on the way out); the
subprocess kills in the second part check that equivalence. A deterministic fake
embedder keeps each run to about a second on the tiny model, and fsync is a no-op here:
the page cache holds everything a crashed process wrote, and durability across power loss
is `test_store.py`'s fsync-order test.

`pytest -m long tests/store/test_crashes.py` runs 300 random histories instead of 12 (~40 min).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from sparsecache.errors import StoreError
from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import encode_with
from sparsecache.kvstore import KVStore, verify
from sparsecache.store import StoreConfig, read_manifest
from support.corpora import POOL, Corpus
from support.crashes import CRASH_TOPICS, FakeEmbedder, crashing, encode_cmd, kill_at, rerun, start_encode
from support.stores import all_codes, assert_same_codes, assert_same_live_chunks


# ================================================================ 1. in-process crashes at every failpoint, random histories


@pytest.fixture
def _no_fsync(monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.fixture
def encode(history_encode, _no_fsync):
    return history_encode


def check_version(store: Path, seen: dict) -> None:
    """verify passes, and within a generation the extents never shrink."""
    r = verify(store)
    assert r["ok"], r["problems"]
    m = read_manifest(store)
    prev = seen.get(m.generation, (0, 0))
    assert m.tokens >= prev[0] and m.chunks >= prev[1], f"extents moved backwards: {prev} → {(m.tokens, m.chunks)}"
    seen[m.generation] = (m.tokens, m.chunks)


def fresh(encode, corpus: Path, tmp: Path) -> Path:
    out = tmp / "fresh"
    shutil.rmtree(out, ignore_errors=True)
    encode(corpus, out)
    return out


def run_history(encode, seed: int, tmp: Path, steps: int = 4, scale: float = 1.0) -> int:
    """One seeded history of mutations, crashes and reruns; returns how many crashes it injected."""
    rng = random.Random(seed)
    corpus = Corpus(tmp / "corpus", rng, scale)
    for _ in range(rng.randint(2, 4)):
        corpus.add()
    store, seen, crashed = tmp / "store", {}, []
    for _ in range(steps):
        if rng.random() < 0.75:
            point = f"{rng.choice(['append', 'append', 'commit', 'commit', 'sync', 'index', 'publish', 'create', 'prune'])}:" \
                    f"{rng.randint(1, 6)}"
            if crashing(encode, corpus.root, store, point):
                crashed.append(point)
        else:
            encode(corpus.root, store)
        if read_manifest_or_none(store):
            check_version(store, seen)
        corpus.mutate(rng.randint(1, 3))
    encode(corpus.root, store)
    check_version(store, seen)
    assert_same_live_chunks(store, fresh(encode, corpus.root, tmp))
    if os.environ.get("SPARSECACHE_FAULT_LOG"):  # what BENCHMARKS.md counts: histories, crashes, failpoints
        with open(os.environ["SPARSECACHE_FAULT_LOG"], "a") as f:
            f.write(json.dumps({"seed": seed, "crashes": crashed}) + "\n")
    return len(crashed)


def read_manifest_or_none(store: Path):
    try:
        return read_manifest(store)
    except StoreError:  # a crash during creation: nothing published yet
        return None


# ---------------------------------------------------------------- regressions (each failed before the fix)


def test_resumed_document_is_not_overwritten_by_a_new_one(encode, tmp_path):
    """Killed inside a multi-batch document, then a document whose id sorts before it arrives:
    the rerun used to append the new document in the middle of the resumed one's rows."""
    corpus = Corpus(tmp_path / "corpus", random.Random(0))
    corpus.write("m-long.txt", POOL[3][:2000])
    assert crashing(encode, corpus.root, tmp_path / "store", "commit:1")
    corpus.write("a-new.txt", POOL[5][:900])
    encode(corpus.root, tmp_path / "store")
    r = verify(tmp_path / "store")
    assert r["ok"], r["problems"]
    assert_same_live_chunks(tmp_path / "store", fresh(encode, corpus.root, tmp_path))


def test_delete_missing_after_a_crash_drops_the_deleted_document(encode, tmp_path):
    """A document finished by a crashed run, then deleted: --delete-missing used to keep it,
    because deletions were computed from the last published version only."""
    corpus = Corpus(tmp_path / "corpus", random.Random(1))
    corpus.write("a.txt", POOL[1][:300])
    corpus.write("b.txt", POOL[2][:1500])
    store = tmp_path / "store"
    for n in range(1, 10):  # the first commit after which a.txt is finished and b.txt is not
        shutil.rmtree(store, ignore_errors=True)
        assert crashing(encode, corpus.root, store, f"commit:{n}")
        pending = json.loads((store / "pending.json").read_text())
        if "a.txt" in pending["documents"]:
            break
    assert "b.txt" not in pending["documents"]
    (corpus.root / "a.txt").unlink()
    del corpus.docs["a.txt"]
    encode(corpus.root, tmp_path / "store")
    assert "a.txt" not in read_manifest(tmp_path / "store").documents
    assert_same_live_chunks(tmp_path / "store", fresh(encode, corpus.root, tmp_path))


def test_verify_names_a_document_whose_rows_hold_another_ones_chunks(encode, tmp_path):
    """The silent corruption of the first regression, made by hand: verify must fail."""
    corpus = Corpus(tmp_path / "corpus", random.Random(2))
    corpus.write("a.txt", POOL[1][:700])
    corpus.write("b.txt", POOL[2][:700])
    encode(corpus.root, tmp_path / "store")
    m = read_manifest(tmp_path / "store")
    path = tmp_path / "store" / "manifests" / f"v{m.version:06d}.json"
    raw = json.loads(path.read_text())
    docs = dict(m.documents.items())
    docs["b.txt"]["first"] = docs["a.txt"]["first"]  # b claims a's rows
    for key in ("segments", "live"):  # the table inline, as format 3 kept it (read the same way)
        raw.pop(key)
    path.write_text(json.dumps({**raw, "format": 3, "documents": docs}))
    r = verify(tmp_path / "store")
    assert not r["ok"]
    assert any("'b.txt'" in p and "'a.txt'" in p for p in r["problems"]), r["problems"]


# ---------------------------------------------------------------- random histories


@pytest.mark.parametrize("seed", range(12))
def test_random_history(encode, tmp_path, seed):
    run_history(encode, seed, tmp_path)


@pytest.mark.long
@pytest.mark.parametrize("seed", range(1000, 1300))
def test_random_history_long(encode, tmp_path, seed):
    run_history(encode, seed, tmp_path, steps=6)


@pytest.mark.parametrize("mode,seed", [(m, s) if s < 1 else pytest.param(m, s, marks=pytest.mark.long)
                                       for m in ("document", "neighbours") for s in range(40)])
def test_random_history_of_a_store_encoded_after(tiny_model, tiny_dictionary, tmp_path, mode, seed, _no_fsync):
    """The same property where chunks are encoded after the chunk before them or their nearest neighbour
    (#94 item 2): a neighbours store re-encodes the documents whose neighbours changed, so it too ends as a
    fresh build of the final corpus, what each chunk read included."""
    from dataclasses import replace

    from support.crashes import HISTORY_BATCH_TOKENS, HISTORY_CONFIG

    from sparsecache.store import Store

    config, fake = replace(HISTORY_CONFIG, encode_after=mode), FakeEmbedder()

    def encode(corpus: Path, store: Path):
        return encode_with([str(corpus)], str(store), tiny_dictionary, tiny_model, config,
                           EncodeOptions(batch_tokens=HISTORY_BATCH_TOKENS, delete_missing=True, keep=3,
                                         progress=False), embedder=fake)

    def read(store: Path) -> dict:
        s = Store.open(store)
        rows = s.manifest.live_rows()
        return dict(zip(s.column("chunk_id")[rows].tolist(), s.column("after")[rows].tolist()))

    run_history(encode, seed, tmp_path)
    assert read(tmp_path / "store") == read(tmp_path / "fresh")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.long)])  # the tiny-model histories above vary more
def test_random_history_on_the_default_model(default_model, tmp_path, seed, _no_fsync):
    """The same property with the real model and the shipped dictionary (short documents:
    encoding runs at ~100 tokens/s on a CPU)."""
    from sparsecache.codec.dictionary import Dictionary, default_dictionary

    d = Dictionary.load(default_dictionary())
    config = StoreConfig(chunk_tokens=16, zarr_chunk_tokens=16)
    fake = FakeEmbedder()

    def encode(corpus: Path, store: Path):
        return encode_with([str(corpus)], store, d, default_model, config,
                           EncodeOptions(batch_tokens=32, delete_missing=True, keep=3, progress=False), embedder=fake)

    assert run_history(encode, seed, tmp_path, steps=3, scale=0.15) >= 1


# ================================================================ 2. an encode process killed with SIGKILL


@pytest.mark.parametrize("point, plain", [("commit:2", False), ("commit:2", True), ("index:1", False),
                                          ("publish:1", False)])
def test_killed_encode_resumes_to_the_same_store(point, plain, crash_corpus, request, tiny_model_dir,
                                                 tiny_dictionary_dir, tmp_path):
    """The CLI's defaults (chunks encoded after their nearest neighbour), and the plain layout where a rerun
    continues a document the kill was inside."""
    reference = request.getfixturevalue("reference_plain" if plain else "reference")
    store = tmp_path / "store"
    cmd = encode_cmd(crash_corpus, store, tiny_model_dir, tiny_dictionary_dir) + (["--encode-after", "prefix"] if plain
                                                                                  else [])
    kill_at(cmd, point, tmp_path)
    if point == "commit:2":
        assert read_manifest(store).version == 1  # nothing published yet: readers see the empty store
        assert (store / "pending.json").exists()
    report = rerun(cmd)
    total = KVStore.open(reference).info()["tokens"]
    if point == "publish:1":  # the version was out; the rerun finds nothing to do
        assert not report["published"] and report["tokens"] == 0
    elif point == "index:1":  # everything was encoded; the rerun only indexes and publishes
        assert report["documents"]["resumed"] == len(CRASH_TOPICS) + 1 and report["tokens"] == 0
    elif plain:  # killed inside the long document: the rerun continues it from the recorded batch
        assert report["documents"]["resumed"] == 0 and 0 < report["tokens"] <= total - 2 * 256
    else:  # a neighbours store starts the open document again (its first chunks may have other neighbours now)
        assert report["documents"]["resumed"] == 0 and 0 < report["tokens"] <= total
    assert_same_codes(all_codes(store), all_codes(reference))
    assert read_manifest(store).documents == read_manifest(reference).documents
    assert verify(store)["ok"]


def test_killed_at_a_random_moment(crash_corpus, reference, tiny_model_dir, tiny_dictionary_dir, tmp_path):
    store = tmp_path / "store"
    cmd = encode_cmd(crash_corpus, store, tiny_model_dir, tiny_dictionary_dir)
    rng = random.Random(1)
    for _ in range(2):
        proc = start_encode(cmd)
        time.sleep(rng.uniform(4.0, 12.0))  # import + model load take ~4 s here; encoding ~5 s
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rerun(cmd)
    assert_same_codes(all_codes(store), all_codes(reference))
    s = KVStore.open(store)
    assert s.info()["tombstoned_chunks"] == 0


def test_killed_inside_a_document_then_the_corpus_changes(crash_corpus, tiny_model, tiny_dictionary, embedder,
                                                          tiny_model_dir, tiny_dictionary_dir, tmp_path):
    """The nightly case with a real kill -9: killed inside the long first document, then a
    document whose id sorts before it arrives and another is deleted; the rerun must equal a
    fresh encode of the changed corpus (it used to alias the two documents' rows)."""
    import shutil

    from support.stores import assert_same_live_chunks

    from sparsecache.store import StoreConfig

    corpus = tmp_path / "corpus"
    shutil.copytree(crash_corpus, corpus)
    store = tmp_path / "store"
    cmd = encode_cmd(corpus, store, tiny_model_dir, tiny_dictionary_dir) + ["--delete-missing"]
    kill_at(cmd, "commit:1", tmp_path)
    (corpus / "aa0-new.txt").write_text((corpus / "pass.txt").read_text() + " Then more text arrived.")
    (corpus / "del.txt").unlink()
    rerun(cmd)
    assert verify(store)["ok"]
    fresh = tmp_path / "fresh"
    encode_with([str(corpus)], fresh, tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=64),
                EncodeOptions(batch_tokens=256, progress=False), embedder=embedder)
    assert_same_live_chunks(store, fresh)
