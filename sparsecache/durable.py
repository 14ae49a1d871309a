"""Durable, concurrency-safe file operations: how anything is written where others may read.

A rename is atomic but not durable: after a power cut the new name can point at a file
whose bytes never left the page cache. So data is fsynced before it is renamed into place
or recorded, and the directory after, so the name itself survives.

Several processes share a node's user cache (Ray actors started together, a query beside a
nightly encode, K servers on one host), so every write there goes through a temporary
whose name no other process or thread can pick (`temp_beside`), and is published by one
rename: over the old file (`publish_file(replace=True)`: readers see the old bytes or the
new), or only where nothing is there yet (`replace=False`: link(2) fails on an existing
name, the loser drops its copy and uses the winner's). A directory (a converted model, a
fetched dictionary) is built whole under a temporary name and renamed into place once
(`publish_dir`): readers see it complete or not at all, and the builders of one directory
take turns on an flock, so the first builds it and the others wait and use it instead of
building it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

PUBLISH_ATTEMPTS = 3  # a damaged directory in the way is moved aside; more than this is a bug, not a race


def temp_beside(path: Path) -> Path:
    """A hidden temporary name in `path`'s directory, unique to this call (pid and a random
    part: two processes, or two threads of one, never share it)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")


def is_temporary(name: str) -> bool:
    """Whether a file name is one `temp_beside` gives (another process's write in flight)."""
    return name.startswith(".") and name.endswith(".tmp")


def publish_file(path: Path, write: Callable[[Path], object], *, replace: bool = True) -> bool:
    """Make `path` by `write(tmp)` into a unique temporary beside it, fsync, rename into place.

    replace=True renames over whatever is there (readers see the old file or the whole new
    one). replace=False creates `path` only where it does not exist: if another process got
    there first its file stays, ours is dropped, and False is returned (use the winner's).
    Returns whether this call's bytes are the ones at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(path)
    try:
        write(tmp)
        fsync_path(tmp)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)
    return True


def write_atomic(path: Path, data: str | bytes, *, replace: bool = True) -> bool:
    """Write bytes (or UTF-8 text) to `path` through `publish_file`: the file is either the
    old one or the complete new one, never a mix, whoever else writes it at the same time."""
    raw = data.encode() if isinstance(data, str) else data
    return publish_file(path, lambda tmp: Path(tmp).write_bytes(raw), replace=replace)


def publish_dir(path: Path, build: Callable[[Path], object], complete: Callable[[Path], bool]) -> Path:
    """The directory `path`, built by `build(tmp)` into a unique temporary and renamed into
    place in one step, unless `complete(path)` already holds; returns `path`.

    Builders take turns on an flock beside the directory (released by the kernel if one
    dies), and whoever gets it second finds the first one's directory complete and uses it.
    Readers take no lock: they see the whole directory or none. A directory at `path` that
    is not complete (an interrupted copy by an older version, damage) is moved aside and
    removed by the lock holder, never while anyone could be building it."""
    path = Path(path)
    if complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path.parent / f".{path.name}.lock"):
        for _ in range(PUBLISH_ATTEMPTS):
            if complete(path):
                return path
            tmp = temp_beside(path)
            try:
                tmp.mkdir()
                build(tmp)
                sync_tree(tmp)
                try:
                    os.rename(tmp, path)  # fails where a non-empty directory is in the way
                except OSError:
                    if path.exists() and not complete(path):
                        _remove_aside(path)
                    continue
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            fsync_path(path.parent)
            return path
    raise OSError(f"{path}: could not publish the directory (something else keeps replacing it)")


def _remove_aside(path: Path) -> None:
    """Rename a damaged directory (or a file in its place) to a unique name in one atomic
    step, so the name is free at once, then delete it."""
    aside = temp_beside(path).with_suffix(".old")
    os.rename(path, aside)
    if aside.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(lock_file: Path):
    """Hold an exclusive flock on `lock_file` for the block (blocking until it is free)."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def fsync_path(path: Path | str) -> None:
    """fsync one file or directory (a directory: so the names in it survive a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_paths(root: Path, paths) -> int:
    """fsync each of `paths` (files or directories under `root`) and every directory from
    each one's parent up to `root`, so that new files' bytes and the names of new files and
    directories survive a power cut (a path gone meanwhile, a temporary renamed away, is
    skipped); returns how many were synced."""
    root = Path(root)
    dirs: set[Path] = set()
    n = 0
    for p in paths:
        p = Path(p)
        try:
            fsync_path(p)
            n += 1
        except FileNotFoundError:
            pass
        for d in p.parents:
            if d in dirs or not (d == root or root in d.parents):
                break
            dirs.add(d)
    for d in sorted(dirs, key=lambda d: -len(d.parts)):
        try:
            fsync_path(d)
            n += 1
        except FileNotFoundError:
            continue
    return n


def sync_tree(root: Path) -> int:
    """fsync every file and directory under `root` (a directory just built); returns how many."""
    n = 0
    for dirpath, _, filenames in os.walk(root):
        for name in [*filenames, "."]:
            fsync_path(os.path.join(dirpath, name))
            n += 1
    return n
