"""Query-time assembly, selection and recomputation against full prefill (tiny model)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecache.errors import ConfigError
from sparsecache.model.cache import Context, recompute
from sparsecache.model.generate import prefill, question_ids
from sparsecache.query.blend import attention_scores, load_cache, select, select_chunks
from sparsecache.query.config import QueryConfig
from sparsecache.query.session import Session
from support.models import eager_attention_mass

QUESTION = "What does the statement do?"


@pytest.fixture(scope="module")
def session(tiny_model, tiny_dictionary, embedder, tmp_path_factory):
    from support.corpora import write_corpus

    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.store import StoreConfig

    root = tmp_path_factory.mktemp("blend")
    corpus = write_corpus(root / "corpus")
    encode_with([str(corpus)], root / "store", tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=64),
                EncodeOptions(batch_tokens=512, progress=False), embedder=embedder)
    s = Session(root / "store", tiny_model)
    s._embedder = embedder
    return s


@pytest.fixture(scope="module")
def chunk_ids(session):
    return [c.id for c in session.store.chunks()][:4]


def first_logits(session, ids, method, ratio=0.0, **kw):
    return session.query(QUESTION, chunks=ids, method=method, recompute_ratio=ratio, max_new_tokens=1, **kw).logits


@pytest.mark.parametrize("method", ["a3", "infoflow", "chunkflow", "cacheblend"])
@pytest.mark.parametrize("window", [1, 8])
def test_recomputing_everything_reproduces_full_prefill(session, chunk_ids, method, window):
    full = first_logits(session, chunk_ids, "full")
    got = first_logits(session, chunk_ids, method, 1.0, group_window=window, group_min=min(5, window))
    torch.testing.assert_close(got, full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("blocks", [1, 3])
def test_the_question_riding_along_equals_its_own_prefill_after(session, chunk_ids, tiny_model, blocks):
    """The question's prefill in the recomputation's pass gives the logits and the cache of
    recomputing first and prefilling the question after, in one pass or in position blocks."""
    q = question_ids(tiny_model, QUESTION)
    apart, along = (load_cache(session.store, chunk_ids, tiny_model) for _ in range(2))
    positions = select(attention_scores(apart, q, tiny_model, 1), apart, 0.3)
    recompute(apart, positions, tiny_model)
    expected = prefill(apart.cache, q, tiny_model)
    got = recompute(along, positions, tiny_model, blocks=blocks, q_ids=q)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert along.cache.get_seq_length() == apart.cache.get_seq_length() == apart.length + len(q)
    for a, b in zip(apart.cache.layers, along.cache.layers):
        torch.testing.assert_close(b.keys, a.keys, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(b.values, a.values, atol=2e-5, rtol=1e-5)


def test_compressed_kv_without_recomputation_differs(session, chunk_ids):
    """The check above is not vacuous: decoded KV alone gives other logits."""
    full = first_logits(session, chunk_ids, "full")
    assert (first_logits(session, chunk_ids, "none") - full).abs().max() > 1e-2


def test_raw_single_chunk_equals_full(session, chunk_ids):
    """One chunk, exact KV, no fusion needed: only fp16 storage of the raw KV separates them."""
    full = first_logits(session, chunk_ids[:1], "full")
    raw = first_logits(session, chunk_ids[:1], "raw")
    torch.testing.assert_close(raw, full, atol=2e-2, rtol=0)
    assert raw.argmax() == full.argmax()


def test_raw_kv_of_a_store_rebuilt_at_the_same_path_is_not_the_old_encodings(tiny_model, tiny_dictionary, embedder,
                                                                              tmp_path):
    """Chunk ids hash a chunk's document and text only, and the raw files live beside the store: a
    store removed and encoded again at the same path with another prefix has the same ids. Its raw KV
    must be computed after its own prefix, not read from the old store's files."""
    import shutil

    from support.corpora import write_corpus

    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.store import StoreConfig

    corpus = write_corpus(tmp_path / "corpus")
    for prefix in (None, "Answer from the context below, briefly.\n"):
        shutil.rmtree(tmp_path / "store", ignore_errors=True)
        encode_with([str(corpus)], tmp_path / "store", tiny_dictionary, tiny_model,
                    StoreConfig(chunk_tokens=64, prefix=prefix), EncodeOptions(batch_tokens=512, progress=False),
                    embedder=embedder)
        s = Session(tmp_path / "store", tiny_model)
        s._embedder = embedder
        one = [c.id for c in s.store.chunks()][:1]
        s.raw_files(one)
        full = first_logits(s, one, "full")
        torch.testing.assert_close(first_logits(s, one, "raw"), full, atol=2e-2, rtol=0)
    assert len(list((tmp_path / "store.raw").iterdir())) == 2  # one directory per encoding


