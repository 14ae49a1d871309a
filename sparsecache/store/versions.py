"""Published versions and the one writer: manifests, publishing, the lock and the lease.

A version is a manifest object `manifests/vNNNNNN.json`, created with put-if-absent and never
overwritten: two writers can never both publish version N, and a reader that pinned N reads
N's bytes for as long as N exists. The writer's exclusion is an flock on a local store (the
kernel drops it when the writer dies) and a lease object on an object store (taken and renewed
with conditional writes, expiring when its holder stops renewing it).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path

import numpy as np

from ..errors import StoreCorrupt, StoreError, StoreLocked, VersionGone
from .backend import Backend, unavailable_kind
from .doctable import DocTable, read_live, read_segment, resolve
from .layout import FORMAT_VERSION, now

log = logging.getLogger("sparsecache")


@dataclass
class Manifest:
    """One published version: which generation, how far its arrays reach, which rows are live.

    The document table ({id: {hash, first, count, tokens, token_offset}}) is not in the manifest
    itself but in the immutable segments it lists (`doctable`), read only when asked for
    (`documents`); which chunk rows are live is a bitmap beside them (`live_rows`), so a reader
    opens a version of any size by reading a few small objects. A manifest of an earlier format
    (format ≤ 3: the whole table inline) reads the same; the next publish writes segments."""

    version: int
    generation: str
    tokens: int = 0  # extent of the token axis
    chunks: int = 0  # extent of the chunk table
    segments: list[dict] = field(default_factory=list)  # the document table's pieces, oldest first
    live: str | None = None  # key of the live-row bitmap
    n_documents: int = 0
    live_chunks: int = 0
    live_tokens: int = 0
    index: str | None = None  # format ≤ 3: one index file of every live row
    index_kind: str | None = None  # the kind of the largest index segment
    # the search index as segments, oldest first: {key, lo, hi, rows, kind}, each over the rows
    # [lo, hi) that were live when it was built (rows deleted since are filtered by `live`)
    index_segments: list[dict] = field(default_factory=list)
    created: str = ""
    note: str = ""
    _backend: Backend | None = field(default=None, repr=False, compare=False)
    _documents: DocTable | None = field(default=None, repr=False, compare=False)
    _rows: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def documents(self) -> DocTable:
        """The document table, read from the segments on first use (O(documents) arrays: writers,
        `verify` and `compact` need it; a reader answering queries does not)."""
        if self._documents is None:
            if self.segments and self._backend is None:
                raise StoreError(f"manifest v{self.version} has no store to read its document table from")
            try:
                self._documents = resolve([read_segment(self._backend, ref) for ref in self.segments])
            except (FileNotFoundError, KeyError, ValueError) as e:
                raise StoreCorrupt(f"{self._backend}: the document table of version {self.version} is "
                                   f"unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
        return self._documents

    def hold_live_rows(self, rows: np.ndarray) -> None:
        """Keep int64 [n_live] `rows` as this version's live rows: what its writer just wrote to the
        bitmap, so `live_rows` need not read it back."""
        self._rows = rows

    def live_rows(self) -> np.ndarray:
        """int64 [n_live] chunk rows of live documents, ascending."""
        if self._rows is None:
            if self.live is not None and self._backend is not None:
                try:
                    self._rows = read_live(self._backend, self.live, self.chunks)
                except (FileNotFoundError, KeyError, ValueError) as e:
                    raise StoreCorrupt(f"{self._backend}: the live-row bitmap of version {self.version} is "
                                       f"unreadable ({type(e).__name__})") from e
            else:
                self._rows = self.documents.rows()
        return self._rows

    def index_pieces(self) -> list[dict]:
        """The index segments; a format ≤ 3 manifest's one index as one segment over every row."""
        if self.index_segments or not self.index:
            return list(self.index_segments)
        return [{"key": self.index, "lo": 0, "hi": self.chunks, "rows": self.live_chunks, "kind": self.index_kind}]

    def to_json(self) -> str:
        # not asdict(): it deep-copies every field, the loaded document table included (40 s at 1M documents)
        fields = {f.name: getattr(self, f.name) for f in dataclass_fields(self) if not f.name.startswith("_")}
        return json.dumps({"format": FORMAT_VERSION, **fields}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, backend: Backend | None = None) -> "Manifest":
        raw = json.loads(text)
        if raw.pop("format", 0) > FORMAT_VERSION:
            raise StoreError("manifest written by a newer sparsecache; upgrade to read this store")
        documents = raw.pop("documents", None)  # format ≤ 3: the table inline
        m = cls(**raw, _backend=backend)
        if documents is not None:
            m._documents = DocTable.from_dict(documents)
            m.n_documents = len(documents)
            m.live_chunks = int(m._documents.cols["count"].sum())
            m.live_tokens = int(m._documents.cols["tokens"].sum())
        return m


