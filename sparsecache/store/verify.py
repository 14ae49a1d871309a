"""`verify`: read every chunk of every array of a version (CRC32C-checked) and check the
manifest's meaning against the chunk table, the index and the dictionary copy."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import StoreCorrupt, StoreError
from .backend import open_backend
from .layout import CODE_ARRAYS, Indexer, root_attrs
from .reader import Store, chunk_key
from .versions import read_manifest


def verify(where, version: int | None = None, indexer: Indexer | None = None,
           dictionary_fingerprint: Callable[[object], str] | None = None) -> dict:
    """Check one version (default: the latest) of the store at a path or URL: every chunk of
    every array, the manifest against the chunk table, and, where given what reads them, the
    index (`indexer.rows`) and the dictionary copy (`dictionary_fingerprint` of its directory
    must be the one recorded at creation; `kvstore.verify` passes both).

    Returns {"ok", "version", "problems": [str], "corrupt_chunks": [chunk ids]}.
    """
    backend = open_backend(where)
    attrs = root_attrs(backend)
    m = read_manifest(backend, version)
    store = Store(backend, attrs, m)
    problems: list[str] = []
    bad_tokens: list[tuple[int, int]] = []
    bad_rows: list[tuple[int, int]] = []
    present = set(backend.list(store.data))
    for name in backend.children(store.data):
        if name == "zarr.json":
            continue
        arr = store.array(name)
        axis = 1 if name in CODE_ARRAYS else 0
        extent, on_tokens = _extent(store, name)
        step = arr.chunks[axis]
        for i in _chunks_to_check(store, name, extent, step, on_tokens):
            key = chunk_key(arr, i, axis)
            span = (i * step, min((i + 1) * step, extent))
            sel = tuple(slice(*span) if a == axis else slice(None) for a in range(arr.ndim))
            why = None
            if f"{store.data}/{name}/{key}" not in present:
                why = "missing"
            else:
                try:
                    arr[sel]
                except (ValueError, RuntimeError, OSError) as e:
                    why = f"unreadable ({str(e)[:80]})"
            if why:
                problems.append(f"{m.generation}/{name}/{key}: {why}")
                if on_tokens:
                    bad_tokens.append(span)
                else:
                    bad_rows.append(_rows_of(store, name, span))
    problems += _check_manifest(store, indexer, dictionary_fingerprint)
    corrupt = _chunks_in(store, bad_tokens, bad_rows)
    return {"ok": not problems, "version": m.version, "problems": problems, "corrupt_chunks": corrupt}


def _chunks_to_check(store: Store, name: str, extent: int, step: int, on_tokens: bool) -> list[int]:
    """Chunk indices holding this version's data. On the token axis and for the embeddings,
    only chunks that hold live data: space a crashed distributed run allocated but never
    wrote is dead (nothing names it) and may have no chunk objects at all."""
    if not (on_tokens or name == "embeddings"):
        return list(range((extent + step - 1) // step))
    rows = store.live_rows()
    if on_tokens:
        spans = [store.row_span(r) for r in rows]
    else:
        spans = [(int(r), int(r) + 1) for r in rows]
    return sorted({i for a, b in spans if b > a for i in range(a // step, (b - 1) // step + 1)})


def _extent(store: Store, name: str) -> tuple[int, bool]:
    """How far array `name` reaches in this version, and whether along the token axis."""
    m = store.manifest
    if name in (*CODE_ARRAYS, "tokens"):
        return m.tokens, True
    if name.endswith("_utf8") and m.chunks:
        try:
            return int(store.array(name[:-5] + "_ends")[m.chunks - 1]), False
        except (ValueError, RuntimeError, OSError):
            return store.array(name).shape[0], False  # its ends are damaged (reported there)
    return (0 if name.endswith("_utf8") else m.chunks), False


def _rows_of(store: Store, name: str, span: tuple[int, int]) -> tuple[int, int]:
    """The chunk rows a damaged span of array `name` touches (bytes → rows for text arrays)."""
    if not name.endswith("_utf8"):
        return span
    try:
        ends = store.array(name[:-5] + "_ends")[: store.manifest.chunks]
    except (ValueError, RuntimeError, OSError):
        return 0, store.manifest.chunks
    return int(np.searchsorted(ends, span[0], side="right")), int(np.searchsorted(ends, span[1] - 1, side="right")) + 1


def _check_index(store: Store, indexer: Indexer | None, rows: np.ndarray) -> list[str]:
    """Every index segment reads, holds only rows of its range, none twice; every live row is in one."""
    m, out, held = store.manifest, [], []
    for piece in m.index_pieces():
        key = piece["key"]
        try:
            data = store.index_bytes(key)
            ids = indexer.rows(data) if indexer is not None else None
        except StoreError as e:
            out.append(str(e))
            continue
        except RuntimeError as e:
            out.append(f"{key}: unreadable index: {str(e).splitlines()[0]}")
            continue
        if ids is None:
            continue
        if len(np.unique(ids)) != len(ids) or ((ids < piece["lo"]) | (ids >= piece["hi"])).any():
            out.append(f"index {key} holds {len(ids) - len(np.unique(ids))} duplicated rows and "
                       f"{int(((ids < piece['lo']) | (ids >= piece['hi'])).sum())} outside its rows "
                       f"{piece['lo']}..{piece['hi'] - 1}")
        held.append(ids)
    if indexer is not None and not out:
        lost = np.setdiff1d(rows, np.concatenate(held) if held else np.zeros(0, np.int64))
        if len(lost):
            out.append(f"the index misses {len(lost)} of {len(rows)} live chunks (rows {lost[:5].tolist()})")
    return out


def _check_manifest(store: Store, indexer: Indexer | None, dictionary_fingerprint) -> list[str]:
    m, out = store.manifest, []
    for name in (*CODE_ARRAYS, "tokens"):
        axis = 1 if name in CODE_ARRAYS else 0
        if store.array(name).shape[axis] < m.tokens:
            out.append(f"{name}: shorter than the manifest's {m.tokens} tokens")
    rows = store.live_rows()
    if len(rows) and rows[-1] >= m.chunks:
        out.append(f"manifest names chunk rows beyond its extent {m.chunks}")
    out += _check_index(store, indexer, rows)
    try:
        out += _check_layout(store)
    except StoreCorrupt as e:
        out.append(str(e))
    if dictionary_fingerprint is not None:
        try:
            if dictionary_fingerprint(store.dictionary_dir()) != store.attrs["dictionary"]:
                out.append("dictionary: the copy does not match the fingerprint recorded at creation")
        except Exception as e:  # a dictionary copy that does not load is corruption too
            out.append(f"dictionary: {e}")
    try:
        store.prefix()
    except StoreCorrupt as e:
        out.append(str(e))
    return out


def _check_layout(store: Store) -> list[str]:
    """The manifest's meaning against the chunk table: each live document owns a contiguous run
    of rows holding its chunks in order, token spans are contiguous and disjoint, no chunk is
    live twice. Names the documents involved."""
    m, out = store.manifest, []
    if not m.chunks:
        return out
    doc_col, ordinal, offset, length = (store.column(c) for c in ("doc_id", "ordinal", "token_offset", "token_length"))
    spans = []  # (first token, end token, doc)
    claimed: dict[int, str] = {}
    for doc, d in m.documents.by_first():
        first, count = int(d["first"]), int(d["count"])
        if first < 0 or first + count > m.chunks:
            out.append(f"document {doc!r}: rows {first}..{first + count - 1} lie beyond the extent {m.chunks}")
            continue
        for r in range(first, first + count):
            if r in claimed:
                out.append(f"document {doc!r}: row {r} is also claimed by document {claimed[r]!r}")
            claimed[r] = doc
        rows = np.arange(first, first + count)
        wrong = [int(r) for r in rows if str(doc_col[r]) != doc]
        if wrong:
            holders = sorted({str(doc_col[r]) for r in wrong})
            out.append(f"document {doc!r}: rows {wrong[:5]} hold chunks of {', '.join(map(repr, holders[:3]))}")
        elif not np.array_equal(ordinal[rows], np.arange(count)):
            out.append(f"document {doc!r}: chunk ordinals {ordinal[rows][:8].tolist()} are not 0..{count - 1}")
        if count:
            starts, ends = offset[rows], offset[rows] + length[rows]
            if not np.array_equal(starts[1:], ends[:-1]) or int(length[rows].sum()) != int(d["tokens"]):
                out.append(f"document {doc!r}: token spans are not one contiguous run of {d['tokens']} tokens")
            elif ends[-1] > m.tokens or starts[0] < 0:
                out.append(f"document {doc!r}: tokens {starts[0]}..{ends[-1]} lie beyond the extent {m.tokens}")
            spans.append((int(starts[0]), int(ends[-1]), doc))
    spans.sort()
    for (a0, a1, da), (b0, b1, db) in zip(spans, spans[1:]):
        if b0 < a1:
            out.append(f"documents {da!r} and {db!r} share tokens {b0}..{min(a1, b1) - 1}")
    live_ids = store.chunk_ids(store.live_rows())
    if len(set(live_ids)) != len(live_ids):
        out.append(f"{len(live_ids) - len(set(live_ids))} chunk id(s) are live twice")
    return out


def _chunks_in(store: Store, bad_tokens: list[tuple[int, int]], bad_rows: list[tuple[int, int]]) -> list[str]:
    """Ids of live chunks whose tokens or table rows fall in a damaged span."""
    out = []
    for r in store.live_rows():
        a, b = store.row_span(r)
        if any(a < hi and lo < b for lo, hi in bad_tokens) or any(lo <= r < hi for lo, hi in bad_rows):
            out.append(store.chunk_ids([r])[0])
    return out
