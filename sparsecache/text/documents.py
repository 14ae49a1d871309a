"""Text every machine has (Python's docs and docstrings), user text files, and token chunks.

The built-in corpus is split deterministically by document name into a training part and a
held-out part, so dictionaries are always evaluated on text they never saw.
"""

from __future__ import annotations

import functools
import hashlib
import pkgutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, TextError

BUILTIN = "builtin"
_HELDOUT_PERCENT = 10
_TEXT_SUFFIXES = {".txt", ".md", ".rst"}


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    source: str = ""  # the --text argument it came from: calibration takes an equal share of each


def _heldout(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 < _HELDOUT_PERCENT


def builtin_documents(split: str = "train") -> list[Document]:
    """Python's documentation topics and standard-library module docstrings.

    `split` is "train", "heldout" or "all"; the split is by document name and never changes.
    """
    if split not in ("train", "heldout", "all"):
        raise ConfigError(f"unknown split {split!r} (train, heldout or all)")
    docs = _pydoc_topics() + list(_stdlib_docstrings())
    if split == "all":
        return docs
    return [d for d in docs if _heldout(d.name) == (split == "heldout")]


def _pydoc_topics() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(f"pydoc:{k}", v) for k, v in sorted(topics.items()) if v.strip()]


@functools.lru_cache(maxsize=1)
def _stdlib_docstrings() -> tuple[Document, ...]:
    """Module docstrings of pure-Python stdlib modules, read without importing them; parsed
    once per process (parsing ~150 modules takes ~2 s, and check-model reads them each run)."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for info in sorted(pkgutil.iter_modules([str(root)]), key=lambda i: i.name):
        path = root / f"{info.name}.py"
        if info.name.startswith("_") or not path.exists():
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        parts = [ast.get_docstring(tree) or ""]
        parts += [ast.get_docstring(n) or "" for n in tree.body
                  if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")]
        text = "\n\n".join(p for p in parts if p.strip())
        if len(text) > 200:
            docs.append(Document(f"stdlib:{info.name}", text))
    return tuple(docs)


def read_documents(paths: list[str] | tuple[str, ...], split: str = "train") -> list[Document]:
    """Documents from files/directories (.txt, .md, .rst), or the built-in corpus for "builtin"."""
    if not paths:
        raise TextError("no text given")
    docs: list[Document] = []
    for p in paths:
        if p == BUILTIN:
            docs += [Document(d.name, d.text, BUILTIN) for d in builtin_documents(split)]
            continue
        path = Path(p)
        if not path.exists():
            raise TextError(f"text not found: {p}")
        files = sorted(f for f in path.rglob("*") if f.suffix in _TEXT_SUFFIXES) if path.is_dir() else [path]
        docs += [Document(str(f), _read_text(f), p) for f in files]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise TextError(f"no text in {', '.join(paths)}")
    return docs


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if b"\x00" in raw[:4096]:
        raise TextError(f"{path}: binary file, not text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        warnings.warn(f"{path}: invalid UTF-8, decoded with replacement characters", stacklevel=2)
        return raw.decode("utf-8", errors="replace")


def interleaved_chunks(docs: list[Document], tokenizer, chunk_tokens: int) -> list[list[int]]:
    """`token_chunks` of each source (the --text a document came from) taken in turn, one
    chunk from each, so that any prefix of the result holds every source about equally (a
    calibration budget then spans the whole mix). One source: its chunks in document order."""
    by_source: dict[str, list[Document]] = {}
    for d in docs:
        by_source.setdefault(d.source, []).append(d)
    queues = [token_chunks(group, tokenizer, chunk_tokens) for group in by_source.values()]
    out = []
    for i in range(max(map(len, queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def token_chunks(docs: list[Document], tokenizer, chunk_tokens: int, min_tokens: int = 16) -> list[list[int]]:
    """Consecutive token windows of at most `chunk_tokens` from each document (no overlap)."""
    chunks = []
    for d in docs:
        ids = tokenizer(d.text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), chunk_tokens):
            piece = ids[start : start + chunk_tokens]
            if len(piece) >= min_tokens:
                chunks.append(piece)
    return chunks
