"""Text in, in two parts: (1) the corpus an encode reads (`text.corpus`): documents found in
directories, files, JSONL and HTML, their ids and hashes, bad input named, and their chunks;
(2) the text a dictionary or wrapper learns from (`text.documents`): the built-in train and
held-out splits, files read, and token chunks interleaved across sources."""

from __future__ import annotations

import json
import random
import tracemalloc

import pytest

from sparsecache.errors import TextError
from sparsecache.text import corpus
from sparsecache.text.corpus import chunks, scan
from sparsecache.text.documents import builtin_documents, read_documents, token_chunks


# ================================================================ 1. the corpus an encode reads


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return tiny_model.tokenizer


def test_scan_finds_every_kind_with_relative_ids(tmp_path):
    (tmp_path / "a.md").write_text("Alpha.\n\nBeta.")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.html").write_text("<p>One <b>two</b> &amp; three</p><script>x()</script><p>Four</p>")
    (tmp_path / "sub" / "c.jsonl").write_text(
        json.dumps({"id": "../../etc/passwd", "text": "evil id"}) + "\n\n"
        + json.dumps({"id": 7, "text": "seven", "meta": {"lang": "en"}}) + "\n")
    (tmp_path / ".hidden.txt").write_text("skip me")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\x00\x00")
    found = scan([str(tmp_path)])
    assert [s.id for s in found] == ["../../etc/passwd", "7", "a.md", "sub/b.html"]
    html = next(s for s in found if s.id == "sub/b.html")
    text = "".join(html.blocks())
    assert "One two & three" in text and "Four" in text and "x()" not in text
    assert next(s for s in found if s.id == "7").meta == {"lang": "en"}


