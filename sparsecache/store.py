"""The corpus store: sparse codes in Zarr v3 arrays, published as versions by atomic manifests.

Layout of a store directory (any Zarr v3 client can read the arrays):

    zarr.json                  root group; attribute "sparsecache" = format, config, fingerprints
    prefix/                    the shared prefix: token_ids [P], keys/values float32 [n_layers, P, m]
    dictionary/                a copy of the dictionaries, so the store is self-contained
    data/gNNNNNN/              one generation of append-only arrays (a new one per compaction):
        tokens                 int32 [N]                  token ids on the global token axis
        {k,v}_indices          uint8 [G, N, row_bytes]    atom indices: Elias–Fano sorted sets (or 13-bit packed)
        {k,v}_coefficients     e4m3 bytes (uint8; or float16/float32) [G, N, s]
        chunk_id, doc_id, content_hash, text, meta   str [C]   the chunk table, one row per chunk
        ordinal, token_length  int32 [C];  token_offset int64 [C]
        embeddings             float32 [C, dim]           so the index can be rebuilt without the embedder
    manifests/vNNNNNN.json     one per published version: generation, extents, live documents → rows
    index/vNNNNNN.faiss        the FAISS index of that version (ids are chunk rows)
    pending.json               a writer's progress since the last version (resume after a crash)
    .lock                      held (flock) by the one writer; names its pid and host
    .sparsecache-store         written first when a store is created: a writer only ever deletes
                               or overwrites inside a directory that carries it

Writers only append past the latest manifest's extents and publish by renaming a complete
manifest into place; every array write is a whole-file atomic replace (zarr's LocalStore),
and chunks that hold published data are rewritten with the same bytes there. So a reader that
pinned version N keeps reading exactly N's data while N+1 is written, and a crash at any
point leaves the latest published version intact. Every Zarr chunk carries a CRC32C.

Durability: before `pending.json` records a batch and before a manifest is renamed into
place, every file written since the last such point and its directory are fsynced, so after
a power cut nothing published or recorded names data that is not on disk.

The invariant the writer keeps (and `verify` checks): every live document owns a contiguous
run of chunk rows and of tokens that no other live document touches; each row it owns holds
one of its chunks, ordinals 0..count-1 in order; the index holds exactly the live rows; and
extents never move backwards within a generation. Rows written by a run that crashed are
either reused by the next run (nothing published names them) or left for `compact`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import fcntl
import json
import os
import shutil
import socket
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .codec import COEF_DTYPES, INDEX_CODINGS, STORAGE_DTYPES, Codec, Codes, index_row_bytes
from .dictionary import Dictionary
from .errors import ConfigError, DictionaryMismatch, StoreCorrupt, StoreError, StoreLocked
from .durable import fsync_path, sync_tree, write_atomic
from .failpoints import failpoint
from .index import build_index, index_ids, index_kind, load_index, save_index, search

FORMAT_VERSION = 2  # 2: config.index_coding (format-1 stores have packed indices and still read)
ATTR = "sparsecache"
CODE_ARRAYS = ("k_indices", "k_coefficients", "v_indices", "v_coefficients")
TABLE_STR = ("chunk_id", "doc_id", "content_hash", "text", "meta")
TABLE_INT = {"ordinal": "int32", "token_offset": "int64", "token_length": "int32"}
COMPRESSORS = ("none", "zstd")
_ROWS_PER_CHUNK = 4096  # chunk-table and embedding rows per Zarr chunk
MARKER = ".sparsecache-store"
_MTIME_SLACK_NS = 2_000_000_000  # file timestamps can lag the clock by a tick; re-syncing clean files is free


@dataclass(frozen=True)
class StoreConfig:
    """Fixed when a store is created; written into its root attributes."""

    chunk_tokens: int = 512
    prefix: str | None = None  # None: the model's chat template up to the user's text
    coef_dtype: str = "float8"  # e4m3: same quality as fp16 on the frontier, 1.38x smaller (BENCHMARKS.md)
    index_coding: str = "elias-fano"  # lossless; 10 instead of 13 bits per index at s = 32 (BENCHMARKS.md)
    zarr_chunk_tokens: int = 512  # tokens per Zarr chunk of the code arrays (measured: BENCHMARKS.md)
    compressor: str = "none"  # codes are near-incompressible; "zstd" trades read time for ~4%
    embedder: str = "default"  # the retrieval encoder; queries must be embedded by the same one

    def __post_init__(self):
        if not 16 <= self.chunk_tokens <= 8192:
            raise ConfigError(f"--chunk-tokens must be in [16, 8192], got {self.chunk_tokens}")
        if self.coef_dtype not in COEF_DTYPES:
            raise ConfigError(f"coefficient dtype must be one of {', '.join(COEF_DTYPES)}")
        if self.index_coding not in INDEX_CODINGS:
            raise ConfigError(f"index coding must be one of {', '.join(INDEX_CODINGS)}")
        if self.zarr_chunk_tokens < 1:
            raise ConfigError("zarr_chunk_tokens must be positive")
        if self.compressor not in COMPRESSORS:
            raise ConfigError(f"compressor must be one of {', '.join(COMPRESSORS)}")


@dataclass
class Manifest:
    """One published version: which generation, how far its arrays reach, which rows are live."""

    version: int
    generation: str
    tokens: int = 0  # extent of the token axis
    chunks: int = 0  # extent of the chunk table
    documents: dict[str, dict] = field(default_factory=dict)  # id → {hash, first, count, tokens}
    index: str | None = None
    index_kind: str | None = None
    created: str = ""
    note: str = ""

    def live_rows(self) -> np.ndarray:
        """int64 [n_live] chunk rows of live documents, ascending."""
        spans = [np.arange(d["first"], d["first"] + d["count"]) for d in self.documents.values()]
        return np.sort(np.concatenate(spans)) if spans else np.zeros(0, np.int64)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT_VERSION, **asdict(self)}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        raw = json.loads(text)
        if raw.pop("format", 0) > FORMAT_VERSION:
            raise StoreError("manifest written by a newer sparsecache; upgrade to read this store")
        return cls(**raw)


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


# ---------------------------------------------------------------- paths and small helpers


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _manifest_path(root: Path, version: int) -> Path:
    return root / "manifests" / f"v{version:06d}.json"


def versions(root: Path) -> list[int]:
    """Published version numbers, ascending."""
    d = Path(root) / "manifests"
    if not d.is_dir():
        return []
    return sorted(int(p.stem[1:]) for p in d.glob("v*.json") if p.stem[1:].isdigit())


def read_manifest(root: Path, version: int | None = None) -> Manifest:
    root = Path(root)
    vs = versions(root)
    if not vs:
        if not (root / "zarr.json").exists():
            raise StoreError(f"no store at {root}")
        raise StoreError(f"{root}: no published version yet (the first encode did not finish; rerun it)")
    v = vs[-1] if version is None else version
    if v not in vs:
        raise StoreError(f"{root}: no version {v} (have {', '.join(map(str, vs))})")
    try:
        return Manifest.from_json(_manifest_path(root, v).read_text())
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise StoreCorrupt(f"{root}: manifest v{v} unreadable: {e}") from e


def _root_attrs(root: Path) -> dict:
    import zarr

    try:
        attrs = dict(zarr.open_group(str(root), mode="r").attrs).get(ATTR)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise StoreError(f"no sparsecache store at {root}") from e
    if not attrs:
        raise StoreError(f"{root} is a Zarr group but not a sparsecache store")
    if attrs.get("format", 0) > FORMAT_VERSION:
        raise StoreError(f"{root}: written by a newer sparsecache (store format {attrs['format']}, "
                         f"this version reads {FORMAT_VERSION}); upgrade sparsecache")
    return attrs


def store_config(attrs: dict) -> StoreConfig:
    """The StoreConfig a store was created with (format-1 stores predate index_coding: packed)."""
    return StoreConfig(**{"index_coding": "packed", **attrs["config"]})


def config_for(path: str | Path, **given) -> StoreConfig:
    """The config to encode into `path` with: an existing store's own settings overridden by the
    non-None `given` ones (the writer refuses any that differ), else the defaults with `given`.

    So a nightly re-index keeps a store's settings when newer defaults change."""
    given = {k: v for k, v in given.items() if v is not None}
    try:
        stored = asdict(store_config(_root_attrs(Path(path))))
    except StoreError:
        stored = {}
    return StoreConfig(**{**stored, **given})


