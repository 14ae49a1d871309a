"""One plan per question (`query.plan`) over one context layout (`store.ContextLayout`), and the bad
input the plan refuses at the front door."""

from __future__ import annotations

import ast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparsecache.errors import ConfigError
from sparsecache.query.budget import Costs
from sparsecache.query.config import QueryConfig
from sparsecache.query.plan import check_question, plan
from sparsecache.store import ContextLayout
from support import REPO

chunk_tokens = st.lists(st.lists(st.integers(-6, 500), max_size=12), max_size=6)


@given(st.lists(st.integers(0, 500), max_size=8), st.integers(0, 4), st.integers(0, 3), chunk_tokens)
def test_a_layout_counts_what_it_lays_out(prefix, header, trailer, chunks):
    layout = ContextLayout.of(prefix + [-(i + 1) for i in range(header)], header + trailer if header + trailer else 0)
    assert layout.prefix == tuple(prefix) and len(layout.header) == header
    assert layout.trailer == (trailer if header + trailer else 0)
    ids = layout.ids(chunks)
    assert len(ids) == layout.context_tokens(map(len, chunks)) == len(prefix) + layout.chunk_tokens(map(len, chunks))
    assert ids[:len(prefix)] == prefix and layout.chunks(chunks) == [list(layout.header) + c for c in chunks]
    assert layout.text(chunks) == [t for t in ids if t >= 0]  # full prefill reads the text: no soft token


class FakeStore:
    """What a plan reads of a store: its layout and its calibration records."""

    def __init__(self, prefix=(1, 2, 3), header=(), records=None):
        self._layout = ContextLayout(tuple(prefix), tuple(header))
        self.records = records or {}

    def layout(self):
        return self._layout

    def calibration(self):
        return self.records


COSTS = Costs(a_full=10.0, p=2.0, a_store=40.0, s=0.2)  # the store path dearer than prefill below 17 tokens


def test_a_plan_prefills_a_cheap_context_and_budgets_the_rest(default_model):
    store, hf = FakeStore(), default_model.config
    cfg = QueryConfig(method="infoflow", ttft_budget=0.5)
    short = plan(cfg, store, hf, "cpu", 3 + 8, COSTS)  # 8 chunk tokens: under the crossover
    assert short.prefill and short.prefilled_under == COSTS.crossover(0.0) and short.chunk_tokens == 8
    assert short.config.method == "full" and short.config.order == cfg.order and short.recompute_ratio is None
    long = plan(cfg, store, hf, "cpu:0", 3 + 400, COSTS)
    assert not long.prefill and long.config is long.blend and long.context_tokens == 403
    assert long.recompute_ratio > 0 and long.recompute_ratio == pytest.approx(COSTS.ratio(403, 0.5), abs=1e-4)
    given_ratio = plan(QueryConfig(method="infoflow", recompute_ratio=0.3), store, hf, "cpu", 403, COSTS)
    assert given_ratio.recompute_ratio == 0.3  # a ratio given wins over the budget
    assert not plan(cfg, store, hf, "cpu", 11, COSTS.__class__(**{**COSTS.to_dict(), "a_store": 0.0})).prefill
    assert not plan(QueryConfig(method="none", prefill_under=0), store, hf, "cpu", 11, COSTS).prefill
    assert plan(QueryConfig(method="none", prefill_under=500), store, hf, "cpu", 403, COSTS).prefilled_under == 500
    assert not plan(QueryConfig(method="full"), store, hf, "cpu", 11, COSTS).prefill  # full is not a cheap case
    with pytest.raises(ValueError, match="method must be named"):
        plan(QueryConfig(method=None), store, hf, "cpu", 11, COSTS)


def test_a_plan_takes_its_costs_from_the_stores_calibration(default_model):
    refit = Costs(a_full=1.0, p=1.0, a_store=1.0, s=0.1)
    store = FakeStore(records={"cpu": {"costs": refit.to_dict()}})
    p = plan(QueryConfig(method="infoflow", ttft_budget=0.5), store, default_model.config, "cpu", 1003)
    assert p.recompute_ratio == pytest.approx(refit.ratio(1003, 0.5), abs=1e-4)


def test_the_session_answers_by_its_plan(session, chunk_ids):  # noqa: F811  (the fixtures imported below)
    cfg = QueryConfig(method="infoflow", ttft_budget=0.5, prefill_under=0)
    session.costs = COSTS  # this module's own session (a module-scoped fixture)
    p = session.plan(cfg, chunk_ids)
    a = session.query("What is it?", cfg, chunks=chunk_ids, max_new_tokens=1)
    assert a.context_tokens == p.context_tokens and a.recompute_ratio == p.recompute_ratio
    assert a.config == cfg


def test_only_the_plan_decides_prefill_or_store():
    """`cheap.applies` and `budget.budgeted` are called from `query/plan.py` alone: a fourth copy of the
    decision cannot creep back into the session, the server or the connector."""
    root = REPO / "sparsecache"
    callers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if name in ("applies", "budgeted"):
                    callers.add(path.relative_to(root).as_posix())
    assert callers == {"query/plan.py"}


@pytest.mark.parametrize("question", ["", "   ", "\n\t", None, 3])
def test_a_question_the_plan_cannot_use_is_refused(question):
    with pytest.raises(ConfigError, match="question"):
        check_question(question)


def test_an_empty_question_is_one_line_and_exit_1_before_anything_loads(tmp_path, monkeypatch):
    """`sparsecache query STORE ""` used to run a whole query (~9 s) on an empty question."""
    from click.testing import CliRunner

    import sparsecache.query.session as session_module
    from sparsecache.cli.main import cli

    monkeypatch.setattr(session_module, "Session", lambda *a, **k: pytest.fail("a session was opened"))
    for q in ("", "   "):
        r = CliRunner().invoke(cli, ["query", str(tmp_path / "no-store"), q])
        assert r.exit_code == 1 and r.output.strip() == "Error: the question is empty", r.output


from test_blend import chunk_ids, session  # noqa: E402,F401  (the module's tiny store and its session)