def test_hash_changes_with_content_only(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("some text")
    h1 = scan([str(f)])[0].hash
    assert scan([str(f)])[0].hash == h1
    f.write_text("some text!")
    assert scan([str(f)])[0].hash != h1


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "no documents"),
    (lambda p: (p / "x.txt").write_bytes(b"abc\x00\x01"), "binary file"),
    (lambda p: (p / "d.jsonl").write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n'), "duplicate document ids: a"),
    (lambda p: (p / "d.jsonl").write_text('{"id": "a"}\n'), "needs a string \"text\""),
    (lambda p: (p / "d.jsonl").write_text('{"id": "a\\u0000", "text": "x"}\n'), "cannot contain a NUL"),
    (lambda p: (p / "d.jsonl").write_text('{"text": "t"}\n'), "needs an \"id\""),
    (lambda p: (p / "d.jsonl").write_text('not json\n'), "d.jsonl:1: not a JSON object"),
    # random bytes without a NUL decode to mostly U+FFFD: binary, not text with a few bad bytes
    (lambda p: (p / "r.txt").write_bytes(bytes(random.Random(0).randrange(1, 256) for _ in range(4000))),
     "binary file, not text .* invalid UTF-8 or control codes"),
    (lambda p: (p / "c.txt").write_bytes(b"\x01\x02\x03\x1b[0m" * 100), "binary file"),
])
def test_bad_input_is_a_clear_error(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(TextError, match=message):
        scan([str(tmp_path)])


def test_missing_path_and_nothing_given(tmp_path):
    with pytest.raises(TextError, match="not found"):
        scan([str(tmp_path / "nope")])
    with pytest.raises(TextError, match="no corpus"):
        scan([])


def test_empty_file_is_skipped_with_a_warning(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "full.txt").write_text("text")
    with pytest.warns(UserWarning, match="empty file skipped"):
        assert [s.id for s in scan([str(tmp_path)])] == ["full.txt"]


def test_whitespace_only_file_is_skipped_with_a_warning(tmp_path):
    (tmp_path / "blank.txt").write_text("  \n\n\t \n")
    (tmp_path / "full.txt").write_text("text")
    with pytest.warns(UserWarning, match="blank.txt: whitespace-only file skipped"):
        assert [s.id for s in scan([str(tmp_path)])] == ["full.txt"]


def test_mostly_text_with_a_few_bad_bytes_is_still_text(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("Les élèves ont visité le musée. ".encode("latin-1") * 50)
    assert [s.id for s in scan([str(tmp_path)])] == ["latin1.txt"]


def test_invalid_utf8_in_jsonl_is_replaced_with_a_warning(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'{"id": "a", "text": "caf\xe9 au lait"}\n')
    with pytest.warns(UserWarning, match="d.jsonl:1: invalid UTF-8"):
        (src,) = scan([str(tmp_path)])
    assert src.text == "caf\ufffd au lait"


@pytest.mark.parametrize("reader", ["scan", "read_documents"])
def test_invalid_utf8_is_replaced_with_a_warning(tmp_path, monkeypatch, reader):
    """Both readers (the corpus an encode reads, the text learn-dict reads) turn a stray byte that
    is not UTF-8 into U+FFFD with a warning; `scan` streams, so its bad byte lands mid-stream,
    after a block boundary."""
    monkeypatch.setattr(corpus, "BLOCK_BYTES", 8)
    f = tmp_path / "latin1.txt"
    f.write_bytes("héllo wörld, ".encode() + b"caf\xe9 " + "ünïcode after".encode())
    with pytest.warns(UserWarning, match="invalid UTF-8"):
        text = "".join(scan([str(f)])[0].blocks()) if reader == "scan" else read_documents([str(f)])[0].text
    assert text == "héllo wörld, caf\ufffd ünïcode after"


def test_chunks_respect_the_limit_and_keep_the_text(tokenizer):
    text = "\n\n".join(f"Paragraph {i}. " + "Sentence here is short. " * (i % 7 + 1) for i in range(40))
    src = scan_text(text)
    got = list(chunks(src, tokenizer, 64))
    assert all(len(c.token_ids) <= 64 for c in got)
    assert "".join(c.text for c in got) == text  # cut only at paragraph/sentence ends
    assert [c.ordinal for c in got] == list(range(len(got)))
    assert len({c.id for c in got}) == len(got)
    for c in got:  # a chunk's tokens are its text's tokens (pieces tokenised separately)
        assert tokenizer.decode(list(c.token_ids)) == c.text


def test_a_sentence_longer_than_a_chunk_is_cut_by_tokens(tokenizer):
    text = "word " * 500
    got = list(chunks(scan_text(text), tokenizer, 50))
    assert all(len(c.token_ids) <= 50 for c in got)
    assert sum(len(c.token_ids) for c in got) >= 500


def test_large_document_streams(tmp_path, tokenizer, monkeypatch):
    """Memory held while chunking stays near one block, not the file size."""
    monkeypatch.setattr(corpus, "BLOCK_BYTES", 4096)
    f = tmp_path / "big.txt"
    para = "A sentence that goes on for a while. " * 5 + "\n\n"
    f.write_text(para * 4000)  # ~750 KB
    src = scan([str(f)])[0]
    tracemalloc.start()
    n = 0
    for c in chunks(src, tokenizer, 256):
        n += len(c.token_ids)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n > 150_000
    assert peak < f.stat().st_size / 4


def scan_text(text: str):
    return corpus.Source("doc", "h", text=text)


# ================================================================ 2. the text a dictionary or wrapper learns from


def test_builtin_split_is_deterministic_and_disjoint():
    train = {d.name for d in builtin_documents("train")}
    held = {d.name for d in builtin_documents("heldout")}
    assert train and held and not train & held
    assert {d.name for d in builtin_documents("heldout")} == held
    assert len(held) < 0.2 * len(train)


def test_read_documents_from_dirs_and_files(tmp_path):
    (tmp_path / "a.md").write_text("alpha text")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta text")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    docs = read_documents([str(tmp_path)])
    assert sorted(d.text for d in docs) == ["alpha text", "beta text"]


@pytest.mark.parametrize("setup,msg", [
    (lambda p: None, "not found"),
    (lambda p: p.write_text(""), "no text"),
    (lambda p: p.write_bytes(b"\x00" * 10), "binary"),
])
def test_bad_text_is_a_clear_error(tmp_path, setup, msg):
    p = tmp_path / "x.txt"
    setup(p)
    with pytest.raises(TextError, match=msg):
        read_documents([str(p)])
    with pytest.raises(TextError):
        read_documents([])


def test_token_chunks_cover_documents(tiny_model):
    docs = builtin_documents("heldout")[:2]
    chunks = token_chunks(docs, tiny_model.tokenizer, 100, min_tokens=1)
    total = sum(len(tiny_model.tokenizer(d.text, add_special_tokens=False)["input_ids"]) for d in docs)
    assert sum(len(c) for c in chunks) == total and max(len(c) for c in chunks) <= 100


def test_several_sources_are_interleaved_so_any_budget_spans_them(tiny_model, tmp_path):
    """learn-dict --text A --text B: a calibration budget takes chunks of A and B in turn, not
    all of A first; a single source keeps its document order (shipped recipes unchanged)."""
    from sparsecache.text.documents import interleaved_chunks

    for name, word in (("a", "apple"), ("b", "bridge")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "t.txt").write_text(f" {word}" * 400)
    docs = read_documents([str(tmp_path / "a"), str(tmp_path / "b")])
    assert [d.source for d in docs] == [str(tmp_path / "a"), str(tmp_path / "b")]
    tok = tiny_model.tokenizer
    chunks = interleaved_chunks(docs, tok, 100)
    first = [tok.decode(c).split()[0] for c in chunks[:4]]
    assert first == ["apple", "bridge", "apple", "bridge"]
    only = read_documents(["builtin"], split="heldout")[:3]
    assert interleaved_chunks(only, tok, 100) == token_chunks(only, tok, 100)
