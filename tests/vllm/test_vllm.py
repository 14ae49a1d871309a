"""vLLM serving RAG prompts through SparsecacheConnector, on the real default model (CPU build of vLLM).

One in-process engine serves every test here (building one costs ~20 s); requests choose the
KV source (exact per-chunk raw files or the store's codes) through their kv_transfer_params.
The connector's counters (vLLM's Prometheus metrics) show whether a request was served from
the store or fell back to prefill, so an equality can never pass by a silent fallback.
"""


import pytest
import torch
from click.testing import CliRunner

from sparsecache.vllm.serving import PARAMS_KEY as PARAMS
from support.engine import counters, engine, generate, with_source

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

QUESTIONS = ("What does this statement do?", "Give one example of its use.")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from pydoc_data.topics import topics

    from sparsecache.cli.main import cli
    from sparsecache.query.session import Session

    root = tmp_path_factory.mktemp("vllm")
    (root / "corpus").mkdir()
    for t in ("assert", "break", "continue", "pass"):
        (root / "corpus" / f"{t}.txt").write_text(topics[t][:1200])
    # plain chunks: the equalities below are with vLLM's prefill of the chunks' own tokens (a store with
    # the default wrapper is served in test_serve.py, and one vLLM can prefill itself in test_vllm_wrapped.py)
    r = CliRunner().invoke(cli, ["encode-corpus", str(root / "corpus"), "--store", str(root / "store"), "--wrapper",
                                 "none"])
    assert r.exit_code == 0, r.output
    session = Session(root / "store")
    session.raw_files([c.id for c in session.store.chunks()])  # exact KV per chunk, beside the store
    return session


@pytest.fixture(scope="module")
def rag(store):
    from sparsecache.vllm.serving import RagPrompts

    return RagPrompts(store.store)


@pytest.fixture(scope="module")
def llm(store):
    from sparsecache.model.gguf import default_model_dir

    with engine(default_model_dir(), store.store.root) as llm:
        yield llm


def test_one_chunk_of_exact_kv_equals_vllm_full_prefill(llm, store, rag):
    """A chunk's KV is computed after the prefix alone, so with one chunk it is the KV full prefill
    makes: injecting it must give vLLM's own greedy answer, token for token (layout, positions, slots)."""
    for chunk in store.store.chunks():
        for q in QUESTIONS:
            req = rag.request(q, chunks=[chunk.id])
            injected, lp_injected, delta = generate(llm, req, with_source(req, "raw"))
            full, lp_full, _ = generate(llm, req, None)
            assert delta["tokens"] == req.context_tokens and delta["fallbacks"] == 0
            assert injected == full, (chunk.id, q)
            for t in lp_full:  # fp16 raw files against fp32 prefill
                assert abs(lp_injected[t] - lp_full[t]) < 2e-2


@pytest.mark.parametrize("source, method", [("raw", "raw"), ("codes", "none")])
def test_several_chunks_match_sparsecaches_own_loop(llm, store, rag, source, method):
    ids = [c.id for c in store.store.chunks()]
    for q in QUESTIONS:
        ours = store.query(q, chunks=ids, method=method, max_new_tokens=12, prefill_under=0)
        req = rag.request(q, chunks=ids)
        tokens, first, delta = generate(llm, req, with_source(req, source), max_tokens=12)
        assert delta["chunks"] == len(ids) and delta["fallbacks"] == 0
        logprobs = torch.log_softmax(ours.logits, -1)
        for t, lp in first.items():
            assert abs(lp - float(logprobs[t])) < 2e-3, (t, lp, float(logprobs[t]))
        assert store.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer


# ------------------------------------------------------------------ blending in the connector


def test_recomputing_every_chunk_token_is_vllms_own_prefill(llm, store, rag):
    """Ratio 1.0: the connector runs every chunk token through vLLM's own layers at its global
    position over the whole context: that is vLLM's full prefill, token for token."""
    ids = [c.id for c in store.store.chunks()]
    for chunks in (ids, ids[1:3], ids[::-1]):
        for q in QUESTIONS:
            req = rag.request(q, chunks=chunks)
            tokens, first, delta = generate(llm, req, with_source(req, "codes", method="infoflow", recompute_ratio=1.0))
            full, lp_full, _ = generate(llm, req, None)
            chunk_tokens = req.context_tokens - len(store.store.prefix()[0])
            assert delta["recomputed"] == chunk_tokens and delta["fallbacks"] == delta["load_errors"] == 0
            assert tokens == full, (chunks, q)
            for t in lp_full:  # only the prefix's KV comes from the store (computed by transformers)
                assert abs(first[t] - lp_full[t]) < 1e-3, (t, first[t], lp_full[t])


