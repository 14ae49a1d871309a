"""One conformance base for every backend (a local directory; S3 on a moto server): the CLI
lifecycle of a store, and the fault-injection property (crash at every failpoint, change the
corpus, rerun: the store equals a fresh encode). A new backend joins by adding a `place`."""

from __future__ import annotations

import json
import os
import random

import pytest

from conftest import Corpus, assert_same_live_chunks, cli_encode, copy_store, crashing, invoke
from sparsecache.failpoints import record
from sparsecache.kvstore import KVStore, verify
from sparsecache.store import open_backend

LOCAL, S3 = "local", "s3"


@pytest.fixture(params=[LOCAL, S3])
def place(request, tmp_path):
    """(backend name, where(name) → a new store location on that backend)."""
    if request.param == LOCAL:
        return LOCAL, lambda name: str(tmp_path / name)
    base = request.getfixturevalue("s3_url")  # skips without the s3 extra
    return S3, lambda name: f"{base}-{name}"


def test_every_command(place, corpus_dir, tiny_model_dir, tiny_dictionary_dir):
    _, where = place
    store = where("store")
    r = cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["published"] and report["documents"]["new"] == 6 and report["tokens_per_s"] > 0
    assert {"forward", "omp", "embed", "write"} <= set(report["seconds"])

    r = cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir)
    assert r.exit_code == 0 and "unchanged: 6 documents" in r.output
    assert "loading model" not in r.output  # answered from the scan alone

    info = json.loads(invoke("info", store, "--json").stdout)
    assert info["path"] == store and info["documents"] == 6 and info["versions"] == [1, 2]
    assert info["bytes_on_disk"]["k_indices"] > 0
    text = invoke("info", store).output
    assert "per token in the arrays (theoretical" in text and "with the dictionary copy" in text

    r = invoke("search", store, "the global statement declares names", "--top-k", 2, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["chunks"][0]["doc_id"] == "global.txt"
    r = invoke("query", store, "What does the global statement do?", "--model", tiny_model_dir, "--top-k", 2,
               "--max-new-tokens", 2, "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["chunks"]
    r = invoke("verify", store)
    assert r.exit_code == 0 and "version 2: ok" in r.output

    (corpus_dir / "pass.txt").unlink()
    assert cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir, "--delete-missing").exit_code == 0
    r = invoke("compact", store, "--keep", 1)
    assert r.exit_code == 0 and "published version 4" in r.output
    b = open_backend(store)
    assert b.children("data") == ["g000002", "zarr.json"] and b.list("manifests") == ["manifests/v000004.json"]
    assert KVStore.open(store).info()["versions"] == [4] and verify(store)["ok"]


def test_damage_is_named(place, corpus_dir, tiny_model_dir, tiny_dictionary_dir):
    _, where = place
    store = where("store")
    assert cli_encode(corpus_dir, store, tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    b = open_backend(store)
    b.put(next(k for k in b.list("data/g000001/v_indices") if k.endswith("/c/0/0/0")), b"garbage")
    r = invoke("verify", store)
    assert r.exit_code == 1
    assert "v_indices/c/0/0/0: unreadable" in r.output and "corrupt chunks:" in r.output


# ---------------------------------------------------------------- every failpoint

@pytest.fixture
def _no_fsync(monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.mark.parametrize("backend,start,points", [
    (LOCAL, "creating", "every"),
    # a re-index passes through more points than a creation (~100 s for every hit on 2 cores): by
    # default the first hit of each failpoint name, every hit with -m long (the creation above
    # crashes at every hit, and test_store_crash.py kills re-indexes between and inside documents)
    (LOCAL, "re-indexing", "each-name"),
    pytest.param(LOCAL, "re-indexing", "every", marks=pytest.mark.long),
    # moto answers slowly (~11 s a point): the first hit of each failpoint name too (what S3 adds
    # is its backend under each kind of point)
    (S3, "re-indexing", "each-name"),
    pytest.param(S3, "re-indexing", "every", marks=pytest.mark.long),
])
def test_crash_at_every_failpoint_then_change_the_corpus(backend, start, points, request, history_encode,
                                                         tmp_path, _no_fsync):
    """Crash at each failpoint a run passes through (store creation, or a re-index of a changed
    corpus), change the corpus, rerun: the store equals a fresh encode of the final corpus."""
    where = ((lambda name: str(tmp_path / name)) if backend == LOCAL else
             (lambda name, base=request.getfixturevalue("s3_url"): f"{base}-{name}"))
    encode, incremental = history_encode, start == "re-indexing"
    base = Corpus(tmp_path / "base", random.Random(7))
    for _ in range(2):
        base.add()
    seed = where("seed")
    if incremental:
        encode(base.root, seed)
        base.mutate(3)
    with record() as trace:
        encode(base.root, copy_store(seed, where("probe")))
    hits = list(dict.fromkeys(trace))
    names = {p.split(":")[0] for p in hits}
    assert names >= {"append", "commit", "sync", "index", "publish"} | (set() if incremental else {"create"})
    if points == "each-name":
        hits = sorted({next(q for q in hits if q.startswith(n + ":")) for n in names})
    final = Corpus(tmp_path / "final", random.Random(8))
    for name, text in base.docs.items():
        final.write(name, text)
    final.next = base.next
    final.mutate(3)
    want = where("fresh")
    encode(final.root, want)
    for point in hits:
        store = copy_store(seed, where("store"))
        assert crashing(encode, base.root, store, point), point
        encode(final.root, store)
        r = verify(store)
        assert r["ok"], (point, r["problems"])
        assert_same_live_chunks(store, want)