def test_chunk_order_is_respected(session, chunk_ids):
    shuffled = [chunk_ids[2], chunk_ids[0], chunk_ids[3], chunk_ids[1]]
    full = first_logits(session, shuffled, "full", order="given")
    torch.testing.assert_close(first_logits(session, shuffled, "a3", 1.0, group_window=1, order="given"), full,
                               atol=2e-5, rtol=1e-5)
    assert (first_logits(session, chunk_ids, "full", order="given") - full).abs().max() > 1e-3  # order matters at all
    rev = session.query(QUESTION, chunks=shuffled[::-1], method="full", max_new_tokens=1, order="reverse").logits
    torch.testing.assert_close(rev, full)


def test_the_query_cache_holds_the_stores_decoded_kv(session, chunk_ids, tiny_model):
    """One decode path: the context a query assembles is Store.load_kv's K/V with layer 0 from
    the tokens, rotated where each chunk lands, bit for bit."""
    from sparsecache.query.blend import restore_first_layer

    ctx = load_cache(session.store, chunk_ids, tiny_model)
    prefix, pk, pv = session.store.prefix()
    kv = session.store.load_kv(chunk_ids)
    restore_first_layer(kv, torch.tensor([t for ts in session.store.tokens(chunk_ids) for t in ts]), tiny_model)
    keys = torch.cat([pk] + [k for k, _ in kv], 1)
    values = torch.cat([pv] + [v for _, v in kv], 1)
    keys = tiny_model.rope.rotate_(keys.float(), torch.arange(keys.shape[1]))
    for layer in range(tiny_model.n_layers):
        cached = ctx.cache.layers[layer]
        assert torch.equal(cached.keys[0].transpose(0, 1).flatten(1), keys[layer])
        assert torch.equal(cached.values[0].transpose(0, 1).flatten(1), values[layer].float())


def test_cache_plugs_into_generate(session, chunk_ids, tiny_model):
    ctx = load_cache(session.store, chunk_ids, tiny_model)
    q = question_ids(tiny_model, QUESTION)
    ids = torch.cat([ctx.token_ids, torch.tensor(q)])[None]
    out = tiny_model.hf.generate(input_ids=ids, **{tiny_model.cache_arg: ctx.cache}, max_new_tokens=4, do_sample=False,
                                 pad_token_id=0)
    ours = session.query(QUESTION, chunks=chunk_ids, method="none", max_new_tokens=4)
    expected = tiny_model.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert ours.answer == expected


@pytest.mark.parametrize("method", ["none", "infoflow", "chunkflow", "legolink", "a3", "cacheblend"])
def test_a_session_with_graphed_passes_answers_as_without(session, chunk_ids, tiny_model, method):
    """Each method's fusion with its fixed passes on `model.graphs`' workspace (uncaptured on a CPU):
    the same first logits and answer, and what it generates after reads the cache the passes left."""
    from sparsecache.model.graphs import enable

    plain = session.query(QUESTION, chunks=chunk_ids, method=method, max_new_tokens=6, prefill_under=0)
    graphs = enable(tiny_model, capture=False)
    try:
        got = session.query(QUESTION, chunks=chunk_ids, method=method, max_new_tokens=6, prefill_under=0)
    finally:
        enable(tiny_model, False)
    assert graphs.runs >= 1
    torch.testing.assert_close(got.logits, plain.logits, atol=2e-5, rtol=1e-4)
    assert got.tokens == plain.tokens and got.recomputed_tokens == plain.recomputed_tokens


