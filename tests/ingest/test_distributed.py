"""Distributed encode on a local Ray cluster (the ray extra): the same live content as a
single-process encode, capped retries for a document that kills its worker, and a driver or
worker killed mid-run converging on the rerun (the fault-injection property of
test_crashes.py, for the distributed path)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sparsecache.failpoints import Crash, crash_at
from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import ModelLoader, encode_with
from sparsecache.kvstore import verify
from sparsecache.store import read_manifest
from support.corpora import Corpus
from support.crashes import HISTORY_BATCH_TOKENS, HISTORY_CONFIG
from support.stores import assert_same_live_chunks

ray = pytest.importorskip("ray", reason="needs the ray extra")


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the module (starting one costs ~10 s)."""
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def encode(tiny_model, tiny_model_dir, tiny_dictionary):
    from sparsecache.kvstore.index import Embedder

    # the store's own embedder, loaded once: the driver plans each chunk's neighbours over the embeddings the
    # actors wrote (they load the store's embedder), so both must be the same model, as they are for a user
    own = Embedder(HISTORY_CONFIG.embedder, "cpu")

    def run(corpus, store, workers=0):
        return encode_with([str(corpus)], store, tiny_dictionary, tiny_model, HISTORY_CONFIG,
                           EncodeOptions(batch_tokens=HISTORY_BATCH_TOKENS, delete_missing=True, keep=3, progress=False,
                                         workers=workers, model=str(tiny_model_dir)),
                           embedder=own)
    return run


@pytest.fixture
def corpus(tmp_path):
    c = Corpus(tmp_path / "corpus", random.Random(3))
    for _ in range(5):
        c.add()
    return c


def test_distributed_store_equals_single_process(ray_cluster, encode, corpus, tmp_path, monkeypatch):
    r = encode(corpus.root, tmp_path / "ray", workers=2)
    assert r.published and r.chunks > 4
    assert verify(tmp_path / "ray")["ok"]
    encode(corpus.root, tmp_path / "one")
    assert_same_live_chunks(tmp_path / "ray", tmp_path / "one")
    # and incrementally: change, add, delete, then the same again, planned in several rounds
    corpus.mutate(4)
    monkeypatch.setattr("sparsecache.ingest.distributed.ROUND_TOKENS", 100)
    encode(corpus.root, tmp_path / "ray", workers=2)
    encode(corpus.root, tmp_path / "one")
    assert verify(tmp_path / "ray")["ok"]
    assert_same_live_chunks(tmp_path / "ray", tmp_path / "one")
    # regions start on Zarr chunk boundaries: no two workers ever wrote one chunk
    m = read_manifest(tmp_path / "ray")
    starts = sorted(d["token_offset"] for d in m.documents.values())
    assert any(s % HISTORY_CONFIG.zarr_chunk_tokens == 0 for s in starts)


def test_a_document_that_always_kills_its_worker_fails_the_job_naming_it(ray_cluster, encode, corpus, tmp_path,
                                                                          monkeypatch):
    from sparsecache.ingest.distributed import EncodeFailed

    encode(corpus.root, tmp_path / "s", workers=1)
    before = read_manifest(tmp_path / "s").version
    corpus.write("poison.txt", corpus.docs[sorted(corpus.docs)[0]] + " and more")
    monkeypatch.setenv("SPARSECACHE_KILL_WORKER", "poison.txt:*")
    with pytest.raises(EncodeFailed, match="poison.txt.*killed their worker 3 times"):
        encode(corpus.root, tmp_path / "s", workers=1)
    assert read_manifest(tmp_path / "s").version == before
    monkeypatch.delenv("SPARSECACHE_KILL_WORKER")
    encode(corpus.root, tmp_path / "s", workers=1)  # the rerun converges
    assert "poison.txt" in read_manifest(tmp_path / "s").documents and verify(tmp_path / "s")["ok"]
    assert_same_live_chunks(tmp_path / "s", fresh_single(encode, corpus, tmp_path))


