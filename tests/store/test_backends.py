"""Every storage backend of a store (a local directory; S3 on a moto server), in three parts:

1. Operations: each backend's tests subclass `BackendTests` (as zarr-python's store tests do), so
   the local directory and the object store answer the same operations the same way,
   put-if-absent and the writer's exclusion included.
2. A store's life on every backend (`place`): the CLI lifecycle, damage named, and the
   fault-injection property (crash at every failpoint, change the corpus, rerun: the store equals
   a fresh encode). A new backend joins by adding a `place`.
3. What only object storage has (the s3 extra): a store there equals a local one, a remote index
   is fetched once, the lease keeps one writer, a killed writer's lease expires and its rerun
   converges, an unreachable endpoint is one line.

Tests that need S3 skip without the s3 extra or moto (the `s3_url` fixture)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import time

import numpy as np
import pytest

from sparsecache.errors import StoreLocked
from sparsecache.failpoints import record
from sparsecache.kvstore import KVStore, verify
from sparsecache.store import Lease, LocalBackend, ObjectBackend, open_backend, read_manifest
from sparsecache.store.versions import writer_lock
from support.cli import cli_encode, invoke
from support.corpora import Corpus
from support.crashes import crashing, encode_cmd, kill_at, rerun
from support.stores import assert_same_live_chunks, copy_store


# ================================================================ 1. operations every backend answers alike


class BackendTests:
    @pytest.fixture
    def backend(self):
        raise NotImplementedError

    def test_put_get_list_delete(self, backend):
        backend.put("a/b/one", b"1")
        backend.put("a/two", b"22")
        backend.put("c", b"")
        assert backend.get("a/b/one") == b"1" and backend.get("c") == b""
        assert backend.list("a") == ["a/b/one", "a/two"]
        assert backend.children("") == ["a", "c"] and backend.children("a") == ["b", "two"]
        assert backend.size("a") == 3
        backend.put("a/two", b"333")  # replace
        assert backend.get("a/two") == b"333"
        backend.delete("a/two")
        backend.delete("a/two")  # a missing key is not an error
        assert not backend.exists("a/two") and backend.exists("a/b/one")
        with pytest.raises(FileNotFoundError):
            backend.get("a/two")
        backend.delete_tree("a")
        assert backend.list("a") == [] and backend.exists("c")

    def test_get_many_keeps_order_and_marks_missing(self, backend):
        for i in range(20):
            backend.put(f"k/{i}", bytes([i]) * i)
        got = backend.get_many([f"k/{i}" for i in reversed(range(20))] + ["k/none"])
        assert got[:-1] == [bytes([i]) * i for i in reversed(range(20))] and got[-1] is None

    def test_put_if_absent_never_overwrites(self, backend):
        assert backend.put_if_absent("m/v1.json", b"first")
        assert not backend.put_if_absent("m/v1.json", b"second")
        assert backend.get("m/v1.json") == b"first"
        assert backend.list("m") == ["m/v1.json"]  # no temp files left behind

    def test_second_writer_is_refused_and_told_who(self, backend):
        with writer_lock(backend):
            with pytest.raises(StoreLocked, match=r"pid \d+ on "):
                writer_lock(backend).acquire()
        with writer_lock(backend) as again:  # released: the next writer gets it, and nothing is stale
            assert again.stale is None

    def test_zarr_store_round_trips(self, backend):
        import numpy as np
        import zarr

        g = zarr.open_group(store=backend.zarr_store(read_only=False), path="data/g1", mode="w")
        g.create_array("x", shape=(10,), chunks=(4,), dtype="int32")[:] = np.arange(10)
        r = zarr.open_group(store=backend.zarr_store(), path="data/g1", mode="r")
        assert r["x"][:].tolist() == list(range(10))
        assert "data/g1/x/c/2" in backend.list("data")


class TestLocalBackend(BackendTests):
    @pytest.fixture
    def backend(self, tmp_path):
        return LocalBackend(tmp_path / "store")

    def test_sync_fsyncs_what_was_written_not_the_store(self, backend, monkeypatch):
        """A commit's cost is what it wrote: `sync` fsyncs the files written (through zarr or
        put) since the last sync and the directories from theirs up to the root, and nothing
        else of a store with many files."""
        import os

        import numpy as np
        import zarr

        g = zarr.open_group(store=backend.zarr_store(read_only=False), path="data/g1", mode="w")
        x = g.create_array("x", shape=(4000,), chunks=(4,), dtype="int32")
        x[:] = np.arange(4000)  # 1,000 chunk files
        backend.sync()
        synced = []
        real = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.path.realpath(f"/proc/self/fd/{fd}")) or real(fd))
        x[3998:] = [7, 7]  # rewrites the last chunk file only
        backend.put("pending.json", b"{}")
        backend.delete("data/g1/x/c/5")
        put_own = len(synced)  # put fsyncs its temporary and its directory itself
        backend.sync()
        root = os.path.realpath(backend.root)
        at = lambda *p: os.path.join(root, *p)  # noqa: E731
        dirs = {root, at("data"), at("data/g1"), at("data/g1/x"), at("data/g1/x/c")}
        assert set(synced[put_own:]) == {at("data/g1/x/c/999"), at("pending.json")} | dirs
        n = len(synced)
        backend.sync()  # nothing written since
        assert len(synced) == n


class TestS3Backend(BackendTests):
    @pytest.fixture
    def backend(self, s3_url):
        return open_backend(s3_url)

    def test_url_and_env(self, backend, s3_url):
        assert isinstance(backend, ObjectBackend) and str(backend) == s3_url

    @pytest.fixture
    def later(self, monkeypatch):
        """later(s): the leases' clock (wall time, as lease.json records it) moves s seconds on,
        so expiry is tested without sleeping through a ttl that a loaded machine might eat."""
        import importlib
        import types

        versions = importlib.import_module("sparsecache.store.versions")  # the package's `versions` is a function

        offset = [0.0]
        monkeypatch.setattr(versions, "time", types.SimpleNamespace(
            time=lambda: time.time() + offset[0], sleep=time.sleep, monotonic=time.monotonic))
        return lambda seconds: offset.__setitem__(0, offset[0] + seconds)

    def test_expired_lease_is_taken_over_once_and_reported(self, backend, later):
        """A writer that died stops renewing; after the ttl the next writer takes over (and is
        told it did), and of two racing for it exactly one wins."""
        from sparsecache.store import Lease

        dead = Lease(backend, ttl=30).acquire()
        dead._stop.set()  # dies: no more renewals, no release
        dead._thread.join()
        with pytest.raises(StoreLocked, match="lease expires"):
            Lease(backend, ttl=30).acquire()
        later(31)
        raw, etag = backend.get_versioned("lease.json")
        first, second = Lease(backend, ttl=30), Lease(backend, ttl=30)
        first.acquire()
        assert first.stale and first.stale["pid"] == json.loads(raw)["pid"]
        with pytest.raises(StoreLocked):
            second.acquire()
        first.release()

    def test_a_writer_whose_lease_was_taken_stops(self, backend, later):
        from sparsecache.store import Lease

        slow = Lease(backend, ttl=30).acquire()
        slow._stop.set()  # paused (GC, network) past its ttl
        slow._thread.join()
        later(31)
        other = Lease(backend, ttl=30).acquire()
        # the renewal thread has not run since (it was paused too): check() renews first,
        # finds another holder, and the writer stops before its next write, commit or publish
        with pytest.raises(StoreLocked, match="another writer took the lease"):
            slow.check()
        other.release()


# ================================================================ 2. a store's life on every backend


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
    # crashes at every hit, and test_crashes.py kills re-indexes between and inside documents)
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


# ================================================================ 3. what only object storage has


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
    report = rerun(cmd)  # killed inside the long first document: a neighbours store (the default) starts it again
    total = KVStore.open(reference).info()["tokens"]  # (continuing one is test_crashes.py's, on the plain layout)
    assert report["published"] and 0 < report["tokens"] <= total
    assert_same_live_chunks(s3_url, reference)


@pytest.mark.skipif(importlib.util.find_spec("obstore") is None, reason="needs the s3 extra")
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
