"""The fidelity suite: generated questions hold the facts they claim, scoring compares answer
spans, and a real run (tiny model) agrees with full prefill wherever the method is exact."""

from __future__ import annotations

import json

import pytest

from sparsecache.bench.fidelity import run_fidelity, table
from sparsecache.errors import ConfigError
from sparsecache.measure.answers import answer_span, contains
from sparsecache.measure.stats import wilson
from sparsecache.measure.suite import load_suite, make_suite
from sparsecache.query.spec import parse_methods
from support import REPO


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


def test_token_f1_gives_partial_credit_by_words():
    from sparsecache.measure.answers import token_f1

    assert token_f1("The town was founded in 1843", "the town was founded in 1843.") == 1.0
    assert token_f1("founded in 1843", "The town was founded in 1843") == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert token_f1("in 1850", "in 1843") == pytest.approx(0.5) and token_f1("yes", "no") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("", "x") == 0.0


@pytest.fixture(scope="module")
def session(tiny_model, tiny_dictionary, embedder, suite, tmp_path_factory):
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig

    out, _, _ = suite
    store = tmp_path_factory.mktemp("fidelity-store") / "store"
    encode_with([str(out / "corpus.jsonl")], store, tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=512),
                EncodeOptions(batch_tokens=4096, progress=False), embedder=embedder)
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
    assert by["infoflow:1.0"]["disagreement"] == 0.0  # neither gains nor losses against full prefill
    assert all("confident" in r and "margin" in r for r in rows if r["label"] == "full")
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

    import sparsecache.model.kvmodel
    from sparsecache.cli.main import cli

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded for a suite that cannot run")

    monkeypatch.setattr(sparsecache.model.kvmodel, "load_model", no_model)
    for args, code, msg in ((["--k", "4,x"], 2, "not a comma-separated list"), (["--k", "1"], 1, "k must be >= 2"),
                            (["--questions", "0"], 1, "at least 1"), (["--questions", "400"], 1, "ask for fewer"),
                            (["--methods", "none@wrapped"], 1, "need a wrapped store (--wrapper)"),
                            (["--wrapper", "shipped"], 1, "no method given does"),
                            (["--entities", "400"], 1, "too few for 4 unique names per entity; use at most 323")):
        r = CliRunner().invoke(cli, ["bench", "fidelity", "--workdir", str(tmp_path / "w"), *args])
        assert r.exit_code == code and msg in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "w").exists()


def test_bench_fidelity_refuses_a_workdir_made_with_other_settings(tmp_path):
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    (tmp_path / "suite.json").write_text(json.dumps({"ks": [8], "questions": 10}))
    r = CliRunner().invoke(cli, ["bench", "fidelity", "--workdir", str(tmp_path)])
    assert r.exit_code == 1 and "holds a suite made with" in r.output and "Traceback" not in r.output
    # a #69 workdir (contexts from retrieval alone) keeps its contexts unless told otherwise, which is refused
    (tmp_path / "suite.json").write_text(json.dumps({"ks": [8], "questions": 10, "split": "dev",
                                                     "contexts": "retrieval"}))
    r = CliRunner().invoke(cli, ["bench", "fidelity", "--workdir", str(tmp_path), "--k", "8", "--questions", "10",
                                 "--two-chunk", "placed"])
    assert r.exit_code == 1 and "holds a suite made with" in r.output
    text = " ".join(CliRunner().invoke(cli, ["bench", "fidelity", "--help"]).output.split())  # unwrapped
    assert "[default: 4,8]" in text and "[default: 100]" in text