def test_query_cuda_graphs_answers_as_without(session, chunk_ids, tiny_model_dir):
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    args = ["query", str(session.store.root), QUESTION, "--chunks", ",".join(chunk_ids), "--model",
            str(tiny_model_dir), "--device", "cpu", "--max-new-tokens", "5", "--prefill-under", "0", "--json"]
    plain, graphed = (CliRunner().invoke(cli, args + extra) for extra in ([], ["--cuda-graphs"]))
    assert plain.exit_code == graphed.exit_code == 0, graphed.output
    assert json.loads(graphed.stdout)["answer"] == json.loads(plain.stdout)["answer"]


def test_attention_scores_match_eager_attention(session, chunk_ids, tiny_model):
    """The scorer's manual attention equals the model's own (eager) attention weights."""
    q = question_ids(tiny_model, QUESTION)
    for layer in (1, 3):
        ctx = load_cache(session.store, chunk_ids, tiny_model)
        scores = attention_scores(ctx, q, tiny_model, layer)
        assert ctx.cache.get_seq_length() == ctx.length  # the question's K/V did not stay behind
        torch.testing.assert_close(scores, eager_attention_mass(tiny_model, ctx, q, layer), atol=1e-4, rtol=1e-4)


def _ctx(prefix: int, n: int) -> Context:
    return Context(cache=None, token_ids=torch.zeros(prefix + n, dtype=torch.long), prefix_len=prefix,
                   spans=[(prefix, prefix + n)])


def test_select_takes_the_top_ratio_of_chunk_tokens_only():
    ctx = _ctx(5, 100)
    scores = torch.arange(105, dtype=torch.float).flip(0)  # the prefix scores highest
    got = select(scores, ctx, 0.1)
    assert got.tolist() == list(range(5, 15))
    assert select(scores, ctx, 0.0).numel() == 0 and select(scores, ctx, 1.0).numel() == 100


def test_grouping_keeps_whole_windows_with_enough_selected():
    ctx = _ctx(0, 32)
    scores = torch.zeros(32)
    scores[[0, 1, 2, 3, 4, 9, 20, 21]] = 1.0  # window 0 has 5 selected, window 1 one, window 2 two
    got = select(scores, ctx, 8 / 32, window=8, min_selected=5)
    assert got.tolist() == list(range(8))


def test_budgeted_grouping_takes_the_windows_with_most_score():
    ctx = _ctx(0, 32)
    scores = torch.zeros(32)
    scores[[9, 10, 20, 21, 22]] = 1.0  # window 2 has the most mass, then window 1
    assert select(scores, ctx, 16 / 32, window=8, min_selected=0).tolist() == list(range(8, 24))
    assert select(scores, ctx, 8 / 32, window=8, min_selected=0).tolist() == list(range(16, 24))


def _chunked(prefix: int, lengths: list[int]) -> Context:
    spans, start = [], prefix
    for n in lengths:
        spans.append((start, start + n))
        start += n
    return Context(cache=None, token_ids=torch.zeros(start, dtype=torch.long), prefix_len=prefix, spans=spans)


def test_whole_chunks_go_first_by_attention_mass_and_the_rest_to_tokens():
    """Four chunks of 10 after a prefix of 5: at r = 0.5 (20 tokens) the two chunks with the most mass
    are recomputed whole, whatever their place; at r = 0.6 the 4 tokens left go to the best tokens of
    the others; under one chunk's share no chunk fits and the choice is `select`'s."""
    ctx = _chunked(5, [10, 10, 10, 10])
    scores = torch.full((45,), 0.01)
    scores[:5] = 9.0  # the prefix is never chosen
    scores[35:45] = 1.0  # the last chunk holds the most mass
    scores[15:25] = 0.5
    scores[[6, 7, 8, 9]] = 0.3  # the first chunk's best tokens: more than any token left in the third
    assert select_chunks(scores, ctx, 0.5).tolist() == list(range(15, 25)) + list(range(35, 45))
    assert select_chunks(scores, ctx, 0.6).tolist() == [6, 7, 8, 9] + list(range(15, 25)) + list(range(35, 45))
    assert torch.equal(select_chunks(scores, ctx, 0.2), select(scores, ctx, 0.2))  # 10 tokens > 8 + 1
    assert select_chunks(scores, ctx, 0.0).numel() == 0 and select_chunks(scores, ctx, 1.0).tolist() == list(range(5, 45))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 6), st.lists(st.integers(1, 40), min_size=1, max_size=8), st.floats(0, 1),
       st.sampled_from([1, 4, 8]), st.integers(0, 2**31 - 1))