def test_blending_runs_on_the_engines_own_model(llm):
    """No second copy: the stack the connector blends on is the model vLLM serves with."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    stack = get_kv_transfer_group().stack
    assert stack is not None and llm.apply_model(id) == [id(stack.model)]


def test_a_model_blending_cannot_drive_is_refused_at_start_up_with_one_line(llm, monkeypatch):
    """No plugin (the model never seen loading) or a model without the decoder-stack shape:
    the worker says why once and serves `none` (the scheduler's claims stay valid)."""
    import types

    import sparsecache.vllm.connector as connector

    said = []
    monkeypatch.setattr(connector.logger, "warning", lambda msg, *a: said.append(msg % a))
    config = types.SimpleNamespace(model_config=object())
    monkeypatch.setattr(connector, "loaded_model", lambda model_config: None)
    assert connector.SparsecacheConnector._stack(None, config) is None
    monkeypatch.setattr(connector, "loaded_model", lambda model_config: torch.nn.Linear(2, 2))
    assert connector.SparsecacheConnector._stack(None, config) is None
    assert len(said) == 2 and "entry point" in said[0] and "decoder stack" in said[1], said


@pytest.fixture
def chosen(monkeypatch):
    """Positions each engine's blending selected, in call order: {"vllm": [...], "query": [...]}."""
    import sparsecache.query.methods.base as methods_base
    import sparsecache.vllm.connector as connector

    seen = {"vllm": [], "query": []}
    choose_many, fuse = methods_base.choose_many, methods_base.Decoded.fuse

    def engine(*args, **kwargs):  # the connector's, for the step's requests
        positions = choose_many(*args, **kwargs)
        seen["vllm"].extend(p.tolist() for p in positions)
        return positions

    def query(*args, **kwargs):  # sparsecache query's fusion (a method: self first): (logits, positions)
        logits, positions = fuse(*args, **kwargs)
        seen["query"].append(positions.tolist())
        return logits, positions

    monkeypatch.setattr(connector, "choose_many", engine)
    monkeypatch.setattr(methods_base.Decoded, "fuse", query)
    return seen


@pytest.mark.parametrize("method, ratio", [("a3", 0.15), ("infoflow", 0.15), ("cacheblend", 0.15), ("cacheclip", 0.15),
                                           ("chunkflow", 0.4), ("legolink", 0.15)])  # chunkflow: whole chunks
def test_each_method_selects_what_query_selects(llm, store, rag, chosen, method, ratio):
    """One implementation: the connector's blend on vLLM's layers and `query`'s on transformers'
    select the same tokens for the same chunks and question, and answer alike."""
    ids = [c.id for c in store.store.chunks()]
    for q in QUESTIONS:
        ours = store.query(q, chunks=ids, method=method, recompute_ratio=ratio, max_new_tokens=12, prefill_under=0)
        req = rag.request(q, chunks=ids)
        tokens, first, delta = generate(llm, req, with_source(req, "codes", method=method, recompute_ratio=ratio),
                                        max_tokens=12)
        assert chosen["vllm"][-1] == chosen["query"][-1] and delta["recomputed"] == ours.recomputed_tokens > 0
        logprobs = torch.log_softmax(ours.logits, -1)
        for t, lp in first.items():
            assert abs(lp - float(logprobs[t])) < 2e-3, (t, lp, float(logprobs[t]))
        assert store.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer


def test_a_ttft_budget_buys_the_ratio_query_buys(llm, store, rag):
    """`ttft_budget` without a ratio: the connector sets the ratio at the request's context length from
    the same cost model as `query` (here the CPU's shipped constants for this model: no calibration),
    so both recompute the same tokens, more than the method's own ratio would."""
    from sparsecache.query.config import QueryConfig

    ids = [c.id for c in store.store.chunks()]
    ours = store.query(QUESTIONS[0], chunks=ids, method="infoflow", ttft_budget=0.5, max_new_tokens=12,
                       prefill_under=0)
    assert ours.recompute_ratio > QueryConfig(method="infoflow").ratio
    req = rag.request(QUESTIONS[0], chunks=ids)
    tokens, _, delta = generate(llm, req, with_source(req, "codes", method="infoflow", ttft_budget=0.5), max_tokens=12)
    assert delta["recomputed"] == ours.recomputed_tokens > 0 and delta["fallbacks"] == 0
    assert store.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer


def test_a_blend_that_fails_after_the_claim_is_recomputed_by_vllm(llm, store, rag, monkeypatch):
    import sparsecache.vllm.connector as connector

    req = rag.request(QUESTIONS[0], chunks=[c.id for c in store.store.chunks()][:3])
    full, _, _ = generate(llm, req, None)

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in the recomputation")

    monkeypatch.setattr(connector, "recompute_many", broken)
    tokens, _, delta = generate(llm, req, with_source(req, "codes", method="infoflow"))
    assert delta["load_errors"] > 0 and delta["tokens"] == 0 and tokens == full


def test_concurrent_requests_in_one_step_each_get_their_own_blend(llm, store, rag):
    """Continuous batching: requests with different chunks and methods share engine steps;
    each answers as it does alone."""
    from vllm import SamplingParams

    ids = [c.id for c in store.store.chunks()]
    cases = [(QUESTIONS[0], ids, "infoflow"), (QUESTIONS[1], ids[:2], "a3"), (QUESTIONS[0], ids[2:], "none"),
             (QUESTIONS[1], ids[::-1], "cacheblend")]
    reqs = [rag.request(q, chunks=c) for q, c, _ in cases]
    params = [with_source(r, "codes", method=m) for r, (_, _, m) in zip(reqs, cases)]
    alone = [generate(llm, r, p) for r, p in zip(reqs, params)]
    before = counters(llm)
    outs = llm.generate([r.vllm_prompt() for r in reqs],
                        [SamplingParams(max_tokens=16, temperature=0, logprobs=5, extra_args={"kv_transfer_params": p})
                         for p in params], use_tqdm=False)
    after = counters(llm)
    assert after["requests"] - before["requests"] == len(cases) and after["fallbacks"] == before.get("fallbacks", 0)
    for out, (tokens, first, _) in zip(outs, alone):
        got = out.outputs[0]
        assert list(got.token_ids) == tokens
        assert all(abs(got.logprobs[0][t].logprob - first[t]) < 1e-4 for t in first if t in got.logprobs[0])


def test_a_context_under_the_cheap_threshold_is_left_to_vllms_prefill(llm, store, rag):
    """On defaults (no prefill_under anywhere) two chunks (~400 tokens) are over the CPU's cheap
    threshold for the default method (`query.cheap`): the connector loads them. A request whose
    prefill_under is above its context is left to vLLM's prefill, counted, and its answer is
    vLLM's own full prefill's."""
    from sparsecache.query.config import DEFAULT_METHOD, QueryConfig

    req = rag.request(QUESTIONS[0], chunks=[c.id for c in store.store.chunks()][:2])
    context = req.context_tokens - len(store.store.prefix()[0])
    assert context >= store.prefill_under(QueryConfig(method=DEFAULT_METHOD))  # the connector's rule is query's
    full, _, _ = generate(llm, req, None)
    _, _, delta = generate(llm, req, req.kv_transfer_params)
    assert delta["prefilled_cheap"] == 0 and delta["tokens"] > 0 and delta["fallbacks"] == 0
    tokens, _, delta = generate(llm, req, with_source(req, "codes", method=DEFAULT_METHOD, prefill_under=context + 1))
    assert delta["prefilled_cheap"] == 1 and delta["tokens"] == 0 and delta["fallbacks"] == 0 and tokens == full


def test_blending_options_are_checked_per_request(llm, store, rag):
    req = rag.request(QUESTIONS[0], chunks=[c.id for c in store.store.chunks()][:2])
    full, _, _ = generate(llm, req, None)
    for bad in ({"method": "cake"}, {"method": "infoflow", "recompute_ratio": 2}, {"method": "nope"}):
        tokens, _, delta = generate(llm, req, with_source(req, "codes", **bad))
        assert delta["fallbacks"] == 1 and delta["tokens"] == 0 and tokens == full, bad


def test_a_mismatched_or_broken_request_is_prefilled_and_answered_correctly(llm, store, rag):
    ids = [c.id for c in store.store.chunks()]
    req = rag.request(QUESTIONS[0], chunks=ids[:2])
    full, _, _ = generate(llm, req, None)
    wrong_order = {"sparsecache": {"chunks": req.kv_transfer_params["sparsecache"]["chunks"][::-1]}}
    unknown = {"sparsecache": {"chunks": ids[:1] + ["no-such-chunk"]}}
    malformed = {"sparsecache": {"chunks": "not a list"}}
    for params in (wrong_order, unknown, malformed):
        tokens, _, delta = generate(llm, req, params)
        assert delta["fallbacks"] == 1 and delta["tokens"] == 0, params
        assert tokens == full, params
    edited = type(req)(list(req.prompt_token_ids), req.kv_transfer_params, req.chunks, req.context_tokens)
    edited.prompt_token_ids[req.context_tokens - 5] += 1  # one token of the last chunk differs
    tokens, _, delta = generate(llm, edited, req.kv_transfer_params)
    assert delta["fallbacks"] == 1 and tokens == generate(llm, edited, None)[0]


def test_a_store_damaged_after_the_claim_is_recomputed_by_vllm(llm, store, rag):
    """The scheduler checks tokens (intact), then the worker finds the codes' files fail their
    checksum: the blocks are reported, vLLM recomputes them, and the answer is full prefill's."""
    ids = [c.id for c in store.store.chunks()]
    req = rag.request(QUESTIONS[1], chunks=ids[:2])
    full, _, _ = generate(llm, req, None)
    files = [f for f in (store.store.root / store.store.data / "k_indices").rglob("*") if f.is_file()]
    saved = {f: f.read_bytes() for f in files}
    # the worker holds the codes earlier tests read (intact) in memory and would serve them from
    # there, as it does through an outage: drop them, so that the damaged files are what it reads
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    from sparsecache.store.reader import span_cache

    span_cache(get_kv_transfer_group()._backend).clear()
    try:
        for f in files:
            f.write_bytes(b"garbage" + saved[f][7:])
        damaged = [generate(llm, req, with_source(req, "codes", method=m)) for m in ("none", "infoflow")]
    finally:
        for f, data in saved.items():
            f.write_bytes(data)
    for tokens, _, delta in damaged:  # loaded as stored, and blended
        assert delta["load_errors"] > 0 and delta["tokens"] == 0
        assert tokens == full
    assert generate(llm, req, with_source(req, "codes"))[2]["tokens"] == req.context_tokens  # repaired: served again


def test_rag_prompts_lay_out_prefix_chunks_question(store, rag):
    from sparsecache.model.generate import question_ids

    ids = [c.id for c in store.store.chunks()][:3]
    req = rag.request("why?", chunks=ids, order="given")
    expected = store.store.prefix()[0] + [t for toks in store.store.tokens(ids) for t in toks]
    assert req.prompt_token_ids == expected + question_ids(store.model, "why?")
    assert req.context_tokens == len(expected)
    assert req.kv_transfer_params == {"sparsecache": {"chunks": ids, "version": store.store.version}}
    assert rag.request("why?", chunks=ids).kv_transfer_params["sparsecache"]["chunks"] == ids[::-1]  # query's default
    hits = rag.request("What does pass do?", top_k=2)
    assert len(hits.chunks) == 2 and hits.kv_transfer_params["sparsecache"]["chunks"] == [h["id"] for h in hits.chunks]


def test_rag_prompts_refuse_a_store_of_another_model(store, tiny_model_dir):
    from sparsecache.errors import DictionaryMismatch
    from sparsecache.vllm.serving import RagPrompts

    with pytest.raises(DictionaryMismatch, match="encoded with model"):
        RagPrompts(store.store, model=str(tiny_model_dir))


def test_a_new_version_is_followed_and_stale_chunks_fall_back(llm, store, rag):
    """Runs last: it re-encodes the store under the running engine. A request laid out from the
    old version is still served from it (its chunks' KV matches its tokens); without a version,
    a chunk the new version no longer has is prefilled; one built against the new version is served."""
    from sparsecache.cli.main import cli
    from sparsecache.vllm.serving import RagPrompts

    corpus = store.store.root.parent / "corpus"
    edited = next(c.id for c in store.store.chunks() if "assert" in c.doc_id)
    other = next(c.id for c in store.store.chunks() if "assert" not in c.doc_id)
    stale = rag.request(QUESTIONS[0], chunks=[other, edited])
    (corpus / "assert.txt").write_text((corpus / "assert.txt").read_text() + "\nAn edit after publishing.")
    r = CliRunner().invoke(cli, ["encode-corpus", str(corpus), "--store", str(store.store.root)])
    assert r.exit_code == 0, r.output
    fresh_rag = RagPrompts(store.store.root)
    assert fresh_rag.store.version > store.store.version
    no_cheap = {PARAMS: {**stale.kv_transfer_params[PARAMS], "prefill_under": 0}}  # two short chunks: the load path
    pinned = generate(llm, stale, no_cheap)[2]
    assert pinned["tokens"] == stale.context_tokens and not pinned.get("fallbacks")
    unpinned = {PARAMS: {k: v for k, v in stale.kv_transfer_params[PARAMS].items() if k != "version"}}
    tokens, _, delta = generate(llm, stale, unpinned)
    assert delta["fallbacks"] == 1 and tokens == generate(llm, stale, None)[0]
    gone = {PARAMS: {**stale.kv_transfer_params[PARAMS], "version": 10 ** 6}}
    assert generate(llm, stale, gone)[2]["fallbacks"] == 1
    fresh = fresh_rag.request(QUESTIONS[0], chunks=[c.id for c in fresh_rag.store.chunks()][:2])
    fresh_params = {PARAMS: {**fresh.kv_transfer_params[PARAMS], "prefill_under": 0}}
    assert generate(llm, fresh, fresh_params)[2]["tokens"] == fresh.context_tokens
