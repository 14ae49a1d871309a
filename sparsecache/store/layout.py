"""What a store holds and how its arrays are laid out: the config, the root attributes, the
arrays of a generation, and how the chunk table's text columns are encoded.

Text columns (format 3): column X is two arrays, `X_utf8` uint8 [bytes] (every row's UTF-8,
concatenated) and `X_ends` int64 [rows] (where each row's bytes end). Both are core Zarr v3
data types, so any Zarr v3 implementation reads them; zarr-python's variable-length string
type ("string" + vlen-utf8) that format 2 used is an extension others do not implement.
Format-2 generations still read (and are appended to in their own layout).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from ..codec.codes import COEF_DTYPE_NAMES, INDEX_CODINGS, STORAGE_DTYPES, index_row_bytes
from ..errors import ConfigError, StoreError
from .backend import Backend

FORMAT_VERSION = 4  # 4: manifests list document-table segments + a live bitmap; 3: text columns as UTF-8 bytes + ends; 2: config.index_coding
# a store whose chunks are encoded after others (config.encode_after, the chunk table's `after` column) says 5 in
# its root attributes, so a release before it refuses it in one line instead of misreading it; every other store
# (and every manifest) stays at FORMAT_VERSION, which those releases read
FORMAT_AFTER = 5
READ_FORMAT = FORMAT_AFTER  # the newest root format this version reads
NEW_CONFIG_DEFAULTS = {"encode_after": "prefix", "encode_after_chunks": 1}  # left out of a store's attributes at these
ATTR = "sparsecache"
CODE_ARRAYS = ("k_indices", "k_coefficients", "v_indices", "v_coefficients")
TABLE_STR = ("chunk_id", "doc_id", "content_hash", "text", "meta")
TABLE_INT = {"ordinal": "int32", "token_offset": "int64", "token_length": "int32"}
COMPRESSORS = ("none", "zstd")
ENCODE_AFTER = ("prefix", "document", "neighbours")  # StoreConfig.encode_after
AFTER = "after"  # the text column of a store encoded after something: the chunk ids each chunk read, comma-separated
TEXT_COLUMNS = (*TABLE_STR, AFTER)  # every text column a store may have
ROWS_PER_CHUNK = 4096  # chunk-table and embedding rows per Zarr chunk
UTF8_CHUNK_BYTES = 1 << 16  # ~30 chunks of text; a larger chunk is rewritten whole on every append
MARKER = ".sparsecache-store"
# what a foreign reader needs to know about the uint8 coefficient bytes of a float8 store
FLOAT8_ATTRS = {"sparsecache": {"element_type": "float8_e4m3fn", "nan": "0x7F",
                                "note": "bytes of IEEE-style e4m3 (1 sign, 4 exponent, 3 mantissa bits, bias 7, no inf)"}}


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
    # offline enrichment (Star Attention's anchor block): every chunk is encoded after the prefix and
    # this text, whose K/V is not kept; None: after the prefix alone, as a query lays it out
    anchor: str | None = None
    # a learned chunk wrapper's digest (`wrapper.Wrapper.digest`): every chunk encoded as
    # prefix | header | chunk | trailer, the soft tokens kept in the prefix group; None: no wrapper
    wrapper: str | None = None
    # what each chunk reads between the prefix and itself when encoded (its K/V not kept; #94):
    # "prefix" nothing, as a query lays chunks out; "document" the chunk(s) before it in its own document;
    # "neighbours" its nearest chunk(s) of other documents by the store's embedder (`ingest/after.py`).
    # A store encoded after something records what, per chunk (the chunk table's `after` column).
    # The default since #94's rule chose it (BENCHMARKS.md): chunks that have read their nearest neighbour keep
    # more of full prefill's answers at the same query cost, for ~1.3x the encode (~2.6x a nightly run's).
    encode_after: str = "neighbours"
    encode_after_chunks: int = 1  # how many: the chunks just before it, or its nearest (the nearest next to it)

    @property
    def linked(self) -> bool:
        """A linked wrapper's store: every query recomputes every chunk's trailer (`wrapper.apply`)."""
        return linked_digest(self.wrapper)

    def __post_init__(self):
        if not 16 <= self.chunk_tokens <= 8192:
            raise ConfigError(f"--chunk-tokens must be in [16, 8192], got {self.chunk_tokens}")
        if self.coef_dtype not in COEF_DTYPE_NAMES:
            raise ConfigError(f"coefficient dtype must be one of {', '.join(COEF_DTYPE_NAMES)}")
        if self.index_coding not in INDEX_CODINGS:
            raise ConfigError(f"index coding must be one of {', '.join(INDEX_CODINGS)}")
        if self.zarr_chunk_tokens < 1:
            raise ConfigError("zarr_chunk_tokens must be positive")
        if self.compressor not in COMPRESSORS:
            raise ConfigError(f"compressor must be one of {', '.join(COMPRESSORS)}")
        if self.encode_after not in ENCODE_AFTER:
            raise ConfigError(f"encode-after must be one of {', '.join(ENCODE_AFTER)}, got {self.encode_after!r}")
        if not 1 <= self.encode_after_chunks <= 8:
            raise ConfigError(f"encode-after-chunks must be in [1, 8], got {self.encode_after_chunks}")
        if self.wrapper and self.anchor:
            raise ConfigError("a store has a wrapper or an anchor, not both")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def open_group(backend: Backend, path: str = "", mode: str = "r"):
    """A Zarr group of the store (`path` relative to its root)."""
    import zarr

    return zarr.open_group(store=backend.zarr_store(read_only=mode == "r"), path=path, mode=mode)


def root_attrs(backend: Backend) -> dict:
    """The store's root attributes (format, config, fingerprints); StoreError where there is no store."""
    try:
        attrs = dict(open_group(backend).attrs).get(ATTR)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise StoreError(f"no sparsecache store at {backend}") from e
    if not attrs:
        raise StoreError(f"{backend} is a Zarr group but not a sparsecache store")
    if attrs.get("format", 0) > READ_FORMAT:
        raise StoreError(f"{backend}: written by a newer sparsecache (store format {attrs['format']}, "
                         f"this version reads {READ_FORMAT}); upgrade sparsecache")
    return attrs


