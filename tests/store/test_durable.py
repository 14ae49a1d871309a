"""The publishing helpers every cache writer uses (sparsecache.durable): unique temporaries,
rename-over, link-if-absent, directories built once under a lock. Races between real
processes on real commands are tests/store/test_concurrency.py's; these pin down the helpers'
own contract, with threads and processes released together."""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import pytest

from sparsecache.durable import publish_dir, publish_file, temp_beside, write_atomic


def _together(n: int, fn) -> list:
    """fn(i) on n threads released by one barrier; the results (or exceptions) in order."""
    barrier, out = threading.Barrier(n, timeout=30), [None] * n

    def run(i):
        barrier.wait()
        try:
            out[i] = fn(i)
        except Exception as e:  # the test asserts on it
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_temporaries_are_unique_and_hidden_beside_the_target(tmp_path):
    names = {temp_beside(tmp_path / "atoms.safetensors") for _ in range(1000)}
    assert len(names) == 1000
    assert all(n.parent == tmp_path and n.name.startswith(".atoms.safetensors.") for n in names)


def test_rename_over_leaves_one_whole_file_and_no_temporaries(tmp_path):
    path = tmp_path / "x.json"
    payloads = [bytes([i]) * 200_000 for i in range(8)]
    for _ in range(20):
        out = _together(8, lambda i: write_atomic(path, payloads[i]))
        assert out == [True] * 8
        assert path.read_bytes() in payloads
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_link_if_absent_has_one_winner_and_the_losers_keep_its_file(tmp_path):
    for r in range(20):
        path = tmp_path / f"r{r}.bin"
        out = _together(8, lambda i: write_atomic(path, bytes([i]) * 100_000, replace=False))
        assert sum(out) == 1, out
        assert path.read_bytes() == bytes([out.index(True)]) * 100_000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_failed_write_leaves_neither_the_file_nor_a_temporary(tmp_path):
    def broken(tmp):
        Path(tmp).write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        publish_file(tmp_path / "f", broken)
    assert list(tmp_path.iterdir()) == []


def _complete(p: Path) -> bool:
    return (p / "b").is_file()


def _build_slowly(tmp: Path, tag: str = "x") -> None:
    (tmp / "a").write_text(tag)
    time.sleep(0.05)  # a window in which a reader would see a half-built directory
    (tmp / "b").write_text(tag)


def test_a_directory_is_built_once_and_readers_never_see_it_half_built(tmp_path):
    target, builds, seen = tmp_path / "model", [], []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            if target.exists():
                seen.append(sorted(p.name for p in target.iterdir()))

    r = threading.Thread(target=reader)
    r.start()
    out = _together(8, lambda i: publish_dir(target, lambda tmp: (builds.append(i), _build_slowly(tmp, str(i))),
                                             _complete))
    stop.set()
    r.join(10)
    assert out == [target] * 8 and len(builds) == 1
    assert (target / "a").read_text() == (target / "b").read_text() == str(builds[0])
    assert all(s == ["a", "b"] for s in seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]


def test_a_damaged_directory_is_replaced_and_a_failed_build_leaves_nothing(tmp_path):
    target = tmp_path / "d"
    target.mkdir()
    (target / "a").write_text("left by an interrupted copy")  # no "b": not complete
    with pytest.raises(RuntimeError):
        publish_dir(target, lambda tmp: (_ for _ in ()).throw(RuntimeError("no space")), _complete)
    assert (target / "a").exists() and len(list(tmp_path.iterdir())) == 2  # d and its lock, no temporaries
    publish_dir(target, _build_slowly, _complete)
    assert _complete(target) and (target / "a").read_text() == "x"
    other = tmp_path / "e"
    other.write_text("a file where the directory belongs")
    assert _complete(publish_dir(other, _build_slowly, _complete))


def _process_build(args) -> tuple[int, bool]:
    target, i, counter = args
    built = []

    def build(tmp):
        built.append(i)
        with open(counter, "a") as f:
            f.write(f"{i}\n")
        _build_slowly(tmp, str(i))

    publish_dir(Path(target), build, _complete)
    return i, bool(built)


def test_processes_take_turns_on_the_build_lock(tmp_path):
    """Across processes (the flock, not a thread lock, is what orders them): one builds."""
    ctx = multiprocessing.get_context("spawn")
    counter = tmp_path / "builds.txt"
    with ctx.Pool(4) as pool:
        for r in range(5):
            target = tmp_path / f"r{r}"
            out = pool.map(_process_build, [(str(target), i, str(counter)) for i in range(4)])
            assert sum(b for _, b in out) == 1
            assert _complete(target)
    assert len(counter.read_text().split()) == 5
