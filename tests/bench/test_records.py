"""The timetable records generator (#69's format b, held out): look-alike services, disjoint
splits, facts in the documents they name, contexts from the store's retrieval."""

import json
import re

import pytest

from sparsecache.bench.records import ASK, KINDS, make_records, records_suite
from sparsecache.errors import ConfigError


def _docs(out):
    return {d["id"]: d["text"] for d in map(json.loads, (out / "corpus.jsonl").read_text().splitlines())}


def test_every_fact_is_in_the_documents_it_names_and_services_have_look_alikes(tmp_path):
    facts = make_records(tmp_path, questions=100, families=10, split="dev")
    docs = _docs(tmp_path)
    assert len(facts) == 100 and sum(f["hops"] == 2 for f in facts) == 20
    for f in facts:
        assert f["truth"] in docs[f["docs"][-1]]
        if f["hops"] == 2:
            assert f["docs"][0].startswith("service-") and f["docs"][1].startswith("operator-")
            assert docs[f["docs"][1]].split("\n")[0].lstrip("# ") in docs[f["docs"][0]]  # the service names its operator
    family = [t for d, t in docs.items() if d.startswith("service-000-")]
    names = {t.split("\n")[0].removeprefix("# ").removesuffix(" timetable") for t in family}
    assert len(names) == len(KINDS) and len({n.split()[0] for n in names}) == 1  # one name, three services
    assert make_records(tmp_path / "again", questions=100, families=10, split="dev") == facts  # seeded


def test_dev_and_test_share_no_names_or_phrasings(tmp_path):
    made = {s: make_records(tmp_path / s, questions=100, families=10, split=s) for s in ("dev", "test")}
    words = {s: set(re.findall(r"[A-Z][a-z]+", (tmp_path / s / "corpus.jsonl").read_text())) for s in made}
    fixed = {"Stop", "Departs", "Platform", "Operated", "It", "Rail", "Lines", "Transit", "Coaches", "Square",
             "Bridge", "Halt", "Cross", "Gate", "Express", "Local", "Night"}
    assert not (words["dev"] & words["test"]) - fixed - {"A"}
    for fact, by_split in ASK.items():
        assert not set(by_split["dev"]) & set(by_split["test"])
    with pytest.raises(ConfigError, match="ask for fewer"):
        make_records(tmp_path / "x", questions=1000, families=5)


def test_a_records_questions_context_is_what_retrieval_returns(tmp_path, tiny_model, tiny_dictionary, embedder):
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig

    facts = make_records(tmp_path, questions=10, families=4, split="test")
    encode_with([str(tmp_path / "corpus.jsonl")], tmp_path / "store", tiny_dictionary, tiny_model,
                StoreConfig(chunk_tokens=512), EncodeOptions(progress=False), embedder=embedder)
    session = Session(tmp_path / "store", tiny_model)
    suite = records_suite(session, facts, ks=(4,))
    chunk_doc = {c.id: c.doc_id for c in session.store.chunks()}
    for q, f in zip(suite[4], facts):
        assert q.chunks == [h["id"] for h in session.retrieve(f["question"], 4)]
        assert [chunk_doc[c] for c in q.needed] == f["docs"]


def test_bench_fidelity_asks_records_questions_after_their_store_exists(tmp_path, tiny_model, tiny_dictionary,
                                                                       embedder, monkeypatch):
    """`bench fidelity --format records`: the corpus is generated, encoded, then each question's
    context comes from that store's retrieval; a rerun reuses the questions."""
    import sparsecache.bench.suite as bench
    from sparsecache.bench.fidelity import parse_configs
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.measure.suite import load_suite
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig

    def suite_session(work, settings, make, device, corpus=None, config=None):
        if not (work / "suite.json").exists():
            make(tiny_model)
            (work / "suite.json").write_text(json.dumps(settings))
        encode_with([str(work / "corpus.jsonl")], work / "store", tiny_dictionary, tiny_model, StoreConfig(),
                    EncodeOptions(progress=False), embedder=embedder)
        return Session(work / "store", tiny_model)

    monkeypatch.setattr(bench, "_suite_session", suite_session)
    args = dict(ks=(4,), questions=5, methods=parse_configs("none"), limit=2, format="records", entities=4)
    r = bench.bench_fidelity(tmp_path, **args)
    made = load_suite(tmp_path)[4]
    assert len(made) == 5 and all(len(q.chunks) == 4 for q in made)
    assert [(x["label"], x["questions"]) for x in r["rows"]] == [("full", 2), ("none", 2)]
    bench.bench_fidelity(tmp_path, **args)
    assert load_suite(tmp_path)[4] == made