def test_chunk_selection_spends_about_the_budget_on_the_chunks_with_most_mass(prefix, lengths, ratio, window, seed):
    ctx = _chunked(prefix, lengths)
    scores = torch.rand(ctx.length, generator=torch.Generator().manual_seed(seed))
    got = select_chunks(scores, ctx, ratio, window=window)
    n = ctx.length - prefix
    k = min(n, round(ratio * n))
    assert got.tolist() == sorted(set(got.tolist())) and all(prefix <= p < ctx.length for p in got.tolist())
    assert len(got) <= k + 2 * window and (k == 0) == (len(got) == 0)
    chosen = set(got.tolist())
    ranked = sorted(range(len(lengths)), key=lambda i: -float(scores[slice(*ctx.spans[i])].sum()))
    whole = [set(range(*ctx.spans[i])) <= chosen for i in ranked]
    t = whole.index(False) if False in whole else len(whole)  # the leading whole chunks by mass
    if k and t < len(ranked):  # the next one did not fit what they left
        assert sum(lengths[i] for i in ranked[:t + 1]) > k + window


def test_legolink_recomputes_the_first_tokens_of_every_chunk_at_most_32():
    """EPIC's LegoLink: the first 32 tokens of each chunk (all of a shorter one) at its own ratio, that
    share of each chunk under a smaller one; what the question attends to does not matter."""
    from sparsecache.query.methods import get

    ctx = _chunked(3, [40, 10, 100])
    spec, scores = get("legolink"), torch.rand(153)
    assert spec.pick(scores, ctx, QueryConfig("legolink")).tolist() == (
        list(range(3, 35)) + list(range(43, 53)) + list(range(53, 85)))
    assert spec.pick(scores, ctx, QueryConfig("legolink", 0.1)).tolist() == [3, 4, 5, 6, 43] + list(range(53, 63))
    assert spec.pick(scores, ctx, QueryConfig("legolink", 0.0)).numel() == 0


def test_legolink_and_chunkflow_answer_through_a_session(session, chunk_ids):
    """Both through `Session.query`: legolink on its defaults recomputes the first 32 tokens of each chunk
    (a toy model's ratio is its own: no costs are measured for it), chunkflow at r = 0.5 at least one
    chunk whole, then windows of tokens, about half the tokens in all."""
    lengths = sorted(b - a for a, b in load_cache(session.store, chunk_ids, session.model).spans)
    got = session.query(QUESTION, chunks=chunk_ids, method="legolink", max_new_tokens=2)
    assert got.recompute_ratio == 1.0 and got.recomputed_tokens == sum(min(32, n) for n in lengths)
    got = session.query(QUESTION, chunks=chunk_ids, method="chunkflow", recompute_ratio=0.5, max_new_tokens=2)
    assert lengths[0] <= got.recomputed_tokens <= round(0.5 * sum(lengths)) + 2 * 8  # a whole chunk; windows of 8


def test_the_coverage_gate_raises_the_ratio_until_the_chosen_tokens_hold_the_share_asked():
    """Attention spread over the context: at r = 0.1 the top tokens hold little of it, so the gate raises the
    ratio in quarters of 0.1 until they hold the share asked, never past twice the ratio; attention on a few
    tokens needs nothing more."""
    from sparsecache.query.methods import get

    ctx = _chunked(5, [50, 50])
    flat = torch.ones(105)
    spec = get("infoflow")
    assert len(spec.pick(flat, ctx, QueryConfig("infoflow", 0.1, group_window=1))) == 10
    assert len(spec.pick(flat, ctx, QueryConfig("infoflow", 0.1, group_window=1, gate_coverage=0.15))) == 15
    assert len(spec.pick(flat, ctx, QueryConfig("infoflow", 0.1, group_window=1, gate_coverage=0.9))) == 20  # capped
    sharp = torch.zeros(105)
    sharp[[20, 30, 90]] = 1.0
    assert len(spec.pick(sharp, ctx, QueryConfig("infoflow", 0.1, group_window=1, gate_coverage=0.9))) == 10
    chunks = get("chunkflow").pick(flat, ctx, QueryConfig("chunkflow", 0.3, group_window=1, gate_coverage=0.6))
    assert len(chunks) == 60  # 0.3 -> 0.6 of the tokens: a whole chunk, then tokens


