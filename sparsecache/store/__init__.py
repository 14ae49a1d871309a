"""The corpus store: sparse codes in Zarr v3 arrays, published as versions by manifests that
are created once and never overwritten. A store lives in a local directory or under an object
store URL (s3://bucket/prefix, gs://, az://); the layout and guarantees are the same.

Layout (any Zarr v3 implementation reads the arrays; only core data types are used):

    zarr.json                  root group; attribute "sparsecache" = format, config, fingerprints
    prefix/                    the shared prefix: token_ids [P], keys/values float32 [n_layers, P, m]
    dictionary/                a copy of the dictionaries, so the store is self-contained
    data/gNNNNNN/              one generation of append-only arrays (a new one per compaction):
        tokens                 int32 [N]                  token ids on the global token axis
        {k,v}_indices          uint8 [G, N, row_bytes]    atom indices: Elias–Fano sorted sets (or 13-bit packed)
        {k,v}_coefficients     uint8 [G, N, s] holding float8 e4m3 (attribute says so), or float16/float32
        {col}_utf8, {col}_ends uint8 [bytes], int64 [C]   text columns chunk_id, doc_id, content_hash, text, meta
        ordinal, token_length  int32 [C];  token_offset int64 [C]
        embeddings             float32 [C, dim]           so the index can be rebuilt without the embedder
    manifests/vNNNNNN.json     one per published version: generation, extents, counts, and the keys of
                               its document-table segments, live-row bitmap and index (a few KB at any size)
    meta/segments/<digest>/    an immutable piece of the document table (doc_id, hash → first, count,
                               tokens, token_offset; ids it deletes), written once: a publish adds
                               the documents that changed and merges pieces log-structured (`doctable`)
    meta/live/<digest>/        bits uint8 [C / 8]: which chunk rows a version's documents own
    index/vNNNNNN.faiss        the FAISS index of that version (ids are chunk rows)
    calibration/vNNNNNN.json   that version's measured query configuration per kind of device
                               (`sparsecache calibrate`; beside the manifest, so older readers ignore it)
    pending.json               a writer's progress since the last version (resume after a crash)
    .lock / lease.json         the one writer: an flock locally, a lease object on object storage
    .sparsecache-store         written first when a store is created: a writer only ever deletes
                               or overwrites inside a root that carries it

The invariant the writer keeps (and `verify` checks): every live document owns a contiguous
run of chunk rows and of tokens that no other live document touches; each row it owns holds
one of its chunks, ordinals 0..count-1 in order; the index holds exactly the live rows; and
extents never move backwards within a generation. Rows written by a run that crashed are
either reused by the next run (nothing published names them) or left for `compact`.

Durability: on a local disk, before `pending.json` records a batch and before a manifest is
created, every file written since the last such point and its directory are fsynced; on an
object store a PUT is durable once acknowledged.

Modules: `backend` (local directory, object store), `layout` (config, arrays, text columns),
`versions` (manifests, publishing, lock and lease), `calibration` (a version's measured query configuration), `doctable` (the document table's pieces),
`writer`, `reader`, `verify`, `compact`.
"""

from __future__ import annotations

from .backend import Backend, LocalBackend, ObjectBackend, is_url, open_backend
from .compact import compact
from .context_layout import ContextLayout
from .layout import CODE_ARRAYS, FORMAT_VERSION, StoreConfig, compressors
from .layout import config_for as _config_for
from .reader import ChunkCodes, ChunkInfo, Store, plain_chunks, read_spans_direct, read_zarr
from .verify import verify
from .versions import Lease, Lock, Manifest, VersionPoller
from .versions import read_manifest as _read_manifest
from .versions import versions as _versions
from .writer import Writer


def config_for(where, **given) -> StoreConfig:
    """The config to encode into the store at `where` (see `layout.config_for`)."""
    return _config_for(open_backend(where), **given)


def read_manifest(where, version: int | None = None) -> Manifest:
    """The manifest of `version` (default: the latest) of the store at a path or URL."""
    return _read_manifest(open_backend(where), version)


def versions(where) -> list[int]:
    """Published version numbers of the store at a path or URL, ascending."""
    return _versions(open_backend(where))


def store_exists(where) -> bool:
    """Whether a store has been created at `where` (a path or URL)."""
    return open_backend(where).exists("zarr.json")


def existing_dictionary(where):
    """A local directory holding the dictionary copy of the store at `where`, or None where
    there is no store yet."""
    b = open_backend(where)
    if not b.exists("zarr.json") or not b.list("dictionary"):
        return None
    return b.fetch_dir("dictionary")


__all__ = ["Backend", "CODE_ARRAYS", "ChunkCodes", "ChunkInfo", "ContextLayout", "FORMAT_VERSION", "Lease",
           "LocalBackend", "Lock", "Manifest", "ObjectBackend", "Store", "StoreConfig", "Writer", "compact",
           "compressors", "config_for", "existing_dictionary", "is_url", "open_backend", "plain_chunks",
           "read_manifest", "read_spans_direct", "read_zarr", "store_exists", "verify", "VersionPoller", "versions"]