def existing_dictionary(path: str | Path) -> Path | None:
    """The dictionary copy of the store at `path`, or None where there is no store yet."""
    d = Path(path) / "dictionary"
    return d if (Path(path) / "zarr.json").exists() and d.is_dir() else None


def _compressors(name: str):
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return [ZstdCodec(level=3), Crc32cCodec()] if name == "zstd" else [Crc32cCodec()]


def array_bytes(path: Path) -> int:
    """Bytes on disk of every file under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


async def _gather(coros):
    return await asyncio.gather(*coros)


def _read_all(requests: list) -> list[np.ndarray]:
    """Run (async array, selection) reads in one round trip of zarr's event loop."""
    from zarr.core.sync import sync

    return sync(_gather([arr.getitem(sel) for arr, sel in requests]))


def _plain_chunks(arr) -> bool:
    """True when chunks are stored as raw little-endian bytes + CRC32C (our uncompressed layout),
    chunked along one axis only: then `read_spans_direct` can read them without zarr's pipeline."""
    from zarr.codecs import BytesCodec, Crc32cCodec

    codecs = arr.metadata.codecs
    endian = getattr(codecs[0], "endian", None)
    return (len(codecs) == 2 and isinstance(codecs[0], BytesCodec) and getattr(endian, "value", endian) in (None, "little")
            and isinstance(codecs[1], Crc32cCodec) and sum(c != n for c, n in zip(arr.chunks, arr.shape)) <= 1)