def test_the_margin_gate_prefills_where_the_first_token_is_unsure(session, chunk_ids):
    """Through `Session.query`: a margin no first token reaches escalates every query to full prefill of the
    same chunks (its logits, the answer marked, the TTFT counting the blend and the prefill); a margin of 0
    escalates none."""
    full = session.query(QUESTION, chunks=chunk_ids, method="full", max_new_tokens=2)
    gated = session.query(QUESTION, chunks=chunk_ids, method="infoflow", recompute_ratio=0.1, gate_margin=1e9,
                          max_new_tokens=2)
    assert gated.escalated and gated.to_dict()["escalated"] and gated.answer == full.answer
    torch.testing.assert_close(gated.logits, full.logits, atol=2e-5, rtol=1e-5)
    assert gated.timings_ms["recompute"] > 0 and gated.timings_ms["prefill"] > 0
    plain = session.query(QUESTION, chunks=chunk_ids, method="infoflow", recompute_ratio=0.1, gate_margin=0.0,
                          max_new_tokens=2)
    assert not plain.escalated and "escalated" not in plain.to_dict()


def test_the_gates_are_validated():
    with pytest.raises(ConfigError, match="gate-coverage must be in"):
        QueryConfig(gate_coverage=0.0)
    with pytest.raises(ConfigError, match="recomputes no tokens"):
        QueryConfig("none", gate_coverage=0.5)
    with pytest.raises(ConfigError, match="gate-margin must be >= 0"):
        QueryConfig(gate_margin=-1.0)
    with pytest.raises(ConfigError, match="is full prefill"):
        QueryConfig("full", gate_margin=1.0)


def test_config_is_validated():
    with pytest.raises(ConfigError, match="--method"):
        QueryConfig("magic")
    with pytest.raises(ConfigError, match="recompute-ratio"):
        QueryConfig("a3", 1.5)
    with pytest.raises(ConfigError, match="group-min"):
        QueryConfig("a3", 0.1, 4, 5)
    with pytest.raises(ConfigError, match="--order"):
        QueryConfig(order="sideways")
    with pytest.raises(ConfigError, match="applies to --method cacheclip, not a3"):
        QueryConfig("a3", selector_layers=2)
    with pytest.raises(ConfigError, match="--selector-layers must be >= 1"):
        QueryConfig("cacheclip", selector_layers=0)
    with pytest.raises(ConfigError, match="--cake-split applies to --method cake"):
        QueryConfig("none", cake_split=1)
    with pytest.raises(ConfigError, match="--reorder attention lays out decoded chunks"):
        QueryConfig("full", reorder="attention")
    assert QueryConfig("a3", 0.1, 1, 5).group_window == 1  # grouping off: M is ignored
    assert QueryConfig("infoflow").layer(30) == 22 and QueryConfig("a3").layer(30) == 1


def test_reordered_context_at_ratio_one_is_full_prefill_of_the_new_order(session, chunk_ids):
    """InfoFlow's reordering only changes the layout: with every chunk token recomputed, the
    answer is full prefill of the chunks in the order it chose."""
    got = session.query(QUESTION, chunks=chunk_ids, method="infoflow", recompute_ratio=1.0, reorder="attention",
                        max_new_tokens=1)
    assert sorted(got.context_ids) == sorted(chunk_ids)
    full = session.query(QUESTION, chunks=got.context_ids, method="full", order="given", max_new_tokens=1)
    torch.testing.assert_close(got.logits, full.logits, atol=2e-4, rtol=1e-4)


def test_attention_order_does_not_depend_on_the_retrieval_order(session, chunk_ids, tiny_model):
    """Each chunk is scored alone at the same positions: the order it picks is the same
    whatever order retrieval handed the chunks in."""
    from sparsecache.query.blend import attention_order, decode_chunks
    from sparsecache.query.methods.base import infoflow_layer
    from sparsecache.stopwatch import Stopwatch

    q = question_ids(tiny_model, QUESTION)
    layer = infoflow_layer(tiny_model.n_layers)
    picked = []
    for ids in (chunk_ids, chunk_ids[::-1]):
        chunks = decode_chunks(session.store, ids, "cpu", Stopwatch("cpu"))
        picked.append(chunks.reordered(attention_order(chunks, q, tiny_model, layer, 0.15)).ids)
    assert picked[0] == picked[1]


