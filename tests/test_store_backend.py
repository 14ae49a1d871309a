"""Conformance of the store's storage backends: each backend's tests subclass `BackendTests`
(as zarr-python's store tests do), so the local directory and the object store answer the
same operations the same way, put-if-absent and the writer's exclusion included."""

from __future__ import annotations

import json
import time

import pytest

from sparsecache.errors import StoreLocked
from sparsecache.store import LocalBackend, ObjectBackend, open_backend
from sparsecache.store.versions import writer_lock


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
