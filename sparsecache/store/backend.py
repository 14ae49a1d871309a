"""Where a store's bytes live: a local directory or an object store (S3, GCS, Azure).

Everything above this module speaks keys ("manifests/v000002.json", "data/g000001/tokens/c/0")
and six operations every backend has: get (whole or many in parallel), put (atomic replace),
put-if-absent (the one primitive publishing needs: a version is created once, never
overwritten), delete, list. Zarr arrays go through `zarr_store()`, zarr's own store for the
same place. Object stores have no rename and no flock, which is why the store's protocol uses
neither directly: publishing is put-if-absent, and the writer's exclusion is
`versions.writer_lock` (an flock on a local directory, a lease object on an object store).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path

from ..durable import publish_dir, publish_file, sync_paths, write_atomic
from ..errors import StoreError, StoreUnavailable

URL_SCHEMES = ("s3://", "gs://", "az://", "abfs://", "memory://")


class Health:
    """Whether a store answers, as this process's reads of it have found, and how often it did not.

    Every read or write of an object store reports here (`ObjectBackend`). With `fail_fast` (set by
    a server's background poller, `versions.VersionPoller`, which keeps probing), reads refuse at
    once while the store is known unreachable, so no request waits out another timeout; the
    poller's own reads pass (`probing`) and its first success reopens the store to every reader.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._probe = threading.local()
        self.reachable = True
        self.since: float | None = None  # time.time() when the store stopped answering
        self.error: str | None = None  # the first failure of this outage, one line
        self.fail_fast = False
        self.errors: dict[str, int] = {}  # failures by kind ("timeout", "unreachable") over the process's life

    def guard(self) -> None:
        """Raise StoreUnavailable at once where the store is known down and this is not a probe."""
        if self.fail_fast and not self.reachable and not getattr(self._probe, "on", False):
            raise StoreUnavailable(f"{self.error}; down for {time.time() - (self.since or time.time()):.0f} s")

    def ok(self) -> None:
        if not self.reachable:
            with self._lock:
                self.reachable, self.since, self.error = True, None, None

    def failed(self, kind: str, line: str) -> None:
        with self._lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            if self.reachable:
                self.reachable, self.since, self.error = False, time.time(), line

    @contextlib.contextmanager
    def probing(self):
        """Reads in this block go to the store even while it is known down (the poller's)."""
        self._probe.on = True
        try:
            yield
        finally:
            self._probe.on = False

    def state(self) -> dict:
        return {"reachable": self.reachable, "since": self.since, "error": self.error, "errors": dict(self.errors)}


class Backend:
    """The operations a store needs from its storage. Keys are '/'-separated, relative to the root."""

    url: str
    timeout_s: float | None = None  # an object store's bound on one operation (None: the client's defaults)

    @property
    def health(self) -> Health:
        """What this process's reads found of the store's reachability (`Health`), one per backend."""
        if "_health" not in self.__dict__:
            self._health = Health()
        return self._health

    def zarr_store(self, read_only: bool = True):
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError where there is none."""
        raise NotImplementedError

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Several objects at once (None for a missing one): one round trip's latency, not n."""
        return [self._get_or_none(k) for k in keys]

    def put(self, key: str, data: bytes) -> None:
        """Replace the object atomically (readers see the old or the new bytes) and durably."""
        raise NotImplementedError

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object unless it exists; False (and nothing written) where it does."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove one object; a missing one is not an error."""
        raise NotImplementedError

    def delete_tree(self, prefix: str) -> None:
        raise NotImplementedError

    def list(self, prefix: str) -> list[str]:
        """Every key under `prefix/`, sorted."""
        raise NotImplementedError

    def children(self, prefix: str = "") -> list[str]:
        """Names one level below `prefix` (objects and 'directories'), sorted."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        return self._get_or_none(key) is not None

    def size(self, prefix: str) -> int:
        """Bytes of every object under `prefix/`."""
        raise NotImplementedError

    def size_of(self, key: str) -> int:
        """Bytes of the object `key` (0 where it is missing)."""
        data = self._get_or_none(key)
        return 0 if data is None else len(data)

    def sync(self) -> None:
        """Make every write through this backend since the last sync durable (object stores: a PUT
        already is)."""

    def check_root(self) -> None:
        """Raise StoreError where the root cannot hold a store at all."""

    def put_built(self, key: str, build) -> object:
        """`build(path)` writes a local file (an index of any size), which is then stored as `key`.
        Returns what `build` returned."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "built"
            out = build(path)
            self.put(key, path.read_bytes())
        return out

    def put_dir(self, local: Path, prefix: str) -> None:
        for f in sorted(Path(local).rglob("*")):
            if f.is_file():
                self.put(f"{prefix}/{f.relative_to(local).as_posix()}", f.read_bytes())

    def fetch_dir(self, prefix: str) -> Path:
        """A local directory holding the files under `prefix` (downloaded where they are remote)."""
        raise NotImplementedError

    def fetch_file(self, key: str) -> Path:
        """A local file holding object `key` (downloaded once where it is remote); FileNotFoundError
        where there is none."""
        raise NotImplementedError

    @property
    def local_root(self) -> Path | None:
        """The directory of a local store, None for an object store."""
        return None

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return self.get(key)
        except FileNotFoundError:
            return None

    def __str__(self) -> str:
        return self.url


class LocalBackend(Backend):
    """A POSIX directory. Writes are fsynced before anything names them (see `durable`)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.url = str(self.root)
        self._dirty: set[Path] = set()  # files written, and directories deleted in, since the last sync
        self._dirty_lock = threading.Lock()

    def _wrote(self, path: Path) -> None:
        with self._dirty_lock:
            self._dirty.add(path)

    @property
    def local_root(self) -> Path:
        return self.root

    def zarr_store(self, read_only: bool = True):
        from zarr.storage import LocalStore

        return LocalStore(self.root, read_only=True) if read_only else _tracked_store(self.root, self._wrote)

    def get(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def put(self, key: str, data: bytes) -> None:
        write_atomic(self.root / key, data)  # the file and its directory fsynced; the directories above at `sync`
        self._wrote(self.root / key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        made = write_atomic(self.root / key, data, replace=False)  # link(2): an atomic create that never overwrites
        self._wrote(self.root / key)
        return made

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)
        self._wrote((self.root / key).parent)

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self.root / prefix, ignore_errors=True)
        self._wrote((self.root / prefix).parent)

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())

    def children(self, prefix: str = "") -> list[str]:
        base = self.root / prefix
        return sorted(p.name for p in base.iterdir()) if base.is_dir() else []

    def exists(self, key: str) -> bool:
        return (self.root / key).exists()

    def size(self, prefix: str) -> int:
        return sum(f.stat().st_size for f in (self.root / prefix).rglob("*") if f.is_file())

    def size_of(self, key: str) -> int:
        path = self.root / key
        return path.stat().st_size if path.is_file() else 0

    def sync(self) -> None:
        # Only what this process wrote through this backend needs syncing (a crashed run synced
        # its rows before pending.json recorded them, and the rest of the store is published,
        # hence synced), so a commit costs what was written, not the size of the store.
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        sync_paths(self.root, dirty)

    def check_root(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"{self.root} exists and is not a directory")

    def put_built(self, key: str, build) -> object:
        """`build(path)` writes a file (an index of any size); it becomes `key` the way `put`
        makes a file (fsynced, then renamed into place). Returns what `build` returned."""
        out = []
        dst = self.root / key
        dst.parent.mkdir(parents=True, exist_ok=True)
        publish_file(dst, lambda tmp: out.append(build(tmp)))
        self._wrote(dst)
        return out[0]

    def put_dir(self, local: Path, prefix: str) -> None:
        dst = self.root / prefix
        if Path(local).resolve() != dst.resolve():
            shutil.copytree(local, dst, dirs_exist_ok=True)
            for f in dst.rglob("*"):
                self._wrote(f)

    def fetch_file(self, key: str) -> Path:
        path = self.root / key
        if not path.is_file():
            raise FileNotFoundError(str(path))
        return path

    def fetch_dir(self, prefix: str) -> Path:
        return self.root / prefix


CONNECT_S = 2.0  # with a timeout: the most one connection attempt may take (a store that answers connects in ms)
RETRIES = 3  # with a timeout: attempts after the first, within it


ENV_PREFIX = {"s3": "AWS_", "gs": "GOOGLE_", "az": "AZURE_", "abfs": "AZURE_"}
ENV_CLIENT_OPTIONS = {"allow_http": bool, "allow_invalid_certificates": bool, "proxy_url": str,
                      "proxy_ca_certificate": str, "proxy_excludes": str, "user_agent": str}


def client_limits(url: str, timeout_s: float) -> dict:
    """obstore's client and retry options that end an operation within about `timeout_s`: each
    attempt within it, no retry started after it (obstore's defaults: 30 s per attempt, retries
    for 3 minutes). Client options given replace those obstore reads from the environment
    (AWS_ALLOW_HTTP, ...), so those are read here too."""
    import os

    bound = timedelta(seconds=timeout_s)
    client = {"timeout": bound, "connect_timeout": timedelta(seconds=min(timeout_s, CONNECT_S))}
    prefix = ENV_PREFIX.get(url.split("://", 1)[0])
    for key, kind in ENV_CLIENT_OPTIONS.items():
        value = os.environ.get(f"{prefix}{key.upper()}") if prefix else None
        if value is not None:
            client[key] = value.strip().lower() in ("1", "true", "yes") if kind is bool else value
    return {"client_options": client,
            "retry_config": {"max_retries": RETRIES, "retry_timeout": bound,
                             "backoff": {"init_backoff": timedelta(milliseconds=100),
                                         "max_backoff": timedelta(seconds=1), "base": 2}}}


def unavailable_kind(e: BaseException) -> str | None:
    """"timeout" or "unreachable" where `e` says the store did not answer (the network, the
    service, the disk); None for what a working store answers (not found, already exists,
    denied) and for everything else."""
    if isinstance(e, StoreUnavailable):
        return "timeout" if "timed out" in str(e) else "unreachable"
    if isinstance(e, (FileNotFoundError, PermissionError, StoreError)):
        return None
    try:
        from obstore.exceptions import GenericError, JoinError
    except ImportError:
        GenericError = JoinError = ()  # noqa: N806
    if not isinstance(e, (GenericError, JoinError, TimeoutError, ConnectionError)):
        return None
    text = str(e).lower()  # obstore's text names its retry_timeout whatever failed: look for the error's kind
    timed_out = isinstance(e, TimeoutError) or "timed out" in text or "kind: timeout" in text
    return "timeout" if timed_out else "unreachable"


def describe(e: BaseException, kind: str, timeout_s: float | None) -> str:
    """What failed, in a few words (obstore's own text is a page: request, retries, source)."""
    text = str(e).lower()
    if kind == "timeout":
        return f"timed out after {timeout_s:g} s" if timeout_s else "timed out"
    for needle, words in (("connection refused", "connection refused"), ("reset", "connection reset"),
                          ("closed", "connection closed"), ("dns", "name not resolved"),
                          ("error sending request", "request not sent")):
        if needle in text:
            return words
    return str(e).splitlines()[0][:120] if str(e) else type(e).__name__


class ObjectBackend(Backend):
    """An object store through obstore (S3, GCS, Azure; `memory://` for tests).

    Credentials, region and endpoint come from the standard environment variables
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_ALLOW_HTTP,
    GOOGLE_SERVICE_ACCOUNT, AZURE_STORAGE_ACCOUNT_NAME, ...), as obstore reads them.

    With `timeout_s` (a server's), every operation ends within about that many seconds
    (`client_limits`); without, obstore's defaults apply (a batch job rides out a short outage).
    An operation the store does not answer raises StoreUnavailable in one line and is counted
    in `health`; downloads of whole files (`fetch_file`: index segments of any size, fetched in
    the background by a server) keep the defaults.
    """

    def __init__(self, url: str, store=None, timeout_s: float | None = None):
        try:
            import obstore  # noqa: F401
            from obstore.store import from_url
        except ImportError:
            raise StoreError(f"{url}: object storage needs the s3 extra: pip install 'sparsecache[s3]'") from None
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        if store is not None:
            self.store = self._bulk = store
        else:
            self.store = from_url(self.url, **(client_limits(self.url, timeout_s) if timeout_s else {}))
            self._bulk = from_url(self.url) if timeout_s else self.store

    def _io(self, op):
        """`op()`, its outcome told to `health`; a store that did not answer raises StoreUnavailable."""
        self.health.guard()
        try:
            out = op()
        except Exception as e:
            kind = unavailable_kind(e)
            if kind is None:
                raise
            line = f"{self.url}: object storage did not answer ({describe(e, kind, self.timeout_s)})"
            self.health.failed(kind, line)
            raise StoreUnavailable(line) from None
        self.health.ok()
        return out

    def zarr_store(self, read_only: bool = True):
        from zarr.storage import ObjectStore

        return ObjectStore(self.store, read_only=read_only)

    def get(self, key: str) -> bytes:
        import obstore

        return self._io(lambda: bytes(obstore.get(self.store, key).bytes()))

    def get_versioned(self, key: str) -> tuple[bytes, str | None]:
        """The bytes and their e-tag (for a conditional update), FileNotFoundError if none."""
        import obstore

        def op():
            r = obstore.get(self.store, key)
            return bytes(r.bytes()), r.meta.get("e_tag")

        return self._io(op)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        import obstore

        async def one(key):
            try:
                return bytes(await (await obstore.get_async(self.store, key)).bytes_async())
            except FileNotFoundError:
                return None

        async def every():
            return await asyncio.gather(*(one(k) for k in keys))

        return self._io(lambda: _run(every()))

    def put(self, key: str, data: bytes, if_match: str | None = None) -> str | None:
        """PUT (`if_match`: only over the version with that e-tag); returns the new e-tag."""
        import obstore

        mode = {"e_tag": if_match} if if_match else "overwrite"
        return self._io(lambda: obstore.put(self.store, key, data, mode=mode).get("e_tag"))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        def op():
            try:
                obstore.put(self.store, key, data, mode="create")
            except (AlreadyExistsError, PreconditionError):
                return False
            return True

        return self._io(op)

    def delete(self, key: str) -> None:
        import obstore

        def op():
            try:
                obstore.delete(self.store, key)
            except FileNotFoundError:
                pass

        self._io(op)

    def delete_tree(self, prefix: str) -> None:
        import obstore

        keys = self.list(prefix)
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            self._io(lambda batch=batch: obstore.delete(self.store, batch))

    def _objects(self, prefix: str) -> list[dict]:
        import obstore

        return self._io(lambda: [o for batch in obstore.list(self.store, prefix.rstrip("/") + "/" if prefix else None)
                                 for o in batch])

    def list(self, prefix: str) -> list[str]:
        return sorted(o["path"] for o in self._objects(prefix))

    def children(self, prefix: str = "") -> list[str]:
        import obstore

        r = self._io(lambda: obstore.list_with_delimiter(self.store, prefix.rstrip("/") + "/" if prefix else None))
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in r["common_prefixes"]]
        names += [o["path"].rsplit("/", 1)[-1] for o in r["objects"]]
        return sorted(names)

    def exists(self, key: str) -> bool:
        import obstore

        def op():
            try:
                obstore.head(self.store, key)
                return True
            except FileNotFoundError:
                return False

        return self._io(op)

    def size(self, prefix: str) -> int:
        return sum(o["size"] for o in self._objects(prefix))

    def fetch_dir(self, prefix: str) -> Path:
        """A local directory holding the objects under `prefix`, downloaded once into the user
        cache: the directory is named by their e-tags, so a replaced object is fetched anew.
        Processes fetching at once (Ray actors starting together) take turns: the first
        downloads, the others use its copy, and none sees it half-written (`publish_dir`)."""
        import hashlib

        from ..paths import cache_root

        objects = sorted((o["path"], o.get("e_tag") or "", o["size"]) for o in self._objects(prefix))
        # "whole": copies are published whole since this version; an older per-file copy may be partial
        key = hashlib.sha256(json.dumps([self.url, objects, "whole"]).encode()).hexdigest()[:16]
        files = [(path[len(prefix) + 1:], path, size) for path, _, size in objects]

        def complete(out: Path) -> bool:
            return all((out / rel).is_file() and (out / rel).stat().st_size == size for rel, _, size in files)

        def download(tmp: Path) -> None:
            for (rel, path, _), data in zip(files, self.get_many([path for _, path, _ in files])):
                if data is None:
                    raise FileNotFoundError(f"{self.url}/{path} vanished while being fetched")
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(data)

        return publish_dir(cache_root() / "remote" / key, download, complete)

    def fetch_file(self, key: str) -> Path:
        """Object `key` as a file in the user cache, downloaded once (streamed: a 1.5 GB index
        segment never sits in memory) and named by the object's e-tag and size, so a replaced
        object is fetched anew; what FAISS memory-maps when a reader opens a remote store."""
        import hashlib

        import obstore

        from ..paths import cache_root

        meta = self._io(lambda: obstore.head(self.store, key))  # FileNotFoundError where there is none
        name = hashlib.sha256(json.dumps([self.url, key, meta.get("e_tag") or "", meta["size"]]).encode()).hexdigest()[:16]

        def download(tmp: Path) -> None:
            def stream():
                with open(tmp / "object", "wb") as f:
                    for part in obstore.get(self._bulk, key).stream(min_chunk_size=8 << 20):
                        f.write(part)

            self._io(stream)

        out = publish_dir(cache_root() / "remote" / name, download,
                          lambda d: (d / "object").is_file() and (d / "object").stat().st_size == meta["size"])
        return out / "object"


def _run(coro):
    """Run a coroutine from sync code, also where an event loop is already running (notebooks)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from zarr.core.sync import sync

    return sync(coro)


def is_url(path: str | Path) -> bool:
    return isinstance(path, str) and path.startswith(URL_SCHEMES)


def open_backend(where: str | Path | Backend, timeout_s: float | None = None) -> Backend:
    """The backend for a local path, a file:// URL or an s3://, gs://, az:// URL; an object
    store's operations bounded by `timeout_s` where given (`ObjectBackend`)."""
    if isinstance(where, Backend):
        return where
    if isinstance(where, str) and where.startswith("file://"):
        return LocalBackend(where[len("file://"):])
    if is_url(where):
        return ObjectBackend(where, timeout_s=timeout_s)
    return LocalBackend(where)


def _tracked_store(root: Path, wrote):
    """zarr's LocalStore for writing, telling `wrote(path)` of every file it writes and every
    directory it deletes in, so `LocalBackend.sync` fsyncs exactly those."""
    from zarr.storage import LocalStore

    class TrackedLocalStore(LocalStore):
        def with_read_only(self, read_only: bool = False):
            return LocalStore(self.root, read_only=True) if read_only else _tracked_store(self.root, wrote)

        async def _set(self, key: str, value, exclusive: bool = False) -> None:
            await super()._set(key, value, exclusive)
            wrote(self.root / key)

        def set_sync(self, key: str, value) -> None:
            super().set_sync(key, value)
            wrote(self.root / key)

        async def delete(self, key: str) -> None:
            await super().delete(key)
            wrote((self.root / key).parent)

        def delete_sync(self, key: str) -> None:
            super().delete_sync(key)
            wrote((self.root / key).parent)

        async def delete_dir(self, prefix: str) -> None:
            await super().delete_dir(prefix)
            wrote((self.root / prefix).parent)

    return TrackedLocalStore(root, read_only=False)
