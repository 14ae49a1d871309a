"""The query path on the families whose K/V capture or attention differs from Llama's: Qwen3
(k_norm), Phi-3 (fused qkv_proj; full and partial rotary), Gemma 2 (sliding-window layers,
attention soft-capping, scaled embeddings) and Gemma 3 (sliding-window layers, k_norm, one RoPE
table per layer type); tiny random models built from their config classes."""

import pytest
import torch
from sparsecache.testing import unit_atoms

from sparsecache.codec.dictionary import DictConfig, Dictionary
from sparsecache.model import default_prefix_ids, extract_kv, load_model
from sparsecache.model.cache import assemble
from sparsecache.model.generate import question_ids
from sparsecache.query.blend import attention_scores, value_deviation
from support.corpora import write_corpus
from support.models import assert_graphed_passes_equal_eager, eager_attention_mass, GEMMA2, GEMMA3, tiny

QUESTION = "What does the statement do?"


@pytest.fixture(scope="module", params=[("Qwen3", {}), ("Phi3", {}), ("Phi3", {"partial_rotary_factor": 0.5}),
                                        ("Gemma2", GEMMA2), ("Gemma3", GEMMA3)],
                ids=["qwen3", "phi3", "phi3-partial-rotary", "gemma2", "gemma3"])
def model(request, tmp_path_factory):
    family, extra = request.param
    m = load_model(str(tiny(family, tmp_path_factory.mktemp(family), **extra)))
    if extra.get("partial_rotary_factor"):  # the partial path is really taken: tables cover half of each 16-dim head
        assert m.rope.tables(torch.arange(3))[0].shape[-1] == 8
    return m


def exact_context(model, texts):
    prefix = default_prefix_ids(model)
    chunks = [model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return assemble(prefix, extract_kv(model, [prefix])[0], chunks, extract_kv(model, chunks, prefix), model)


def test_attention_scores_match_the_models_own_eager_attention(model):
    q = question_ids(model, QUESTION)
    for layer in (0, 1):
        ctx = exact_context(model, ["The pass statement does nothing at all.", "A break ends the loop early."])
        scores = attention_scores(ctx, q, model, layer)
        torch.testing.assert_close(scores, eager_attention_mass(model, ctx, q, layer), atol=1e-4, rtol=1e-4)


def test_the_passes_on_a_graph_workspace_equal_the_ordinary_ones(model):
    """`model.graphs`' static passes (padded, over a fixed capacity, masked by position) under sliding
    windows, soft caps, per-layer-type RoPE tables, k_norm and fused projections."""
    q = question_ids(model, QUESTION)
    texts = ["The pass statement does nothing at all.", "A break ends the loop early, skipping the else clause."]
    assert_graphed_passes_equal_eager(model, lambda: exact_context(model, texts), q, 0.3, 1)


def test_first_layer_kv_is_what_the_model_computes_at_layer_0(model):
    """Layer 0's K/V from the tokens alone (position 0, the run stopped at layer 0's attention)
    equal the K/V captured in a forward after a prefix: the family's embedding scale, norms,
    fused projections and k_norm included."""
    from sparsecache.model.stack import first_layer_kv

    prefix = default_prefix_ids(model)
    ids = model.tokenizer("The pass statement does nothing at all.", add_special_tokens=False)["input_ids"]
    (k, v), = extract_kv(model, [ids], prefix)
    fk, fv = first_layer_kv(model, torch.tensor(ids))
    torch.testing.assert_close(fk, k[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fv, v[0], atol=1e-5, rtol=1e-5)


def test_value_deviation_is_zero_for_one_exact_chunk(model):
    """One chunk's exact V after the prefix is what full-context prefill computes."""
    ctx = exact_context(model, ["The pass statement does nothing at all, and that is its purpose."])
    assert value_deviation(ctx, model, 1).abs().max() < 1e-4


def test_encode_store_query_end_to_end(model, embedder, tmp_path):
    """encode-corpus → store → query; recomputing every chunk token reproduces full prefill."""
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig

    m = model.m
    d = Dictionary(unit_atoms(m, 512, 1), unit_atoms(m, 512, 2), DictConfig(512, 4, 1), model.fingerprint())
    corpus = write_corpus(tmp_path / "corpus")
    encode_with([str(corpus)], tmp_path / "store", d, model, StoreConfig(chunk_tokens=64),
                EncodeOptions(batch_tokens=512, progress=False), embedder=embedder)
    s = Session(tmp_path / "store", model)
    s._embedder = embedder
    ids = [c.id for c in s.store.chunks()][:3]
    full = s.query(QUESTION, chunks=ids, method="full", max_new_tokens=1).logits
    for method in ("a3", "infoflow", "cacheblend"):
        got = s.query(QUESTION, chunks=ids, method=method, recompute_ratio=1.0, max_new_tokens=1).logits
        torch.testing.assert_close(got, full, atol=2e-4, rtol=1e-4)
    a = s.query(QUESTION, top_k=2, method="infoflow", max_new_tokens=4)
    assert len(a.chunks) == 2 and a.timings_ms["ttft"] > 0


def test_rope_from_the_config_alone_rotates_as_the_model(model):
    """vLLM's worker has the config, not the HF model: its Rope must rotate every layer as the
    model's own, in place or not, for a group of layers starting anywhere (Gemma 3's tables differ by layer)."""
    from sparsecache.model import Rope

    keys = torch.randn(model.n_layers, 7, model.m)
    pos = torch.arange(40, 47)
    want = model.rope.rotate(keys, pos)
    alone = Rope.for_config(model.config)
    torch.testing.assert_close(alone.rotate(keys, pos), want)
    torch.testing.assert_close(alone.rotate_(keys.clone(), pos), want)
    torch.testing.assert_close(alone.rotate_(keys[1:].clone(), pos, first_layer=1), want[1:])