def store_config(attrs: dict) -> StoreConfig:
    """The StoreConfig a store was created with (format-1 stores predate index_coding: packed; a field left
    out at its NEW_CONFIG_DEFAULTS value is that value, whatever StoreConfig's default is now)."""
    return StoreConfig(**{"index_coding": "packed", **NEW_CONFIG_DEFAULTS, **attrs["config"]})


def config_for(backend: Backend, **given) -> StoreConfig:
    """The config to encode into a store with: an existing store's own settings overridden by the
    non-None `given` ones (the writer refuses any that differ), else the defaults with `given`.

    So a nightly re-index keeps a store's settings when newer defaults change."""
    given = {k: v for k, v in given.items() if v is not None}
    try:
        stored = asdict(store_config(root_attrs(backend)))
    except StoreError:
        stored = {}
    return StoreConfig(**{**stored, **given})


def compressors(name: str):
    """The Zarr codec chain for a compressor name; every chunk carries a CRC32C."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return [ZstdCodec(level=3), Crc32cCodec()] if name == "zstd" else [Crc32cCodec()]


class Indexer(Protocol):
    """The search index a version publishes beside its manifest. The store keeps its bytes
    and never reads them; `sparsecache.kvstore.index.FaissIndexer` is the one sparsecache uses."""

    def build(self, embeddings: np.ndarray, rows: np.ndarray) -> tuple[bytes, str]:
        """The index file over the live rows' `embeddings` [n, dim], answering with `rows`,
        and the name of its kind (recorded in the manifest)."""

    def rows(self, data: bytes) -> np.ndarray:
        """The rows an index file answers with (`verify` checks them against the live rows)."""


class DictionaryCopy(Protocol):
    """What the store needs of the dictionary it keeps a copy of (`sparsecache.codec.dictionary.
    Dictionary`): its files, its fingerprint and the sizes its code arrays take."""

    config: object  # a DictConfig: atoms, sparsity, layers_per_signal, index_bits
    model: dict  # the model fingerprint; "layers" sets the number of layer groups

    def fingerprint(self) -> str: ...

    def save(self, directory) -> object: ...


def create_generation(backend: Backend, name: str, config: StoreConfig, dictionary_config, layers: int,
                      embed_dim: int) -> None:
    """Lay out the empty arrays of generation `name` under data/ for a dictionary of
    `dictionary_config` over a model of `layers` layers."""
    g = open_group(backend, f"data/{name}", mode="w")
    c = dictionary_config
    G = layers // c.layers_per_signal
    rb = index_row_bytes(c, config.index_coding)
    s, zt = c.sparsity, config.zarr_chunk_tokens
    comp = compressors(config.compressor)
    fp8 = config.coef_dtype == "float8"
    for kind in ("k", "v"):
        g.create_array(f"{kind}_indices", shape=(G, 0, rb), chunks=(G, zt, rb), dtype="uint8",
                       fill_value=0, compressors=comp)
        g.create_array(f"{kind}_coefficients", shape=(G, 0, s), chunks=(G, zt, s),
                       dtype=STORAGE_DTYPES[config.coef_dtype], fill_value=0x7F if fp8 else float("nan"),
                       compressors=comp, attributes=FLOAT8_ATTRS if fp8 else None)
    g.create_array("tokens", shape=(0,), chunks=(zt,), dtype="int32", fill_value=-1, compressors=compressors("none"))
    for col in table_strings(config):
        g.create_array(f"{col}_utf8", shape=(0,), chunks=(UTF8_CHUNK_BYTES,), dtype="uint8", fill_value=0,
                       compressors=compressors("zstd"))
        g.create_array(f"{col}_ends", shape=(0,), chunks=(ROWS_PER_CHUNK,), dtype="int64", fill_value=-1,
                       compressors=compressors("zstd"))
    for col, dtype in TABLE_INT.items():
        g.create_array(col, shape=(0,), chunks=(ROWS_PER_CHUNK,), dtype=dtype, fill_value=-1,
                       compressors=compressors("zstd"))
    g.create_array("embeddings", shape=(0, embed_dim), chunks=(ROWS_PER_CHUNK // 4, embed_dim),
                   dtype="float32", fill_value=0.0, compressors=compressors("zstd"))


LINKED = "L"  # the mark after a linked wrapper's lengths in its digest ("16+8L:…", `wrapper.Wrapper.digest`)


def linked_digest(wrapper: str | None) -> bool:
    """Whether a wrapper digest (`Wrapper.digest`) is a linked wrapper's."""
    return bool(wrapper) and wrapper.split(":", 1)[0].endswith(LINKED)


