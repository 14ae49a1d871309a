"""Encodes that crash: an in-process encode stopped at a failpoint (random corpus histories) and
an `encode-corpus` subprocess killed with SIGKILL at one, then rerun."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import REPO


import numpy as np

from sparsecache.failpoints import Crash, crash_at
from sparsecache.store import StoreConfig


HISTORY_CONFIG = StoreConfig(chunk_tokens=32, zarr_chunk_tokens=16, coef_dtype="float16")


HISTORY_BATCH_TOKENS = 64  # two chunks: a document of 1-5 batches spans 1-5 commits


class FakeEmbedder:
    """Unit vectors from a hash of the text: deterministic, fast, and text-dependent."""

    name = "fake"
    dim = 8

    def embed(self, texts):
        out = np.stack([np.frombuffer(hashlib.sha256(t.encode()).digest()[:32], np.int32).astype(np.float32)
                        for t in texts]) if texts else np.zeros((0, self.dim), np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def crashing(encode, corpus: Path, store: Path, point: str) -> bool:
    """Run an encode that crashes at failpoint "name:n"; False if it finished without reaching it."""
    name, n = point.split(":")
    with crash_at(name, int(n)):
        try:
            encode(corpus, store)
        except Crash:
            return True
    return False


CRASH_TOPICS = ("assert", "break", "continue", "del", "global", "pass", "return", "while", "yield", "import")


CRASH_ARGS = ["--chunk-tokens", "64", "--batch-tokens", "256"]


def encode_cmd(corpus: Path, store: Path, model_dir: Path, dict_dir: Path) -> list[str]:
    return [sys.executable, "-m", "sparsecache.cli.main", "encode-corpus", str(corpus), "--store", str(store),
            "--model", str(model_dir), "--dict", str(dict_dir), *CRASH_ARGS, "--device", "cpu", "--json"]


def start_encode(cmd: list[str], **env) -> subprocess.Popen:
    return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO)


def kill_at(cmd: list[str], point: str, tmp: Path) -> None:
    """Run until the failpoint `point` stops the process, then SIGKILL it there."""
    marker = tmp / "paused"
    proc = start_encode(cmd, SPARSECACHE_PAUSE_AT=point, SPARSECACHE_PAUSE_FILE=str(marker))
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "failpoint never reached"
        time.sleep(0.05)
    time.sleep(0.1)  # the process stops itself right after writing the marker
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    marker.unlink()


def rerun(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return json.loads(proc.stdout)
