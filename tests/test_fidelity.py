"""The fidelity suite: generated questions hold the facts they claim, scoring compares answer
spans, and a real run (tiny model) agrees with full prefill wherever the method is exact."""

from __future__ import annotations

import json

import pytest

from sparsecache.bench.fidelity import answer_span, contains, load_suite, make_suite, run_fidelity, table
from sparsecache.bench.ruler import parse_methods, wilson
from sparsecache.errors import ConfigError


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    made = make_suite(out, ks=(4, 8), questions=50, entities=20)
    docs = {d["id"]: d["text"] for d in map(json.loads, (out / "corpus.jsonl").read_text().splitlines())}
    return out, made, docs


def test_the_suite_is_seeded_and_saved(suite, tmp_path):
    out, made, _ = suite
    assert load_suite(out) == made
    assert make_suite(tmp_path, ks=(4, 8), questions=50, entities=20) == made
    assert make_suite(tmp_path / "other", ks=(4, 8), questions=50, entities=20, seed=1) != made


def test_every_question_has_its_facts_in_its_context_at_random_ranks(suite):
    _, made, docs = suite
    ranks = set()
    for k, questions in made.items():
        assert len(questions) == 50 and sum(q.hops == 2 for q in questions) == 10
        for q in questions:
            assert len(q.chunk_docs) == k == len(set(q.chunk_docs)) and set(q.docs) <= set(q.chunk_docs)
            assert contains(docs[q.docs[-1]], q.truth)  # the fact is in the (last) document it needs
            assert not contains(q.question, q.truth)  # and the question does not give it away
            ranks.add(q.chunk_docs.index(q.docs[0]))
    assert ranks == set(range(8))  # the answer's chunk lands anywhere


def test_a_two_hop_question_needs_both_documents(suite):
    _, made, docs = suite
    q = next(q for q in made[4] if q.hops == 2)
    entity, person = q.docs
    name = docs[person].split(" is remembered")[0]
    assert name in docs[entity] and not contains(docs[entity], q.truth)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="k must be >= 2"):
        make_suite(tmp_path, ks=(1,))
    with pytest.raises(ConfigError, match="--entities"):
        make_suite(tmp_path, ks=(8,), entities=6)
    with pytest.raises(ConfigError, match="ask for fewer"):
        make_suite(tmp_path, ks=(4,), questions=500, entities=10)
    # 10 entities hold 80 questions, but only 50 one-hop: 70 questions would need 56 of them
    assert len(make_suite(tmp_path, ks=(4,), questions=60, entities=10)[4]) == 60
    with pytest.raises(ConfigError, match="50 one-hop"):
        make_suite(tmp_path, ks=(4,), questions=70, entities=10)
    with pytest.raises(ConfigError, match="at least 1"):
        make_suite(tmp_path, ks=(4,), questions=0)


def test_answer_spans_compare_first_sentences_without_case_or_punctuation():
    assert answer_span("The town was founded in 1843. It is old.") == "the town was founded in 1843"
    assert answer_span("  The Town was founded in 1843!\nMore") == answer_span("the town was founded in 1843")
    assert answer_span("It has 3.5 bridges.") == "it has 3 5 bridges"
    assert contains("It was founded by Ilse Barmon.", "ilse barmon") and not contains("in 18430", "1843")


@pytest.fixture(scope="module")
def session(tiny_model, tiny_dictionary, embedder, suite, tmp_path_factory):
    from sparsecache.encoder import encode_corpus
    from sparsecache.session import Session
    from sparsecache.store import StoreConfig

    out, _, _ = suite
    store = tmp_path_factory.mktemp("fidelity-store") / "store"
    encode_corpus([str(out / "corpus.jsonl")], store, tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=512),
                  embedder=embedder, batch_tokens=4096, progress=False)
    s = Session(store, tiny_model)
    s._embedder = embedder
    return s


