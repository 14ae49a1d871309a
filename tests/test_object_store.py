"""Stores on object storage (the s3 extra), against a moto S3 server on 127.0.0.1: every
command works on an s3:// URL, the store equals a local one, the lease keeps one writer, a
killed writer's lease expires and its rerun converges, and crashes at every failpoint of a
re-index converge as they do locally."""

from __future__ import annotations

import json
import random
import time

import pytest

from sparsecache.store import Lease, Store, open_backend, read_manifest, verify
from conftest import assert_same_live_chunks, cli_encode, Corpus, crashing, encode_cmd, invoke, kill_at, rerun
from sparsecache.failpoints import record

pytest.importorskip("obstore", reason="needs the s3 extra")


def test_every_command_on_an_s3_store(s3_url, corpus_dir, tmp_path, tiny_model_dir, tiny_dictionary_dir):
    r = cli_encode(corpus_dir, s3_url, tiny_model_dir, tiny_dictionary_dir, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["published"]
    assert cli_encode(corpus_dir, tmp_path / "local", tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    assert_same_live_chunks(s3_url, tmp_path / "local")

    r = cli_encode(corpus_dir, s3_url, tiny_model_dir, tiny_dictionary_dir)
    assert r.exit_code == 0 and "unchanged: 6 documents" in r.output
    info = json.loads(invoke("info", s3_url, "--json").stdout)
    assert info["path"] == s3_url and info["documents"] == 6 and info["bytes_on_disk"]["k_indices"] > 0
    hits = json.loads(invoke("search", s3_url, "the global statement declares names", "--top-k", 2,
                             "--json").stdout)["chunks"]
    assert hits[0]["doc_id"] == "global.txt"
    r = invoke("query", s3_url, "What does the global statement do?", "--model", tiny_model_dir, "--top-k", 2,
               "--max-new-tokens", 2, "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["chunks"]
    r = invoke("verify", s3_url)
    assert r.exit_code == 0 and "ok" in r.output
    (corpus_dir / "pass.txt").unlink()
    assert cli_encode(corpus_dir, s3_url, tiny_model_dir, tiny_dictionary_dir, "--delete-missing").exit_code == 0
    r = invoke("compact", s3_url, "--keep", 1)
    assert r.exit_code == 0 and "published version 4" in r.output
    b = open_backend(s3_url)
    assert b.children("data") == ["g000002", "zarr.json"] and b.list("manifests") == ["manifests/v000004.json"]
    assert verify(s3_url)["ok"]


def test_damage_on_s3_is_named(s3_url, corpus_dir, tiny_model_dir, tiny_dictionary_dir):
    assert cli_encode(corpus_dir, s3_url, tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    b = open_backend(s3_url)
    key = next(k for k in b.list("data/g000001/k_indices") if k.endswith("/c/0/0/0"))
    b.put(key, b"garbage")
    r = invoke("verify", s3_url)
    assert r.exit_code == 1 and "k_indices/c/0/0/0" in r.output and "corrupt chunks:" in r.output


def test_a_second_writer_is_refused_naming_the_holder(s3_url, corpus_dir, tiny_model_dir, tiny_dictionary_dir):
    with Lease(open_backend(s3_url)):
        r = cli_encode(corpus_dir, s3_url, tiny_model_dir, tiny_dictionary_dir)
    assert r.exit_code != 0 and "is being written by pid" in r.output


def test_killed_writer_on_s3_expires_and_the_rerun_converges(s3_url, crash_corpus, reference, tiny_model_dir,
                                                             tiny_dictionary_dir, tmp_path, monkeypatch):
    """kill -9 mid-encode (its lease stays, unrenewed), the rerun is refused until the lease
    expires, then takes over (reported as stale) and builds the same store as an uninterrupted run."""
    cmd = encode_cmd(crash_corpus, s3_url, tiny_model_dir, tiny_dictionary_dir)
    monkeypatch.setenv("SPARSECACHE_LEASE_TTL", "3")
    kill_at(cmd, "commit:2", tmp_path)
    assert read_manifest(s3_url).version == 1
    r = invoke("encode-corpus", crash_corpus, "--store", s3_url, "--model", tiny_model_dir, "--dict",
               tiny_dictionary_dir, "--chunk-tokens", 64)
    assert r.exit_code != 0 and "lease expires in" in r.output
    time.sleep(3.2)
    report = rerun(cmd)  # killed inside the long first document: continued from the recorded batch
    total = Store.open(reference).info()["tokens"]
    assert report["published"] and 0 < report["tokens"] <= total - 2 * 256
    assert_same_live_chunks(s3_url, reference)


@pytest.fixture(scope="module")
def s3_encode(tiny_model, tiny_dictionary):
    from conftest import HISTORY_BATCH_TOKENS, HISTORY_CONFIG, FakeEmbedder

    from sparsecache.encoder import encode_corpus

    fake = FakeEmbedder()

    def run(corpus, store):
        return encode_corpus([str(corpus)], str(store), tiny_dictionary, tiny_model, HISTORY_CONFIG, embedder=fake,
                             batch_tokens=HISTORY_BATCH_TOKENS, delete_missing=True, keep=3, progress=False)
    return run


def _copy(src: str, dst: str) -> str:
    a, b = open_backend(src), open_backend(dst)
    b.delete_tree("")
    for key in a.list(""):
        b.put(key, a.get(key))
    return dst


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.long)], ids=["each-name", "every"])
def test_crash_at_failpoints_of_a_reindex_on_s3(s3_url, s3_encode, tmp_path, every):
    """test_store_faults' every-failpoint property, on the object store: by default at the
    first and last hit of each failpoint name (moto answers slowly: every point takes ~11 s),
    with -m long at every one (~10 min)."""
    rng = random.Random(7)
    base = Corpus(tmp_path / "base", rng)
    for _ in range(2):
        base.add()
    seed = s3_url + "-seed"
    s3_encode(base.root, seed)
    base.mutate(3)
    with record() as trace:
        s3_encode(base.root, _copy(seed, s3_url + "-probe"))
    points = list(dict.fromkeys(trace))
    if not every:
        names = {p.split(":")[0] for p in points}
        points = sorted({p for n in names for p in (next(q for q in points if q.startswith(n + ":")),
                                                    [q for q in points if q.startswith(n + ":")][-1])})
    final = Corpus(tmp_path / "final", random.Random(8))
    for name, text in base.docs.items():
        final.write(name, text)
    final.next = base.next
    final.mutate(3)
    want = tmp_path / "fresh"
    s3_encode(final.root, want)
    for point in points:
        store = _copy(seed, s3_url)
        assert crashing(s3_encode, base.root, store, point), point
        s3_encode(final.root, store)
        r = verify(store)
        assert r["ok"], (point, r["problems"])
        assert_same_live_chunks(store, want)


def test_an_unreachable_object_store_is_one_line(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    for k, v in {"AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                 "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    r = invoke("info", "s3://nobucket/x")
    assert r.exit_code == 1 and "object storage:" in r.output and "Traceback" not in r.output


def test_moto_copy_serves_a_store_and_restores_the_environment(s3_url, tmp_path):
    """The benchmarks' S3 copy (bench.suite.moto_copy) holds the store's objects but not its
    lock or lease, and hands the session's server back its AWS_* settings afterwards."""
    import os

    from sparsecache.bench.suite import moto_copy

    local = open_backend(tmp_path / "store")
    local.put("zarr.json", b"{}")
    local.put("lease", b"held")
    before = os.environ["AWS_ENDPOINT_URL"]
    with moto_copy(tmp_path / "store") as url:
        assert os.environ["AWS_ENDPOINT_URL"] != before
        assert open_backend(url).get("zarr.json") == b"{}"
        assert not open_backend(url).exists("lease")
    assert os.environ["AWS_ENDPOINT_URL"] == before
    assert open_backend(s3_url).list("") == []  # the session's server is the one answering again