def manifest_key(version: int) -> str:
    return f"manifests/v{version:06d}.json"


def versions(backend: Backend) -> list[int]:
    """Published version numbers, ascending."""
    names = [k.rsplit("/", 1)[-1] for k in backend.list("manifests")]
    return sorted(int(n[1:-5]) for n in names if n.startswith("v") and n.endswith(".json") and n[1:-5].isdigit())


class VersionPoller:
    """The newest published version of a store, looked for in a background thread every
    `every_s` seconds, so that no request waits on a LIST of the manifests (`every_s` 0: looked
    for on every call instead, in the caller's thread).

    `ready(version)` runs in the poller's thread before a new version is announced (a server
    opens it, fetches its index and reads its chunk table there); where it fails, the version
    before stays announced and the next poll tries again. The poller's reads are probes
    (`Health.probing`): they go to the store while it is known down, and once one succeeds, the
    backend's readers are let through again. Started, it makes the backend fail fast while the
    store is down (`Health.fail_fast`). With `follow` False it polls only while the store is
    down (a process that needs the recovery, not the versions).
    """

    def __init__(self, backend: Backend, every_s: float = 1.0, ready=None, follow: bool = True,
                 name: str = "sparsecache-versions"):
        self.backend, self.every_s, self.ready, self.follow = backend, every_s, ready, follow
        self.version = self._newest()
        self.polls = self.failures = 0
        self.last_error: str | None = None
        self.unreachable = False  # whether the last poll failed because the store did not answer
        self._stop = threading.Event()
        self._thread = None
        if every_s > 0:
            backend.health.fail_fast = True
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def __call__(self) -> int:
        """The newest version known (with `every_s` 0: listed now)."""
        if self._thread is None:
            self.poll(raise_errors=True)
        return self.version

    def _newest(self) -> int:
        vs = versions(self.backend)
        if not vs:
            raise StoreError(f"{self.backend}: no published version")
        return vs[-1]

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.follow or not self.backend.health.reachable:
                self.poll()

    def poll(self, raise_errors: bool = False) -> None:
        """List the versions once and, where there is a newer one, make it ready and announce it."""
        self.polls += 1
        try:
            with self.backend.health.probing():
                newest = self._newest()
                if newest != self.version and self.ready is not None:
                    self.ready(newest)
        except Exception as e:  # noqa: BLE001 -- the poller outlives whatever one poll met; the next tries again
            if raise_errors:
                raise
            self.failures += 1
            self.unreachable = unavailable_kind(e) is not None
            line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if line != self.last_error:
                log.warning("sparsecache: looking for a new version of %s failed (%s); retrying every %g s",
                            self.backend, line, self.every_s)
            self.last_error = line
            return
        if self.last_error is not None:
            log.warning("sparsecache: %s answers again (version %d)", self.backend, newest)
        self.last_error, self.unreachable = None, False
        self.version = newest

    def close(self) -> None:
        self._stop.set()


READ_ATTEMPTS = 5  # a latest version pruned between listing and reading it: list again (each time a newer one exists)


def read_manifest(backend: Backend, version: int | None = None) -> Manifest:
    """The manifest of `version` (default: the latest).

    The latest can be pruned between the listing and the read (a writer published two
    versions meanwhile and kept fewer); then the listing is taken again."""
    for _ in range(READ_ATTEMPTS):
        vs = versions(backend)
        if not vs:
            if not backend.exists("zarr.json"):
                raise StoreError(f"no store at {backend}")
            raise StoreError(f"{backend}: no published version yet (the first encode did not finish; rerun it)")
        v = vs[-1] if version is None else version
        if v not in vs:
            raise StoreError(f"{backend}: no version {v} (have {', '.join(map(str, vs))})")
        try:
            raw = backend.get(manifest_key(v))
        except FileNotFoundError:
            if version is not None:
                raise VersionGone(f"{backend}: version {v} was deleted (compact or --keep) as it was read") from None
            continue
        try:
            return Manifest.from_json(raw, backend)
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise StoreCorrupt(f"{backend}: manifest v{v} unreadable: {e}") from e
    raise StoreError(f"{backend}: the latest version was deleted {READ_ATTEMPTS} times as it was read "
                     "(is a writer publishing with --keep 1 in a loop?)")


def publish(backend: Backend, m: Manifest) -> None:
    """Create version `m.version`; refuse if it exists (another writer published it first)."""
    if not backend.put_if_absent(manifest_key(m.version), m.to_json().encode()):
        raise StoreLocked(f"{backend}: version {m.version} was published by another writer meanwhile; "
                          "nothing of this run was published (rerun to build on it)")


def _holder() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": now()}


def _who(owner: dict | None) -> str:
    return f"pid {owner.get('pid')} on {owner.get('host')} since {owner.get('since')}" if owner else "another process"


