"""A corpus: documents found in directories, files and JSONL, and their token chunks.

Documents are found and hashed first (`scan`), so a re-index knows what changed before it
encodes anything, and bad input fails before a store is touched. Text is read in blocks
and chunked as it streams, so one very large file never has to fit in memory.
A document id is only ever data (a JSONL id or a path relative to its corpus root); it is
never turned back into a file path.
"""

from __future__ import annotations

import codecs
import hashlib
import html.parser
import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TextError
from .documents import builtin_documents

TEXT_SUFFIXES = {".txt", ".md", ".rst"}
HTML_SUFFIXES = {".html", ".htm"}
JSONL_SUFFIXES = {".jsonl"}
BLOCK_BYTES = 1 << 20
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_PARAGRAPH_END = re.compile(r"\n\s*\n")


@dataclass(frozen=True)
class Source:
    """One document: its id, content hash, and how to read its text again (in blocks)."""

    id: str
    hash: str
    path: Path | None = None  # a text/html file read in blocks
    text: str | None = None  # JSONL and built-in documents are already in memory
    meta: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        """The document's bytes as stored (an HTML file's markup included): what a progress bar can be
        sized by before the document is read."""
        return self.path.stat().st_size if self.text is None else len(self.text.encode("utf-8"))

    def blocks(self) -> Iterator[str]:
        """The document's text in pieces of about BLOCK_BYTES."""
        if self.text is not None:
            yield self.text
            return
        html_doc = self.path.suffix.lower() in HTML_SUFFIXES
        stripper = HTMLText() if html_doc else None
        for piece in _decoded_blocks(self.path):
            yield stripper.feed_text(piece) if stripper else piece


@dataclass(frozen=True)
class Chunk:
    """At most `chunk_tokens` tokens of one document, cut at a paragraph or sentence end."""

    doc_id: str
    ordinal: int
    text: str
    token_ids: tuple[int, ...]
    meta: str = ""  # the document's JSONL "meta" as JSON, else ""

    @property
    def id(self) -> str:
        """Stable across runs and compaction: the same text at the same place gets the same id."""
        h = hashlib.sha256(f"{self.doc_id}\0{self.ordinal}\0{self.text}".encode())
        return h.hexdigest()[:16]

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]

    def row(self) -> dict:
        """Its row of the store's chunk table (`Writer.append`, `Writer.write_rows`)."""
        return {"chunk_id": self.id, "doc_id": self.doc_id, "content_hash": self.hash, "text": self.text,
                "meta": self.meta, "ordinal": self.ordinal, "token_length": len(self.token_ids)}


# ---------------------------------------------------------------- finding documents


def scan(paths: list[str] | tuple[str, ...]) -> list[Source]:
    """Every document under `paths` (directories, files, JSONL, or "builtin"), sorted by id.

    Raises TextError for missing paths, binary files, malformed JSONL, duplicate ids and an
    empty corpus. Empty documents are skipped with a warning.
    """
    if not paths:
        raise TextError("no corpus given")
    found: list[Source] = []
    for p in paths:
        found += _scan_one(p)
    seen: dict[str, int] = {}
    for s in found:
        seen[s.id] = seen.get(s.id, 0) + 1
    dupes = sorted(i for i, n in seen.items() if n > 1)
    if dupes:
        raise TextError(f"duplicate document ids: {', '.join(dupes[:5])}" + (" …" if len(dupes) > 5 else ""))
    if not found:
        raise TextError(f"no documents in {', '.join(paths)}")
    return sorted(found, key=lambda s: s.id)


def _scan_one(p: str) -> list[Source]:
    if p in ("builtin", "builtin:train", "builtin:heldout"):  # Python's docs; the held-out 10% is the demo corpus
        split = p.partition(":")[2] or "all"
        return [Source(d.name, _text_hash(d.text), text=d.text) for d in builtin_documents(split)]
    path = Path(p)
    if not path.exists():
        raise TextError(f"corpus path not found: {p}")
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and _wanted(f, path))
        return [s for f in files for s in _file_sources(f, f.relative_to(path).as_posix())]
    return _file_sources(path, path.name)


def _wanted(f: Path, root: Path) -> bool:
    hidden = any(part.startswith(".") for part in f.relative_to(root).parts)
    return not hidden and f.suffix.lower() in TEXT_SUFFIXES | HTML_SUFFIXES | JSONL_SUFFIXES


def _file_sources(path: Path, doc_id: str) -> list[Source]:
    if path.suffix.lower() in JSONL_SUFFIXES:
        return _jsonl_sources(path)
    digest, size, blank = _file_hash(path)
    if size == 0 or blank:
        warnings.warn(f"{path}: {'empty' if size == 0 else 'whitespace-only'} file skipped", stacklevel=2)
        return []
    return [Source(doc_id, digest, path=path)]


# Share of characters that are U+FFFD (invalid UTF-8) or control codes above which a file is
# binary data, not text with a few bad bytes: random bytes decode to ~50% U+FFFD, while a
# Latin-1 file of accented prose stays under a few percent.
BINARY_SHARE = 0.3
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f\ufffd]")