def test_cake_is_full_prefill_when_it_computes_everything_and_none_when_it_computes_nothing(session, chunk_ids):
    """Cake's computing thread prefills leading chunks exactly; its loader places decoded
    codes after them. Both ends of the split are methods already tested."""
    full = session.query(QUESTION, chunks=chunk_ids, method="full", max_new_tokens=1)
    none = session.query(QUESTION, chunks=chunk_ids, method="none", max_new_tokens=1)
    all_computed = session.query(QUESTION, chunks=chunk_ids, method="cake", cake_split=len(chunk_ids), max_new_tokens=1)
    torch.testing.assert_close(all_computed.logits, full.logits, atol=2e-4, rtol=1e-4)
    assert all_computed.recomputed_tokens == full.context_tokens - len(session.store.prefix()[0])
    nothing = session.query(QUESTION, chunks=chunk_ids, method="cake", cake_split=0, max_new_tokens=1)
    torch.testing.assert_close(nothing.logits, none.logits, atol=1e-5, rtol=1e-5)
    assert nothing.recomputed_tokens == 0


def test_cake_two_threads_meet_and_cover_every_chunk(session, chunk_ids):
    """Left to meet on their own, the threads split the chunks somewhere; the result is the
    fixed split at that point, whichever it was."""
    from sparsecache.query.overlap import Rates

    session.rates = Rates()  # nothing measured yet: no closed form to follow
    free = session.query(QUESTION, chunks=chunk_ids, method="cake", max_new_tokens=1)
    lengths = [session.store.chunk(c).token_length for c in free.context_ids]  # in context order
    computed = next(n for n in range(len(chunk_ids) + 1) if sum(lengths[:n]) == free.recomputed_tokens)
    fixed = session.query(QUESTION, chunks=chunk_ids, method="cake", cake_split=computed, max_new_tokens=1)
    torch.testing.assert_close(free.logits, fixed.logits, atol=1e-5, rtol=1e-5)
    assert free.context_tokens == fixed.context_tokens


def test_cake_reports_a_failed_load_in_the_callers_thread(session, chunk_ids, monkeypatch):
    from sparsecache.errors import StoreCorrupt

    def broken(*args, **kwargs):
        raise StoreCorrupt("chunk unreadable")

    monkeypatch.setattr(session.store, "read_codes", broken)
    with pytest.raises(StoreCorrupt, match="chunk unreadable"):
        session.query(QUESTION, chunks=chunk_ids, method="cake", cake_split=0, max_new_tokens=1)


def test_the_closed_form_cake_split_balances_decode_against_prefill():
    from sparsecache.query.overlap import cake_split

    # our loop: compute N while S - N load, so N / r_p = (S - N) / r_d
    assert cake_split(1000, decode_tokens_per_s=9000, prefill_tokens_per_s=1000) == 100
    assert cake_split(1000, 1e9, 1) == 0 and cake_split(1000, 1, 1e9) == 1000


def test_selector_scores_are_the_truncated_models_own_attention(session, chunk_ids, tiny_model):
    """CacheClip's selector: full prefill of context + question through the first n layers;
    its scores are the question's eager attention weights at layer n-1 of that prefill."""
    from sparsecache.query.blend import selector_scores

    ctx = load_cache(session.store, chunk_ids, tiny_model)
    q = question_ids(tiny_model, QUESTION)
    S = ctx.length
    tiny_model.hf.set_attn_implementation("eager")
    try:
        ids = torch.cat([ctx.token_ids, torch.tensor(q)])[None]
        attn = tiny_model.hf(input_ids=ids, output_attentions=True).attentions
    finally:
        tiny_model.hf.set_attn_implementation("sdpa")
    for n in (1, 2):
        want = attn[n - 1][0, :, S:, :S].sum((0, 1))
        torch.testing.assert_close(selector_scores(ctx, q, tiny_model, n), want, atol=1e-4, rtol=1e-4)


