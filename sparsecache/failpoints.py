"""Named points in the store's write path where crash tests stop the writer.

Every place where a crash leaves a different state on disk calls `failpoint(name)`. Two ways
to crash there, both counting hits per name ("commit:2" = the second commit):

- in a subprocess, `SPARSECACHE_PAUSE_AT="name:n"`: the process writes
  `$SPARSECACHE_PAUSE_FILE` and stops itself (SIGSTOP), so a test can `kill -9` it at that
  exact instruction;
- in-process, `crash_at("name", n)`: `failpoint` raises `Crash`, a BaseException that no
  `except Exception` swallows. Nothing in the write path cleans up on the way out (the lock
  is dropped as the kernel would drop it), so this is the same state a kill leaves, at a
  fraction of the cost: the fault-injection suite runs hundreds of histories this way.

`record()` lists the failpoints one run passes through, so a test can crash at each of them.
Costs a dictionary lookup per call otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


class Crash(BaseException):
    """Raised at an armed failpoint (tests only)."""


_hits: dict[str, int] = {}
_armed: tuple[str, int] | None = None
_trace: list[str] | None = None


def failpoint(name: str) -> None:
    """Stop or crash here if a test asked for this hit of `name`."""
    spec = os.environ.get("SPARSECACHE_PAUSE_AT", "")
    if _armed is None and _trace is None and not spec:
        return
    _hits[name] = n = _hits.get(name, 0) + 1
    if _trace is not None:
        _trace.append(f"{name}:{n}")
    if _armed == (name, n):
        raise Crash(f"{name}:{n}")
    if spec == f"{name}:{n}":
        Path(os.environ["SPARSECACHE_PAUSE_FILE"]).write_text(name)
        os.kill(os.getpid(), signal.SIGSTOP)


@contextlib.contextmanager
def crash_at(name: str, n: int = 1):
    """Raise `Crash` at the n-th hit of failpoint `name` inside the block."""
    global _armed
    _hits.clear()
    _armed = (name, n)
    try:
        yield
    finally:
        _armed = None
        _hits.clear()


@contextlib.contextmanager
def record():
    """Collect the "name:n" failpoints passed inside the block into the yielded list."""
    global _trace
    _hits.clear()
    _trace = []
    try:
        yield _trace
    finally:
        _trace = None
        _hits.clear()


def kill_worker(doc_ids: list[str], attempt: int) -> None:
    """Tests: with SPARSECACHE_KILL_WORKER="doc:n" a distributed worker dies (as kill -9 would
    leave it) on its first n attempts at a region holding document `doc`; "doc:*" on every one."""
    spec = os.environ.get("SPARSECACHE_KILL_WORKER", "")
    if not spec:
        return
    doc, n = spec.rsplit(":", 1)
    if doc in doc_ids and (n == "*" or attempt <= int(n)):
        os._exit(137)


_starts = 0


def start_failure() -> None:
    """Tests: with SPARSECACHE_FAIL_START=n the first n start-up attempts of each distributed
    worker process fail as a vanished file would (a transient error, which is retried)."""
    global _starts
    n = int(os.environ.get("SPARSECACHE_FAIL_START", "0") or 0)
    _starts += 1
    if _starts <= n:
        raise FileNotFoundError(f"injected start-up failure {_starts} of {n} (SPARSECACHE_FAIL_START)")
