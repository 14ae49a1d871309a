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

import numpy as np

from .backend import Backend
from .layout import compressors, open_group

MERGE_RATIO = 2  # merge the newest segment into the previous one while that one is at most this many times larger
MAX_SEGMENTS = 32  # and never keep more than this many
FIELDS = ("first", "count", "tokens", "token_offset")
PIECE_ROWS = 1 << 20  # rows per Zarr chunk of a segment's arrays
COMPLETE = "complete"  # a piece's group attribute, set after its arrays are written


class Segment:
    """One segment's content: `entries` {doc_id: {hash, first, count, tokens, token_offset}}
    and `deleted` (ids removed before the entries apply)."""

    def __init__(self, entries: dict[str, dict], deleted: list[str] | set[str] = ()):
        self.entries = entries
        self.deleted = sorted(set(deleted))

    def __len__(self) -> int:
        return len(self.entries) + len(self.deleted)

    def then(self, later: "Segment") -> "Segment":
        """This segment followed by `later`, as one."""
        gone = set(later.deleted)
        entries = {k: v for k, v in self.entries.items() if k not in gone}
        entries.update(later.entries)
        return Segment(entries, set(self.deleted) | set(later.deleted))

    def arrays(self) -> dict[str, np.ndarray]:
        ids = sorted(self.entries)
        out = {"doc_id": _utf8(ids), "hash": _utf8([str(self.entries[i].get("hash", "")) for i in ids]),
               "deleted": _utf8(self.deleted)}
        flat = {f"{k}_{part}": v for k, (blob, ends) in out.items() for part, v in (("utf8", blob), ("ends", ends))}
        for f in FIELDS:
            flat[f] = np.array([int(self.entries[i].get(f, 0)) for i in ids], np.int64)
        return flat

    def digest(self, arrays: dict[str, np.ndarray]) -> str:
        h = hashlib.sha256()
        for name in sorted(arrays):
            h.update(name.encode())
            h.update(np.ascontiguousarray(arrays[name]).tobytes())
        return h.hexdigest()[:24]


def _utf8(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [v.encode("utf-8") for v in values]
    return np.frombuffer(b"".join(encoded), np.uint8), np.cumsum([len(e) for e in encoded], dtype=np.int64)


def _strings(blob: np.ndarray, ends: np.ndarray) -> list[str]:
    raw = blob.tobytes()
    starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
    return [raw[a:b].decode("utf-8") for a, b in zip(starts.tolist(), ends.tolist())]


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
    ids = _strings(a["doc_id_utf8"], a["doc_id_ends"])
    hashes = _strings(a["hash_utf8"], a["hash_ends"])
    cols = [a[f].tolist() for f in FIELDS]
    entries = {i: {"hash": h, **dict(zip(FIELDS, vals))} for i, h, *vals in zip(ids, hashes, *cols)}
    return Segment(entries, _strings(a["deleted_utf8"], a["deleted_ends"]))


def resolve(segments: list[Segment]) -> dict[str, dict]:
    """The document table the segments make, in order."""
    table: dict[str, dict] = {}
    for s in segments:
        for d in s.deleted:
            table.pop(d, None)
        table.update(s.entries)
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