def test_a_worker_killed_once_is_retried(ray_cluster, encode, corpus, tmp_path, monkeypatch):
    victim = sorted(corpus.docs)[2]
    monkeypatch.setenv("SPARSECACHE_KILL_WORKER", f"{victim}:1")
    encode(corpus.root, tmp_path / "s", workers=2)
    monkeypatch.delenv("SPARSECACHE_KILL_WORKER")
    encode(corpus.root, tmp_path / "one")
    assert_same_live_chunks(tmp_path / "s", tmp_path / "one")


# CI kills the driver at a commit between batches (where the workers' writes land wherever they land);
# the other four points (each ~65 s of Ray start-up and encodes on 2 cores) run with -m long. The
# publish is the driver's own Writer.publish, which a crash tests in one process
# (test_crashes.py: killed_encode_resumes_to_the_same_store[publish:1]).
@pytest.mark.parametrize("point", [pytest.param("commit:1", marks=pytest.mark.long), "commit:2",
                                   pytest.param("commit:4", marks=pytest.mark.long),
                                   pytest.param("index:1", marks=pytest.mark.long),
                                   pytest.param("publish:1", marks=pytest.mark.long)])
def test_driver_crash_then_corpus_change_converges(ray_cluster, encode, corpus, tmp_path, point):
    """The driver dies at a failpoint (its workers' writes land wherever they land), the corpus
    changes, the rerun (distributed) equals a fresh single-process encode of the final corpus."""
    store = tmp_path / "s"
    encode(corpus.root, store, workers=2)
    corpus.mutate(3)
    name, n = point.split(":")
    with crash_at(name, int(n)), pytest.raises(Crash):
        encode(corpus.root, store, workers=2)
    corpus.mutate(2)
    encode(corpus.root, store, workers=2)
    assert verify(store)["ok"], verify(store)["problems"]
    assert_same_live_chunks(store, fresh_single(encode, corpus, tmp_path))


def test_distributed_crash_then_single_process_rerun(ray_cluster, encode, corpus, tmp_path):
    """Either path resumes the other's crashed run."""
    store = tmp_path / "s"
    with crash_at("commit", 3), pytest.raises(Crash):
        encode(corpus.root, store, workers=2)
    encode(corpus.root, store)
    assert verify(store)["ok"]
    assert_same_live_chunks(store, fresh_single(encode, corpus, tmp_path))


def test_transient_errors_are_retried_and_others_are_not(caplog):
    from sparsecache.errors import ModelError
    from sparsecache.ingest.distributed import transient, with_retries

    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise FileNotFoundError("atoms.safetensors.tmp -> atoms.safetensors")
        return "loaded"

    assert with_retries(flaky, 3, "actor start-up", backoff_s=0.01) == "loaded" and len(calls) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("actor start-up failed (attempt 1 of 3: FileNotFoundError: atoms")
    with pytest.raises(FileNotFoundError):  # the last attempt's error is the one raised
        with_retries(lambda: open("/nonexistent/x"), 2, "actor start-up", backoff_s=0.01)
    refusals = [ModelError("model directory not found: /x"), PermissionError("denied"), ValueError("bad")]
    assert not any(map(transient, refusals))
    wrapped = ModelError("cannot load model")
    wrapped.__cause__ = ConnectionResetError()
    assert transient(wrapped) and transient(TimeoutError())


def test_a_transient_failure_at_actor_start_up_is_retried(ray_cluster, encode, corpus, tmp_path, monkeypatch):
    """Each actor's first start-up fails as the fetch race did; the retry makes the job succeed."""
    monkeypatch.setenv("SPARSECACHE_FAIL_START", "1")
    encode(corpus.root, tmp_path / "s", workers=2)
    monkeypatch.delenv("SPARSECACHE_FAIL_START")
    assert_same_live_chunks(tmp_path / "s", fresh_single(encode, corpus, tmp_path))
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    said = [line for f in logs.glob("worker-*.err") for line in f.read_text(errors="replace").splitlines()
            if "actor start-up failed (attempt 1 of 3: FileNotFoundError: injected start-up failure 1 of 1" in line]
    assert len(said) >= 2, "each actor logs its retry in one line"