def _file_hash(path: Path) -> tuple[str, int, bool]:
    """sha256 of the file's bytes, its size and whether it is whitespace only, read in blocks.

    Raises TextError for binary content (NUL bytes, or mostly undecodable/control characters)."""
    h, size, chars, junk, blank = hashlib.sha256(), 0, 0, 0, True
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with path.open("rb") as f:
        while block := f.read(BLOCK_BYTES):
            if b"\x00" in block:
                raise TextError(f"{path}: binary file, not text")
            h.update(block)
            size += len(block)
            text = decoder.decode(block)
            chars += len(text)
            junk += len(_CONTROL.findall(text))
            blank = blank and not text.strip()
    if chars and junk / chars > BINARY_SHARE:
        raise TextError(f"{path}: binary file, not text ({junk / chars:.0%} of its characters are "
                        "invalid UTF-8 or control codes)")
    return h.hexdigest()[:16], size, blank


def _text_hash(text: str, meta: dict | None = None) -> str:
    h = hashlib.sha256(text.encode())
    if meta:
        h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _jsonl_sources(path: Path) -> list[Source]:
    out = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:  # as for text files: replace, warn, go on
                warnings.warn(f"{where}: invalid UTF-8, decoded with replacement characters", stacklevel=2)
                line = raw.decode("utf-8", errors="replace")
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TextError(f"{where}: not a JSON object ({e})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise TextError(f"{where}: each line needs a string \"text\"")
            if not isinstance(rec.get("id"), (str, int)) or str(rec["id"]) == "":
                raise TextError(f"{where}: each line needs an \"id\" (string or integer)")
            if "\0" in str(rec["id"]):
                raise TextError(f"{where}: an \"id\" cannot contain a NUL character")
            meta = rec.get("meta") or {}
            if not isinstance(meta, dict):
                raise TextError(f"{where}: \"meta\" must be an object")
            if not rec["text"].strip():
                warnings.warn(f"{where}: empty text skipped", stacklevel=2)
                continue
            out.append(Source(str(rec["id"]), _text_hash(rec["text"], meta), text=rec["text"], meta=meta))
    return out


# ---------------------------------------------------------------- reading text


def _decoded_blocks(path: Path) -> Iterator[str]:
    """UTF-8 text of a file in blocks; invalid bytes become U+FFFD, with one warning."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    with path.open("rb") as f:
        while True:
            block = f.read(BLOCK_BYTES)
            state = decoder.getstate()
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError:
                warnings.warn(f"{path}: invalid UTF-8, decoded with replacement characters", stacklevel=2)
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                decoder.setstate(state)
                text = decoder.decode(block, final=not block)
            if text:
                yield text
            if not block:
                return


class HTMLText(html.parser.HTMLParser):
    """Visible text of an HTML stream: tags dropped, script/style skipped, blocks → paragraphs."""

    _BLOCKS = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "section", "article", "pre"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self._out: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("script", "style")
        if tag in self._BLOCKS:
            self._out.append("\n\n")

    def handle_endtag(self, tag):
        self._skip -= tag in ("script", "style") and self._skip > 0

    def handle_data(self, data):
        if not self._skip:
            self._out.append(data)

    def feed_text(self, piece: str) -> str:
        self.feed(piece)
        out, self._out = "".join(self._out), []
        return out


# ---------------------------------------------------------------- chunking


def chunks(source: Source, tokenizer, chunk_tokens: int) -> Iterator[Chunk]:
    """The document's token chunks in order, each at most `chunk_tokens` tokens.

    Paragraphs are packed whole while they fit; a longer paragraph is cut at sentence ends,
    and a longer sentence at token boundaries. Streams: holds one block plus one chunk.
    """
    meta = json.dumps(source.meta, sort_keys=True) if source.meta else ""
    ordinal, texts, ids = 0, [], []
    for text, piece_ids in _pieces(_paragraphs(source.blocks()), tokenizer, chunk_tokens):
        if ids and len(ids) + len(piece_ids) > chunk_tokens:
            yield Chunk(source.id, ordinal, "".join(texts), tuple(ids), meta)
            ordinal, texts, ids = ordinal + 1, [], []
        texts.append(text)
        ids += piece_ids
    if ids:
        yield Chunk(source.id, ordinal, "".join(texts), tuple(ids), meta)


def _paragraphs(blocks: Iterator[str]) -> Iterator[str]:
    """Paragraphs with their trailing blank lines, so joining them gives the text back."""
    tail = ""
    for block in blocks:
        text = tail + block
        last = 0
        for m in _PARAGRAPH_END.finditer(text):
            yield text[last : m.end()]
            last = m.end()
        tail = text[last:]
        if len(tail) > BLOCK_BYTES:  # no blank line for a whole block: cut anyway, memory first
            yield tail
            tail = ""
    if tail.strip():
        yield tail


def _pieces(paragraphs: Iterator[str], tokenizer, limit: int) -> Iterator[tuple[str, list[int]]]:
    """(text, token ids) units of at most `limit` tokens: paragraphs, else sentences, else slices."""
    for para in paragraphs:
        ids = _encode(tokenizer, para)
        if len(ids) <= limit:
            yield para, ids
            continue
        for sentence in _split_keep(para, _SENTENCE_END):
            sids = _encode(tokenizer, sentence)
            if len(sids) <= limit:
                yield sentence, sids
                continue
            for start in range(0, len(sids), limit):
                part = sids[start : start + limit]
                yield tokenizer.decode(part), part


def _split_keep(text: str, pattern: re.Pattern) -> list[str]:
    cuts = [m.end() for m in pattern.finditer(text)]
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if text[a:b]]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]
