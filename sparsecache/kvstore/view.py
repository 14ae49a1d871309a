"""A store read as K/V: the storage of `sparsecache.store` with what decodes and searches it.

`store` keeps bytes, arrays, manifests and versions and hands back codes and the index file
as bytes; it never interprets either. `KVStore` adds the dictionary copy and its `Codec`
(codes → pre-RoPE K/V on any device) and the FAISS index segments (`indexes`, `search`), which the
session, blending, serving and the vLLM connector read through. `verify` and `compact` here
are the store's, given FAISS and the dictionary format to check and rebuild with.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .. import store as storage
from ..codec.coding import Codec
from ..codec.dictionary import Dictionary
from ..errors import StoreCorrupt
from ..stopwatch import Stopwatch
from ..store import ChunkCodes, ChunkInfo, Manifest
from ..store.reader import INFO_COLUMNS
from .index import FaissIndexer, LiveRows, index_ids, load_index_file, search_segments

SEARCH_COLUMNS = ("chunk_id", *INFO_COLUMNS)  # what `search` reads for each hit (`Store.chunks_at`)


class KVStore(storage.Store):
    """A read-only view of one published version that decodes K/V and answers searches."""

    CARRIED = (*storage.Store.CARRIED, "_dictionary", "_codec", "_index_cache")  # never change over a store's life
    _dictionary: Dictionary | None = None
    _codec: Codec | None = None
    _live = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._index_cache: dict[str, object] = {}

    @property
    def dictionary(self) -> Dictionary:
        if self._dictionary is None:
            d = Dictionary.load(self.dictionary_dir())
            if d.fingerprint() != self.attrs["dictionary"]:
                raise StoreCorrupt(f"{self.backend}: the dictionary copy does not match the fingerprint recorded at creation")
            self._dictionary = d
        return self._dictionary

    def codec(self) -> Codec:
        if self._codec is None:
            self._codec = Codec(self.dictionary, self.config.coef_dtype, indices=self.config.index_coding)
        return self._codec

    def load_kv(self, chunk_ids: list[str], device="cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Decoded pre-RoPE (keys, values) per chunk, each [n_layers, T_chunk, m] float32 on `device`."""
        return self.decode_codes(self.read_codes(chunk_ids), device)

    def decode_codes(self, codes: ChunkCodes, device="cpu", watch: Stopwatch | None = None,
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per chunk of `codes` on `device`, in one batched decode per K and V.
        `watch` times the transfer (host → device) and the reconstruction apart."""
        dev = torch.device(device)
        watch = watch if watch is not None else Stopwatch(dev)
        with watch.step("transfer"):
            parts = [torch.from_numpy(x).to(dev, non_blocking=True)
                     for x in (codes.k.indices, codes.k.coefficients, codes.v.indices, codes.v.coefficients)]
        with watch.step("reconstruct"):
            codec = self.codec()
            k = codec.decode((parts[0], parts[1]), "k", dev)  # (n_layers, T, m)
            v = codec.decode((parts[2], parts[3]), "v", dev)
        return list(zip(k.split(codes.lengths, dim=1), v.split(codes.lengths, dim=1)))

    def prepare(self, search: bool = True) -> "KVStore":
        """`Store.prepare`, and with `search` what answering questions also reads: this version's
        index segments (an object store's fetched once into the local cache) and its calibration
        (`serve`'s default method). The connector, which only loads chunks, prepares without."""
        super().prepare()
        if search:
            self.indexes()
            self.calibration()
        return self

    def indexes(self) -> list:
        """The FAISS index segments of this version (ids are chunk rows), loaded once each and
        memory-mapped (an object store's from a local copy fetched once, `Backend.fetch_file`), so
        opening reads no vectors. Segments are immutable files, so a newer version of the store
        (`latest`) reuses the ones it shares."""
        out = []
        for piece in self.manifest.index_pieces():
            key = piece["key"]
            if key not in self._index_cache:
                self._index_cache[key] = self._load_index(key)
            out.append(self._index_cache[key])
        for stale in set(self._index_cache) - {p["key"] for p in self.manifest.index_pieces()}:
            del self._index_cache[stale]
        return out

    def _load_index(self, key: str):
        try:
            return load_index_file(self.backend.fetch_file(key))  # an object store's: cached locally once
        except FileNotFoundError:
            raise self.missing_index(key) from None
        except RuntimeError as e:
            raise StoreCorrupt(f"{self.backend}/{key}: unreadable FAISS index: {str(e).splitlines()[0]}") from e

    def warm(self, background: bool = True, block: int = 16 << 20) -> threading.Thread | None:
        """Read the files a search touches once, start to end, so that the OS page cache holds
        them and searches stop waiting for the disk: this version's index segment files
        (memory-mapped, otherwise read list by list by the first searches that touch them: ~0.5 s
        each at 10M chunks on a ~700 MB/s disk) and, on a local store, the chunk-table columns a
        search answers with (`SEARCH_COLUMNS`: a search's hits are otherwise random reads of
        cold Zarr chunks, 8 rows × 7 arrays). A serving process calls it after opening; in the
        background by default (the thread is returned), else it returns when done. The cache is
        the kernel's: this reads through a small buffer and holds nothing itself."""
        paths = [self.backend.fetch_file(p["key"]) for p in self.manifest.index_pieces()] + self.column_files(SEARCH_COLUMNS)

        def read_all() -> None:
            buf = bytearray(block)
            for path in paths:
                try:
                    with open(path, "rb", buffering=0) as f:
                        while f.readinto(buf):
                            pass
                except OSError:  # pruned under us: the search that needs it says so
                    continue

        if not background:
            read_all()
            return None
        t = threading.Thread(target=read_all, name="sparsecache-warm", daemon=True)
        t.start()
        return t

    def index_rows(self) -> np.ndarray:
        """The live rows the index answers with (sorted): every live row, where the store is whole."""
        ids = np.concatenate([index_ids(ix) for ix in self.indexes()] or [np.zeros(0, np.int64)])
        return np.intersect1d(ids, self.live_rows())

    def search(self, query_embedding: np.ndarray, k: int,
               documents: list[str] | None = None) -> list[tuple[ChunkInfo, float]]:
        """The k live chunks nearest to a query embedding [dim], best first, with scores; with
        `documents`, only among those documents' chunks (an unknown document id is an error)."""
        hits = self.search_rows(query_embedding, k, documents)
        return list(zip(self.chunks_at([row for row, _ in hits]), [score for _, score in hits]))

    def search_rows(self, query_embedding: np.ndarray, k: int,
                    documents: list[str] | None = None) -> list[tuple[int, float]]:
        """`search`'s first step alone: the FAISS segments' k best (chunk-table row, score)."""
        within = None if documents is None else self.document_rows(documents)
        if self._live is None:
            self._live = LiveRows(self.live_rows(), self.manifest.chunks)
        return search_segments(self.indexes(), query_embedding, k, within, self._live)


def verify(where, version: int | None = None) -> dict:
    """`store.verify` with the FAISS index's rows and the dictionary copy's fingerprint checked."""
    return storage.verify(where, version, FaissIndexer(), lambda d: Dictionary.load(d).fingerprint())


def compact(where, keep: int = 2, index_kind: str = "auto") -> Manifest:
    """`store.compact` with a FAISS index of `index_kind` (`index_config.INDEX_KINDS`)."""
    return storage.compact(where, FaissIndexer(index_kind), keep)