def test_a_run_agrees_with_full_prefill_where_the_method_is_exact_and_resumes(session, suite, tmp_path):
    _, made, _ = suite
    few = {4: made[4][:5]}
    results = tmp_path / "results.json"
    rows = run_fidelity(session, few, parse_methods("infoflow:1.0,none"), results, max_new_tokens=6)
    assert len(rows) == 3 * 5
    by = {r["label"]: r for r in table(rows)}
    # recomputing every token is full prefill: the same answers, every token agreeing
    assert by["infoflow:1.0"]["same_answer"] == 1.0 and by["infoflow:1.0"]["token_agreement"] == 1.0
    assert by["infoflow:1.0"]["same_answer_ci95"] == wilson(5, 5)
    assert "same_answer" not in by["full"] and by["full"]["questions"] == 5
    assert all(r["recomputed_tokens"] == 0 for r in rows if r["label"] == "none")
    saved = json.loads(results.read_text())["rows"]
    assert saved == json.loads(json.dumps(rows))
    calls = []
    real = session.query
    session.query = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        assert run_fidelity(session, few, parse_methods("infoflow:1.0,none"), results) == saved and not calls
    finally:
        session.query = real


def test_bench_fidelity_refuses_bad_settings_before_loading_the_model(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from sparsecache.cli.main import cli
    import sparsecache.model

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded for a suite that cannot run")

    monkeypatch.setattr(sparsecache.model, "load_model", no_model)
    for args, code, msg in ((["--k", "4,x"], 2, "not a comma-separated list"), (["--k", "1"], 1, "k must be >= 2"),
                            (["--questions", "0"], 1, "at least 1"), (["--questions", "400"], 1, "ask for fewer")):
        r = CliRunner().invoke(cli, ["bench", "fidelity", "--workdir", str(tmp_path / "w"), *args])
        assert r.exit_code == code and msg in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "w").exists()


def test_bench_fidelity_refuses_a_workdir_made_with_other_settings(tmp_path):
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    (tmp_path / "suite.json").write_text(json.dumps({"ks": [8], "questions": 10}))
    r = CliRunner().invoke(cli, ["bench", "fidelity", "--workdir", str(tmp_path)])
    assert r.exit_code == 1 and "holds a suite made with" in r.output and "Traceback" not in r.output
    text = " ".join(CliRunner().invoke(cli, ["bench", "fidelity", "--help"]).output.split())  # unwrapped
    assert "[default: 4,8]" in text and "[default: 100]" in text


def test_bench_fidelity_answers_the_first_questions_of_some_of_a_workdirs_ks(session, suite, tmp_path, monkeypatch):
    import shutil

    import sparsecache.bench.suite as bench

    out, made, _ = suite
    work = tmp_path / "w"
    work.mkdir()
    shutil.copy(out / "questions.json", work)
    (work / "suite.json").write_text(json.dumps({"ks": [4, 8], "questions": 50}))
    seen = []
    monkeypatch.setattr(bench, "_suite_session", lambda w, settings, make, device: seen.append(settings) or session)
    r = bench.bench_fidelity(work, ks=(8,), questions=50, methods=parse_methods("none"), limit=2)
    assert seen == [{"ks": [4, 8], "questions": 50}]  # the workdir's suite, not a new one
    assert [(x["k"], x["label"], x["questions"]) for x in r["rows"]] == [(8, "full", 2), (8, "none", 2)]
    saved = json.loads((work / "results.json").read_text())["rows"]
    assert {x["question"] for x in saved} == {q.id for q in made[8][:2]}
    bench.bench_fidelity(work, ks=(8,), questions=50, methods=parse_methods("none"), limit=2, model_path="other")
    assert seen[-1] == {"ks": [8], "questions": 50, "model": "other"}  # not the default model's suite


def test_the_rule_picks_the_best_agreement_within_half_of_full_prefills_ttft():
    from sparsecache.bench.fidelity import pick_default

    def row(label, same, ttft, k=8):
        return {"k": k, "label": label, "same_answer": same, "token_agreement": same, "ttft_ms": ttft}

    agreement = [row("full", 1.0, 0), row("a", 0.10, 0), row("b", 0.20, 0), row("c", 0.90, 0), row("b", 0.5, 0, k=4)]
    ttft = [row("full", 1.0, 1000), row("a", 0, 300), row("b", 0, 500), row("c", 0, 501)]
    r = pick_default(agreement, ttft)
    assert r["chosen"] == "b"  # c agrees more but costs more than half; b is exactly half
    assert [(x["label"], x["within"], x["ttft_vs_full"]) for x in r["rows"]] == [
        ("a", True, 0.3), ("b", True, 0.5), ("c", False, 0.501)]
    assert pick_default(agreement, ttft, budget=0.2)["chosen"] is None
    with pytest.raises(ValueError, match="no full-prefill TTFT"):
        pick_default(agreement, ttft[1:])
