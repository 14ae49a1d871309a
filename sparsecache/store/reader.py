"""Reading one published version: the chunk table, codes by token span, the prefix, the index.

Span reads of the code arrays skip zarr's pipeline where the chunks are plain bytes + CRC32C
(the default layout): the needed chunk objects are fetched in one batch (parallel GETs on an
object store), each is CRC-checked, and the spans are sliced out.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..codec.codes import Codes
from ..errors import StoreCorrupt, StoreError, VersionGone
from ..model.fingerprint import check_same_model
from .backend import Backend, open_backend
from .calibration import read_calibration
from .context_layout import ContextLayout
from .layout import (CODE_ARRAYS, TEXT_COLUMNS, legacy_strings, open_group, read_rows, read_strings, root_attrs,
                     store_config, text_arrays, zarr_points)
from .versions import READ_ATTEMPTS, Manifest, manifest_key, read_manifest, versions

INFO_COLUMNS = ("doc_id", "ordinal", "token_offset", "token_length")  # a ChunkInfo's, beside its id
ROWS_ONE_BY_ONE = 256  # more rows than this: a column is read whole (once) rather than row by row
WHOLE_COLUMNS_UP_TO = 100_000  # chunks up to which a column is read whole (once) on first use: quicker
# than Zarr's per-call cost on every search; above it, the rows a search answers with are read alone


@dataclass(frozen=True)
class ChunkInfo:
    id: str
    doc_id: str
    ordinal: int
    row: int
    token_offset: int
    token_length: int


@dataclass
class ChunkCodes:
    """The codes of several chunks, concatenated along the token axis (in the order asked)."""

    chunk_ids: list[str]
    lengths: list[int]
    tokens: np.ndarray  # int32 [T]
    k: Codes  # indices [G, T, row_bytes], coefficients [G, T, s]
    v: Codes

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.tokens.nbytes


def read_zarr(requests: list) -> list[np.ndarray]:
    """Run (async array, selection) reads in one round trip of zarr's event loop."""
    from zarr.core.sync import sync

    async def every():
        return await asyncio.gather(*(arr.getitem(sel) for arr, sel in requests))

    return sync(every())


def chunk_codec(arr) -> str | None:
    """"plain" where `arr`'s chunks are stored as raw little-endian bytes + CRC32C (our
    uncompressed layout), "zstd" where as zstd-compressed bytes + CRC32C; else None (zarr's
    own pipeline reads them)."""
    from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec

    codecs = arr.metadata.codecs
    endian = getattr(codecs[0], "endian", None)
    if not (isinstance(codecs[0], BytesCodec) and getattr(endian, "value", endian) in (None, "little")
            and isinstance(codecs[-1], Crc32cCodec)):
        return None
    if len(codecs) == 2:
        return "plain"
    return "zstd" if len(codecs) == 3 and isinstance(codecs[1], ZstdCodec) else None


def plain_chunks(arr) -> bool:
    """True when chunks are plain (`chunk_codec`) and chunked along one axis only: then
    `read_spans_direct` can read them without zarr's pipeline."""
    return chunk_codec(arr) == "plain" and sum(c != n for c, n in zip(arr.chunks, arr.shape)) <= 1


def decode_chunk(arr, raw: bytes | None, where: str) -> np.ndarray:
    """One chunk object of `arr` (`chunk_codec` not None) as an array of its chunk shape:
    CRC-checked, zstd undone; a missing or damaged one raises StoreCorrupt naming `where`."""
    import google_crc32c

    if raw is None:
        raise StoreCorrupt(f"{where} is missing")
    body = raw[:-4]
    if google_crc32c.value(body) != int.from_bytes(raw[-4:], "little"):
        raise StoreCorrupt(f"{where} fails its CRC32C check (damaged or truncated)")
    if chunk_codec(arr) == "zstd":
        from numcodecs.zstd import Zstd

        try:
            body = Zstd().decode(body)
        except RuntimeError as e:
            raise StoreCorrupt(f"{where}: zstd cannot decode it ({e})") from e
    dtype = arr.dtype.newbyteorder("<")
    if len(body) != int(np.prod(arr.chunks)) * dtype.itemsize:
        raise StoreCorrupt(f"{where} has {len(body)} bytes, not a whole chunk")
    return np.frombuffer(body, dtype).reshape(arr.chunks)