def config_attrs(config: StoreConfig) -> tuple[int, dict]:
    """(the root format, the config as a store's attributes keep it): a store in the default format is written
    so that a release before `encode_after` existed opens it (its StoreConfig has no such fields); a store encoded
    after something, or with a linked wrapper (whose trailers an older release would read as stored), says
    FORMAT_AFTER, which such releases refuse."""
    fields = {k: v for k, v in asdict(config).items() if NEW_CONFIG_DEFAULTS.get(k, object()) != v}
    return (FORMAT_AFTER if config.encode_after != "prefix" or config.linked else FORMAT_VERSION), fields


def table_strings(config: StoreConfig) -> tuple[str, ...]:
    """The chunk table's text columns in a store of `config`: TABLE_STR, and AFTER where chunks are
    encoded after something."""
    return TABLE_STR + ((AFTER,) if config.encode_after != "prefix" else ())


def text_columns(group) -> tuple[str, ...]:
    """The text columns generation `group` holds (`table_strings` of the config it was laid out for)."""
    return TABLE_STR + ((AFTER,) if f"{AFTER}_ends" in group else ())


def put(arr, data: np.ndarray, at: int, axis: int) -> None:
    """Write `data` at [at, at + len) along `axis`, growing (or trimming an unpublished tail) first."""
    end = at + data.shape[axis]
    shape = list(arr.shape)
    if shape[axis] != end:
        shape[axis] = end
        arr.resize(tuple(shape))
    sel = [slice(None)] * arr.ndim
    sel[axis] = slice(at, end)
    arr[tuple(sel)] = data


