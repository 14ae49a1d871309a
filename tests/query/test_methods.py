"""The query-method registry: every part reads it, and a method is one module."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sparsecache.query import methods
from sparsecache.errors import ConfigError
from sparsecache.query.config import METHODS, SCORERS, QueryConfig
from test_blend import QUESTION, chunk_ids, session  # noqa: F401  (fixtures)


def test_the_registry_holds_every_method_once_in_the_clis_order():
    assert METHODS == methods.names() == ("none", "a3", "infoflow", "chunkflow", "legolink", "cacheblend",
                                          "cacheclip", "cake", "full", "raw", "superposition")
    assert SCORERS == ("a3", "infoflow", "chunkflow", "legolink", "cacheblend", "cacheclip", "superposition")
    assert methods.names(connector=True) == ("none", "a3", "infoflow", "chunkflow", "legolink", "cacheblend",
                                             "cacheclip")
    assert [m.name for m in methods.REGISTRY.values()] == list(methods.REGISTRY)
    with pytest.raises(ValueError, match="registered twice"):
        methods.register(methods.get("none"))
    with pytest.raises(KeyError, match="one of none, a3"):
        methods.get("magic")


def test_the_benchmarks_tables_and_the_cli_read_the_registry():
    from click.testing import CliRunner

    from sparsecache.query.spec import METHODS as RULER
    from sparsecache.bench.ttft import TTFT_METHODS
    from sparsecache.cli.main import cli

    assert list(RULER)[:2] == ["full", "raw"] and set(METHODS) <= set(RULER)
    assert RULER["infoflow"] == {"method": "infoflow", "recompute_ratio": 0.15} and RULER["none"] == {"method": "none"}
    assert [m for m, _ in TTFT_METHODS] == ["full", "raw", "none", "a3", "infoflow", "cacheblend", "cake"]
    out = CliRunner().invoke(cli, ["query", "--help"], terminal_width=200).output
    for m in methods.REGISTRY.values():
        assert m.name in out
    assert "InfoFlow; the default" in " ".join(out.split())


def test_the_default_is_the_rules_choice_and_a_method_named_alone_keeps_its_own_ratio():
    """#69's rule chose infoflow at r = 0.1 for `query`, `Session`, `serve` and the connector
    alike. A method named without a ratio gets its own ratio,
    also where the default config is changed into it (Session.query's dataclasses.replace)."""
    import dataclasses

    from click.testing import CliRunner

    from sparsecache.cli.main import cli
    from sparsecache.query.config import DEFAULT_METHOD, served_config
    from sparsecache.vllm.server import ServeConfig

    cfg = QueryConfig()
    # #69's rule chose infoflow at r = 0.1 on a wrapped store; every chunk kept, so serve and the connector share it
    assert (cfg.method, cfg.recompute_ratio, cfg.ratio, cfg.paths) == ("infoflow", None, 0.1, None)
    assert methods.get("superposition").paths == 2 and cfg.recomputes
    assert dataclasses.replace(cfg, method="superposition").ratio == 0.5
    assert dataclasses.replace(cfg, method="cacheblend").ratio == 0.25
    assert QueryConfig("a3").ratio == 0.25 and QueryConfig("a3", 0.1).ratio == 0.1
    assert not QueryConfig("infoflow", 0.0).recomputes and not QueryConfig("none").recomputes
    # where a store holds no calibration (`sparsecache calibrate`): serve's method None falls back to it
    assert DEFAULT_METHOD == ServeConfig(store="x").blend.method == "infoflow" and ServeConfig.method is None
    assert DEFAULT_METHOD in methods.names(connector=True)
    query = " ".join(CliRunner().invoke(cli, ["query", "--help"], terminal_width=200).output.split())
    assert "calibrate` measured one (`info` shows it), else infoflow]" in query and "superposition 0.5" in query
    assert "infoflow 0.1" in query and "(default 2;" in query
    serve = " ".join(CliRunner().invoke(cli, ["serve", "--help"], terminal_width=200).output.split())
    assert "else infoflow]" in serve and "infoflow 0.1" in serve and "superposition 0.5" not in serve
    assert served_config({}) == cfg  # a request that names nothing gets query's default


def test_importing_the_registry_loads_no_torch():
    code = "import sys, sparsecache.query.config; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr[-2000:]


def test_a_method_is_one_registered_class(session, chunk_ids):  # noqa: F811
    """A new method, registered from outside the package, is a QueryConfig choice and answers
    through Session.query like the built-in ones; the registry's dispatch runs its code."""
    from sparsecache.query.methods.base import Decoded

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


def _question_logprob(s, chunk: str, q_ids: list[int]) -> float:
    """log P(q_ids[1:] | prefix + chunk, q_ids[0]) by the model's own forward over the chunk's
    decoded cache: what superposition scores each path by."""
    from sparsecache.query.blend import load_cache

    ctx = load_cache(s.store, [chunk], s.model)
    m = s.model
    pos = torch.arange(ctx.length, ctx.length + len(q_ids))[None]
    with torch.inference_mode():
        out = m.hf(input_ids=torch.tensor([q_ids]), position_ids=pos, **{m.cache_arg: ctx.cache}, use_cache=True)
    logp = out.logits[0, :-1].float().log_softmax(-1)
    return float(logp.gather(-1, torch.tensor(q_ids[1:])[:, None]).sum())


def test_superposition_keeps_the_path_that_makes_the_question_likeliest(session, chunk_ids):  # noqa: F811
    """Each path is prefix + one chunk + the question, all paths in one batched run: its score
    is the model's own log-likelihood of the question there, and with one path kept the answer
    is that path's, exactly as a query of that chunk alone."""
    from sparsecache.model.generate import question_ids

    q_ids = question_ids(session.model, QUESTION)
    want = [_question_logprob(session, c, q_ids) for c in chunk_ids]
    best = chunk_ids[max(range(len(want)), key=want.__getitem__)]
    got = session.query(QUESTION, chunks=chunk_ids, method="superposition", paths=1, recompute_ratio=0.0,
                        max_new_tokens=4)
    alone = session.query(QUESTION, chunks=[best], method="none", max_new_tokens=4)
    assert got.context_ids == [best] and got.recomputed_tokens == 0
    torch.testing.assert_close(got.logits, alone.logits, atol=2e-4, rtol=1e-4)
    assert got.tokens == alone.tokens

    from sparsecache.query.methods.superposition import path_scores
    from sparsecache.query.blend import decode_chunks
    from sparsecache.stopwatch import Stopwatch

    chunks = decode_chunks(session.store, chunk_ids, "cpu", Stopwatch("cpu"), session.model)  # as queries read them
    scores, _ = path_scores(chunks, q_ids, session.model)
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
