"""Cloze questions over a store's own text (#69's format c): spans found and blanked, splits by
document, contexts from retrieval, and a run against full prefill through `run_fidelity`."""

import json

import pytest

from sparsecache.bench.fidelity import parse_configs, run_fidelity, table
from sparsecache.errors import ConfigError
from sparsecache.measure.cloze import BLANK, blank, make_cloze, sentences, split_of
from sparsecache.measure.suite import load_suite, save_suite

DOCS = {
    "uuid.md": "The uuid module generates identifiers as specified in RFC 4122. Call uuid.uuid4() for a random one.",
    "zipapp.md": "Omitting ARGS works as for argparse, using sys.argv as the argument list. It was added in 3.5.",
    "tea.md": "The harbour town of Velmora brews tea with smoked pine needles since 1873. Its mayor serves it at noon.",
    "ast.md": "Pass type_comments=True to get back type comments where the syntax allows them to appear.",
}


@pytest.mark.parametrize("sentence,kind,span", [
    ("The uuid module generates identifiers as specified in RFC 4122.", "rfc", "RFC 4122"),
    ("Changed in version 3.8: the slash may be used to mark positional-only parameters.", "version", "3.8"),
    ("Pass type_comments=True to get back type comments where the syntax allows.", "identifier", "type_comments"),
    ("Omitting ARGS works as for argparse, using sys.argv[1:] as the argument list.", "identifier", "sys.argv"),
    ("The harbour town brews its tea with smoked pine needles since 1873, they say.", "number", "1873"),
])
def test_a_sentence_is_asked_about_its_most_distinctive_span(sentence, kind, span):
    got_kind, got_span, blanked = blank(sentence)
    assert (got_kind, got_span) == (kind, span) and blanked.count(BLANK) == 1
    assert blanked.replace(BLANK, span) == " ".join(sentence.split())


def test_sentences_without_one_clear_span_are_not_asked():
    assert blank("Nothing in this sentence is a number or an identifier at all.") is None
    assert blank("Both 1873 and 1874 appear here, so which one is asked is unclear.") is None  # two numbers
    assert blank("RFC 4122.") is None  # too short to be found by retrieval
    assert sentences("One. Two!\n\nThree? Four") == ["One.", "Two!", "Three?", "Four"]


def test_splits_are_by_document_and_stable():
    assert {split_of(d) for d in DOCS} <= {"dev", "test"}
    assert [split_of(d) for d in DOCS] == [split_of(d) for d in DOCS]


@pytest.fixture(scope="module")
def cloze_session(tiny_model, tiny_dictionary, embedder, tmp_path_factory):
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig

    root = tmp_path_factory.mktemp("cloze")
    (root / "corpus.jsonl").write_text("".join(json.dumps({"id": d, "text": t}) + "\n" for d, t in DOCS.items()))
    encode_with([str(root / "corpus.jsonl")], root / "store", tiny_dictionary, tiny_model,
                StoreConfig(chunk_tokens=24), EncodeOptions(progress=False), embedder=embedder)
    return root, Session(root / "store", tiny_model)


def test_cloze_questions_come_from_the_stores_chunks_with_retrievals_context(cloze_session):
    root, session = cloze_session
    chunks = {c.id: c for c in session.store.chunks()}
    for split in ("dev", "test"):
        docs = [d for d in DOCS if split_of(d) == split]
        if not docs:
            continue
        made = make_cloze(session, ks=(2,), questions=1, split=split)
        q = made[2][0]
        assert chunks[q.needed[0]].doc_id in docs and len(q.chunks) == 2
        assert q.chunks == [h["id"] for h in session.retrieve(q.question, 2)]
        assert BLANK in q.question and q.truth.lower() not in q.question.lower().replace(BLANK.lower(), "")
        with pytest.raises(ConfigError, match="ask for fewer"):
            make_cloze(session, ks=(2,), questions=100, split=split)
    save_suite(root / "s", made)
    assert load_suite(root / "s") == made  # a cloze question's chunk ids survive the file


def test_a_cloze_run_scores_against_full_prefill_of_the_retrieved_chunks(cloze_session):
    root, session = cloze_session
    split = split_of(next(iter(DOCS)))
    suite = make_cloze(session, ks=(2,), questions=1, split=split)
    rows = run_fidelity(session, suite, parse_configs("infoflow:1.0,gold"), root / "results.json", max_new_tokens=4)
    by = {r["label"]: r for r in rows}
    assert by["infoflow:1.0"]["answer"] == by["full"]["answer"]  # every token recomputed: full prefill
    assert by["gold"]["context_tokens"] < by["full"]["context_tokens"]  # the needed chunk alone
    assert {r["label"] for r in table(rows)} == {"full", "infoflow:1.0", "gold"}