def legacy_strings(group) -> bool:
    """Whether a generation keeps its text columns as zarr-python strings (format ≤ 2)."""
    return "text_ends" not in group


def text_arrays(col: str, legacy: bool) -> tuple[str, ...]:
    """The array names that hold text column `col`."""
    return (col,) if legacy else (f"{col}_utf8", f"{col}_ends")


def read_strings(group, col: str, rows: int, legacy: bool) -> np.ndarray:
    """object [rows] of str: the first `rows` values of text column `col`."""
    if legacy:
        return group[col][:rows]
    ends = group[f"{col}_ends"][:rows]
    blob = group[f"{col}_utf8"][: int(ends[-1])].tobytes() if rows else b""
    starts = np.concatenate([[0], ends[:-1]]) if rows else ends
    return np.array([blob[a:b].decode("utf-8") for a, b in zip(starts, ends)], dtype=object)


def zarr_points(arrays):
    """A `read_rows` fetch through Zarr: values of 1-D arrays at positions, all concurrently
    (`arrays`: name → zarr Array)."""
    from zarr.core.sync import sync

    def fetch(reads: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        handles = [arrays[a]._async_array for a, _ in reads]  # opened here: not inside zarr's loop

        async def every():
            return await asyncio.gather(*(h.get_coordinate_selection(at) for h, (_, at) in zip(handles, reads)))

        return sync(every())

    return fetch


def read_rows(fetch, names: list[str], rows, legacy: bool) -> dict[str, list]:
    """Values of chunk-table columns `names` at `rows`, reading only the chunks that hold them,
    all columns at once: two rounds of `fetch` ([(array name, positions)] → [values], as
    `zarr_points`): the integer columns and the text columns' ends, then the text bytes."""
    rows = np.asarray(rows, np.int64)
    text = [n for n in names if n in TEXT_COLUMNS]
    first = [(n, rows) for n in names if n not in TEXT_COLUMNS or legacy]
    need = np.unique(np.concatenate([rows, rows - 1]))
    need = need[need >= 0]
    first += [(f"{n}_ends", need) for n in text if not legacy]
    got = dict(zip([a for a, _ in first], fetch(first) if len(rows) else [np.zeros(0)] * len(first)))
    out = {n: got[n].tolist() for n in names if n not in TEXT_COLUMNS}
    if legacy:
        out.update({n: [str(v) for v in got[n]] for n in text})
        return out
    spans, second = {}, []
    for n in text:
        ends = dict(zip(need.tolist(), got[f"{n}_ends"].tolist()))
        spans[n] = [(ends.get(r - 1, 0) if r else 0, ends[r]) for r in rows.tolist()]
        second.append((f"{n}_utf8", np.concatenate([np.arange(a, b) for a, b in spans[n]] + [np.zeros(0, np.int64)])))
    blobs = iter(fetch([(a, at) for a, at in second if len(at)]) if any(len(at) for _, at in second) else [])
    for (n, (_, at)) in zip(text, second):
        blob = next(blobs).tobytes() if len(at) else b""
        cuts = np.cumsum([0] + [b - a for a, b in spans[n]])
        out[n] = [blob[cuts[i]: cuts[i + 1]].decode("utf-8") for i in range(len(rows))]
    return out


def write_strings(group, col: str, values: list[str], row0: int, legacy: bool, start: int | None = None) -> int:
    """Write `values` as rows row0.. of text column `col` (rows before row0 must be written);
    `start` is where row0's bytes begin when the caller knows (else it is read). Returns
    where the last row's bytes end."""
    if legacy:
        put(group[col], np.array(values, dtype=object), row0, axis=0)
        return 0
    if start is None:
        start = int(group[f"{col}_ends"][row0 - 1]) if row0 else 0
    encoded = [v.encode("utf-8") for v in values]
    ends = start + np.cumsum([len(e) for e in encoded], dtype=np.int64)
    put(group[f"{col}_utf8"], np.frombuffer(b"".join(encoded), np.uint8), start, axis=0)
    put(group[f"{col}_ends"], ends, row0, axis=0)
    return int(ends[-1]) if len(ends) else start
