"""The document table of a version, as immutable pieces: a publish writes what changed.

A version's manifest lists its document table as segments, oldest first. A segment is a
Zarr group under `meta/segments/<digest>/`, written once and never changed (its name is the
digest of its content, so rewriting it writes the same bytes): the documents it adds or
replaces (`doc_id`, `hash`, and where their chunks are: `first`, `count`, `tokens`,
`token_offset`) and the document ids it deletes. Reading the segments in order, each one's
deletions first, then its entries (a later entry for an id replaces an earlier one), gives the
table. A nightly run that changes 1% of the documents writes one segment of 1% of the table;
segments are merged, newest into the one before it, while that one is at most MERGE_RATIO
times larger (log-structured, as Lucene's and LSM stores' merges are): each segment is then
more than twice the next, so a version has O(log N) segments and an entry is rewritten
O(log N) times over its life. A publish writes what changed, plus on average a logarithmic
share of merging; the big base segment is rewritten only once the changes add up to it.

Beside the segments, a version names its live-row bitmap (`meta/live/<digest>`, one bit per
row of the chunk table): what a reader needs to answer searches without reading the table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from .backend import Backend
from .layout import compressors, open_group

MERGE_RATIO = 2  # merge the newest segment into the previous one while that one is at most this many times larger
MAX_SEGMENTS = 32  # and never keep more than this many
FIELDS = ("first", "count", "tokens", "token_offset")
PIECE_ROWS = 1 << 20  # rows per Zarr chunk of a segment's arrays
COMPLETE = "complete"  # a piece's group attribute, set after its arrays are written


class DocTable(Mapping):
    """The document table, {doc_id: {hash, first, count, tokens, token_offset}}, as columns.

    Ids are a sorted numpy bytes array (UTF-8; bytewise order is Python's order of the strings)
    beside a hash column and one int64 column per field, so a table of ten million documents
    is a few hundred MB of arrays rather than ten million dicts, loads from its segments with
    vectorised reads, and is updated by a sorted merge. It reads as a mapping (`table[id]` gives
    the entry as a dict); the vectorised methods (`find`, `then`, `rows`) are what the writer
    uses. Ids and hashes must not end with a NUL character (numpy's bytes arrays drop it)."""

    def __init__(self, ids: np.ndarray, hashes: np.ndarray, cols: dict[str, np.ndarray]):
        self.ids, self.hashes, self.cols = ids, hashes, cols

    @classmethod
    def empty(cls) -> "DocTable":
        return cls(np.zeros(0, "S1"), np.zeros(0, "S1"), {f: np.zeros(0, np.int64) for f in FIELDS})

    @classmethod
    def from_dict(cls, entries: Mapping[str, dict]) -> "DocTable":
        if isinstance(entries, DocTable):
            return entries
        ids = sorted(entries)
        hashes = [str(entries[i].get("hash", "")) for i in ids]
        if any(v.endswith("\0") for v in (*ids, *hashes)):
            raise ValueError("a document id or hash ends with a NUL character")
        cols = {f: np.array([int(entries[i].get(f, 0)) for i in ids], np.int64) for f in FIELDS}
        return cls(_bytes(ids), _bytes(hashes), cols)

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[str]:
        return (i.decode("utf-8") for i in self.ids.tolist())

    def __contains__(self, doc_id) -> bool:
        return isinstance(doc_id, str) and self._pos(doc_id) >= 0

    def __getitem__(self, doc_id: str) -> dict:
        i = self._pos(doc_id) if isinstance(doc_id, str) else -1
        if i < 0:
            raise KeyError(doc_id)
        return self.entry(i)

    def items(self) -> Iterator[tuple[str, dict]]:  # type: ignore[override]  # position order, no lookups
        return ((self.ids[i].decode("utf-8"), self.entry(i)) for i in range(len(self)))

    def values(self) -> Iterator[dict]:  # type: ignore[override]
        return (self.entry(i) for i in range(len(self)))

    def entry(self, i: int) -> dict:
        return {"hash": self.hashes[i].decode("utf-8"), **{f: int(self.cols[f][i]) for f in FIELDS}}

    def _pos(self, doc_id: str) -> int:
        return int(self.find(np.array([doc_id.encode("utf-8")]))[0])

    def find(self, ids: np.ndarray | list[str]) -> np.ndarray:
        """Positions of `ids` (a bytes array, or strings) in the table; -1 where absent."""
        keys = ids if isinstance(ids, np.ndarray) else _bytes(list(ids))
        if not len(self.ids) or not len(keys):
            return np.full(len(keys), -1, np.int64)
        pos = np.minimum(np.searchsorted(self.ids, keys), len(self.ids) - 1)
        return np.where(self.ids[pos] == keys, pos, -1).astype(np.int64)

    def take(self, keep: np.ndarray) -> "DocTable":
        """The rows `keep` (a mask or ascending positions), still sorted."""
        return DocTable(self.ids[keep], self.hashes[keep], {f: c[keep] for f, c in self.cols.items()})

    def then(self, later: "DocTable", deleted: np.ndarray = np.zeros(0, "S1")) -> "DocTable":
        """This table with `deleted` removed and `later`'s entries put in (replacing any with the
        same id): a sorted merge, O(len(self)) copying and O(len(later) log len(self)) search."""
        drop = np.concatenate([self.find(deleted), self.find(later.ids)])
        keep = np.ones(len(self), bool)
        keep[drop[drop >= 0]] = False
        base = self.take(keep) if not keep.all() else self
        if not len(later):
            return base
        at = np.searchsorted(base.ids.astype(_wider(base.ids, later.ids)), later.ids)

        def merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return np.insert(a.astype(_wider(a, b), copy=False), at, b)

        return DocTable(merged(base.ids, later.ids), merged(base.hashes, later.hashes),
                        {f: np.insert(base.cols[f], at, later.cols[f]) for f in FIELDS})

    def rows(self) -> np.ndarray:
        """int64 chunk rows the table's documents own, ascending."""
        first, count = self.cols["first"], self.cols["count"]
        if not len(first) or not count.sum():
            return np.zeros(0, np.int64)
        starts = np.repeat(first - np.concatenate([[0], np.cumsum(count)[:-1]]), count)
        return np.sort(starts + np.arange(int(count.sum())))

    def by_first(self) -> Iterator[tuple[str, dict]]:
        """(id, entry) in the order of their first chunk row (how the rows lie in the store)."""
        for i in np.argsort(self.cols["first"], kind="stable").tolist():
            yield self.ids[i].decode("utf-8"), self.entry(i)


class Segment:
    """One segment's content: `entries` (a DocTable, or a dict made into one) and `deleted`
    (ids removed before the entries apply)."""

    def __init__(self, entries: Mapping[str, dict], deleted: np.ndarray | list[str] | set[str] = ()):
        self.entries = DocTable.from_dict(entries)
        self.deleted = deleted if isinstance(deleted, np.ndarray) else _bytes(sorted(set(deleted)))

    def __len__(self) -> int:
        return len(self.entries) + len(self.deleted)

    def then(self, later: "Segment") -> "Segment":
        """This segment followed by `later`, as one."""
        gone = np.union1d(self.deleted, later.deleted) if len(later.deleted) else self.deleted
        return Segment(self.entries.then(later.entries, later.deleted), gone)

    def arrays(self) -> dict[str, np.ndarray]:
        e = self.entries
        out = {"doc_id": _utf8(e.ids), "hash": _utf8(e.hashes), "deleted": _utf8(self.deleted)}
        flat = {f"{k}_{part}": v for k, (blob, ends) in out.items() for part, v in (("utf8", blob), ("ends", ends))}
        for f in FIELDS:
            flat[f] = e.cols[f].astype(np.int64, copy=False)
        return flat

    def digest(self, arrays: dict[str, np.ndarray]) -> str:
        h = hashlib.sha256()
        for name in sorted(arrays):
            h.update(name.encode())
            h.update(np.ascontiguousarray(arrays[name]).tobytes())
        return h.hexdigest()[:24]


@dataclass
class Update:
    """A new version's document table as a change to its base (`updated`)."""

    segment: Segment  # what the new version adds, replaces and deletes (or the whole table)
    refs: list[dict]  # the base's segments it follows ([] where it is the whole table)
    live: np.ndarray  # bool [chunks]: the chunk-table rows live in the new version
    live_tokens: int
    n_documents: int


def updated(changed: Mapping[str, dict], deleted: Iterable[str], chunks: int, base=None) -> Update:
    """The document table of a version of `chunks` chunk-table rows: `base`'s (a Manifest of the same
    generation, or None: a new store or generation) with the documents `deleted` removed and the
    `changed` ones ({id: {hash, first, count, tokens, token_offset}}) put in. On a segmented base the
    new segment holds what changed (entries equal to base's are no change); otherwise it is the whole
    table. Costs O(change) in Python and a vectorised O(documents) pass over `base`'s table."""
    new = DocTable.from_dict(changed)
    gone = np.array(sorted({d.encode("utf-8") for d in deleted} - set(new.ids.tolist())), dtype=np.bytes_)
    live = np.zeros(chunks, bool)
    if base is not None and base.segments:  # what changed since base
        old = base.documents
        at = old.find(new.ids)
        same = at >= 0
        same[same] = (old.hashes[at[same]] == new.hashes[same]) & np.logical_and.reduce(
            [old.cols[f][at[same]] == new.cols[f][same] for f in FIELDS])
        new = new.take(~same)
        at = at[~same]
        gone = gone[old.find(gone) >= 0]
        replaced = np.concatenate([old.find(gone), at[at >= 0]])  # entries no longer live
        live[base.live_rows()] = True
        live[old.take(np.sort(replaced)).rows()] = False
        live[new.rows()] = True
        tokens = base.live_tokens + int(new.cols["tokens"].sum()) - int(old.cols["tokens"][replaced].sum())
        return Update(Segment(new, gone), base.segments, live, int(tokens),
                      base.n_documents + int((at < 0).sum()) - len(gone))
    if base is not None:  # a base of the inline format: the whole table
        new = base.documents.then(new, gone)
    live[new.rows()] = True
    return Update(Segment(new), [], live, int(new.cols["tokens"].sum()), len(new))


def _bytes(values: list[str]) -> np.ndarray:
    """UTF-8 bytes array of `values` (at least one byte wide, so that empty input concatenates)."""
    return np.array([v.encode("utf-8") for v in values], dtype=np.bytes_) if values else np.zeros(0, "S1")


def _wider(a: np.ndarray, b: np.ndarray) -> np.dtype:
    return np.dtype(f"S{max(a.dtype.itemsize, b.dtype.itemsize, 1)}")


def _utf8(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A bytes array as one blob of its values and where each ends (the format's string columns)."""
    width = values.dtype.itemsize
    if not len(values) or not width:
        return np.zeros(0, np.uint8), np.zeros(0, np.int64)
    grid = np.ascontiguousarray(values).view(np.uint8).reshape(len(values), width)
    lengths = np.strings.str_len(values).astype(np.int64)
    if (lengths == width).all():
        return grid.reshape(-1), np.cumsum(lengths)
    return grid[np.arange(width) < lengths[:, None]], np.cumsum(lengths)


def _fixed(blob: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The bytes array that `_utf8` made `blob` and `ends` from (one pass per byte of the longest)."""
    lengths = np.diff(ends, prepend=0).astype(np.int64)
    width = int(lengths.max()) if len(lengths) else 0
    if not width:
        return np.zeros(len(ends), "S1")
    if (lengths == width).all():
        return np.ascontiguousarray(blob).view(f"S{width}").copy()
    grid = np.zeros((len(ends), width), np.uint8)
    starts = ends - lengths
    for j in range(width):
        has = np.flatnonzero(lengths > j)
        grid[has, j] = blob[starts[has] + j]
    return grid.view(f"S{width}").reshape(-1)


def _write_once(backend: Backend, key: str, arrays: dict[str, np.ndarray], attributes: dict | None = None) -> None:
    """The Zarr group `key` of `arrays`, unless a complete one is there (same key, same content):
    its `COMPLETE` attribute is set last, so a group a crash left half-written is written again, and one
    that a published version references is never rewritten under its readers."""
    if backend.exists(f"{key}/zarr.json") and open_group(backend, key).attrs.get(COMPLETE):
        return
    g = open_group(backend, key, mode="w")
    for name, data in arrays.items():
        g.create_array(name, data=data, chunks=(max(1, min(len(data), PIECE_ROWS)),),
                       compressors=compressors("zstd"), attributes=attributes)
    g.attrs[COMPLETE] = True


def write_segment(backend: Backend, seg: Segment) -> dict:
    """Write `seg` (idempotent: same content, same key); its manifest entry."""
    arrays = seg.arrays()
    key = f"meta/segments/{seg.digest(arrays)}"
    _write_once(backend, key, arrays)
    return {"key": key, "entries": len(seg.entries), "deleted": len(seg.deleted)}


def read_segment(backend: Backend, ref: dict) -> Segment:
    g = open_group(backend, ref["key"])
    a = {name: g[name][:] for name in g.array_keys()}
    entries = DocTable(_fixed(a["doc_id_utf8"], a["doc_id_ends"]), _fixed(a["hash_utf8"], a["hash_ends"]),
                       {f: a[f].astype(np.int64, copy=False) for f in FIELDS})
    return Segment(entries, _fixed(a["deleted_utf8"], a["deleted_ends"]))


def resolve(segments: list[Segment]) -> DocTable:
    """The document table the segments make, in order."""
    table = DocTable.empty()
    for s in segments:
        table = table.then(s.entries, s.deleted)
    return table


def appended(backend: Backend, refs: list[dict], seg: Segment) -> list[dict]:
    """The segment list `refs` with `seg` written after it, merged log-structured (module docstring)."""
    refs = list(refs)
    if not len(seg):
        return refs
    size = len(seg)
    while refs and (refs[-1]["entries"] + refs[-1]["deleted"] <= MERGE_RATIO * size or len(refs) >= MAX_SEGMENTS):
        seg = read_segment(backend, refs.pop()).then(seg)
        if not refs:
            seg = Segment(seg.entries)  # the oldest segment: nothing before it to delete from
        size = len(seg)
    return refs + [write_segment(backend, seg)]


def write_live(backend: Backend, live: np.ndarray) -> str:
    """The live-row bitmap (bool [chunks]) as a Zarr array; its key."""
    bits = np.packbits(live.astype(bool))
    key = f"meta/live/{hashlib.sha256(bits.tobytes() + str(len(live)).encode()).hexdigest()[:24]}"
    _write_once(backend, key, {"bits": bits}, {"rows": int(len(live))})
    return key


def read_live(backend: Backend, key: str, rows: int) -> np.ndarray:
    """Live chunk rows (int64, ascending) from the bitmap at `key`."""
    bits = open_group(backend, key)["bits"][:]
    return np.flatnonzero(np.unpackbits(bits, count=rows)).astype(np.int64)
