import pytest

from sparsecache.errors import TextError
from sparsecache.text.documents import builtin_documents, read_documents, token_chunks


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


def test_invalid_utf8_is_replaced_with_a_warning(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"caf\xe9 ok")
    with pytest.warns(UserWarning, match="invalid UTF-8"):
        (doc,) = read_documents([str(p)])
    assert doc.text == "caf\ufffd ok"


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