class ByteLRU:
    """Arrays by key, the least recently used dropped once they hold more than `budget` bytes;
    safe to share between threads."""

    def __init__(self, budget: int):
        from collections import OrderedDict

        self.budget, self.held = budget, 0
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.held = 0

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value: np.ndarray) -> None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return
            self._items[key] = value
            self.held += value.nbytes
            while self.held > self.budget and len(self._items) > 1:
                self.held -= self._items.popitem(last=False)[1].nbytes


SPAN_CACHE_BYTES = 256 << 20  # token spans (a chunk's tokens, its codes) kept per store connection


def span_cache(backend: Backend) -> ByteLRU:
    """The chunk spans this process has read through `backend` (every version opened through it
    shares them). A span of a generation's arrays never changes once written (appends only extend
    an array; compaction writes a new generation), so a span read once is served from here after,
    also while the store does not answer."""
    cache = backend.__dict__.get("_span_cache")
    if cache is None:
        cache = backend.__dict__.setdefault("_span_cache", ByteLRU(SPAN_CACHE_BYTES))
    return cache


class DirectPoints:
    """A `layout.read_rows` fetch from the chunk objects of 1-D arrays (`chunk_codec`): every
    chunk a round needs in one batch of GETs, each CRC-checked and decoded, and decoded chunks
    kept (up to CACHE_BYTES) for the searches after. Zarr's pipeline costs ~1 ms a chunk on
    this CPU, which above 100K chunks made a search's eight answers cost ~40 ms to look up."""

    CACHE_BYTES = 64 << 20

    def __init__(self, backend: Backend, folder: str, handles, fallback):
        self.backend, self.folder, self.handles, self.fallback = backend, folder, handles, fallback
        self.cache = ByteLRU(self.CACHE_BYTES)

    def __call__(self, reads: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        arrays = [self.handles[name] for name, _ in reads]
        if any(a.ndim != 1 or chunk_codec(a) is None for a in arrays):
            return self.fallback(reads)
        wanted = {(name, int(i)) for (name, at), a in zip(reads, arrays) for i in np.unique(at // a.chunks[0])}
        chunks = {w: c for w in wanted if (c := self.cache.get(w)) is not None}  # held here: keeping new ones may evict them
        missing = sorted(wanted - set(chunks))
        keys = [f"{self.folder}/{name}/{chunk_key(self.handles[name], i, 0)}" for name, i in missing]
        for (name, i), key, raw in zip(missing, keys, self.backend.get_many(keys)):
            chunks[(name, i)] = decode_chunk(self.handles[name], raw, key.removeprefix("data/"))
        for w, chunk in chunks.items():
            self.cache.put(w, chunk)
        out = []
        for (name, at), a in zip(reads, arrays):
            step = a.chunks[0]
            values = np.empty(len(at), a.dtype)
            which = at // step
            for i in np.unique(which):
                sel = which == i
                values[sel] = chunks[(name, int(i))][at[sel] - i * step]
            out.append(values)
        return out


def chunk_key(arr, i: int, axis: int) -> str:
    """The key (relative to the array) of the i-th chunk along `axis`."""
    return arr.metadata.encode_chunk_key(tuple(i if d == axis else 0 for d in range(arr.ndim)))


def read_spans_direct(arr, backend: Backend, folder: str, spans: list[tuple[int, int]], axis: int) -> np.ndarray:
    """Spans along `axis` of a plain-chunked Zarr array at key `folder`, read from its chunk objects.

    Same result as zarr's own read (tests compare them) at a fraction of the cost: zarr's
    async pipeline spends ~1 ms per chunk on this CPU, a file read + CRC check ~0.15 ms.
    Each chunk is CRC-checked; a missing or damaged one raises StoreCorrupt.
    """
    shape, step = arr.chunks, arr.chunks[axis]
    needed = sorted({i for a, b in spans for i in range(a // step, (b - 1) // step + 1)})
    keys = [chunk_key(arr, i, axis) for i in needed]
    name = folder.removeprefix("data/")  # the generation's array, as `verify` names its chunks
    loaded = {i: decode_chunk(arr, raw, f"{name}/{key}")
              for i, key, raw in zip(needed, keys, backend.get_many([f"{folder}/{k}" for k in keys]))}
    out_shape = list(shape)
    out_shape[axis] = sum(b - a for a, b in spans)
    out = np.empty(out_shape, arr.dtype)
    pos = 0
    for a, b in spans:
        for i in range(a // step, (b - 1) // step + 1):
            lo, hi = max(a, i * step) - i * step, min(b, (i + 1) * step) - i * step
            dst = [slice(None)] * len(shape)
            src = [slice(None)] * len(shape)
            dst[axis], src[axis] = slice(pos, pos + hi - lo), slice(lo, hi)
            out[tuple(dst)] = loaded[i][tuple(src)]
            pos += hi - lo
    return out


class _Handles(dict):
    """A generation's arrays by name, each opened once."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def __missing__(self, name: str):
        self[name] = self.group[name]
        return self[name]


class Store:
    """A read-only view of one published version (the latest unless `version` is given)."""

    def __init__(self, backend: Backend, attrs: dict, manifest: Manifest):
        self.backend = backend
        self.attrs = attrs
        self.config = store_config(attrs)
        self.manifest = manifest
        self.data = f"data/{manifest.generation}"
        self.group = open_group(backend, self.data)
        self._arrays = {name: self.group[name] for name in (*CODE_ARRAYS, "tokens")}
        self.legacy_strings = legacy_strings(self.group)
        self._rows = manifest.live_rows()
        # the chunk table's columns are read whole only when something needs them whole; a
        # search reads the rows it answers with (`chunk_at`), so opening costs O(1) reads
        self._columns: dict[str, np.ndarray] = {}
        self._row_of: dict[str, int] | None = None
        self._known: dict[str, int] = {}  # ids of live rows read one by one
        self._handles = _Handles(self.group)  # opened arrays: opening one by name costs a read
        self._points = DirectPoints(backend, self.data, self._handles, zarr_points(self._handles))
        self._prefix = None

    @classmethod
    def open(cls, where, version: int | None = None) -> "Store":
        """The store at a path or URL (s3://, gs://, az://), pinned to `version` (default: latest).

        Opening reads the chunk table; a latest version pruned meanwhile (two publishes by a
        writer keeping one version) is opened again as the new latest, bounded."""
        backend = open_backend(where)
        attrs = root_attrs(backend)
        for _ in range(READ_ATTEMPTS):
            manifest = read_manifest(backend, version)
            try:
                store = cls(backend, attrs, manifest)
            except Exception:
                if backend.exists(manifest_key(manifest.version)):
                    raise  # not explained by a deletion: the error stands
                store = None
            if store is not None and store.published():
                return store
            if version is not None:
                raise VersionGone(f"{backend}: version {version} was deleted (compact or --keep) as it was opened")
        raise VersionGone(f"{backend}: {READ_ATTEMPTS} versions in a row were deleted as they were opened")

    def published(self) -> bool:
        """Whether this store's version still exists. Publishing deletes manifests before the
        data only they use, so whatever was read before this returns True was read intact
        (zarr reads a deleted chunk as fill values, silently; this check is what catches it)."""
        return self.backend.exists(manifest_key(self.version))

    def latest(self) -> "Store":
        """The newest published version of this store; what never changes over a store's life
        (its shared prefix, and what a subclass names in `CARRIED`) is carried over, not read again."""
        return self.at(None)

    def at(self, version: int | None) -> "Store":
        """Version `version` (None: the newest) of this store, opened through the same backend,
        with what never changes over a store's life carried over (`latest`)."""
        new = type(self).open(self.backend, version)
        for name in self.CARRIED:
            setattr(new, name, getattr(self, name))
        return new

    def prepare(self) -> "Store":
        """Read now what requests would otherwise read on first use: the chunk table's columns a
        search and a layout read (whole, where that is how they are read: `WHOLE_COLUMNS_UP_TO`)
        and the prefix. A server's background poller calls it before it moves requests onto
        this version, so no request waits on the store for them."""
        if self.manifest.chunks <= WHOLE_COLUMNS_UP_TO:
            for name in ("chunk_id", *INFO_COLUMNS):
                self._column(name)
            self._rows_by_id()
        self._prefix_group()
        return self

    CARRIED = ("_prefix",)  # attributes that never change over a store's life: `at` carries them to a newer version

    def calibration(self) -> dict:
        """This version's measured query configuration, {device kind: record} ({} where none:
        `sparsecache calibrate`, `store.calibration`); read once per version."""
        if self._calibration is None:
            self._calibration = read_calibration(self.backend, self.version)
        return self._calibration

    _calibration: dict | None = None

    @property
    def root(self):
        """The local directory of the store, or its URL."""
        return self.backend.local_root or self.backend.url

    @property
    def version(self) -> int:
        return self.manifest.version

    def array(self, name: str):
        """One Zarr array of this version's generation."""
        return self.group[name]

    def column(self, name: str) -> np.ndarray:
        """One chunk-table column (or the embeddings) up to this version's extent; a damaged
        Zarr chunk raises StoreCorrupt naming its file."""
        n = self.manifest.chunks
        try:
            if name in TEXT_COLUMNS:
                return read_strings(self.group, name, n, self.legacy_strings)
            return self.group[name][:n]
        except (ValueError, RuntimeError, OSError) as e:
            raise self._damaged(name, e) from e

    def _damaged(self, name: str, e: Exception) -> StoreCorrupt:
        """The error for an unreadable column: which of its Zarr chunks fail to read."""
        names = self._arrays_of(name)
        bad = [f"{self.manifest.generation}/{a}/{k}" for a in names for k in damaged_chunks(self.group[a])]
        return StoreCorrupt(f"{self.backend}: {', '.join(bad) or name} unreadable "
                            f"({str(e).splitlines()[0][:80]}); `sparsecache verify` lists all damage")

    def check_model(self, fingerprint: dict) -> None:
        """Raise DictionaryMismatch unless this store was encoded with a model like `fingerprint`."""
        check_same_model(fingerprint, self.attrs["model"], str(self.backend))

    def dictionary_dir(self):
        """A local directory holding the store's copy of its dictionary (the fingerprint it
        must have is attrs["dictionary"])."""
        return self.backend.fetch_dir("dictionary")

    def chunks(self) -> list[ChunkInfo]:
        """The live chunks of this version, in store order."""
        return self.chunks_at(self._rows)

    def live_rows(self) -> np.ndarray:
        return self._rows

    def _arrays_of(self, column: str) -> tuple[str, ...]:
        """The Zarr arrays holding a chunk-table column."""
        return text_arrays(column, self.legacy_strings) if column in TEXT_COLUMNS else (column,)

    def column_files(self, columns) -> list:
        """The local files holding chunk-table `columns` of this version's generation (a text
        column's bytes and ends), for reading ahead; none on an object store."""
        root = self.backend.local_root
        if root is None:
            return []
        base = root / "data" / self.manifest.generation
        arrays = [a for c in columns for a in self._arrays_of(c)]
        return sorted(f for a in arrays for f in (base / a).rglob("*") if f.is_file())

    def _column(self, name: str) -> np.ndarray:
        """A whole column, read once."""
        if name not in self._columns:
            self._columns[name] = self.column(name) if self.manifest.chunks else np.zeros(0, object)
        return self._columns[name]

    def _at(self, name: str, rows) -> list:
        """Values of column `name` at `rows`: from the whole column when it was read, else row by row."""
        return self._many([name], rows)[name]

    def _many(self, names: list[str], rows) -> dict[str, list]:
        """Values of several columns at `rows`, read together (`layout.read_rows`) unless whole."""
        if not len(rows) or all(n in self._columns for n in names) or len(rows) > ROWS_ONE_BY_ONE \
                or self.manifest.chunks <= WHOLE_COLUMNS_UP_TO:
            return {n: [self._column(n)[r] for r in rows] for n in names}
        try:
            return read_rows(self._points, names, rows, self.legacy_strings)
        except (ValueError, RuntimeError, OSError) as e:
            raise self._damaged(names[0], e) from e

    def chunk_ids(self, rows) -> list[str]:
        ids = [str(i) for i in self._at("chunk_id", rows)]
        self._known.update(zip(ids, map(int, rows)))
        return ids

    def row(self, chunk_id: str) -> int:
        r = self._known.get(chunk_id)
        if r is not None:
            return r
        try:
            return self._rows_by_id()[chunk_id]
        except KeyError:
            raise StoreError(f"no live chunk {chunk_id!r} in version {self.version} of {self.backend}") from None

    def _rows_by_id(self) -> dict[str, int]:
        """Every live chunk id's row, read once."""
        if self._row_of is None:
            ids = self._column("chunk_id")
            self._row_of = {str(ids[r]): int(r) for r in self._rows}
        return self._row_of

    def chunk(self, chunk_id: str) -> ChunkInfo:
        return self._infos([chunk_id], [self.row(chunk_id)])[0]

    def chunks_at(self, rows) -> list[ChunkInfo]:
        """The live chunks at chunk-table rows `rows` (what the index answers with)."""
        rows = [int(r) for r in rows]
        v = self._many(["chunk_id", *INFO_COLUMNS], rows)
        ids = [str(c) for c in v["chunk_id"]]
        self._known.update(zip(ids, rows))
        return self._infos(ids, rows, v)

    def _infos(self, chunk_ids: list[str], rows: list[int], values: dict | None = None) -> list[ChunkInfo]:
        v = values or self._many(list(INFO_COLUMNS), rows)
        return [ChunkInfo(c, str(d), int(o), r, int(a), int(n))
                for c, r, d, o, a, n in zip(chunk_ids, rows, *(v[k] for k in INFO_COLUMNS))]

    def spans(self, chunk_ids: list[str]) -> list[tuple[int, int]]:
        """[start, end) of each chunk on the token axis."""
        return self.row_spans([self.row(c) for c in chunk_ids])

    def row_spans(self, rows) -> list[tuple[int, int]]:
        v = self._many(["token_offset", "token_length"], rows)
        return [(int(a), int(a + n)) for a, n in zip(v["token_offset"], v["token_length"])]

    def row_span(self, row: int) -> tuple[int, int]:
        return self.row_spans([row])[0]

    def tokens(self, chunk_ids: list[str]) -> list[list[int]]:
        """Token ids of each chunk."""
        spans = self.spans(chunk_ids)
        flat = self._read_spans("tokens", spans)
        return [t.tolist() for t in np.split(flat, np.cumsum([b - a for a, b in spans])[:-1])]

    def texts(self, chunk_ids: list[str]) -> list[str]:
        return [str(t) for t in self._at("text", [self.row(c) for c in chunk_ids])]

    def prefix(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The shared prefix: token ids and its exact pre-RoPE keys and values [n_layers, P, m]
        (a wrapped store's header excluded: `header`).

        Read once per Store (it never changes); treat the tensors as read-only."""
        ids, k, v, _ = self._prefix_group()
        P = len(self.layout().prefix)
        return (ids, k, v) if P == len(ids) else (ids[:P], k[:, :P], v[:, :P])

    def header(self) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        """A wrapped store's header: its soft token ids and exact pre-RoPE K/V [n_layers, H, m],
        the same before every chunk (encoded after the prefix alone); None without a wrapper."""
        ids, k, v, _ = self._prefix_group()
        P = len(self.layout().prefix)
        return None if P == len(ids) else (ids[P:], k[:, P:], v[:, P:])

    def encoded_after(self) -> list[int]:
        """The token ids every chunk was encoded after: the prefix, and a wrapped store's header."""
        return self._prefix_group()[0]

    def layout(self) -> ContextLayout:
        """How a context of this store's chunks is laid out (`context_layout`)."""
        ids, _, _, soft = self._prefix_group()
        return ContextLayout.of(ids, 0 if soft is None else soft.shape[0], self.config.linked)

    def soft(self) -> torch.Tensor | None:
        """A wrapped store's soft tokens [H + T, hidden] (`KVModel.soft`); None without a wrapper."""
        return self._prefix_group()[3]

    def _prefix_group(self):
        if self._prefix is None:
            try:
                g = open_group(self.backend, "prefix")
                ids = [int(t) for t in g["token_ids"][:]]
                soft = torch.from_numpy(g["soft"][:]) if "soft" in g else None
                self._prefix = (ids, torch.from_numpy(g["keys"][:]), torch.from_numpy(g["values"][:]), soft)
            except (ValueError, KeyError, FileNotFoundError) as e:
                raise StoreCorrupt(f"{self.backend}: prefix KV unreadable: {e}") from e
        return self._prefix

    def read_codes(self, chunk_ids: list[str]) -> ChunkCodes:
        """The codes and token ids of `chunk_ids`, concatenated in the order given (storage → CPU)."""
        spans = self.spans(chunk_ids)
        try:
            cat = {name: self._read_spans(name, spans) for name in (*CODE_ARRAYS, "tokens")}
        except StoreCorrupt as e:
            raise StoreCorrupt(f"{e} (reading chunk(s) {', '.join(chunk_ids)})") from e
        return ChunkCodes(list(chunk_ids), [b - a for a, b in spans], cat["tokens"],
                          Codes(cat["k_indices"], cat["k_coefficients"]),
                          Codes(cat["v_indices"], cat["v_coefficients"]))

    def _read_spans(self, name: str, spans: list[tuple[int, int]]) -> np.ndarray:
        """Token spans of one array, concatenated along its token axis; spans read before
        through this backend come from its `span_cache`."""
        axis = 0 if name == "tokens" else 1
        cache = span_cache(self.backend)
        keys = [(self.manifest.generation, name, a, b) for a, b in spans]
        parts = [cache.get(k) for k in keys]
        missing = [i for i, p in enumerate(parts) if p is None]
        if missing:
            read = self._read_spans_from_store(name, [spans[i] for i in missing], axis)
            ends = np.cumsum([spans[i][1] - spans[i][0] for i in missing])[:-1]
            for i, part in zip(missing, np.split(read, ends, axis)):
                parts[i] = part
                cache.put(keys[i], part.copy())  # the caller's array is its own
            if len(missing) == len(spans):
                return read  # read now, in the order asked: no second copy
        return np.concatenate(parts, axis=axis)

    def _read_spans_from_store(self, name: str, spans: list[tuple[int, int]], axis: int) -> np.ndarray:
        arr = self._arrays[name]
        if plain_chunks(arr):
            return read_spans_direct(arr, self.backend, f"{self.data}/{name}", spans, axis)
        self._check_present(name, spans)
        sel = [(slice(a, b),) if axis == 0 else (slice(None), slice(a, b)) for a, b in spans]
        try:
            parts = read_zarr([(arr._async_array, s) for s in sel])
        except (ValueError, RuntimeError, OSError) as e:
            raise StoreCorrupt(f"{self.backend}: {name} unreadable: {e}") from e
        return np.concatenate(parts, axis=axis)

    def _check_present(self, name: str, spans: list[tuple[int, int]]) -> None:
        """A missing Zarr chunk would read as fill values; name it instead."""
        arr = self._arrays[name]
        axis = 0 if name == "tokens" else 1
        step = arr.chunks[axis]
        for a, b in spans:
            for i in range(a // step, (b - 1) // step + 1):
                key = chunk_key(arr, i, axis)
                if not self.backend.exists(f"{self.data}/{name}/{key}"):
                    raise StoreCorrupt(f"{self.backend}: {name} is missing {key}")

    def index_bytes(self, key: str) -> bytes:
        """One index segment's file (`layout.Indexer` made it; ids are chunk rows)."""
        try:
            return self.backend.get(key)
        except FileNotFoundError:
            raise self.missing_index(key) from None

    def missing_index(self, key: str) -> StoreCorrupt:
        return StoreCorrupt(f"{self.backend}/{key}: the FAISS index of version {self.version} is missing "
                            "(`sparsecache compact` rebuilds it)")

    def _index_size(self, key: str) -> int:
        if not self.backend.exists(key):
            raise self.missing_index(key)
        return self.backend.size_of(key)

    def document_rows(self, documents: list[str]) -> np.ndarray:
        """The live chunk rows of `documents` (an unknown document id is an error)."""
        live = self._column("doc_id")[self._rows]
        unknown = sorted(set(documents) - set(live.tolist()))
        if unknown:
            raise StoreError(f"no document {', '.join(map(repr, unknown[:5]))} in version {self.version} of "
                             f"{self.backend}")
        return self._rows[np.isin(live, list(documents))]

    def info(self) -> dict:
        """Versions, counts, bytes per array and compression ratios (see `sparsecache info`).

        Every ratio's numerator is the fp16 K and V bytes of the tokens in question:
        - theoretical: per token, fp16 KV bytes ÷ the code bytes one token takes in the arrays;
        - measured_codes_only: fp16 KV of every stored token ÷ the bytes the code arrays occupy
          (chunk headers, CRCs and padding of the last chunk included);
        - measured_with_dictionary: the same with the dictionary copy's bytes added to the
          denominator (it is fixed, so this ratio approaches the codes-only one as the corpus grows).
        In a wrapped store the measured ratios count the chunks' text tokens only: the trailers'
        codes are overhead in the denominator (`wrapper` says how many tokens they take).
        """
        m = self.manifest
        fp = self.attrs["model"]
        G = self.group["k_indices"].shape[0]
        code_bytes_per_token = sum(int(np.prod(self.group[n].shape[2:])) * self.group[n].dtype.itemsize
                                   for n in CODE_ARRAYS) * G
        fp16_per_token = 2 * fp["layers"] * fp["m"] * 2
        disk = {n: self.backend.size(f"{self.data}/{n}") for n in self.backend.children(self.data)
                if n != "zarr.json"}
        codes_disk = sum(disk[n] for n in CODE_ARRAYS)
        dict_disk = self.backend.size("dictionary")
        live_tokens = m.live_tokens
        layout = self.layout()
        header, trailer = len(layout.header), layout.trailer
        text_tokens = layout.text_tokens(m.tokens, m.chunks)

        def ratio(num, den):
            return round(num / den, 3) if den else None

        return {
            "path": str(self.root),
            "version": m.version,
            "versions": versions(self.backend),
            "generation": m.generation,
            "documents": m.n_documents,
            "chunks": len(self._rows),
            "tombstoned_chunks": m.chunks - len(self._rows),
            "tokens": live_tokens,
            "stored_tokens": m.tokens,
            "bytes_on_disk": {**disk, "dictionary": dict_disk, "prefix": self.backend.size("prefix"),
                              "index": sum(self._index_size(p["key"]) for p in m.index_pieces())},
            "compression": {
                "theoretical": ratio(fp16_per_token, code_bytes_per_token),
                "measured_codes_only": ratio(fp16_per_token * text_tokens, codes_disk),
                "measured_with_dictionary": ratio(fp16_per_token * text_tokens, codes_disk + dict_disk),
                "code_bytes_per_token": code_bytes_per_token,
                "fp16_bytes_per_token": fp16_per_token,
                "disk_vs_theoretical_codes": ratio(codes_disk, code_bytes_per_token * m.tokens),
            },
            "index_kind": m.index_kind,
            "index_segments": len(m.index_pieces()),
            "document_segments": len(m.segments),
            **({"wrapper": {"digest": self.config.wrapper, "header": header, "trailer": trailer,
                            "trailer_tokens": trailer * m.chunks, "linked": self.config.linked}}
               if self.soft() is not None else {}),
            "model": fp,
            "dictionary": self.attrs["dictionary"],
            "config": self.attrs["config"],
            "created": self.attrs.get("created"),
            "format": self.attrs["format"],
            **({"calibration": self.calibration()} if self.calibration() else {}),
        }


def damaged_chunks(arr) -> list[str]:
    """Keys of the Zarr chunks of a 1-axis-chunked array that fail to read."""
    step, bad = arr.chunks[0], []
    for i in range((arr.shape[0] + step - 1) // step):
        try:
            arr[i * step: min((i + 1) * step, arr.shape[0])]
        except (ValueError, RuntimeError, OSError):
            bad.append(chunk_key(arr, i, 0))
    return bad