def test_an_actor_that_cannot_start_fails_the_job_in_one_line(ray_cluster, encode, corpus, tmp_path, monkeypatch):
    from sparsecache.ingest.distributed import STARTUP_ATTEMPTS, EncodeFailed

    monkeypatch.setenv("SPARSECACHE_FAIL_START", str(STARTUP_ATTEMPTS))  # every attempt fails
    with pytest.raises(EncodeFailed) as e:
        encode(corpus.root, tmp_path / "s", workers=1)
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("nothing was published"), msg
    assert "an actor could not start: FileNotFoundError: injected start-up failure " \
           f"{STARTUP_ATTEMPTS} of {STARTUP_ATTEMPTS}" in msg, msg


def test_a_fresh_node_encodes_into_a_new_s3_prefix(encode, corpus, s3_url, tmp_path, monkeypatch):
    """Two actors start on an empty node cache and fetch the new store's dictionary from S3 at
    once (what failed two runs in three: both renamed one fixed temporary name); the store
    equals a single-process encode of the same corpus. Last in the module: it restarts Ray."""
    ray.shutdown()  # workers inherit the environment of the process that starts the cluster
    cache = tmp_path / "new-node-cache"
    monkeypatch.setenv("SPARSECACHE_CACHE", str(cache))
    try:
        r = encode(corpus.root, s3_url, workers=2)
    finally:
        ray.shutdown()
    copies = [p for p in (cache / "remote").iterdir() if not p.name.startswith(".")]
    assert r.published and len(copies) == 1  # one copy of the dictionary, fetched by the actors
    assert verify(s3_url)["ok"]
    assert_same_live_chunks(s3_url, fresh_single(encode, corpus, tmp_path))


def fresh_single(encode, corpus, tmp_path):
    out = tmp_path / "fresh"
    encode(corpus.root, out)
    return out


def test_a_wrapped_store_encoded_after_neighbours_encodes_on_ray_as_in_one_process(ray_cluster, tiny_model_dir,
                                                                                  tiny_dictionary, corpus, tmp_path):
    """The actors read the store's soft tokens and encode each chunk after the header with its trailer, and
    after its nearest neighbour as the driver planned it (#94 item 2: `--encode-after neighbours`, the
    neighbour laid out with its own trailer and header), as one process does: the same tokens (trailers
    included), codes and what each chunk read, first encode and incremental (documents encoded again for
    their neighbours)."""
    from dataclasses import replace

    from sparsecache.kvstore import KVStore
    from sparsecache.model import load_model
    from sparsecache.store import Store
    from sparsecache.wrapper.apply import initial_wrapper

    wrapper = initial_wrapper(load_model(str(tiny_model_dir)), 3, 2)
    config = replace(HISTORY_CONFIG, wrapper=wrapper.digest(), encode_after="neighbours")

    def run(store, workers=0):
        # a loader: the driver's model takes the wrapper's soft tokens, so not the session's shared tiny model;
        # the store's own embedder (not the fake the other tests give the driver): the driver plans neighbours
        # over the embeddings the actors wrote, so both must be the same model, as they are for a user
        options = EncodeOptions(batch_tokens=HISTORY_BATCH_TOKENS, delete_missing=True, keep=3, progress=False,
                                workers=workers, model=str(tiny_model_dir))
        return encode_with([str(corpus.root)], store, tiny_dictionary, ModelLoader(options), config, options,
                           wrapper=wrapper)

    def after(store):
        s = Store.open(store)
        rows = s.manifest.live_rows()
        return dict(zip(s.column("chunk_id")[rows].tolist(), s.column("after")[rows].tolist()))

    for _ in range(2):  # a first encode, then an incremental one after the corpus changed
        assert run(tmp_path / "ray", workers=2).published
        run(tmp_path / "one")
        assert verify(tmp_path / "ray")["ok"]
        assert_same_live_chunks(tmp_path / "ray", tmp_path / "one")
        assert after(tmp_path / "ray") == after(tmp_path / "one") and any(after(tmp_path / "one").values())
        s = KVStore.open(tmp_path / "ray")
        assert s.config.wrapper == wrapper.digest()
        tokens = s.tokens([c.id for c in s.chunks()])
        assert all(t[-2:] == wrapper.ids()[1] and min(t[:-2]) >= 0 for t in tokens)
        corpus.mutate(3)
