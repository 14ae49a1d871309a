"""What only object storage has (the s3 extra), against a moto S3 server on 127.0.0.1: a
store there equals a local one, the lease keeps one writer, and a killed writer's lease
expires and its rerun converges. What every backend shares (every command, damage named,
crashes at every failpoint) is `test_backends.py`."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sparsecache.kvstore import KVStore
from sparsecache.store import Lease, open_backend, read_manifest
from conftest import assert_same_live_chunks, cli_encode, encode_cmd, invoke, kill_at, rerun

pytest.importorskip("obstore", reason="needs the s3 extra")


def test_an_s3_store_equals_a_local_one(s3_url, corpus_dir, tmp_path, tiny_model_dir, tiny_dictionary_dir):
    assert cli_encode(corpus_dir, s3_url, tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    assert cli_encode(corpus_dir, tmp_path / "local", tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    assert_same_live_chunks(s3_url, tmp_path / "local")
    remote, local = KVStore.open(s3_url), KVStore.open(tmp_path / "local")
    q = np.ones(local.attrs["embed_dim"], np.float32) / 20
    assert [(c.id, round(x, 5)) for c, x in remote.search(q, 3)] == [(c.id, round(x, 5)) for c, x in local.search(q, 3)]


def test_a_remote_index_is_fetched_once(s3_url, corpus_dir, tiny_model_dir, tiny_dictionary_dir, monkeypatch):
    """A reader of an object store searches a local copy of each index segment (streamed into
    the user cache once, named by the object's e-tag), never the whole file held in memory."""
    import obstore

    from sparsecache.paths import cache_root

    assert cli_encode(corpus_dir, s3_url, tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    key = read_manifest(open_backend(s3_url)).index_pieces()[0]["key"]
    path = open_backend(s3_url).fetch_file(key)
    assert path.is_relative_to(cache_root() / "remote") and path.read_bytes() == open_backend(s3_url).get(key)
    with monkeypatch.context() as m:
        m.setattr(obstore, "get", lambda *a, **k: pytest.fail("fetched again"))
        assert open_backend(s3_url).fetch_file(key) == path
    inode = path.stat().st_ino
    s = KVStore.open(s3_url)
    assert s.search(np.ones(s.attrs["embed_dim"], np.float32), 2) and path.stat().st_ino == inode
    with pytest.raises(FileNotFoundError):
        open_backend(s3_url).fetch_file("index/v999999-000000000000.faiss")


def test_a_second_writer_is_refused_naming_the_holder(s3_url, corpus_dir, tiny_model_dir, tiny_dictionary_dir):
    with Lease(open_backend(s3_url)):
        r = cli_encode(corpus_dir, s3_url, tiny_model_dir, tiny_dictionary_dir)
    assert r.exit_code != 0 and "is being written by pid" in r.output


def test_killed_writer_on_s3_expires_and_the_rerun_converges(s3_url, crash_corpus, reference, tiny_model_dir,
                                                             tiny_dictionary_dir, tmp_path, monkeypatch):
    """kill -9 mid-encode (its lease stays, unrenewed), the rerun is refused until the lease
    expires, then takes over (reported as stale) and builds the same store as an uninterrupted run."""
    cmd = encode_cmd(crash_corpus, s3_url, tiny_model_dir, tiny_dictionary_dir)
    ttl = 10  # long enough that the refusal below comes before the expiry on a loaded machine
    monkeypatch.setenv("SPARSECACHE_LEASE_TTL", str(ttl))
    kill_at(cmd, "commit:2", tmp_path)
    killed = time.monotonic()  # its last renewal was before this
    assert read_manifest(s3_url).version == 1
    r = invoke("encode-corpus", crash_corpus, "--store", s3_url, "--model", tiny_model_dir, "--dict",
               tiny_dictionary_dir, "--chunk-tokens", 64)
    assert r.exit_code != 0 and "lease expires in" in r.output
    time.sleep(max(0.0, killed + ttl + 0.5 - time.monotonic()))
    report = rerun(cmd)  # killed inside the long first document: continued from the recorded batch
    total = KVStore.open(reference).info()["tokens"]
    assert report["published"] and 0 < report["tokens"] <= total - 2 * 256
    assert_same_live_chunks(s3_url, reference)


def test_an_unreachable_object_store_is_one_line(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    for k, v in {"AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                 "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    r = invoke("info", "s3://nobucket/x")
    assert r.exit_code == 1 and "object storage:" in r.output and "127.0.0.1:1" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_moto_copy_serves_a_store_and_restores_the_environment(s3_url, tmp_path):
    """The benchmarks' S3 copy (bench.suite.moto_copy) holds the store's objects but not its
    lock or lease, and hands the session's server back its AWS_* settings afterwards."""
    import os

    from sparsecache.testing import moto_copy

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
