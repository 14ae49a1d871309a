"""The RULER-style suite: generated tasks hold exactly the answers they claim, scoring and
intervals are right, and a run resumes from its saved cells."""

from __future__ import annotations

import collections
import json
import re

import pytest

from sparsecache.bench.ruler import TASKS, Trial, load_suite, make_suite, run_suite
from sparsecache.query.spec import parse_methods
from sparsecache.measure.stats import wilson
from sparsecache.errors import ConfigError


@pytest.fixture(scope="module")
def suite(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ruler")
    trials = make_suite(tiny_model.tokenizer, out, TASKS, trials=3, k=8, tokens_per_chunk=120)
    docs = {d["id"]: d["text"] for d in map(json.loads, (out / "corpus.jsonl").read_text().splitlines())}
    return out, trials, docs


def context_text(trial, docs) -> str:
    return "\n".join(docs[d] for d in trial.chunk_docs)


def test_the_suite_is_seeded_and_every_task_has_its_trials(suite, tiny_model, tmp_path):
    out, trials, docs = suite
    again = make_suite(tiny_model.tokenizer, tmp_path, TASKS, trials=3, k=8, tokens_per_chunk=120)
    assert again == trials == load_suite(out)
    assert (tmp_path / "corpus.jsonl").read_text() == (out / "corpus.jsonl").read_text()
    assert collections.Counter(t.task for t in trials) == {task: 3 for task in TASKS}
    for t in trials:
        assert len(t.chunk_docs) == len(set(t.chunk_docs)) == 8
        text = context_text(t, docs)
        assert all(e in text for e in t.expected), (t.task, t.expected)
    # filler is shared, needle chunks are per trial
    assert sum(d.startswith("filler") for d in docs) == 16


def test_needle_tasks_spread_their_answers_over_chunks(suite):
    _, trials, docs = suite
    for t in trials:
        holding = [d for d in t.chunk_docs if any(e in docs[d] for e in t.expected)]
        want = {"single": 1, "multikey": 1, "multivalue": 3, "vartrack": 3, "cwe": 4}[t.task]
        assert len(holding) == want, (t.task, holding)
        if t.task == "multikey":  # two more keys distract
            assert sum("special magic number" in docs[d] for d in t.chunk_docs) == 3


def test_cwe_common_words_are_the_only_repeated_list_words(suite):
    _, trials, docs = suite
    for t in (t for t in trials if t.task == "cwe"):
        counts = collections.Counter(re.findall(r"[a-z]+", context_text(t, docs).lower()))
        lists = [w for d in t.chunk_docs if d.startswith("cwe") for w in re.findall(r"^\d+\. (\w+)$", docs[d], re.M)]
        assert {w: counts[w] for w in t.expected} == {w: 12 for w in t.expected}
        assert all(counts[w] == 1 for w in set(lists) - set(t.expected))  # no filler holds a list word


def test_vartrack_chain_resolves_to_exactly_the_expected_variables(suite):
    _, trials, docs = suite
    for t in (t for t in trials if t.task == "vartrack"):
        text = context_text(t, docs)
        value = re.search(r"value (\d+)", t.question).group(1)
        held = dict(re.findall(r"VAR (\w+) = (\d+)\.", text))
        links = re.findall(r"VAR (\w+) = VAR (\w+)\.", text)
        while True:  # follow assignments until nothing changes: the order in the text does not matter
            new = {y: held[x] for y, x in links if x in held and y not in held}
            if not new:
                break
            held.update(new)
        assert sorted(v for v, x in held.items() if x == value) == sorted(t.expected)
        assert 4 <= len(t.expected) <= 6 and len(held) == len(t.expected) + 3  # plus the distractor chain


def test_found_matches_whole_words_case_blind():
    t = Trial("cwe", [], "q", "p", ["cable", "feats"], 8)
    assert t.found("1. Cable, 2. feats") == [True, True]
    assert t.found("cables and defeats") == [False, False]


def test_wilson_interval():
    assert wilson(0, 20) == (0.0, 0.161)
    assert wilson(20, 20) == (0.839, 1.0)
    assert wilson(10, 20) == (0.299, 0.701)


def test_methods_are_labels_or_method_ratio():
    got = parse_methods("full,a3:0.3,infoflow:0.15+reorder,cake")
    assert got == {"full": {"method": "full"}, "a3:0.3": {"method": "a3", "recompute_ratio": 0.3},
                   "infoflow:0.15+reorder": {"method": "infoflow", "recompute_ratio": 0.15, "reorder": "attention"},
                   "cake": {"method": "cake"}}
    # no ratio: the method's own, or what a TTFT budget buys per question (#79 item 5's candidates)
    budgeted = parse_methods("infoflow+ttft_budget=0.5@wrapped")["infoflow+ttft_budget=0.5@wrapped"]
    assert budgeted == {"method": "infoflow", "ttft_budget": 0.5, "store": "wrapped"}
    for bad, msg in (("a3:x", "neither a label"), ("a3:0.1+flip", "unknown suffix"), (",", "names no method"),
                     ("infoflow+ttft_budget=2", "ttft-budget")):
        with pytest.raises(ConfigError, match=msg):
            parse_methods(bad)


def test_unknown_tasks_and_too_few_chunks_are_refused(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="unknown task"):
        make_suite(tiny_model.tokenizer, tmp_path, ("single", "niah"))
    with pytest.raises(ConfigError, match="k must be >= 4"):
        make_suite(tiny_model.tokenizer, tmp_path, k=3)


def test_bench_ruler_refuses_bad_tasks_before_loading_the_model(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from sparsecache.cli.main import cli
    import sparsecache.model.kvmodel

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded for a suite that cannot run")

    monkeypatch.setattr(sparsecache.model.kvmodel, "load_model", no_model)
    for args, msg in ((["--tasks", "single,bogus"], "unknown task(s) bogus"), (["--k", "3"], "k must be >= 4"),
                      (["--methods", "full,none@wrapped"], "need a wrapped store (--wrapper)"),
                      (["--methods", "full,none", "--wrapper", "shipped"], "no method given does")):
        r = CliRunner().invoke(cli, ["bench", "ruler", "--workdir", str(tmp_path), *args])
        assert r.exit_code == 1 and msg in r.output and "Traceback" not in r.output, r.output


class _Answer:
    def __init__(self, text):
        self.answer, self.timings_ms = text, {"ttft": 10.0}


class _FakeSession:
    """Answers from a table, so scoring is checked without a model; counts its queries."""

    def __init__(self, trials, docs, right: set[str]):
        self.store = type("S", (), {"chunks": lambda _: [type("C", (), {"doc_id": d, "id": "c-" + d, "ordinal": 0})
                                                          for d in docs]})()
        self.by_context = {tuple("c-" + d for d in t.chunk_docs): t for t in trials}
        self.right, self.calls = right, 0

    def query(self, question, chunks, method, **kw):
        self.calls += 1
        t = self.by_context[tuple(chunks)]
        assert question == t.question and kw["answer_prefix"] == t.answer_prefix
        return _Answer(" ".join(t.expected) if method in self.right else " ".join(t.expected[:1]) + " nothing")


def test_run_suite_scores_every_cell_and_resumes_from_saved_ones(suite, tmp_path):
    _, trials, docs = suite
    fake = _FakeSession(trials, docs, right={"full"})
    methods = parse_methods("full,none")
    results = tmp_path / "results.json"
    rows = run_suite(fake, trials, methods, results)
    assert len(rows) == 2 * len(TASKS) and fake.calls == 2 * len(trials)
    by = {(r["task"], r["label"]): r for r in rows}
    for task in TASKS:
        assert by[task, "full"]["accuracy"] == 1.0 and by[task, "full"]["interval95"] == wilson(3, 3)
        many = task in ("multivalue", "vartrack", "cwe")  # one of several answers found
        assert by[task, "none"]["accuracy"] == (0.0 if many else 1.0)
        assert 0 < by[task, "none"]["recall"] < 1 if many else by[task, "none"]["recall"] == 1.0
    again = _FakeSession(trials, docs, right=set())
    saved = json.loads(results.read_text())["rows"]  # saved as it went
    assert saved == json.loads(json.dumps(rows))
    assert run_suite(again, trials, methods, results) == saved and again.calls == 0


def test_bench_ruler_refuses_a_workdir_made_with_other_settings(tmp_path):
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    (tmp_path / "suite.json").write_text(json.dumps({"tasks": ["single"], "trials": 5, "k": 8, "tokens_per_chunk": 200}))
    r = CliRunner().invoke(cli, ["bench", "ruler", "--workdir", str(tmp_path), "--trials", "20"])
    assert r.exit_code == 1 and "holds a suite made with" in r.output and "Traceback" not in r.output
    (tmp_path / "suite.json").write_text(json.dumps({"tasks": ["single"], "trials": 20, "k": 8, "tokens_per_chunk": 200}))
    r = CliRunner().invoke(cli, ["bench", "ruler", "--workdir", str(tmp_path), "--tasks", "single",
                                 "--model", str(tmp_path / "other-model")])  # the default model's suite and store
    assert r.exit_code == 1 and "holds a suite made with" in r.output and "Traceback" not in r.output


def test_the_default_suite_fits_the_held_out_text(tiny_model, tmp_path):
    """20 trials of every task need ~200 needle chunks, more than the held-out text has
    pieces: trials reuse pieces, never a filler of their own context."""
    trials = make_suite(tiny_model.tokenizer, tmp_path, TASKS, trials=20, k=8, tokens_per_chunk=200)
    docs = {d["id"]: d["text"] for d in map(json.loads, (tmp_path / "corpus.jsonl").read_text().splitlines())}
    assert len(trials) == 100
    for t in trials:
        texts = [docs[d] for d in t.chunk_docs]
        assert len(set(texts)) == len(texts)


def test_wrapped_methods_are_answered_by_the_wrapped_session(suite):
    _, trials, docs = suite
    methods = parse_methods("none,none@wrapped,infoflow:0.2+reorder@wrapped")
    assert methods["none@wrapped"] == {**methods["none"], "store": "wrapped"}
    assert methods["infoflow:0.2+reorder@wrapped"] == {"method": "infoflow", "recompute_ratio": 0.2,
                                                       "reorder": "attention", "store": "wrapped"}
    plain, wrapped = _FakeSession(trials, docs, right=set()), _FakeSession(trials, docs, right={"none", "infoflow"})
    rows = run_suite(plain, trials, methods, wrapped=wrapped)
    by = {(r["task"], r["label"]): r["accuracy"] for r in rows}
    many = ("multivalue", "vartrack", "cwe")  # where the plain session's one-of-several answer is wrong
    assert {by[t, "none"] for t in many} == {0.0} and {by[t, "none@wrapped"] for t in TASKS} == {1.0}
    assert plain.calls == len(trials) and wrapped.calls == 2 * len(trials)
    with pytest.raises(ConfigError, match="need a wrapped store"):
        run_suite(plain, trials, methods)
    with pytest.raises(ConfigError, match="only store suffix"):
        parse_methods("none@plain")
