"""The query-method registry: every part reads it, and a method is one module."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecache import methods
from sparsecache.errors import ConfigError
from sparsecache.query_config import METHODS, SCORERS, QueryConfig
from test_blend import QUESTION, chunk_ids, session  # noqa: F401  (fixtures)


def test_the_registry_holds_every_method_once_in_the_clis_order():
    assert METHODS == methods.names() == ("none", "a3", "infoflow", "cacheblend", "cacheclip", "cake", "full", "raw",
                                          "superposition", "superposition-ensemble")
    assert SCORERS == ("a3", "infoflow", "cacheblend", "cacheclip", "superposition")
    assert methods.names(connector=True) == ("none", "a3", "infoflow", "cacheblend", "cacheclip")
    assert [m.name for m in methods.REGISTRY.values()] == list(methods.REGISTRY)
    with pytest.raises(ValueError, match="registered twice"):
        methods.register(methods.get("none"))
    with pytest.raises(KeyError, match="one of none, a3"):
        methods.get("magic")


def test_the_benchmarks_tables_and_the_cli_read_the_registry():
    from click.testing import CliRunner

    from sparsecache.bench.ruler import METHODS as RULER
    from sparsecache.bench.suite import TTFT_METHODS
    from sparsecache.cli.main import cli

    assert list(RULER)[:2] == ["full", "raw"] and set(METHODS) <= set(RULER)
    assert RULER["infoflow"] == {"method": "infoflow", "recompute_ratio": 0.15} and RULER["none"] == {"method": "none"}
    assert [m for m, _ in TTFT_METHODS] == ["full", "raw", "none", "a3", "infoflow", "cacheblend", "cake"]
    out = CliRunner().invoke(cli, ["query", "--help"], terminal_width=200).output
    for m in methods.REGISTRY.values():
        assert m.name in out
    assert "superposition prompting; the default" in " ".join(out.split())


def test_the_default_is_the_rules_choice_and_a_method_named_alone_keeps_its_own_ratio():
    """#51's rule chose superposition with 2 paths at r = 0.5 for `query`; `serve` and the
    connector keep the best they can serve. A method named without a ratio gets its own ratio,
    also where the default config is changed into it (Session.query's dataclasses.replace)."""
    import dataclasses

    from click.testing import CliRunner

    from sparsecache.cli.main import cli
    from sparsecache.query_config import SERVE_METHOD
    from sparsecache.vllm.server import ServeConfig

    cfg = QueryConfig()
    assert (cfg.method, cfg.recompute_ratio, cfg.ratio, cfg.paths) == ("superposition", None, 0.5, None)
    assert methods.get(cfg.method).paths == 2 and cfg.recomputes
    assert dataclasses.replace(cfg, method="infoflow").ratio == 0.25
    assert QueryConfig("a3").ratio == 0.25 and QueryConfig("a3", 0.1).ratio == 0.1
    assert not QueryConfig("infoflow", 0.0).recomputes and not QueryConfig("none").recomputes
    assert SERVE_METHOD == ServeConfig.method == "infoflow" and SERVE_METHOD in methods.names(connector=True)
    query = " ".join(CliRunner().invoke(cli, ["query", "--help"], terminal_width=200).output.split())
    assert "[default: superposition]" in query and "superposition 0.5" in query and "infoflow 0.25" in query
    assert "(default 2;" in query
    serve = " ".join(CliRunner().invoke(cli, ["serve", "--help"], terminal_width=200).output.split())
    assert "[default: infoflow]" in serve and "infoflow 0.25" in serve and "superposition 0.5" not in serve


def test_importing_the_registry_loads_no_torch():
    code = "import sys, sparsecache.query_config; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr[-2000:]


def test_a_method_is_one_registered_class(session, chunk_ids):  # noqa: F811
    """A new method, registered from outside the package, is a QueryConfig choice and answers
    through Session.query like the built-in ones; the registry's dispatch runs its code."""
    from sparsecache.methods.base import Decoded

    called = []

    class FirstChunkOnly(Decoded):
        name = "first-only"
        summary = "the first chunk alone (a test's method)"

        def prefilled(self, session, ids, q_ids, cfg, watch):
            called.append(list(ids))
            return super().prefilled(session, ids[:1], q_ids, cfg, watch)

    methods.register(FirstChunkOnly())
    try:
        got = session.query(QUESTION, chunks=chunk_ids, method="first-only", order="given", max_new_tokens=1)
        alone = session.query(QUESTION, chunks=chunk_ids[:1], method="none", order="given", max_new_tokens=1)
        assert called == [chunk_ids] and got.context_ids == chunk_ids[:1] and got.method == "first-only"
        torch.testing.assert_close(got.logits, alone.logits)
        assert not QueryConfig("first-only").recomputes
        with pytest.raises(ConfigError, match="applies to --method cacheclip"):
            QueryConfig("first-only", selector_layers=2)
    finally:
        del methods.REGISTRY["first-only"]
    with pytest.raises(ConfigError, match="--method must be one of"):
        QueryConfig("first-only")


def _question_logprob(session, chunk: str, q_ids: list[int]) -> float:
    """log P(q_ids[1:] | prefix + chunk, q_ids[0]) by the model's own forward over the chunk's
    decoded cache: what superposition scores each path by."""
    from sparsecache.blend import load_cache

    ctx = load_cache(session.store, [chunk], session.model)
    m = session.model
    pos = torch.arange(ctx.length, ctx.length + len(q_ids))[None]
    with torch.inference_mode():
        out = m.hf(input_ids=torch.tensor([q_ids]), position_ids=pos, **{m.cache_arg: ctx.cache}, use_cache=True)
    logp = out.logits[0, :-1].float().log_softmax(-1)
    return float(logp.gather(-1, torch.tensor(q_ids[1:])[:, None]).sum())


def test_superposition_keeps_the_path_that_makes_the_question_likeliest(session, chunk_ids):  # noqa: F811
    """Each path is prefix + one chunk + the question, all paths in one batched run: its score
    is the model's own log-likelihood of the question there, and with one path kept the answer
    is that path's, exactly as a query of that chunk alone."""
    from sparsecache.blend import question_ids

    q_ids = question_ids(session.model, QUESTION)
    want = [_question_logprob(session, c, q_ids) for c in chunk_ids]
    best = chunk_ids[max(range(len(want)), key=want.__getitem__)]
    got = session.query(QUESTION, chunks=chunk_ids, method="superposition", paths=1, recompute_ratio=0.0,
                        max_new_tokens=4)
    alone = session.query(QUESTION, chunks=[best], method="none", max_new_tokens=4)
    assert got.context_ids == [best] and got.recomputed_tokens == 0
    torch.testing.assert_close(got.logits, alone.logits, atol=2e-4, rtol=1e-4)
    assert got.tokens == alone.tokens

    from sparsecache.methods.superposition import path_scores
    from sparsecache.blend import decode_chunks
    from sparsecache.stopwatch import Stopwatch

    scores, _ = path_scores(decode_chunks(session.store, chunk_ids, "cpu", Stopwatch("cpu")), q_ids, session.model)
    assert scores == pytest.approx(want, abs=1e-3)


def test_superposition_keeping_every_path_at_ratio_one_is_full_prefill_in_its_order(session, chunk_ids):  # noqa: F811
    got = session.query(QUESTION, chunks=chunk_ids, method="superposition", paths=len(chunk_ids),
                        recompute_ratio=1.0, max_new_tokens=1)
    assert sorted(got.context_ids) == sorted(chunk_ids)
    full = session.query(QUESTION, chunks=got.context_ids, method="full", order="given", max_new_tokens=1)
    torch.testing.assert_close(got.logits, full.logits, atol=2e-4, rtol=1e-4)
    two = session.query(QUESTION, chunks=chunk_ids, method="superposition", paths=2, recompute_ratio=0.0,
                        max_new_tokens=1)
    assert len(two.context_ids) == 2 and two.context_ids[-1] == got.context_ids[-1]  # the likeliest by the question
    with pytest.raises(ConfigError, match="--paths applies to --method superposition"):
        QueryConfig("infoflow", paths=2)


def test_chunk_starts_are_recomputed_first_and_the_budget_filled_by_score(session, chunk_ids):  # noqa: F811
    from sparsecache.blend import load_cache, question_ids
    from sparsecache.methods.base import choose

    ctx = load_cache(session.store, chunk_ids, session.model)
    q = question_ids(session.model, QUESTION)
    plain = choose(ctx, q, QueryConfig("infoflow", 0.3), session.model)
    starts = choose(ctx, q, QueryConfig("infoflow", 0.3, chunk_starts=2), session.model)
    want = {p for a, b in ctx.spans for p in range(a, min(b, a + 2))}
    assert want <= set(starts.tolist()) and not want <= set(plain.tolist())
    assert abs(starts.numel() - plain.numel()) <= 8  # the same budget (grouping rounds to windows)
    got = session.query(QUESTION, chunks=chunk_ids, method="a3", recompute_ratio=1.0, chunk_starts=4, max_new_tokens=1)
    full = session.query(QUESTION, chunks=got.context_ids, method="full", order="given", max_new_tokens=1)
    torch.testing.assert_close(got.logits, full.logits, atol=2e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match="--chunk-starts"):
        QueryConfig("none", chunk_starts=2)


def test_the_ensemble_mixes_each_kept_paths_own_answer_by_its_posterior(session, chunk_ids):  # noqa: F811
    """One path: superposition's answer. Two: the first token's distribution is the mixture of
    the two chunks' own answers weighted by P(question | path); decoding with a reference
    (teacher forcing) leaves every path's cache as it found it."""
    from sparsecache.blend import question_ids

    q_ids = question_ids(session.model, QUESTION)
    one = session.query(QUESTION, chunks=chunk_ids, method="superposition-ensemble", paths=1, max_new_tokens=4)
    sup = session.query(QUESTION, chunks=chunk_ids, method="superposition", paths=1, recompute_ratio=0.0,
                        max_new_tokens=4)
    assert one.context_ids == sup.context_ids and one.tokens == sup.tokens
    torch.testing.assert_close(one.logits, sup.logits.log_softmax(-1), atol=1e-4, rtol=1e-4)

    two = session.query(QUESTION, chunks=chunk_ids, method="superposition-ensemble", paths=2, max_new_tokens=6)
    assert len(two.context_ids) == 2 and two.recomputed_tokens == 0
    alone = [session.query(QUESTION, chunks=[c], method="none", max_new_tokens=1).logits for c in two.context_ids]
    weights = torch.tensor([_question_logprob(session, c, q_ids) for c in two.context_ids]).log_softmax(0)
    want = torch.logsumexp(torch.stack([x.log_softmax(-1) for x in alone]) + weights[:, None], 0)
    torch.testing.assert_close(two.logits, want, atol=1e-3, rtol=1e-3)
    again = session.query(QUESTION, chunks=chunk_ids, method="superposition-ensemble", paths=2, max_new_tokens=6,
                          reference=two.tokens)
    assert again.agreement == 1.0 and again.tokens == two.tokens


def test_keep_chunks_keeps_each_rows_best_chunks_by_top_token_mass():
    from sparsecache.attend import keep_chunks

    probs = torch.tensor([[0.10, 0.05, 0.05, 0.30, 0.02, 0.02, 0.01, 0.45],   # chunk 1 ([3, 5)) beats chunk 0
                          [0.10, 0.40, 0.30, 0.05, 0.05, 0.02, 0.03, 0.05]])  # chunk 0 ([1, 3)) beats the others
    spans = [(1, 3), (3, 5), (5, 7)]  # position 0 (prefix) and 7 (question) always stay
    got = keep_chunks(probs, spans, 1)
    want = probs.clone()
    want[0, [1, 2, 5, 6]] = 0
    want[1, [3, 4, 5, 6]] = 0
    torch.testing.assert_close(got, want / want.sum(-1, keepdim=True))
    assert torch.equal(keep_chunks(probs, spans, 3), probs)


def test_selective_attention_over_every_chunk_is_plain_attention(session, chunk_ids):  # noqa: F811
    """The attention function reproduces the model's own where it keeps every chunk (prefill
    and each decoding step); keeping one chunk per head changes the answer's distribution."""
    plain = session.query(QUESTION, chunks=chunk_ids, method="none", max_new_tokens=4)
    every = session.query(QUESTION, chunks=chunk_ids, method="none", attend_chunks=len(chunk_ids), max_new_tokens=4)
    torch.testing.assert_close(every.logits, plain.logits, atol=2e-4, rtol=1e-4)
    assert every.tokens == plain.tokens
    one = session.query(QUESTION, chunks=chunk_ids, method="infoflow", recompute_ratio=0.3, attend_chunks=1,
                        max_new_tokens=4, reference=plain.tokens)
    assert not torch.allclose(one.logits, plain.logits, atol=1e-3)
    again = session.query(QUESTION, chunks=chunk_ids, method="infoflow", recompute_ratio=0.3, attend_chunks=1,
                          max_new_tokens=4)
    assert one.tokens == again.tokens  # teacher forcing left the cache as it was
    with pytest.raises(ConfigError, match="--attend-chunks"):
        QueryConfig("full", attend_chunks=2)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.5, 1.5), st.floats(0.5, 1.5))
