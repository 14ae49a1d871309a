"""Durable file operations: what must reach the disk before a store names it.

A rename is atomic but not durable: after a power cut the new name can point at a file
whose bytes never left the page cache. So data is fsynced before it is renamed into place
or recorded, and the directory after, so the name itself survives.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write, fsync, rename: the file is either the old one or the complete new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path | str) -> None:
    """fsync one file or directory (a directory: so the names in it survive a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path, since_ns: int) -> int:
    """fsync every file and directory under `root` modified since `since_ns`; returns how many.

    A directory's mtime moves when entries are added, renamed or removed, so syncing the
    changed directories makes new files' names durable along with their bytes."""
    n = 0
    for dirpath, _, filenames in os.walk(root):
        for name in [*filenames, "."]:
            path = os.path.join(dirpath, name)
            try:
                if os.stat(path).st_mtime_ns >= since_ns:
                    fsync_path(path)
                    n += 1
            except FileNotFoundError:  # a temp file renamed away meanwhile
                continue
    return n