def test_bench_fidelity_answers_the_first_questions_of_some_of_a_workdirs_ks(session, suite, tmp_path, monkeypatch):
    import shutil

    import sparsecache.bench.suite as bench

    out, made, _ = suite
    work = tmp_path / "w"
    work.mkdir()
    shutil.copy(out / "questions.json", work)
    (work / "suite.json").write_text(json.dumps({"ks": [4, 8], "questions": 50, "contexts": "retrieval"}))
    seen = []
    monkeypatch.setattr(bench, "_suite_session", lambda w, settings, make, device: seen.append(settings) or session)
    r = bench.bench_fidelity(work, ks=(8,), questions=50, methods=parse_methods("none"), limit=2)
    assert seen == [{"ks": [4, 8], "questions": 50, "contexts": "retrieval"}]  # the workdir's suite, not a new one
    # the generated contexts were replaced by what the store's retrieval returns for each question (#69)
    asked = load_suite(work)
    for q, m in zip(asked[8][:5], made[8]):
        assert q.id == m.id and q.chunks == [h["id"] for h in session.retrieve(q.question, 8)]
        assert [session.store.chunk(c).doc_id for c in q.needed] == m.docs
    assert [(x["k"], x["label"], x["questions"]) for x in r["rows"]] == [(8, "full", 2), (8, "none", 2)]
    saved = json.loads((work / "results.json").read_text())["rows"]
    assert {x["question"] for x in saved} == {q.id for q in made[8][:2]}
    bench.bench_fidelity(work, ks=(8,), questions=50, methods=parse_methods("none"), limit=2, model_path="other")
    assert seen[-1] == {"ks": [8], "questions": 50, "contexts": "retrieval", "model": "other"}  # not the default's