def test_ape_logits_are_apes_blockwise_merge_in_one_softmax(seed, temperature, scale):
    """APE attends to the prefix, the chunks and the question as blocks merged by their
    log-sum-exps, the chunks' logits / T and their log-sum-exp x T*S: one softmax over
    `ape_logits` gives every position that weight."""
    from sparsecache.attend import ape_logits

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, 12, generator=g) * 3
    spans = [(2, 5), (5, 9)]  # prefix [0, 2), chunks [2, 9), question [9, 12)
    blocks = {"prefix": slice(0, 2), "chunks": slice(2, 9), "question": slice(9, 12)}
    lse = {b: torch.logsumexp(logits[..., s] / (temperature if b == "chunks" else 1), -1) for b, s in blocks.items()}
    lse["chunks"] = lse["chunks"] * temperature * scale
    weight = torch.stack(list(lse.values()), -1).softmax(-1)
    want = torch.cat([weight[..., i:i + 1] * (logits[..., s] / (temperature if b == "chunks" else 1)).softmax(-1)
                      for i, (b, s) in enumerate(blocks.items())], -1)
    torch.testing.assert_close(ape_logits(logits, spans, temperature, scale).softmax(-1), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ape_logits(logits, spans, 1.0, 1.0), logits)


def test_ape_changes_how_the_answer_attends_and_only_from_its_layer_on(session, chunk_ids):  # noqa: F811
    """From a layer past the last, APE changes nothing (the attention function is the model's own,
    prefill and decoding); from layer 0 it changes the answer's distribution; superposition's
    kept chunks take it too."""
    plain = session.query(QUESTION, chunks=chunk_ids, method="none", max_new_tokens=4)
    n = session.model.n_layers
    past = session.query(QUESTION, chunks=chunk_ids, method="none", ape_temperature=0.9, ape_scale=0.9,
                         ape_from_layer=n, max_new_tokens=4)
    torch.testing.assert_close(past.logits, plain.logits, atol=2e-4, rtol=1e-4)
    assert past.tokens == plain.tokens
    ape = session.query(QUESTION, chunks=chunk_ids, method="none", ape_temperature=0.5, ape_scale=0.5,
                        max_new_tokens=4)
    assert not torch.allclose(ape.logits, plain.logits, atol=1e-3)
    sup = session.query(QUESTION, chunks=chunk_ids, method="superposition", paths=1, recompute_ratio=0.0,
                        ape_temperature=0.9, max_new_tokens=4)
    assert len(sup.context_ids) == 1 and sup.recomputed_tokens == 0
    with pytest.raises(ConfigError, match="--ape"):
        QueryConfig("full", ape_temperature=0.9)
    with pytest.raises(ConfigError, match="must be > 0"):
        QueryConfig("none", ape_scale=0)