class Lock:
    """One writer per local store: an flock on `.lock`, which the kernel drops if the writer dies.

    The file also names its holder, so a second writer can say who holds it, and a file left
    non-empty by a writer that died is recognised (and reported) as a stale lock.
    """

    def __init__(self, root: Path):
        self.path = Path(root) / ".lock"
        self.fd: int | None = None
        self.stale: dict | None = None

    def acquire(self) -> "Lock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # the holder writes its name just after taking the lock: give it a moment to (up to
            # 5 s, for a holder descheduled on a loaded machine; a named holder returns at once)
            for _ in range(500):
                owner = self._owner(fd)
                if owner:
                    break
                time.sleep(0.01)
            os.close(fd)
            raise StoreLocked(f"store is locked: {self.path.parent} is being written by {_who(owner)}") from None
        self.stale = self._owner(fd) or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        self.fd = fd
        return self

    @staticmethod
    def _owner(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (json.JSONDecodeError, OSError):
            return {}

    def check(self) -> None:
        """An flock cannot be lost while its holder lives."""

    def release(self) -> None:
        import fcntl

        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


class Lease:
    """One writer per object store: `lease.json`, taken and renewed by conditional writes.

    Taking it: create it if absent, or replace an expired (or released) one conditionally on
    the e-tag that was read, so of two writers racing for a dead holder's lease exactly one
    wins. A thread renews it every ttl/3 (again conditionally: a renewal that finds another
    holder marks the lease lost, and the writer stops before its next commit or publish).
    A writer that dies stops renewing, so its lease expires after `ttl` seconds and the next
    writer takes over (reported as a stale lease, like a stale local lock).
    """

    KEY = "lease.json"

    def __init__(self, backend, ttl: float | None = None):
        self.backend = backend
        self.ttl = float(ttl or os.environ.get("SPARSECACHE_LEASE_TTL", 60))
        self.stale: dict | None = None
        self.etag: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewing = threading.Lock()  # the thread and check() must not race on the e-tag
        self._me = {**_holder(), "token": os.urandom(8).hex()}

    def _record(self, released: bool = False) -> bytes:
        return json.dumps({**self._me, "expires": 0 if released else time.time() + self.ttl}).encode()

    def acquire(self) -> "Lease":
        b = self.backend
        if not b.put_if_absent(self.KEY, self._record()):
            try:
                raw, etag = b.get_versioned(self.KEY)
                owner = json.loads(raw)
            except FileNotFoundError:  # released and deleted between our two calls: try once more
                return self.acquire()
            if owner.get("expires", 0) > time.time():
                raise StoreLocked(f"store is locked: {b} is being written by {_who(owner)} "
                                  f"(lease expires in {owner['expires'] - time.time():.0f}s unless renewed)")
            from obstore.exceptions import PreconditionError

            try:
                self.etag = b.put(self.KEY, self._record(), if_match=etag)
            except PreconditionError:
                raise StoreLocked(f"store is locked: {b}: another writer took the expired lease first") from None
            self.stale = owner if owner.get("expires") else None  # expires 0: released cleanly
        else:
            self.etag = b.get_versioned(self.KEY)[1]
        self._renewed = time.time()
        self._thread = threading.Thread(target=self._renew_loop, name="sparsecache-lease", daemon=True)
        self._thread.start()
        return self

    def renew(self) -> None:
        """One conditional renewal; marks the lease lost where another writer holds it now."""
        from obstore.exceptions import PreconditionError

        try:
            with self._renewing:
                self.etag = self.backend.put(self.KEY, self._record(), if_match=self.etag)
                self._renewed = time.time()
        except PreconditionError:
            self.lost = "another writer took the lease (this writer was paused longer than its ttl)"
        except Exception as e:  # a network error: keep trying until the lease would have expired
            if time.time() > self._renewed + self.ttl:
                self.lost = f"lease not renewed for {self.ttl:.0f}s ({e})"

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3) and not self.lost:
            self.renew()

    def check(self) -> None:
        """Raise StoreLocked if the lease was lost: nothing further may be written or published.

        Renews first where the last renewal is older than a third of the ttl: after a pause
        (a frozen VM, SIGSTOP) the renewal thread may not have run yet, and this is what
        notices that another writer took over meanwhile."""
        if not self.lost and time.time() - self._renewed > self.ttl / 3:
            self.renew()
        if self.lost:
            raise StoreLocked(f"{self.backend}: {self.lost}; stopping before writing further")

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
            self._thread = None
        if self.etag and not self.lost:
            from obstore.exceptions import PreconditionError

            try:
                self.backend.put(self.KEY, self._record(released=True), if_match=self.etag)
            except PreconditionError:
                pass
        self.etag = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def writer_lock(backend: Backend):
    """The writer's exclusion on `backend`: a context manager with `.stale` (a dead holder's
    record or None): an flock on a local directory, a lease object on an object store."""
    return Lock(backend.local_root) if backend.local_root is not None else Lease(backend)