def read_spans_direct(arr, folder: Path, spans: list[tuple[int, int]], axis: int) -> np.ndarray:
    """Spans along `axis` of a plain-chunked Zarr array, read straight from its chunk files.

    Same result as zarr's own read (tests compare them) at a fraction of the cost: zarr's
    async pipeline spends ~1 ms per chunk on this CPU, a file read + CRC check ~0.15 ms.
    Each chunk file is CRC-checked; a missing or damaged one raises StoreCorrupt.
    """
    import google_crc32c

    shape, step = arr.chunks, arr.chunks[axis]
    dtype = arr.dtype.newbyteorder("<")
    size = int(np.prod(shape))
    out_shape = list(shape)
    out_shape[axis] = sum(b - a for a, b in spans)
    out = np.empty(out_shape, arr.dtype)
    loaded: dict[int, np.ndarray] = {}
    pos = 0
    for a, b in spans:
        for i in range(a // step, (b - 1) // step + 1):
            if i not in loaded:
                key = arr.metadata.encode_chunk_key(tuple(i if d == axis else 0 for d in range(arr.ndim)))
                try:
                    raw = (folder / key).read_bytes()
                except FileNotFoundError:
                    raise StoreCorrupt(f"{folder.name} is missing {key}") from None
                body = raw[:-4]
                if len(body) != size * dtype.itemsize or google_crc32c.value(body) != int.from_bytes(raw[-4:], "little"):
                    raise StoreCorrupt(f"{folder.name}/{key} fails its CRC32C check (damaged or truncated)")
                loaded[i] = np.frombuffer(body, dtype).reshape(shape)
            lo, hi = max(a, i * step) - i * step, min(b, (i + 1) * step) - i * step
            dst = [slice(None)] * len(shape)
            src = [slice(None)] * len(shape)
            dst[axis], src[axis] = slice(pos, pos + hi - lo), slice(lo, hi)
            out[tuple(dst)] = loaded[i][tuple(src)]
            pos += hi - lo
    return out


# ---------------------------------------------------------------- the lock


class Lock:
    """One writer per store: an flock on `.lock`, which the kernel drops if the writer dies.

    The file also names its holder, so a second writer can say who holds it, and a file left
    non-empty by a writer that died is recognised (and reported) as a stale lock.
    """

    def __init__(self, root: Path):
        self.path = Path(root) / ".lock"
        self.fd: int | None = None
        self.stale: dict | None = None

    def acquire(self) -> "Lock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = self._owner(fd)
            os.close(fd)
            who = f"pid {owner.get('pid')} on {owner.get('host')} since {owner.get('since')}" if owner else "another process"
            raise StoreLocked(f"store is locked: {self.path.parent} is being written by {who}") from None
        self.stale = self._owner(fd) or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": _now()}).encode(), 0)
        self.fd = fd
        return self

    @staticmethod
    def _owner(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (json.JSONDecodeError, OSError):
            return {}

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


# ---------------------------------------------------------------- reading


class Store:
    """A read-only view of one published version (the latest unless `version` is given)."""

    def __init__(self, root: Path, attrs: dict, manifest: Manifest):
        import zarr

        self.root = Path(root)
        self.attrs = attrs
        self.config = store_config(attrs)
        self.manifest = manifest
        self.group = zarr.open_group(str(self.root / "data" / manifest.generation), mode="r")
        self._arrays = {name: self.group[name] for name in (*CODE_ARRAYS, "tokens")}
        self._rows = manifest.live_rows()
        ids = self.column("chunk_id") if manifest.chunks else np.zeros(0, object)
        self._row_of = {str(ids[r]): int(r) for r in self._rows}
        self._offset = self.column("token_offset")
        self._length = self.column("token_length")
        self._ids = ids
        self._table = None
        self._prefix = None
        self._dictionary: Dictionary | None = None
        self._codec: Codec | None = None
        self._index = None

    def column(self, name: str) -> np.ndarray:
        """One chunk-table column (or the embeddings) up to this version's extent; a damaged
        Zarr chunk raises StoreCorrupt naming its file."""
        try:
            return self.group[name][: self.manifest.chunks]
        except (ValueError, RuntimeError, OSError) as e:
            bad = _damaged_chunks(self.group[name], self.root / "data" / self.manifest.generation / name,
                                  self.manifest.chunks)
            raise StoreCorrupt(f"{self.root}: {', '.join(bad) or name} unreadable ({str(e).splitlines()[0][:80]}); "
                               "`sparsecache verify` lists all damage") from e

    @classmethod
    def open(cls, path: str | Path, version: int | None = None) -> "Store":
        root = Path(path)
        attrs = _root_attrs(root)
        return cls(root, attrs, read_manifest(root, version))

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def dictionary(self) -> Dictionary:
        if self._dictionary is None:
            self._dictionary = Dictionary.load(self.root / "dictionary")
            if self._dictionary.fingerprint() != self.attrs["dictionary"]:
                raise StoreCorrupt(f"{self.root}: the dictionary copy does not match the fingerprint recorded at creation")
        return self._dictionary

    def codec(self) -> Codec:
        if self._codec is None:
            self._codec = Codec(self.dictionary, self.config.coef_dtype, indices=self.config.index_coding)
        return self._codec

    def chunks(self) -> list[ChunkInfo]:
        """The live chunks of this version, in store order."""
        return [self.chunk(str(self._ids[r])) for r in self._rows]

    def row(self, chunk_id: str) -> int:
        try:
            return self._row_of[chunk_id]
        except KeyError:
            raise StoreError(f"no live chunk {chunk_id!r} in version {self.version} of {self.root}") from None

    def chunk(self, chunk_id: str) -> ChunkInfo:
        r = self.row(chunk_id)
        if self._table is None:  # read once: a per-row zarr read costs ~5 ms
            self._table = (self.column("doc_id"), self.column("ordinal"))
        return ChunkInfo(chunk_id, str(self._table[0][r]), int(self._table[1][r]), r,
                         int(self._offset[r]), int(self._length[r]))

    def spans(self, chunk_ids: list[str]) -> list[tuple[int, int]]:
        """[start, end) of each chunk on the token axis."""
        return [(int(self._offset[r]), int(self._offset[r] + self._length[r])) for r in map(self.row, chunk_ids)]

    def tokens(self, chunk_ids: list[str]) -> list[list[int]]:
        """Token ids of each chunk."""
        spans = self.spans(chunk_ids)
        flat = self._read_spans("tokens", spans)
        return [t.tolist() for t in np.split(flat, np.cumsum([b - a for a, b in spans])[:-1])]

    def texts(self, chunk_ids: list[str]) -> list[str]:
        text = self.column("text")
        return [str(text[self.row(c)]) for c in chunk_ids]

    def prefix(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The shared prefix: token ids and its exact pre-RoPE keys and values [n_layers, P, m].

        Read once per Store (it never changes); treat the tensors as read-only."""
        import zarr

        if self._prefix is None:
            g = zarr.open_group(str(self.root / "prefix"), mode="r")
            try:
                ids = [int(t) for t in g["token_ids"][:]]
                self._prefix = (ids, torch.from_numpy(g["keys"][:]), torch.from_numpy(g["values"][:]))
            except ValueError as e:
                raise StoreCorrupt(f"{self.root}: prefix KV unreadable: {e}") from e
        return self._prefix

    def read_codes(self, chunk_ids: list[str]) -> ChunkCodes:
        """The codes and token ids of `chunk_ids`, concatenated in the order given (disk → CPU)."""
        spans = self.spans(chunk_ids)
        try:
            cat = {name: self._read_spans(name, spans) for name in (*CODE_ARRAYS, "tokens")}
        except StoreCorrupt as e:
            raise StoreCorrupt(f"{e} (reading chunk(s) {', '.join(chunk_ids)})") from e
        return ChunkCodes(list(chunk_ids), [b - a for a, b in spans], cat["tokens"],
                          Codes(cat["k_indices"], cat["k_coefficients"]),
                          Codes(cat["v_indices"], cat["v_coefficients"]))

    def _read_spans(self, name: str, spans: list[tuple[int, int]]) -> np.ndarray:
        """Token spans of one array, concatenated along its token axis."""
        arr = self._arrays[name]
        axis = 0 if name == "tokens" else 1
        folder = self.root / "data" / self.manifest.generation / name
        if _plain_chunks(arr):
            return read_spans_direct(arr, folder, spans, axis)
        self._check_present(name, spans)
        sel = [(slice(a, b),) if axis == 0 else (slice(None), slice(a, b)) for a, b in spans]
        try:
            parts = _read_all([(arr._async_array, s) for s in sel])
        except (ValueError, RuntimeError, OSError) as e:
            raise StoreCorrupt(f"{self.root}: {name} unreadable: {e}") from e
        return np.concatenate(parts, axis=axis)

    def _check_present(self, name: str, spans: list[tuple[int, int]]) -> None:
        """A missing Zarr chunk would read as fill values; name it instead."""
        arr = self._arrays[name]
        axis = 0 if name == "tokens" else 1
        step = arr.chunks[axis]
        for a, b in spans:
            for i in range(a // step, (b - 1) // step + 1):
                key = arr.metadata.encode_chunk_key(tuple(i if d == axis else 0 for d in range(arr.ndim)))
                if not (self.root / "data" / self.manifest.generation / name / key).exists():
                    raise StoreCorrupt(f"{self.root}: {name} is missing {key}")

    def load_kv(self, chunk_ids: list[str], device="cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Decoded pre-RoPE (keys, values) per chunk, each [n_layers, T_chunk, m] float32 on `device`.

        All chunks are decoded in one batched call per K and V.
        """
        codes = self.read_codes(chunk_ids)
        codec = self.codec()
        k = codec.decode(codes.k, "k", device)  # (n_layers, T, m)
        v = codec.decode(codes.v, "v", device)
        return list(zip(k.split(codes.lengths, dim=1), v.split(codes.lengths, dim=1)))

    def index(self):
        if self._index is None:
            if not self.manifest.index:
                raise StoreError(f"{self.root}: version {self.version} has no index")
            path = self._index_path()
            try:
                self._index = load_index(path)
            except RuntimeError as e:
                raise StoreCorrupt(f"{path}: unreadable FAISS index: {str(e).splitlines()[0]}") from e
        return self._index

    def search(self, query_embedding: np.ndarray, k: int) -> list[tuple[ChunkInfo, float]]:
        """The k live chunks nearest to a query embedding [dim], best first, with scores."""
        return [(self.chunk(str(self._ids[row])), score) for row, score in search(self.index(), query_embedding, k)]

    def info(self) -> dict:
        """Versions, counts, bytes on disk per array and compression ratios (see `sparsecache info`)."""
        m = self.manifest
        fp = self.attrs["model"]
        G = self.group["k_indices"].shape[0]
        code_bytes_per_token = sum(int(np.prod(self.group[n].shape[2:])) * self.group[n].dtype.itemsize
                                   for n in CODE_ARRAYS) * G
        fp16_per_token = 2 * fp["layers"] * fp["m"] * 2
        data = self.root / "data" / m.generation
        disk = {n: array_bytes(data / n) for n in sorted(os.listdir(data)) if (data / n).is_dir()}
        codes_disk = sum(disk[n] for n in CODE_ARRAYS)
        dict_disk = array_bytes(self.root / "dictionary")
        live_tokens = sum(d["tokens"] for d in m.documents.values())

        def ratio(num, den):
            return round(num / den, 3) if den else None

        return {
            "path": str(self.root),
            "version": m.version,
            "versions": versions(self.root),
            "generation": m.generation,
            "documents": len(m.documents),
            "chunks": len(self._rows),
            "tombstoned_chunks": m.chunks - len(self._rows),
            "tokens": live_tokens,
            "stored_tokens": m.tokens,
            "bytes_on_disk": {**disk, "dictionary": dict_disk, "prefix": array_bytes(self.root / "prefix"),
                              "index": self._index_bytes()},
            "compression": {
                "theoretical": ratio(fp16_per_token, code_bytes_per_token),
                "measured_codes_only": ratio(fp16_per_token * m.tokens, codes_disk),
                "measured_with_dictionary": ratio(fp16_per_token * m.tokens, codes_disk + dict_disk),
                "code_bytes_per_token": code_bytes_per_token,
                "fp16_bytes_per_token": fp16_per_token,
                "disk_vs_theoretical_codes": ratio(codes_disk, code_bytes_per_token * m.tokens),
            },
            "index_kind": m.index_kind,
            "model": fp,
            "dictionary": self.attrs["dictionary"],
            "config": self.attrs["config"],
            "created": self.attrs.get("created"),
            "format": self.attrs["format"],
        }


    def _index_path(self) -> Path:
        path = self.root / self.manifest.index
        if not path.is_file():
            raise StoreCorrupt(f"{path}: the FAISS index of version {self.version} is missing")
        return path

    def _index_bytes(self) -> int:
        return self._index_path().stat().st_size if self.manifest.index else 0


def _damaged_chunks(arr, folder: Path, extent: int) -> list[str]:
    """Paths (generation/array/key) of the Zarr chunks of a 1-axis-chunked array that fail to read."""
    step, bad = arr.chunks[0], []
    for i in range((extent + step - 1) // step):
        key = arr.metadata.encode_chunk_key((i,) + (0,) * (arr.ndim - 1))
        try:
            arr[i * step : min((i + 1) * step, extent)]
        except (ValueError, RuntimeError, OSError):
            bad.append(f"{folder.parent.name}/{folder.name}/{key}")
    return bad


# ---------------------------------------------------------------- writing


class Writer:
    """The one writer of a store: appends codes past the latest version and publishes new ones.

    Use as a context manager; it holds the store's lock. Progress between versions is kept in
    `pending.json` after every `commit`, so a crashed run resumes instead of redoing work.
    """

    def __init__(self, path: str | Path):
        self.root = Path(path)
        self.lock = Lock(self.root)

    def __enter__(self):
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"{self.root} exists and is not a directory")
        if not _ours(self.root):
            raise StoreError(f"{self.root} is not a sparsecache store: a non-empty directory sparsecache "
                             f"did not create (no {MARKER}); refusing to write into it")
        self.lock.acquire()
        # Only what this writer writes needs syncing: a crashed run synced its rows before
        # pending.json recorded them, and the rest of the store is published, hence synced.
        self._synced = time.time_ns() - _MTIME_SLACK_NS
        if not (self.root / MARKER).exists():  # before anything else is created in it
            write_atomic(self.root / MARKER, json.dumps({"created": _now(), "format": FORMAT_VERSION}))
        import zarr

        # every chunk is written even when it equals the fill value, so a missing file always means damage
        self._zarr_config = zarr.config.set({"array.write_empty_chunks": True})
        self._zarr_config.__enter__()
        if self.lock.stale:
            s = self.lock.stale
            warnings.warn(f"{self.root}: took over a stale lock left by pid {s.get('pid')} on {s.get('host')} "
                          f"(since {s.get('since')}); resuming its work", stacklevel=2)
        return self

    def __exit__(self, *exc):
        self._zarr_config.__exit__(*exc)
        self.lock.release()

    def sync(self) -> None:
        """Make everything written since the last sync durable (see `durable`)."""
        cut = time.time_ns()
        sync_tree(self.root, self._synced)
        self._synced = cut - _MTIME_SLACK_NS
        failpoint("sync")

    # -- creation

    def initialised(self) -> bool:
        return bool(versions(self.root))

    def create(self, config: StoreConfig, dictionary: Dictionary, model_fp: dict, prefix_ids: list[int],
               prefix_kv: tuple[torch.Tensor, torch.Tensor], embed_dim: int) -> None:
        """Lay out a new store and publish an empty version 1 (overwrites a half-created one:
        `__enter__` has checked that this directory is one sparsecache created)."""
        import zarr

        for sub in ("data", "prefix", "dictionary", "manifests", "index"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        (self.root / "pending.json").unlink(missing_ok=True)
        failpoint("create")
        root = zarr.open_group(str(self.root), mode="a")  # not "w": that would delete the held .lock
        prefix = root.create_group("prefix")
        k, v = prefix_kv
        for name, data in (("token_ids", np.asarray(prefix_ids, np.int32)), ("keys", k.float().cpu().numpy()),
                           ("values", v.float().cpu().numpy())):
            prefix.create_array(name, data=data, compressors=_compressors("none"))
        dictionary.save(self.root / "dictionary")
        failpoint("create")
        self._create_generation("g000001", config, dictionary, embed_dim)
        root.attrs[ATTR] = {"format": FORMAT_VERSION, "config": asdict(config), "model": model_fp,
                            "dictionary": dictionary.fingerprint(), "dictionary_config": asdict(dictionary.config),
                            "embed_dim": embed_dim, "created": _now()}
        (self.root / "manifests").mkdir()
        (self.root / "index").mkdir()
        failpoint("create")
        m = Manifest(1, "g000001", created=_now(), note="created")
        self._write_index(m, zarr.open_group(str(self.root / "data" / m.generation), mode="r"), "auto")
        self.sync()
        self._publish(m)  # an empty version with an (empty) index: every version can be searched

    def _create_generation(self, name: str, config: StoreConfig, dictionary: Dictionary, embed_dim: int) -> None:
        import zarr

        g = zarr.open_group(str(self.root / "data" / name), mode="w")
        c = dictionary.config
        G = dictionary.model["layers"] // c.layers_per_signal
        rb = index_row_bytes(c, config.index_coding)
        s, zt = c.sparsity, config.zarr_chunk_tokens
        comp = _compressors(config.compressor)
        for kind in ("k", "v"):
            g.create_array(f"{kind}_indices", shape=(G, 0, rb), chunks=(G, zt, rb), dtype="uint8",
                           fill_value=0, compressors=comp)
            fp8 = config.coef_dtype == "float8"  # stored as e4m3 bytes; 0x7F is its NaN
            g.create_array(f"{kind}_coefficients", shape=(G, 0, s), chunks=(G, zt, s),
                           dtype=STORAGE_DTYPES[config.coef_dtype], fill_value=0x7F if fp8 else float("nan"),
                           compressors=comp)
        g.create_array("tokens", shape=(0,), chunks=(zt,), dtype="int32", fill_value=-1,
                       compressors=_compressors("none"))
        for col in TABLE_STR:
            g.create_array(col, shape=(0,), chunks=(_ROWS_PER_CHUNK,), dtype=str, compressors=_compressors("zstd"))
        for col, dtype in TABLE_INT.items():
            g.create_array(col, shape=(0,), chunks=(_ROWS_PER_CHUNK,), dtype=dtype, fill_value=-1,
                           compressors=_compressors("zstd"))
        g.create_array("embeddings", shape=(0, embed_dim), chunks=(_ROWS_PER_CHUNK // 4, embed_dim),
                       dtype="float32", fill_value=0.0, compressors=_compressors("zstd"))

    def attrs(self) -> dict:
        return _root_attrs(self.root)

    def check_compatible(self, config: StoreConfig, dictionary: Dictionary, model_fp: dict) -> None:
        """Refuse to append codes that would not mean the same as the ones already stored."""
        a = self.attrs()
        if a["dictionary"] != dictionary.fingerprint():
            raise DictionaryMismatch(f"{self.root} was encoded with dictionary {a['dictionary']}; "
                                     f"the one given is {dictionary.fingerprint()} (use the same --dict or a new store)")
        for key in ("config_hash", "layers", "m"):
            if a["model"].get(key) != model_fp.get(key):
                raise DictionaryMismatch(f"{self.root} was encoded with model {a['model'].get('name')}, "
                                         f"not {model_fp.get('name')}")
        stored = store_config(a)
        for key in ("chunk_tokens", "prefix", "coef_dtype", "index_coding", "embedder"):
            if getattr(stored, key) != getattr(config, key):
                raise ConfigError(f"{self.root} was built with {key}={getattr(stored, key)!r}; "
                                  f"got {getattr(config, key)!r} (use a new store to change it)")

    # -- appending

    def begin(self) -> tuple[dict[str, dict], dict | None]:
        """Start appending after the latest version.

        Returns the documents a crashed run already finished, and the one it was in the
        middle of (or None); appending continues after the finished ones until `rewind`.
        """
        import zarr

        self.base = read_manifest(self.root)
        self.group = zarr.open_group(str(self.root / "data" / self.base.generation), mode="r+")
        self.tokens, self.chunks = self.base.tokens, self.base.chunks
        self.done: dict[str, dict] = {}
        open_doc = None
        pending = self._pending()
        if pending and pending["base"] == self.base.version and pending["generation"] == self.base.generation:
            self.tokens, self.chunks, self.done = pending["tokens"], pending["chunks"], pending["documents"]
            open_doc = (pending.get("open") or [None])[0]
        self.finished_tokens, self.finished_chunks = self.tokens, self.chunks
        return dict(self.done), open_doc

    def _pending(self) -> dict | None:
        p = self.root / "pending.json"
        try:
            return json.loads(p.read_text()) if p.exists() else None
        except json.JSONDecodeError:
            return None  # torn by a crash before rename cannot happen, but never trust it blindly

    def append(self, chunk_rows: list[dict], tokens: np.ndarray, k: Codes, v: Codes, embeddings: np.ndarray) -> int:
        """Append chunks (table rows), their tokens [T], codes [G, T, ·] and embeddings [n, dim].

        Returns the first new chunk row. Nothing is visible to readers until `publish`.
        """
        n, T = len(chunk_rows), len(tokens)
        row0, tok0 = self.chunks, self.tokens
        offsets = tok0 + np.concatenate([[0], np.cumsum([r["token_length"] for r in chunk_rows])[:-1]])
        _put(self.group["tokens"], tokens.astype(np.int32), tok0, axis=0)
        for name, data in zip(CODE_ARRAYS, (k.indices, k.coefficients, v.indices, v.coefficients)):
            _put(self.group[name], data, tok0, axis=1)
            failpoint("append")  # a crash here leaves a torn batch: some arrays written, some not
        for col in TABLE_STR:
            _put(self.group[col], np.array([r[col] for r in chunk_rows], dtype=object), row0, axis=0)
        for col, dtype in TABLE_INT.items():
            vals = offsets if col == "token_offset" else [r[col] for r in chunk_rows]
            _put(self.group[col], np.asarray(vals, dtype=dtype), row0, axis=0)
        failpoint("append")
        _put(self.group["embeddings"], embeddings.astype(np.float32), row0, axis=0)
        self.chunks, self.tokens = row0 + n, tok0 + T
        return row0

    def commit(self, documents: dict[str, dict], tokens: int, chunks: int, open_docs: list[dict] = ()) -> None:
        """Record finished documents (the extents they end at) and any document still being
        written (its rows so far), so a crashed run resumes at this batch instead of redoing it."""
        if tokens < self.finished_tokens or chunks < self.finished_chunks:
            raise StoreError(f"{self.root}: extents would move backwards ({self.finished_tokens} → {tokens} "
                             f"tokens, {self.finished_chunks} → {chunks} chunks); refusing to record them")
        self.done.update(documents)
        self.finished_tokens, self.finished_chunks = tokens, chunks
        state = {"base": self.base.version, "generation": self.base.generation, "tokens": tokens,
                 "chunks": chunks, "documents": self.done, "open": list(open_docs)}
        self.sync()  # pending.json must never record rows whose bytes could still be lost
        write_atomic(self.root / "pending.json", json.dumps(state))
        failpoint("commit")

    def rewind(self, tokens: int, chunks: int) -> None:
        """Continue appending at these extents (drops rows of a document that was not finished)."""
        self.tokens, self.chunks = tokens, chunks

    # -- publishing

    def publish(self, documents: dict[str, dict], index_kind_name: str = "auto", note: str = "") -> Manifest:
        """Build the index of the live chunks, then publish a new version covering them."""
        m = Manifest(self.base.version + 1, self.base.generation, self.tokens, self.chunks,
                     dict(sorted(documents.items())), created=_now(), note=note)
        self._write_index(m, self.group, index_kind_name)
        failpoint("index")
        self.sync()
        self._publish(m)
        failpoint("publish")
        (self.root / "pending.json").unlink(missing_ok=True)
        return m

    def _write_index(self, m: Manifest, group, kind: str) -> None:
        rows = m.live_rows()
        emb = group["embeddings"][: m.chunks][rows] if m.chunks else np.zeros((0, group["embeddings"].shape[1]))
        index = build_index(emb, rows, kind)
        m.index, m.index_kind = f"index/v{m.version:06d}.faiss", index_kind(index)
        save_index(index, self.root / m.index)

    def _publish(self, m: Manifest) -> None:
        write_atomic(_manifest_path(self.root, m.version), m.to_json())

    # -- compaction

    def compact(self, keep: int = 2, index_kind_name: str = "auto") -> Manifest:
        """Copy the live rows into a new generation, publish it, then drop versions beyond `keep`."""
        import zarr

        if keep < 1:
            raise ConfigError("--keep must be at least 1")
        base = read_manifest(self.root)
        attrs = self.attrs()
        old = zarr.open_group(str(self.root / "data" / base.generation), mode="r")
        name = f"g{int(base.generation[1:]) + 1:06d}"
        self._create_generation(name, store_config(attrs), Dictionary.load(self.root / "dictionary"),
                                attrs["embed_dim"])
        new = zarr.open_group(str(self.root / "data" / name), mode="r+")
        docs, tok, row = {}, 0, 0
        for doc_id, d in sorted(base.documents.items(), key=lambda kv: kv[1]["first"]):
            rows = slice(d["first"], d["first"] + d["count"])
            t0 = int(old["token_offset"][d["first"]])
            span = slice(t0, t0 + d["tokens"])
            _put(new["tokens"], old["tokens"][span], tok, axis=0)
            for a in CODE_ARRAYS:
                _put(new[a], old[a][:, span], tok, axis=1)
            for col in (*TABLE_STR, "ordinal", "token_length", "embeddings"):
                _put(new[col], old[col][rows], row, axis=0)
            _put(new["token_offset"], old["token_offset"][rows] - t0 + tok, row, axis=0)
            docs[doc_id] = {**d, "first": row, "token_offset": tok}
            row, tok = row + d["count"], tok + d["tokens"]
            failpoint("append")
        m = Manifest(base.version + 1, name, tok, row, docs, created=_now(), note=f"compacted from v{base.version}")
        self._write_index(m, new, index_kind_name)
        failpoint("index")
        self.sync()
        self._publish(m)
        failpoint("publish")
        (self.root / "pending.json").unlink(missing_ok=True)  # it pointed into the old generation
        self.prune(keep)
        return m

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` versions, and generations/indexes none of them uses."""
        vs = versions(self.root)
        drop, kept = vs[:-keep], [read_manifest(self.root, v) for v in vs[-keep:]]
        for v in drop:
            _manifest_path(self.root, v).unlink()
            failpoint("prune")
        used_gen = {m.generation for m in kept}
        used_idx = {m.index for m in kept}
        for g in (self.root / "data").iterdir():
            if g.name not in used_gen:
                shutil.rmtree(g)
        for f in (self.root / "index").iterdir():
            if f"index/{f.name}" not in used_idx:
                f.unlink()
        return drop


def _ours(root: Path) -> bool:
    """Whether the writer may create and delete inside `root`: it is missing or empty (a
    `.lock` aside), carries the marker, or is a store made before the marker existed."""
    if not root.is_dir():
        return True
    names = {p.name for p in root.iterdir()} - {".lock"}
    if not names or MARKER in names:
        return True
    try:
        return "zarr.json" in names and bool(versions(root)) and bool(_root_attrs(root))
    except StoreError:
        return False


def _put(arr, data: np.ndarray, at: int, axis: int) -> None:
    """Write `data` at [at, at + len) along `axis`, growing (or trimming an unpublished tail) first."""
    end = at + data.shape[axis]
    shape = list(arr.shape)
    if shape[axis] != end:
        shape[axis] = end
        arr.resize(tuple(shape))
    sel = [slice(None)] * arr.ndim
    sel[axis] = slice(at, end)
    arr[tuple(sel)] = data


# ---------------------------------------------------------------- verification


def verify(path: str | Path, version: int | None = None) -> dict:
    """Read every chunk of every array of a version and check it against the manifest.

    Returns {"ok", "version", "problems": [str], "corrupt_chunks": [chunk ids]}.
    """
    root = Path(path)
    attrs = _root_attrs(root)
    m = read_manifest(root, version)
    store = Store(root, attrs, m)
    problems: list[str] = []
    bad_tokens: list[tuple[int, int]] = []
    bad_rows: list[tuple[int, int]] = []
    data = root / "data" / m.generation
    for name in sorted(os.listdir(data)):
        if not (data / name).is_dir():
            continue
        arr = store.group[name]
        axis = 1 if name in CODE_ARRAYS else 0
        extent = m.tokens if name in (*CODE_ARRAYS, "tokens") else m.chunks
        step = arr.chunks[axis]
        for i in range((extent + step - 1) // step):
            coords = tuple(i if a == axis else 0 for a in range(arr.ndim))
            key = arr.metadata.encode_chunk_key(coords)
            span = (i * step, min((i + 1) * step, extent))
            sel = tuple(slice(*span) if a == axis else slice(None) for a in range(arr.ndim))
            why = None
            if not (data / name / key).exists():
                why = "missing"
            else:
                try:
                    arr[sel]
                except (ValueError, RuntimeError, OSError) as e:
                    why = f"unreadable ({str(e)[:80]})"
            if why:
                problems.append(f"{m.generation}/{name}/{key}: {why}")
                (bad_tokens if extent == m.tokens else bad_rows).append(span)
    problems += _check_manifest(store, root, attrs)
    corrupt = _chunks_in(store, bad_tokens, bad_rows)
    return {"ok": not problems, "version": m.version, "problems": problems, "corrupt_chunks": corrupt}


def _check_manifest(store: Store, root: Path, attrs: dict) -> list[str]:
    m, out = store.manifest, []
    for name in (*CODE_ARRAYS, "tokens"):
        axis = 1 if name in CODE_ARRAYS else 0
        if store.group[name].shape[axis] < m.tokens:
            out.append(f"{name}: shorter than the manifest's {m.tokens} tokens")
    rows = store._rows
    if len(rows) and rows[-1] >= m.chunks:
        out.append(f"manifest names chunk rows beyond its extent {m.chunks}")
    try:
        ids = index_ids(store.index())
        if len(ids) != len(rows) or not np.array_equal(np.sort(ids), rows):
            extra, lost = np.setdiff1d(ids, rows), np.setdiff1d(rows, ids)
            out.append(f"index {m.index} holds {len(ids)} vectors for {len(rows)} live chunks "
                       f"({len(ids) - len(np.unique(ids))} duplicated, {len(extra)} not live, {len(lost)} missing)")
    except StoreError as e:
        out.append(str(e))
    try:
        out += _check_layout(store)
    except StoreCorrupt as e:
        out.append(str(e))
    try:
        store.dictionary
    except (StoreCorrupt, Exception) as e:  # a dictionary copy that does not load is corruption too
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
    for doc, d in sorted(m.documents.items(), key=lambda kv: kv[1]["first"]):
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
    live_ids = [str(store._ids[r]) for r in store._rows]
    if len(set(live_ids)) != len(live_ids):
        out.append(f"{len(live_ids) - len(set(live_ids))} chunk id(s) are live twice")
    return out


def _chunks_in(store: Store, bad_tokens: list[tuple[int, int]], bad_rows: list[tuple[int, int]]) -> list[str]:
    """Ids of live chunks whose tokens or table rows fall in a damaged span."""
    out = []
    for r in store._rows:
        a, b = int(store._offset[r]), int(store._offset[r] + store._length[r])
        if any(a < hi and lo < b for lo, hi in bad_tokens) or any(lo <= r < hi for lo, hi in bad_rows):
            out.append(str(store._ids[r]))
    return out
