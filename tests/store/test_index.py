"""The embedder (default all-MiniLM-L6-v2) and the FAISS index over chunk embeddings."""

from __future__ import annotations

import numpy as np
import pytest

from sparsecache.errors import ModelError
from sparsecache.kvstore.index import build_index, index_kind, index_to_bytes, load_index_bytes, search

TEXTS = [
    "The cat sat on the mat and purred.",
    "Interest rates were raised by the central bank to curb inflation.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "The striker scored twice in the second half of the final.",
]


def test_embeddings_are_unit_and_meaningful(embedder):
    e = embedder.embed(TEXTS)
    assert e.shape == (4, 384) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    q = embedder.embed(["monetary policy and inflation", "plants and sunlight", "a football match"])
    assert (q @ e.T).argmax(1).tolist() == [1, 2, 3]


def test_batching_does_not_change_embeddings(embedder):
    np.testing.assert_allclose(embedder.embed(TEXTS, batch=1), embedder.embed(TEXTS, batch=4), atol=1e-5)


def test_long_text_is_embedded_in_windows(embedder):
    """A text past the 256-token window still counts its tail (truncation would ignore it)."""
    head = "The history of the Roman empire and its emperors. " * 40  # ~400 tokens
    a = embedder.embed([head + "Quantum computers use qubits and superposition. " * 20])[0]
    b = embedder.embed([head])[0]
    q = embedder.embed(["qubits and quantum computing"])[0]
    assert q @ a > q @ b + 0.05


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_index_answers_with_the_given_ids(kind, embedder, tmp_path):
    e = embedder.embed(TEXTS)
    ids = np.array([40, 10, 30, 20])
    index = build_index(e, ids, kind)
    assert index_kind(index) == kind and index.ntotal == 4
    loaded = load_index_bytes(index_to_bytes(index))
    hits = search(loaded, embedder.embed(["a football match"])[0], 2)
    assert hits[0][0] == 20 and hits[0][1] > hits[1][1]
    assert not list(tmp_path.glob("*.tmp"))


def test_auto_picks_flat_for_small_then_hnsw_then_ivf(monkeypatch):
    from sparsecache.kvstore import index_config

    rng = np.random.default_rng(0)
    e = rng.standard_normal((50, 8)).astype(np.float32)
    assert index_kind(build_index(e, np.arange(50))) == "flat"
    monkeypatch.setattr(index_config, "HNSW_ABOVE", 10)
    assert index_kind(build_index(e, np.arange(50))) == "hnsw"
    monkeypatch.setattr(index_config, "IVF_ABOVE", 20)
    assert index_kind(build_index(e, np.arange(50))) == "ivf-f16"
    with pytest.raises(ValueError, match="index kind"):
        build_index(e, np.arange(50), "ivf")


def test_empty_input_and_missing_embedder(embedder, tmp_path):
    assert embedder.embed([]).shape == (0, 384)
    assert build_index(np.zeros((0, 384), np.float32), np.zeros(0, np.int64)).ntotal == 0
    from sparsecache.kvstore.index import Embedder

    with pytest.raises(ModelError, match="embedder not found"):
        Embedder(str(tmp_path / "nope"))