def test_shards_answer_disjoint_questions_resume_and_merge(session, suite, tmp_path, monkeypatch):
    """`bench fidelity --shard I/N` (#96 folded scripts/experiments/fidelity_shard.py into it): each shard
    answers its own questions question by question into its own file, an existing shard file is continued
    only with --resume, seed rows count as done, and a run without a shard merges every shard's rows."""
    import shutil

    import sparsecache.bench.suite as bench
    from sparsecache.bench.suite import Shard

    out, made, _ = suite
    work = tmp_path / "w"
    work.mkdir()
    shutil.copy(out / "questions.json", work)
    (work / "suite.json").write_text(json.dumps({"ks": [4, 8], "questions": 50, "contexts": "retrieval"}))
    monkeypatch.setattr(bench, "_suite_session", lambda w, settings, make, device: session)
    none = parse_methods("none")
    for i in (0, 1):
        bench.bench_fidelity(work, ks=(8,), questions=50, methods=none, limit=2, shard=Shard(i, 2))
    files = {i: json.loads((work / f"results-{i}-of-2.json").read_text())["rows"] for i in (0, 1)}
    assert {r["question"] for r in files[0]} == {made[8][0].id, made[8][2].id}
    assert {r["question"] for r in files[1]} == {made[8][1].id, made[8][3].id}
    seed = tmp_path / "seed.json"  # shard 1's rows, as if measured elsewhere: a new shard 1 counts them as done
    seed.write_text(json.dumps({"rows": [{**r, "seeded": True} for r in files[1] + files[0]]}))
    (work / "results-1-of-2.json").unlink()
    bench.bench_fidelity(work, ks=(8,), questions=50, methods=none, limit=2, shard=Shard(1, 2, seeds=(seed,)))
    rows = json.loads((work / "results-1-of-2.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["seeded"] for r in rows)  # its own questions' rows only, none answered again
    with pytest.raises(ConfigError, match="--resume continues it"):
        bench.bench_fidelity(work, ks=(8,), questions=50, methods=none, limit=2, shard=Shard(0, 2))
    again = bench.bench_fidelity(work, ks=(8,), questions=50, methods=none, limit=3, shard=Shard(0, 2, resume=True))
    assert again["shard"] == "0/2" and len(json.loads((work / "results-0-of-2.json").read_text())["rows"]) == 6
    r = bench.bench_fidelity(work, ks=(8,), questions=50, methods=none, limit=4)  # merges, answers nothing new
    assert [(x["k"], x["label"], x["questions"]) for x in r["rows"]] == [(8, "full", 4), (8, "none", 4)]
    with pytest.raises(ConfigError, match="I/N"):
        Shard.parse("2/2")
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    r = CliRunner().invoke(cli, ["bench", "fidelity", "--workdir", str(work), "--resume"])
    assert r.exit_code == 2 and "go with --shard" in r.output


def test_the_rule_picks_the_best_agreement_within_half_of_full_prefills_ttft():
    from sparsecache.bench.fidelity import pick_default

    def row(label, same, ttft, k=8):
        return {"k": k, "label": label, "same_answer": same, "token_agreement": same, "ttft_ms": ttft}

    agreement = [row("full", 1.0, 0), row("a", 0.10, 0), row("b", 0.20, 0), row("c", 0.90, 0), row("b", 0.5, 0, k=4)]
    ttft = [row("full", 1.0, 1000), row("a", 0, 300), row("b", 0, 500), row("c", 0, 501)]
    r = pick_default(agreement, ttft, rule="same_answer")
    assert r["chosen"] == "b"  # c agrees more but costs more than half; b is exactly half
    assert [(x["label"], x["within"], x["ttft_vs_full"]) for x in r["rows"]] == [
        ("a", True, 0.3), ("b", True, 0.5), ("c", False, 0.501)]
    assert pick_default(agreement, ttft, budget=0.2, rule="same_answer")["chosen"] is None
    with pytest.raises(ValueError, match="no full-prefill TTFT"):
        pick_default(agreement, ttft[1:])


def test_51s_rule_is_correct_answers_relative_to_full_then_right_where_full_is_right():
    from sparsecache.bench.fidelity import pick_default

    def row(label, rel, where, ttft):
        return {"k": 8, "label": label, "correct_vs_full": rel, "right_where_full_right": where, "ttft_ms": ttft}

    agreement = [row("a", 0.9, 0.6, 0), row("b", 0.9, 0.7, 0), row("c", 1.1, 0.9, 0)]
    ttft = [row("full", 1, 1, 1000), row("a", 0, 0, 200), row("b", 0, 0, 400), row("c", 0, 0, 600)]
    r = pick_default(agreement, ttft, rule="correct_vs_full")
    assert r["rule"] == "correct_vs_full" and r["chosen"] == "b"  # a tie on the first key: the second decides


def test_the_default_rule_is_kepts_lower_bound_then_value_tokens_then_ttft_with_the_needed_chunks_kept():
    """#69's rule, stated before it was applied: within half of full prefill's TTFT, the highest
    lower bound of kept, then value-token agreement, then the lower TTFT; a method that drops
    chunks is eligible only if it kept the needed ones on >= 99% / 95% of one- / two-chunk questions."""
    from sparsecache.bench.fidelity import pick_default

    def row(label, low, value, ttft, **holds):
        return {"k": 8, "label": label, "kept_ci95": (low, 1.0), "value_agreement": value, "ttft_ms": ttft, **holds}

    drops = dict(drops_chunks=True, holds_hops1_n=50, holds_hops2_n=10)
    agreement = [row("a", 0.80, 0.90, 0), row("b", 0.85, 0.90, 0), row("c", 0.85, 0.95, 0), row("d", 0.85, 0.95, 0),
                 row("drops", 0.99, 1.0, 0, holds_hops1=1.0, holds_hops2=0.2, **drops), row("slow", 0.99, 1.0, 0),
                 row("unseen", 0.99, 1.0, 0, holds_hops1=1.0, **{**drops, "holds_hops2_n": 0}),
                 row("keeps", 0.86, 0.5, 0, holds_hops1=0.99, holds_hops2=0.95, **drops)]
    ttft = [row("full", 0, 0, 1000), row("a", 0, 0, 100), row("b", 0, 0, 200), row("c", 0, 0, 400), row("d", 0, 0, 300),
            row("drops", 0, 0, 100), row("slow", 0, 0, 600), row("unseen", 0, 0, 100), row("keeps", 0, 0, 450)]
    r = pick_default(agreement, ttft)
    assert r["rule"] == "kept" and r["chosen"] == "keeps"  # it drops chunks, but never the needed ones
    eligible = {x["label"]: (x["within"], x["keeps_chunks"]) for x in r["rows"]}
    assert eligible["drops"] == (False, False)
    assert eligible["unseen"] == (False, False)  # never seen on a question needing two chunks: not eligible
    assert pick_default([x for x in agreement if x["label"] != "keeps"], ttft)["chosen"] == "d"  # ties: the faster


def test_the_frontier_plot_and_table_read_the_rules_rows(tmp_path):
    """docs/tables/fidelity_table.py --rule kept: the table of every configuration and the frontier plot."""
    import subprocess
    import sys

    def row(label, correct, ttft, confident=True):
        return {"k": 8, "label": label, "question": "q0", "hops": 1, "correct": correct, "ttft_ms": ttft,
                "full_correct": True, "full_confident": confident, "same_answer": correct, "token_agreement": 0.9,
                "value_top1": [1, 1], "value_kl": 0.1, "holds_answer": True}

    rows = [{"k": 8, "label": "full", "question": "q0", "hops": 1, "correct": True, "ttft_ms": 1000.0,
             "confident": True}, row("none", False, 200.0), row("infoflow:1.0", True, 1100.0)]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": rows}))
    script = REPO / "docs" / "tables" / "fidelity_table.py"
    out = subprocess.run([sys.executable, str(script), str(results), str(results), "--plot", str(tmp_path / "f.png")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "chosen by the rule (kept): none" in out.stdout  # the only one within half of full prefill's TTFT
    lines = [x for x in out.stdout.splitlines() if x.startswith("| none") or x.startswith("| infoflow")]
    assert len(lines) == 2 and lines[0].startswith("| infoflow:1.0 | 1 | 1.00") and lines[1].endswith("| 0.20 | yes |")
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_summaries_score_against_full_prefill_with_intervals():
    from sparsecache.bench.fidelity import summarise

    # 10 questions: full prefill right on the first 5; the method right on 3 of those and 1 other
    rows = [{"question": f"q{i}", "hops": 1 + (i % 5 == 4), "correct": i in (0, 1, 2, 7), "full_correct": i < 5,
             "same_answer": i < 3, "answer_f1": 1.0 if i < 3 else 0.25, "token_agreement": 0.5 + 0.05 * i,
             "ttft_ms": 10.0,
             "holds_answer": i != 9} for i in range(10)]
    s = summarise(rows)
    assert s["correct"] == 0.4 and s["correct_vs_full"] == 0.8 and s["right_where_full_right"] == 0.6
    assert s["right_where_full_right_ci95"] == wilson(3, 5) and s["same_answer_ci95"] == wilson(3, 10)
    lo, hi = s["correct_vs_full_ci95"]
    assert lo < 0.8 < hi and s["correct_vs_full_ci95"] == summarise(rows)["correct_vs_full_ci95"]  # seeded
    lo, hi = s["token_agreement_ci95"]
    assert lo < s["token_agreement"] < hi
    lo, hi = s["answer_f1_ci95"]
    assert s["answer_f1"] == pytest.approx(0.475) and lo < 0.475 < hi
    assert s["holds_answer"] == 0.9 and s["correct_hops1"] == 0.5 and s["correct_hops2"] == 0.0
    assert summarise(rows, {f"q{i}": {"correct": True} for i in range(10)})["correct_vs_full"] == 0.4  # full's rows
    full = [{k: r[k] for k in ("question", "hops", "correct", "ttft_ms")} for r in rows]  # full prefill's own rows
    assert summarise(full)["correct_hops1"] == 0.5 and "correct_vs_full" not in summarise(full)


def test_the_dev_and_test_splits_share_no_names_or_phrasings(tmp_path):
    from sparsecache.measure.suite import KINDS, PERSON_FACTS

    made = {split: make_suite(tmp_path / split, ks=(4, 8, 16), questions=200, split=split) for split in ("dev", "test")}
    assert all(len(m[8]) == 200 and sum(q.hops == 2 for q in m[8]) == 40 for m in made.values())
    texts = {split: (tmp_path / split / "corpus.jsonl").read_text() for split in made}
    import re

    import sparsecache.measure.suite as generator

    fixed = set(re.findall(r"[A-Z][a-z]+", open(generator.__file__).read()))  # words of the templates themselves
    names = {split: set(re.findall(r"[A-Z][a-z]+", t)) - fixed for split, t in texts.items()}
    assert len(names["dev"]) > 100 and not names["dev"] & names["test"]
    templates = [p for spec in KINDS.values() for _, phrasings in spec["facts"].values() for p in phrasings]
    templates += [p for _, phrasings in PERSON_FACTS.values() for p in phrasings]

    def used(split):
        asked = {q.question for qs in made[split].values() for q in qs}
        return {t for t in templates if any(re.fullmatch(re.escape(t).replace(r"\{n\}", ".+").replace(r"\{role\}", ".+"), a)
                                            for a in asked)}
    assert used("dev") and not used("dev") & used("test")
    assert make_suite(tmp_path / "again", ks=(4, 8, 16), questions=200, split="dev") == made["dev"]
    with pytest.raises(ConfigError, match="--split"):
        make_suite(tmp_path / "x", split="validation")


def test_the_train_split_shares_no_names_or_phrasings_with_dev_or_test(tmp_path):
    """What learned wrappers train on (`learn-wrapper`) must leave dev and test unseen; adding the
    train split left the dev suite byte for byte as it was measured."""
    import hashlib
    import re

    from sparsecache.measure.suite import KINDS, PERSON_FACTS, TRAIN_ASK

    made = {split: make_suite(tmp_path / split, ks=(8,), questions=200, split=split) for split in ("dev", "test", "train")}
    words = {split: set(re.findall(r"[A-Z][a-z]+", (tmp_path / split / "corpus.jsonl").read_text())) for split in made}
    common = words["dev"] & words["test"]  # template words (and the given names neither split has)
    assert not (words["train"] - common) & (words["dev"] | words["test"]) - common
    asked = {split: {q.question for q in m[8]} for split, m in made.items()}
    split_templates = [p for spec in KINDS.values() for _, ps in spec["facts"].values() for p in ps]
    split_templates += [p for _, ps in PERSON_FACTS.values() for p in ps]

    def matches(template, question):
        return re.fullmatch(re.escape(template).replace(r"\{n\}", ".+").replace(r"\{role\}", ".+"), question)
    assert not any(matches(t, q) for t in split_templates for q in asked["train"])
    train_templates = [a.replace("{n}", x) for asks in TRAIN_ASK.values() for a in asks for x in ("{n}", "{role}")]
    assert all(any(matches(t, q) for t in train_templates) for q in asked["train"])
    assert not any(matches(t, q) for t in train_templates for split in ("dev", "test") for q in asked[split])
    digest = hashlib.md5((tmp_path / "dev" / "questions.json").read_bytes()).hexdigest()
    assert digest == "dba5f6ef1abc99d498ccce42b8456713"  # the dev suite of every committed measurement


def test_gold_answers_from_the_answers_own_chunks(session, suite, tmp_path):
    from sparsecache.bench.fidelity import parse_configs

    _, made, _ = suite
    few = {4: [q for q in made[4] if q.hops == 2][:2] + made[4][:1]}
    rows = run_fidelity(session, few, parse_configs("gold,superposition:0+paths=1"), tmp_path / "r.json", max_new_tokens=4)
    gold = [r for r in rows if r["label"] == "gold"]
    want = {q.id: len(q.docs) for q in few[4]}
    assert all(r["holds_answer"] and r["recomputed_tokens"] == 0 for r in gold)
    assert all(r["context_tokens"] < f["context_tokens"] for r, f in zip(gold, [r for r in rows if r["label"] == "full"]))
    assert {r["question"]: r["hops"] for r in gold} == want
    sup = [r for r in rows if r["label"] == "superposition:0+paths=1"]
    assert not all(r["holds_answer"] for r in sup if r["hops"] == 2)  # one path cannot hold two documents
    assert all(r["dropped"] == 3 and r["retrieved_answer"] for r in sup)
    from sparsecache.bench.fidelity import summarise

    s = summarise(sup, {r["question"]: r for r in rows if r["label"] == "full"})
    assert s["drops_chunks"] and s["holds_hops2_n"] == 2 and s["holds_hops2"] < 1
    assert "drops_chunks" not in summarise([r for r in rows if r["label"] == "full"])
    with pytest.raises(ConfigError, match="paths"):
        parse_configs("superposition:0+paths=0")


def test_the_committed_measurements_choose_the_default_query_uses(tmp_path):
    """#69's rule (`kept`) over the dev split's answers and the quiet CPU's TTFT run committed in
    docs/benchmarks chooses the configuration `QueryConfig()` is, on the store a new default-model
    store is (wrapped with the default wrapper): the default follows the measurement."""
    import importlib.util

    from click.testing import CliRunner

    from sparsecache.query.config import QueryConfig
    from sparsecache.wrapper.config import DEFAULT_WRAPPERS

    root = REPO
    spec = importlib.util.spec_from_file_location("fidelity_table", root / "docs/tables/fidelity_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    bench = root / "docs/benchmarks/fidelity69-2026-11-29"
    answers, ttft = bench / "dev-entities/results.json", bench / "ttft/results.json"
    r = CliRunner().invoke(table.main, [str(answers), str(ttft), "--rule", "kept", "--out", str(tmp_path / "d.json")])
    assert r.exit_code == 0, r.output
    chosen = json.loads((tmp_path / "d.json").read_text())["chosen"]
    cfg = QueryConfig()
    assert chosen == f"{cfg.method}:{cfg.ratio:g}@wrapped" and DEFAULT_WRAPPERS, r.output
    # the wrapper those answers were measured with is the one new stores get
    meta = json.loads((root / "dictionaries" / DEFAULT_WRAPPERS[0] / "wrapper.json").read_text())
    assert "specimen" in meta["recipe"]["questions"]


def test_wrapped_methods_answer_from_the_wrapped_store_beside_the_plain_one(session, suite, tmp_path, embedder):
    """`method@wrapped` answers from the suite encoded with a learned wrapper: its `none` reads
    k wrapped chunks (header + trailer more context per chunk), and `full@wrapped` prefills the
    chunks' own text, full prefill's answer to the token."""
    import shutil

    from sparsecache.bench.fidelity import parse_configs
    from sparsecache.bench.suite import wrapped_session
    from sparsecache.wrapper.apply import initial_wrapper

    out, made, _ = suite
    shutil.copy(out / "corpus.jsonl", tmp_path)
    initial_wrapper(session.model, 3, 2).save(tmp_path / "wrapper")
    wrapped = wrapped_session(tmp_path, session, str(tmp_path / "wrapper"), "cpu", embedder)
    wrapped._embedder = embedder
    methods = parse_configs("none,none@wrapped,full@wrapped")
    assert methods["none@wrapped"] == {**methods["none"], "store": "wrapped"}
    rows = run_fidelity(session, {4: made[4][:3]}, methods, max_new_tokens=4, wrapped=wrapped)
    by = {(r["label"], r["question"]): r for r in rows}
    for q in made[4][:3]:
        assert by["none@wrapped", q.id]["context_tokens"] == by["none", q.id]["context_tokens"] + 4 * (3 + 2)
        assert by["full@wrapped", q.id]["tokens"] == by["full", q.id]["tokens"]
        assert by["none@wrapped", q.id]["recomputed_tokens"] == 0
    with pytest.raises(ConfigError, match="need a wrapped store"):
        run_fidelity(session, {4: made[4][:1]}, methods)
    with pytest.raises(ConfigError, match="only store suffix"):
        parse_configs("none@other")


def test_a_wrapped_store_encoded_after_neighbours_is_measured_as_it_is(session, suite, tmp_path, embedder):
    """A workdir's wrapped store encoded with `encode-corpus --encode-after neighbours` (how #94 item 2 is
    measured) is reused with its mode, not refused for differing from the plain store's settings."""
    import shutil
    from dataclasses import replace

    from sparsecache.bench.suite import wrapped_session
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.wrapper.apply import initial_wrapper

    out, _, _ = suite
    shutil.copy(out / "corpus.jsonl", tmp_path)
    w = initial_wrapper(session.model, 3, 2)
    w.save(tmp_path / "wrapper")
    config = replace(session.store.config, wrapper=w.digest(), encode_after="neighbours", encode_after_chunks=2)
    encode_with([str(tmp_path / "corpus.jsonl")], tmp_path / "store-wrapped", session.store.dictionary, session.model,
                config, EncodeOptions(progress=False), embedder=embedder, wrapper=w)
    wrapped = wrapped_session(tmp_path, session, str(tmp_path / "wrapper"), "cpu", embedder)
    assert (wrapped.store.config.encode_after, wrapped.store.config.encode_after_chunks) == ("neighbours", 2)


def test_a_plain_store_encoded_after_neighbours_is_measured_as_it_is(suite, tmp_path, tiny_model_dir,
                                                                    tiny_dictionary_dir, tiny_model, tiny_dictionary,
                                                                    embedder):
    """The same for the workdir's plain store (how a model whose default store is plain, Qwen, is measured)."""
    import shutil

    from sparsecache.bench.suite import bench_fidelity
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.kvstore import KVStore
    from sparsecache.store import StoreConfig

    out, _, _ = suite  # the suite bench_fidelity makes for these settings: the same corpus
    shutil.copy(out / "corpus.jsonl", tmp_path)
    r = encode_with([str(tmp_path / "corpus.jsonl")], tmp_path / "store", tiny_dictionary, tiny_model,
                    StoreConfig(encode_after="neighbours"), EncodeOptions(progress=False), embedder=embedder)
    bench_fidelity(tmp_path, ks=(4, 8), questions=50, entities=20, methods=parse_methods("none"), limit=1,
                   model_path=str(tiny_model_dir), dictionary=str(tiny_dictionary_dir), two_chunk="retrieval")
    store = KVStore.open(tmp_path / "store")
    assert store.config.encode_after == "neighbours" and store.version == r.version  # reused: no new version


def test_kept_counts_only_what_full_prefill_answers_with_confidence_and_disagreement_counts_gains_too():
    from sparsecache.bench.fidelity import summarise

    # full prefill right on q0-q5, confident on q0-q3; the method right on q0, q1, q4 and on q8 (a gain)
    rows = [{"question": f"q{i}", "hops": 1, "correct": i in (0, 1, 4, 8), "full_correct": i < 6,
             "full_confident": i < 4, "same_answer": False, "token_agreement": 0.5, "ttft_ms": 1.0,
             **({"value_agreement": 1.0 if i < 2 else 0.5, "value_kl": 0.1} if i < 6 else {})} for i in range(10)]
    s = summarise(rows)
    assert s["confident"] == 4 and s["kept"] == 0.5 and s["kept_ci95"] == wilson(2, 4)
    assert s["disagreement"] == 0.4  # q2, q3, q5 lost, q8 gained
    assert s["value_agreement"] == 0.75 and s["value_kl"] == 0.1  # over the confident questions only
    assert s["correct_vs_full"] == round(4 / 6, 4)
    beats = [{**r, "correct": True} for r in rows]
    assert summarise(beats)["correct_vs_full"] == 1.0 and summarise(beats)["kept"] == 1.0  # capped at full prefill


def test_value_tokens_are_the_answers_tokens_over_the_true_value_and_their_kl_is_zero_for_full_prefill(tiny_model):
    import torch

    from sparsecache.measure.answers import CONFIDENT_MARGIN, value_figures, value_positions, value_reference

    tok = tiny_model.tokenizer
    tokens = tok("The town was founded in 1873, long ago.", add_special_tokens=False)["input_ids"]
    pos = value_positions(tok, tokens, "1873")
    assert pos and tok.decode([tokens[i] for i in pos]).strip() == "1873"
    assert value_positions(tok, tokens, "1874") == [] and value_positions(tok, tokens, "187") == []
    V = len(tok)
    lp = torch.full((len(tokens), V), -20.0)
    lp[torch.arange(len(tokens)), torch.tensor(tokens)] = -0.01
    lp[torch.arange(len(tokens)), (torch.tensor(tokens) + 1) % V] = -3.0  # a runner-up ~3 nats below
    lp = lp.log_softmax(-1)
    ref = {"tokens": tokens, **value_reference(lp, tokens, pos)}
    assert ref["margin"] == pytest.approx(2.99, abs=0.01) and ref["margin"] >= CONFIDENT_MARGIN
    same = value_figures(ref, lp)
    assert same["value_agreement"] == 1.0 and same["value_kl"] == pytest.approx(0.0, abs=1e-6)
    other = lp.clone()
    other[:, :] = lp.roll(1, dims=-1)  # every top-1 moved to the next id
    worse = value_figures(ref, other)
    assert worse["value_agreement"] == 0.0 and worse["value_kl"] > 1.0


def test_confident_only_runs_the_methods_only_where_full_prefill_is_confident(session, suite, tmp_path):
    _, made, _ = suite
    few = {4: made[4][:3]}
    results = tmp_path / "results.json"
    rows = run_fidelity(session, few, parse_methods("none"), results, max_new_tokens=4)
    full = [r for r in rows if r["label"] == "full"]
    data = json.loads(results.read_text())
    data["rows"] = [{**r, "confident": r["question"] == full[0]["question"]} if r["label"] == "full" else r
                    for r in full]  # as if full prefill were confident on the first question only
    results.write_text(json.dumps(data))
    again = run_fidelity(session, few, parse_methods("none"), results, max_new_tokens=4, confident_only=True)
    assert [r["question"] for r in again if r["label"] == "none"] == [full[0]["question"]]



def test_confident_only_where_full_prefill_is_confident_on_none_ends_with_full_prefills_rows(session, suite, tmp_path,
                                                                                            capsys):
    """A split where full prefill answers nothing with confidence (#94's two-chunk test split for SmolLM2-135M) leaves
    the methods nothing to answer: the run ends with full prefill's rows and says so, and does not fail."""
    _, made, _ = suite
    few = {4: made[4][:2]}
    results = tmp_path / "results.json"
    full = [r for r in run_fidelity(session, few, {}, results, max_new_tokens=4) if r["label"] == "full"]
    results.write_text(json.dumps({"rows": [{**r, "confident": False} for r in full]}))
    again = run_fidelity(session, few, parse_methods("none"), results, max_new_tokens=4, confident_only=True)
    assert [r["label"] for r in again] == ["full", "full"]
    assert "none  no questions to answer" in capsys.readouterr().err

def test_a_two_chunk_questions_chunks_are_placed_among_the_look_alikes():
    """#79: both needed chunks at fixed ranks, retrieval's best others around them in order;
    a one-chunk question's context stays retrieval's."""
    from types import SimpleNamespace

    from sparsecache.bench.fidelity import placed, retrieved
    from sparsecache.measure.suite import Question

    hits = ["a", "n2", "b", "c", "d", "e", "f", "g", "h", "i"]
    assert placed(hits, ["n1", "n2"], 8) == ["a", "b", "n1", "c", "n2", "d", "e", "f"]
    assert placed(hits, ["n1"], 4) == ["a", "n1", "n2", "b"]
    with pytest.raises(ValueError):
        placed(hits, ["x", "y", "z"], 2)

    docs = {d: f"c-{d}" for d in ("d1", "d2", "d3")}
    store = SimpleNamespace(chunks=lambda: [SimpleNamespace(ordinal=0, doc_id=d, id=c) for d, c in docs.items()])
    pool = [f"x{i}" for i in range(12)]
    session = SimpleNamespace(store=store, retrieve=lambda q, k: [{"id": c} for c in pool[:k]])
    two = Question("q2", "?", "v", ["d1", "d2"], [], 2)
    one = Question("q1", "?", "v", ["d3"], [], 1)
    got = retrieved(session, {8: [two, one]}, place_needed=True)[8]
    assert got[0].chunks == ["x0", "x1", "c-d1", "x2", "c-d2", "x3", "x4", "x5"] and got[0].needed == ["c-d1", "c-d2"]
    assert got[1].chunks == pool[:8]  # retrieval missed it: full prefill cannot answer either
    assert retrieved(session, {8: [two]})[8][0].chunks == pool[:8]  # #69's suites: retrieval alone
