"""Text to encode: six short pydoc topics, calibration text, documents of a random corpus history
(`Corpus`), and a corpus encoded by a user's first `encode-corpus`."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest




@pytest.fixture
def text_file(tmp_path) -> Path:
    from sparsecache.text.documents import builtin_documents

    docs = builtin_documents("train")[:30]
    p = tmp_path / "calib.txt"
    p.write_text("\n\n".join(d.text for d in docs)[:60_000])
    return p


CORPUS_TOPICS = ("assert", "break", "continue", "del", "global", "pass")


def write_corpus(root: Path, topics=CORPUS_TOPICS) -> Path:
    """Six short pydoc topics as .txt files (a few hundred tokens each)."""
    from pydoc_data.topics import topics as pydoc

    root.mkdir(parents=True, exist_ok=True)
    for t in topics:
        (root / f"{t}.txt").write_text(pydoc[t][:1500])
    return root


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


def encoded_docs(root: Path, docs: dict[str, str]) -> Path:
    """`docs` ({file name: text}) written to root/corpus and encoded into root/store by `encode-corpus` in a
    process of its own, with its defaults (the default model), as a user's first encode runs; the store."""
    (root / "corpus").mkdir()
    for name, text in docs.items():
        (root / "corpus" / name).write_text(text + "\n")
    out = subprocess.run([sys.executable, "-m", "sparsecache.cli.main", "encode-corpus", str(root / "corpus"),
                          "--store", str(root / "store")], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "published version" in out.stdout, (out.stdout + out.stderr)[-2000:]
    return root / "store"


def _pool() -> list[str]:
    from pydoc_data.topics import topics

    return [t for _, t in sorted(topics.items()) if len(t) > 400]


POOL = _pool()


def document(rng: random.Random, scale: float = 1.0) -> str:
    """Text of 1-5 batches: a run of 250-1,300 characters of Python's docs (times `scale`)."""
    src = rng.choice(POOL)
    n = int(rng.randint(250, 1300) * scale)
    start = rng.randint(0, max(0, len(src) - n))
    return src[start : start + n]


class Corpus:
    """A directory of .txt documents that a history mutates."""

    def __init__(self, root: Path, rng: random.Random, scale: float = 1.0):
        self.root, self.rng, self.docs, self.next, self.scale = root, rng, {}, 0, scale
        root.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, text: str) -> None:
        self.docs[name] = text
        (self.root / name).write_text(text)

    def add(self) -> None:
        # ids sort anywhere among the existing ones, so new work lands before and after open documents
        self.write(f"{self.rng.choice('abcmxz')}{self.next:03d}.txt", document(self.rng, self.scale))
        self.next += 1

    def change(self) -> None:
        if self.docs:
            name = self.rng.choice(sorted(self.docs))
            self.write(name, self.docs[name][: len(self.docs[name]) // 2] + document(self.rng, self.scale))

    def delete(self) -> None:
        if len(self.docs) > 1:
            name = self.rng.choice(sorted(self.docs))
            (self.root / name).unlink()
            del self.docs[name]

    def rename(self) -> None:
        if self.docs:
            name = self.rng.choice(sorted(self.docs))
            text = self.docs.pop(name)
            (self.root / name).unlink()
            self.write(f"r{self.next:03d}-{name}", text)
            self.next += 1

    def mutate(self, ops: int) -> None:
        for _ in range(ops):
            self.rng.choice([self.add, self.add, self.change, self.delete, self.rename])()