def test_cacheclip_recomputing_everything_is_full_prefill(session, chunk_ids):
    full = first_logits(session, chunk_ids, "full")
    got = first_logits(session, chunk_ids, "cacheclip", 1.0, selector_layers=2)
    torch.testing.assert_close(got, full, atol=2e-4, rtol=1e-4)


def test_a_selector_with_another_tokenizer_is_one_clear_error(session, chunk_ids, tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<not-in-the-main-vocabulary>"])
    tok.save_pretrained(other)
    with pytest.raises(ConfigError, match="tokenizer differs"):
        first_logits(session, chunk_ids, "cacheclip", 0.2, selector_model=str(other))
    assert first_logits(session, chunk_ids, "cacheclip", 0.2, selector_model=str(tiny_model_dir)).isfinite().all()


def test_cake_splits_by_the_closed_form_once_the_session_has_measured_its_rates(session, chunk_ids):
    """A `none` query measures decoding and a `full` one prefill; cake's default split is then
    the closed form's, the most leading chunks whose tokens fit in N* = S·r_p / (r_p + r_d)."""
    from sparsecache.query.overlap import Rates

    session.rates = Rates()
    session.query(QUESTION, chunks=chunk_ids, method="none", max_new_tokens=1)
    session.query(QUESTION, chunks=chunk_ids, method="full", max_new_tokens=1)
    assert session.rates.decode_tokens_per_s > 0 and session.rates.prefill_tokens_per_s > 0
    session.rates = Rates(decode_tokens_per_s=1_000.0, prefill_tokens_per_s=1_000.0)  # N* = half the tokens
    a = session.query(QUESTION, chunks=chunk_ids, method="cake", max_new_tokens=1)
    lengths = [session.store.chunk(c).token_length for c in a.context_ids]
    assert a.recomputed_tokens == sum(lengths[: session.rates.split(lengths)])
    assert 0 < a.recomputed_tokens < sum(lengths)


@pytest.mark.parametrize("method", ["none", "infoflow"])
def test_a_bfloat16_session_answers_from_the_same_store_close_to_float32(session, chunk_ids, tiny_model_dir, method):
    """`--dtype bfloat16` (the GPU's default): decoded K/V, recomputation and prefill in bf16,
    each method's first logits within bf16's rounding of float32's, and recomputing everything
    is still full prefill (of the bf16 model)."""
    half = Session(session.store, str(tiny_model_dir), dtype="bfloat16")
    half._embedder = session._embedder
    assert half.model.dtype == torch.bfloat16 and session.model.dtype == torch.float32
    ratio = 0.3 if method != "none" else 0.0
    got, want = (first_logits(s, chunk_ids, method, ratio) for s in (half, session))
    assert got.dtype == torch.float32
    scale = want.abs().max()
    assert (got - want).abs().max() < 0.05 * scale
    if method != "none":
        torch.testing.assert_close(first_logits(half, chunk_ids, method, 1.0), first_logits(half, chunk_ids, "full"),
                                   atol=0.02 * float(scale), rtol=0.02)


def test_contexts_blended_together_get_what_each_gets_alone(session, chunk_ids, tiny_model):
    """What a serving engine does with the requests one step admits: their questions scored in one
    run through the layers, their selected tokens recomputed in one run (`stack.Batch`), each
    attending over its own cache. Each gets the selection and the cache it gets alone."""
    from sparsecache.model.cache import recompute_many
    from sparsecache.query.methods.base import choose_many

    cases = [(chunk_ids, QUESTION, QueryConfig(method="infoflow", recompute_ratio=0.3)),
             (chunk_ids[:2], "Why would one use it?", QueryConfig(method="a3", recompute_ratio=0.2)),
             (chunk_ids[1:], QUESTION, QueryConfig(method="infoflow", recompute_ratio=0.5)),
             (chunk_ids[::-1], QUESTION, QueryConfig(method="cacheblend", recompute_ratio=0.3))]
    qs = [question_ids(tiny_model, q) for _, q, _ in cases]
    alone = []
    for (ids, _, cfg), q in zip(cases, qs):
        ctx = load_cache(session.store, ids, tiny_model)
        positions = cfg.spec.choose(ctx, q, cfg, tiny_model)
        recompute(ctx, positions, tiny_model)
        alone.append((ctx, positions))
    ctxs = [load_cache(session.store, ids, tiny_model) for ids, _, _ in cases]
    together = choose_many(ctxs, qs, [cfg for _, _, cfg in cases], tiny_model)
    recompute_many(ctxs, together, tiny_model)
    for (want, want_pos), got, got_pos in zip(alone, ctxs, together):
        assert torch.equal(got_pos, want_pos) and got_pos.numel() > 0
        for a, b in zip(got.cache.layers, want.cache.layers):
            assert a.keys.shape == b.keys.shape  # the questions' K/V did not stay behind
            torch.testing.assert_close(a.keys, b.keys, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(a.values, b.values, atol=2e-5, rtol=1e-5)


def test_layer_0_comes_from_the_tokens_exactly(session, chunk_ids, tiny_model):
    """Layer 0's pre-RoPE K/V are a function of the token alone: a reader recomputes them from the
    stored tokens (`first_layer` "tokens", the default) and gets exactly what the encode captured,
    where the codes were lossy; every other layer is the codes' decode, untouched."""
    from sparsecache.model import extract_kv
    from sparsecache.query.blend import decode_chunks
    from sparsecache.stopwatch import Stopwatch

    store = session.store
    coded = decode_chunks(store, chunk_ids, "cpu", Stopwatch("cpu"))
    restored = decode_chunks(store, chunk_ids, "cpu", Stopwatch("cpu"), tiny_model)
    exact = extract_kv(tiny_model, store.tokens(chunk_ids), store.encoded_after())
    for (ck, cv), (rk, rv), (ek, ev) in zip(coded.kv, restored.kv, exact):
        torch.testing.assert_close(rk[0], ek[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rv[0], ev[0], atol=1e-5, rtol=1e-5)
        assert (ck[0] - ek[0]).abs().max() > 1e-2  # the tiny random dictionary's codes are far off there
        assert torch.equal(rk[1:], ck[1:]) and torch.equal(rv[1:], cv[1:])


def test_first_layer_is_a_query_setting(session, chunk_ids):
    """The default reads layer 0 from the tokens; `first_layer="codes"` reads the codes as before,
    and gives other logits on a lossy dictionary; anything else is refused."""
    assert QueryConfig().first_layer == "tokens"
    tokens = first_logits(session, chunk_ids, "none")
    codes = first_logits(session, chunk_ids, "none", first_layer="codes")
    assert not torch.allclose(tokens, codes, atol=1e-3)
    torch.testing.assert_close(first_logits(session, chunk_ids, "none", first_layer="tokens"), tokens)
    with pytest.raises(ConfigError, match="first_layer"):
        QueryConfig(first_layer="exact")


def test_a_blend_over_exact_kv_isolates_the_codecs_loss(session, chunk_ids):
    """`source="raw"`: the same method over each chunk's exact fp16 K/V. With nothing recomputed it is the
    `raw` baseline; recomputing everything is full prefill whichever K/V it started from; and it is
    refused where a method does not read per-chunk K/V."""
    session.raw_files(chunk_ids)
    full = first_logits(session, chunk_ids, "full")
    raw = first_logits(session, chunk_ids, "raw")
    torch.testing.assert_close(first_logits(session, chunk_ids, "none", source="raw"), raw, atol=1e-4, rtol=0)
    assert (first_logits(session, chunk_ids, "none") - raw).abs().max() > 1e-3  # the codes differ: not vacuous
    exact = first_logits(session, chunk_ids, "a3", 1.0, group_window=1, source="raw")
    torch.testing.assert_close(exact, full, atol=2e-5, rtol=1e-5)
    partial = session.query(QUESTION, chunks=chunk_ids, method="infoflow", recompute_ratio=0.25, source="raw",
                            max_new_tokens=1, prefill_under=0)
    assert partial.recomputed_tokens > 0 and partial.bytes_read > 0
    for bad in (dict(method="cake", source="raw"), dict(method="superposition", source="raw"),
                dict(method="none", source="fp8")):
        with pytest.raises(ConfigError, match="source"):
            QueryConfig(**bad)
