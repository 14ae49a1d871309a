"""Learned chunk wrappers: the wrapped layout against full prefill, gradients, the artifact, and
`learn-wrapper` end to end (checkpoint, resume, the learning curve)."""

import json

import pytest
import torch
from click.testing import CliRunner

from sparsecache.model.generate import question_ids
from sparsecache.errors import ConfigError
from sparsecache.model import default_prefix_ids, extract_kv
from sparsecache.wrapper.apply import Wrapper, continuation_logits, initial_wrapper, wrapped_kv
from sparsecache.wrapper.config import WrapperConfig


def _ids(model, text):
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def _embedded(model, ids):
    with torch.no_grad():
        return model.hf.model.embed_tokens(torch.tensor(ids)).float()


def test_one_wrapped_chunk_is_full_prefill_of_the_wrapped_sequence(default_model):
    """k = 1: `prefix | header chunk trailer | question` from the per-chunk path gives the logits of a
    full prefill of the same tokens (the wrapper here is real tokens' embeddings)."""
    m = default_model
    prefix, chunk = default_prefix_ids(m), _ids(m, "The town of Velesk was founded in 1721. It has nine bridges.")
    head, tail = _ids(m, "Here is a document:"), _ids(m, "\n\n")
    q = question_ids(m, "When was Velesk founded?")
    with torch.no_grad():
        keys, values = wrapped_kv(m, [chunk], prefix, _embedded(m, head), _embedded(m, tail))
        got = continuation_logits(m, keys, values, q)
        want = m.hf(input_ids=torch.tensor([prefix + head + chunk + tail + q])).logits[0, -len(q):].float()
    assert keys.shape[1] == len(prefix + head + chunk + tail)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)


def test_no_wrapper_is_the_stores_per_chunk_layout(default_model):
    """Without a wrapper the layout is what a store's `none` reads: each chunk's pre-RoPE K/V after
    the prefix, rotated to consecutive global positions after the prefix's own."""
    m = default_model
    prefix = default_prefix_ids(m)
    chunks = [_ids(m, "Alpha beta gamma delta."), _ids(m, "One two three four five six.")]
    with torch.no_grad():
        keys, values = wrapped_kv(m, chunks, prefix, None, None)
    parts = extract_kv(m, [prefix] + chunks, [])[:1] + extract_kv(m, chunks, prefix)
    k = torch.cat([p[0] for p in parts], 1)
    v = torch.cat([p[1] for p in parts], 1)
    torch.testing.assert_close(keys, m.rope.rotate(k, torch.arange(k.shape[1])), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(values, v, atol=1e-4, rtol=1e-4)


def test_the_loss_reaches_header_and_trailer_and_leaves_the_model_alone(tiny_model):
    from sparsecache.wrapper.learn import distillation_loss

    m = tiny_model
    for p in m.hf.parameters():
        p.requires_grad_(False)
    w = initial_wrapper(m, 2, 3)
    header, trailer = w.header.requires_grad_(), w.trailer.requires_grad_()
    target = {"inputs": [5, 6, 7], "n": 2, "idx": torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
              "logp": torch.tensor([[-0.1, -2.0, -4.0], [-1.0, -1.0, -3.0]]).half()}
    loss = distillation_loss(m, [1, 2], [[10, 11, 12], [13, 14]], target, header, trailer)
    loss.backward()
    assert loss.item() >= 0
    assert header.grad.abs().sum() > 0 and trailer.grad.abs().sum() > 0
    assert all(p.grad is None for p in m.hf.parameters())


def test_a_linked_trailer_is_recomputed_in_place_and_learned_through_that_pass(tiny_model):
    """A linked wrapper's student recomputes every trailer after all the chunks before it: with one
    chunk that is what the trailer was encoded after, so nothing changes; with two the second chunk's
    trailer reads the first; the loss reaches header and trailer through the recomputation too."""
    from sparsecache.wrapper.apply import wrapped_ids
    from sparsecache.wrapper.learn import distillation_loss, student_logits

    m = tiny_model
    for p in m.hf.parameters():
        p.requires_grad_(False)
    w = initial_wrapper(m, 2, 3, linked=True)
    before = m.soft  # the session's shared model may read a wrapped store another test opened
    prefix, chunks, q = [1, 2], [[10, 11, 12, 40, 41], [13, 14, 15]], [5, 6, 7]
    ids, links = wrapped_ids(prefix, chunks, 2, 3)
    assert ids == [1, 2, -1, -2, 10, 11, 12, 40, 41, -3, -4, -5, -1, -2, 13, 14, 15, -3, -4, -5]
    assert links == [9, 10, 11, 17, 18, 19] and all(ids[p] < -2 for p in links)
    with torch.no_grad():
        one_linked, cache = student_logits(m, prefix, chunks[:1], q, w.header, w.trailer, linked=True)
        one_stored, _ = student_logits(m, prefix, chunks[:1], q, w.header, w.trailer)
        two_linked, _ = student_logits(m, prefix, chunks, q, w.header, w.trailer, linked=True)
        two_stored, _ = student_logits(m, prefix, chunks, q, w.header, w.trailer)
    torch.testing.assert_close(one_linked, one_stored, atol=2e-5, rtol=1e-4)
    assert cache.get_seq_length() == len(prefix) + 2 + 5 + 3 + len(q)
    assert not torch.allclose(two_linked, two_stored, atol=1e-4)
    assert m.soft is before  # the learned table is the pass's only: the model's own is put back
    header, trailer = w.header.requires_grad_(), w.trailer.requires_grad_()
    target = {"inputs": q, "n": 2, "idx": torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
              "logp": torch.tensor([[-0.1, -2.0, -4.0], [-1.0, -1.0, -3.0]]).half()}
    loss = distillation_loss(m, prefix, chunks, target, header, trailer, linked=True)
    loss.backward()
    assert header.grad.abs().sum() > 0 and trailer.grad.abs().sum() > 0
    assert all(p.grad is None for p in m.hf.parameters())


def test_a_wrapper_round_trips_and_refuses_another_model(tmp_path, tiny_model, default_model):
    w = initial_wrapper(tiny_model, 3, 2)
    w.meta = {"recipe": {"steps": 1}}
    w.save(tmp_path / "w")
    back = Wrapper.load(tmp_path / "w" / "wrapper.json")
    assert back.lengths == (3, 2) and back.meta == w.meta
    assert torch.equal(back.header, w.header) and torch.equal(back.trailer, w.trailer)
    back.check_model(tiny_model)
    with pytest.raises(ConfigError, match="learned for"):
        back.check_model(default_model)
    with pytest.raises(ConfigError, match="not a wrapper"):
        Wrapper.load(tmp_path)


def test_bad_settings_are_refused():
    for bad in ({"header": 0, "trailer": 0}, {"k": 1}, {"text_share": 1.5}, {"steps": 0}, {"lr": 0.0},
                {"linked": True, "trailer": 0}):
        with pytest.raises(ConfigError):
            WrapperConfig(**bad)


TINY = ["--header", "1", "--trailer", "1", "--steps", "4", "--k", "2", "--prompts", "3", "--eval-every", "2",
        "--eval-questions", "1"]


def test_learn_wrapper_checkpoints_resumes_and_writes_its_curve(tiny_model_dir, tmp_path, monkeypatch):
    """An interrupted run resumes from its checkpoint to the wrapper an uninterrupted run learns."""
    from sparsecache.cli.main import cli
    import sparsecache.wrapper.learn as lw

    args = ["learn-wrapper", "--model", str(tiny_model_dir), "--device", "cpu", *TINY]
    whole = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "whole")])
    assert whole.exit_code == 0, whole.output
    assert "none with the wrapper" in whole.output
    curve = json.loads((tmp_path / "whole" / "curve.json").read_text())
    assert [p["step"] for p in curve["curve"]] == [0, 2, 4]
    assert {"correct_vs_full", "right_where_full_right", "token_agreement", "text_ppl", "text_top1"} <= \
        set(curve["plain"]) & set(curve["curve"][-1])
    assert "held-out text" in whole.output
    assert (tmp_path / "whole" / "curve.png").stat().st_size > 0

    real, calls = lw.distillation_loss, []

    def dies_at_step_3(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(lw, "distillation_loss", dies_at_step_3)
    out = str(tmp_path / "cut")
    assert CliRunner().invoke(cli, [*args, "--out", out]).exit_code != 0
    refused = CliRunner().invoke(cli, [*args, "--out", out])
    assert refused.exit_code != 0 and "--resume" in refused.output
    monkeypatch.setattr(lw, "distillation_loss", real)
    resumed = CliRunner().invoke(cli, [*args, "--out", out, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    a, b = Wrapper.load(tmp_path / "whole"), Wrapper.load(out)
    torch.testing.assert_close(a.header, b.header)
    torch.testing.assert_close(a.trailer, b.trailer)
    other = CliRunner().invoke(cli, [*args, "--out", out, "--resume", "--lr", "0.5"])
    assert other.exit_code != 0 and "other settings" in other.output


# ---------------------------------------------------------------- stores encoded with a wrapper


QUESTION = "What does the text say?"


@pytest.fixture
def wrapped_store(tmp_path, corpus_dir, tiny_model_dir, tiny_dictionary_dir, tiny_model):
    """A store of the tiny model encoded with a wrapper made of real tokens' embeddings, so a wrapped
    chunk is exactly prefix | head tokens | chunk | tail tokens, which full prefill can read."""
    from support.cli import cli_encode

    w = initial_wrapper(tiny_model, 3, 2)
    w.save(tmp_path / "wrapper")
    r = cli_encode(corpus_dir, tmp_path / "wrapped", tiny_model_dir, tiny_dictionary_dir, "--wrapper", tmp_path / "wrapper")
    assert r.exit_code == 0, r.output
    return tmp_path / "wrapped", w


def _real_ids(model, w):
    """The real tokens the tiny wrapper's soft tokens are the embeddings of (initial_wrapper's texts)."""
    head = (_ids(model, "The following passage is one of several documents.") * 3)[:3]
    tail = (_ids(model, "\n\n") * 2)[:2]
    torch.testing.assert_close(w.header, _embedded(model, head))
    torch.testing.assert_close(w.trailer, _embedded(model, tail))
    return head, tail


def test_a_wrapped_store_keeps_the_header_once_and_each_chunks_trailer(wrapped_store, tiny_model, corpus_dir):
    from sparsecache.kvstore import KVStore
    from sparsecache.model import prefix_ids

    path, w = wrapped_store
    s = KVStore.open(path)
    assert s.config.wrapper == w.digest()
    header_ids, trailer_ids = w.ids()
    assert s.prefix()[0] == prefix_ids(tiny_model, None) and s.header()[0] == header_ids == [-1, -2, -3]
    assert s.encoded_after() == s.prefix()[0] + header_ids
    layout = s.layout()  # the one definition of a context every reader lays out
    assert layout.prefix == tuple(s.prefix()[0]) and layout.header == (-1, -2, -3) and layout.trailer == 2
    torch.testing.assert_close(s.soft(), w.table())
    chunk = s.chunks()[0]
    tokens = s.tokens([chunk.id])[0]
    assert tokens[-2:] == trailer_ids == [-4, -5] and all(t >= 0 for t in tokens[:-2])
    assert chunk.token_length == len(tokens)
    info = s.info()
    assert info["wrapper"] == {"digest": w.digest(), "header": 3, "trailer": 2, "trailer_tokens": 2 * info["chunks"],
                               "linked": False}
    c = info["compression"]  # the trailers' codes count as overhead, not as compressed text
    text = info["stored_tokens"] - info["wrapper"]["trailer_tokens"]
    assert c["measured_codes_only"] == round(c["fp16_bytes_per_token"] * text / sum(
        info["bytes_on_disk"][n] for n in ("k_indices", "k_coefficients", "v_indices", "v_coefficients")), 3)


def test_recomputing_everything_in_a_wrapped_store_is_full_prefill_of_the_wrapped_text(wrapped_store, tiny_model,
                                                                                       embedder):
    """Soft tokens are recomputed like any other (their embeddings from the store): infoflow at r = 1
    gives full prefill's logits of prefix | head chunk₁ tail | head chunk₂ tail | question, and `full`
    prefills the chunks' own text alone, as it does from a plain store."""
    from sparsecache.model.generate import question_ids as q_ids
    from sparsecache.model.generate import full_prefill
    from sparsecache.query.session import Session

    path, w = wrapped_store
    head, tail = _real_ids(tiny_model, w)
    s = Session(path, tiny_model)
    s._embedder = embedder
    ids = [c.id for c in s.store.chunks()][:2]
    got = s.query(QUESTION, chunks=ids, method="infoflow", recompute_ratio=1.0, max_new_tokens=1)
    text = [[t for t in toks if t >= 0] for toks in s.store.tokens(ids[::-1])]  # the default order: best last
    q = q_ids(tiny_model, QUESTION)
    seq = s.store.prefix()[0] + [t for c in text for t in head + c + tail] + q
    want, _ = full_prefill(seq, tiny_model)
    torch.testing.assert_close(got.logits, want, atol=2e-4, rtol=1e-4)
    assert got.context_tokens == len(seq) - len(q)
    full = s.query(QUESTION, chunks=ids, method="full", max_new_tokens=1)
    plain, _ = full_prefill(s.store.prefix()[0] + [t for c in text for t in c] + q, tiny_model)
    torch.testing.assert_close(full.logits, plain, atol=2e-4, rtol=1e-4)
    none = s.query(QUESTION, chunks=ids, method="none", max_new_tokens=2)
    assert none.context_tokens == len(seq) - len(q) and none.recomputed_tokens == 0
    # k = 1: exact per-chunk K/V (raw, fp16) of a wrapped chunk is full prefill of the wrapped text
    raw = s.query(QUESTION, chunks=ids[:1], method="raw", max_new_tokens=1)
    one, _ = full_prefill(s.store.prefix()[0] + head + text[-1] + tail + q, tiny_model)
    torch.testing.assert_close(raw.logits, one, atol=2e-2, rtol=1e-2)
    for method in ("a3", "cacheblend", "cacheclip", "cake"):  # every method lays the wrapper out
        exact = s.query(QUESTION, chunks=ids, method=method, recompute_ratio=1.0, max_new_tokens=1,
                        **({"cake_split": 2} if method == "cake" else {}))
        torch.testing.assert_close(exact.logits, want, atol=2e-4, rtol=1e-4, msg=method)
    kept = s.query(QUESTION, chunks=ids, method="superposition", paths=1, max_new_tokens=2)
    assert kept.context_tokens in {len(s.store.prefix()[0]) + len(head) + len(c) + len(tail) for c in text}  # one path


def test_a_header_only_wrapper_learns_encodes_and_answers_as_full_prefill(tmp_path, corpus_dir,
                                                                          tiny_model_dir, tiny_dictionary_dir, embedder):
    """`--trailer 0` (a header before every chunk, nothing after it: running text continues straight
    from the chunk): its loss reaches the header, a store keeps no soft token with any chunk, and
    recomputing everything gives full prefill of prefix | head chunk₁ | head chunk₂ | question."""
    from support.cli import cli_encode
    from sparsecache.model.generate import full_prefill
    from sparsecache.kvstore import KVStore
    from sparsecache.wrapper.learn import distillation_loss
    from sparsecache.model import load_model
    from sparsecache.query.session import Session

    m = load_model(str(tiny_model_dir))  # its own: a model reads one wrapper's soft tokens, and others gave theirs
    w = initial_wrapper(m, 3, 0)
    assert w.lengths == (3, 0) and w.ids() == ([-1, -2, -3], [])
    header = w.header.clone().requires_grad_()
    target = {"inputs": [5, 6], "n": 1, "idx": torch.tensor([[1, 2]], dtype=torch.int32),
              "logp": torch.tensor([[-0.1, -2.5]]).half()}
    distillation_loss(m, [1, 2], [[10, 11, 12], [13, 14]], target, header, w.trailer).backward()
    assert header.grad.abs().sum() > 0
    w.save(tmp_path / "w")
    r = cli_encode(corpus_dir, tmp_path / "s", tiny_model_dir, tiny_dictionary_dir, "--wrapper", tmp_path / "w")
    assert r.exit_code == 0, r.output
    store = KVStore.open(tmp_path / "s")
    assert store.info()["wrapper"]["trailer_tokens"] == 0
    assert all(t >= 0 for toks in store.tokens([c.id for c in store.chunks()]) for t in toks)
    s = Session(tmp_path / "s", m)
    s._embedder = embedder
    ids = [c.id for c in s.store.chunks()][:2]
    got = s.query(QUESTION, chunks=ids, method="infoflow", recompute_ratio=1.0, max_new_tokens=1)
    head = (_ids(m, "The following passage is one of several documents.") * 3)[:3]
    text = s.store.tokens(ids[::-1])
    q = question_ids(m, QUESTION)
    want, _ = full_prefill(s.store.prefix()[0] + [t for c in text for t in head + c] + q, m)
    torch.testing.assert_close(got.logits, want, atol=2e-4, rtol=1e-4)


def test_a_wrapped_store_refuses_another_wrapper_and_keeps_its_own(wrapped_store, tmp_path, corpus_dir, tiny_model,
                                                                   tiny_model_dir, tiny_dictionary_dir):
    from support.cli import cli_encode
    from sparsecache.kvstore import KVStore

    path, w = wrapped_store
    other = initial_wrapper(tiny_model, 2, 2)
    other.save(tmp_path / "other")
    r = cli_encode(corpus_dir, path, tiny_model_dir, tiny_dictionary_dir, "--wrapper", tmp_path / "other")
    assert r.exit_code == 1 and "was built with wrapper=" in r.output and "Traceback" not in r.output
    (corpus_dir / "added.txt").write_text("A new document arrives in the nightly run.\n\nIt has two paragraphs.\n")
    r = cli_encode(corpus_dir, path, tiny_model_dir, tiny_dictionary_dir)  # no --wrapper: the store's own
    assert r.exit_code == 0, r.output
    s = KVStore.open(path)
    new = [c for c in s.chunks() if "added" in c.doc_id]
    assert new and s.tokens([new[0].id])[0][-2:] == w.ids()[1]
    plain = tmp_path / "plain"
    assert cli_encode(corpus_dir, plain, tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    assert KVStore.open(plain).header() is None and KVStore.open(plain).soft() is None


def test_serving_lays_soft_tokens_out_as_placeholders_and_salts_with_the_wrapper(wrapped_store, tiny_model_dir):
    """vLLM takes token ids only: each soft token is the model's placeholder id in the prompt, every
    chunk `header chunk trailer`; the salt names the wrapper, whose KV those placeholders stand for."""
    import dataclasses

    from sparsecache.vllm.serving import RagPrompts
    from sparsecache.wrapper.apply import placeholder_id

    path, w = wrapped_store
    rag = RagPrompts(path, model=str(tiny_model_dir))
    ids = [c.id for c in rag.store.chunks()][:2]
    req = rag.request("What is it?", chunks=ids)
    fill = rag.placeholder
    assert fill == placeholder_id(rag.model_config) >= 0
    H, T = w.lengths
    want = rag.store.prefix()[0]
    for toks in rag.store.tokens(req.params["chunks"]):  # in prompt order
        want += [fill] * H + [t if t >= 0 else fill for t in toks]
    assert req.prompt_token_ids[: req.context_tokens] == want and all(t >= 0 for t in req.prompt_token_ids)
    assert req.wrapper == w.digest()
    assert req.cache_salt != dataclasses.replace(req, wrapper=None).cache_salt


def test_the_shipped_wrapper_is_found_for_the_default_model_only(default_model, tiny_model, tmp_path, corpus_dir,
                                                                 tiny_model_dir, tiny_dictionary_dir):
    from support.cli import cli_encode
    from sparsecache.wrapper.apply import default_wrapper, shipped_wrapper

    w = Wrapper.load(shipped_wrapper(default_model.fingerprint()))
    w.check_model(default_model)
    assert w.lengths == (16, 0) and w.meta["store_eval"]["split"] == "dev"
    assert "specimen" in w.meta["recipe"]["questions"]  # #69: learned from data no evaluation format is drawn from
    assert default_wrapper(default_model.fingerprint()) == shipped_wrapper(default_model.fingerprint())
    assert default_wrapper(tiny_model.fingerprint()) is None  # a model with no wrapper: plain stores, as before
    with pytest.raises(ConfigError, match="no wrapper ships"):
        shipped_wrapper(tiny_model.fingerprint())
    r = cli_encode(corpus_dir, tmp_path / "s", tiny_model_dir, tiny_dictionary_dir, "--wrapper", "shipped")
    assert r.exit_code == 1 and "no wrapper ships" in r.output and "Traceback" not in r.output


def test_a_shipped_wrapper_measured_to_cost_answers_warns_when_named(default_model, recwarn):
    """Qwen's neutral wrapper ships but cost its default answers (#94): naming it says so; the default
    model's does not warn."""
    from sparsecache.codec.dictionary import SHIPPED_DIR
    from sparsecache.wrapper.apply import load_wrapper

    qwen = json.loads((SHIPPED_DIR / "qwen2.5-coder-0.5b-wrapper-h16-t0-neutral" / "wrapper.json").read_text())["model"]
    with pytest.warns(UserWarning, match="plain by default"):
        assert load_wrapper("shipped", qwen).lengths == (16, 0)
    load_wrapper("shipped", default_model.fingerprint())
    assert not [w for w in recwarn if "shipped wrapper" in str(w.message)]


def test_a_new_store_gets_its_models_default_wrapper_unless_none_and_an_existing_one_keeps_its_own(
        tmp_path, corpus_dir, tiny_model, tiny_model_dir, tiny_dictionary_dir, monkeypatch, wrapped_store):
    """encode-corpus with no --wrapper: a new store of a model with a default wrapper (DEFAULT_WRAPPERS,
    found by fingerprint among the shipped ones) is wrapped with it; `--wrapper none` makes it plain,
    and is refused for a store built wrapped; an existing store keeps what it was built with."""
    from support.cli import cli_encode
    import sparsecache.codec.dictionary
    import sparsecache.wrapper.apply
    from sparsecache.kvstore import KVStore

    shipped = tmp_path / "shipped"
    w = initial_wrapper(tiny_model, 2, 1)
    w.save(shipped / "tiny-wrapper")
    monkeypatch.setattr(sparsecache.codec.dictionary, "SHIPPED_DIR", shipped)
    monkeypatch.setattr(sparsecache.wrapper.apply, "DEFAULT_WRAPPERS", ("tiny-wrapper",))
    assert cli_encode(corpus_dir, tmp_path / "new", tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    assert KVStore.open(tmp_path / "new").config.wrapper == w.digest()
    r = cli_encode(corpus_dir, tmp_path / "plain", tiny_model_dir, tiny_dictionary_dir, "--wrapper", "none")
    assert r.exit_code == 0, r.output
    assert KVStore.open(tmp_path / "plain").config.wrapper is None
    (corpus_dir / "added.txt").write_text("Another document arrives.\n")
    assert cli_encode(corpus_dir, tmp_path / "plain", tiny_model_dir, tiny_dictionary_dir).exit_code == 0
    assert KVStore.open(tmp_path / "plain").config.wrapper is None  # its own, not the default
    path, own = wrapped_store
    r = cli_encode(corpus_dir, path, tiny_model_dir, tiny_dictionary_dir, "--wrapper", "none")
    assert r.exit_code == 1 and f"built with wrapper={own.digest()}" in r.output and "Traceback" not in r.output


def test_a_served_cheap_context_of_a_wrapped_store_is_laid_out_as_text(wrapped_store, tiny_model_dir):
    """vLLM prefills a cheap context itself (`query.cheap`), and a soft token's placeholder id is not
    text: `serve` lays such a context out as full prefill reads it (the prefix and the chunks' text),
    tells the connector to prefill it and reports full prefill; a context read from the store keeps
    its soft tokens. (On the default model, r = 1 is such a context: tests/vllm/test_serve.py.)"""
    pytest.importorskip("prometheus_client")
    from sparsecache.query.methods.full import text_ids
    from sparsecache.vllm.server import PREFILL_ALL, Rag, ServeConfig

    path, _ = wrapped_store
    rag = Rag(ServeConfig(str(path), model=str(tiny_model_dir), top_k=2))
    try:
        rag.device = "cpu"
        store = rag.prompts.store
        ids = [c.id for c in store.chunks()][:2]
        laid_out = rag.prompts.request("What is it?", chunks=ids)
        question = laid_out.prompt_token_ids[laid_out.context_tokens:]
        text = text_ids(store, laid_out.params["chunks"])  # in prompt order
        read = rag.request("What is it?", rag.options({"chunks": ids, "prefill_under": 0}))
        assert read.prompt_token_ids == laid_out.prompt_token_ids and not read.prefilled
        assert read.params["prefill_under"] == 0 and rag.sources(read)["method"] == "infoflow"
        cheap = rag.request("What is it?", rag.options({"chunks": ids, "prefill_under": 10 ** 6}))
        assert cheap.prompt_token_ids == text + question
        assert cheap.context_tokens == len(text) < laid_out.context_tokens
        assert cheap.prefilled and cheap.params["prefill_under"] == PREFILL_ALL
        assert rag.sources(cheap)["method"] == "full" and cheap.cache_salt != read.cache_salt
    finally:
        rag.close()


def test_a_linked_store_recomputes_every_chunks_trailer_in_every_query(tmp_path, corpus_dir, tiny_model_dir,
                                                                      tiny_dictionary_dir, tiny_model, embedder):
    """A store encoded with a linked wrapper says so (its digest, `info`, a root format older releases
    refuse); every method recomputes each chunk's trailer, `none` only those, in the question's pass;
    recomputing everything is still full prefill of the wrapped text."""
    from support.cli import cli_encode

    from sparsecache.kvstore import KVStore
    from sparsecache.model.generate import full_prefill
    from sparsecache.model.generate import question_ids as q_ids
    from sparsecache.query.session import Session
    from sparsecache.store.layout import FORMAT_AFTER

    w = initial_wrapper(tiny_model, 3, 2, linked=True)
    w.save(tmp_path / "linked")
    assert Wrapper.load(tmp_path / "linked").linked and w.digest().split(":")[0] == "3+2L"
    r = cli_encode(corpus_dir, tmp_path / "store", tiny_model_dir, tiny_dictionary_dir, "--wrapper", tmp_path / "linked")
    assert r.exit_code == 0, r.output
    store = KVStore.open(tmp_path / "store")
    assert store.config.linked and store.layout().linked and store.info()["wrapper"]["linked"] is True
    from sparsecache.cli.main import cli

    said = CliRunner().invoke(cli, ["info", str(tmp_path / "store")])
    assert said.exit_code == 0 and "linked: every query recomputes each chunk's trailer" in said.output
    assert store.attrs["format"] == FORMAT_AFTER  # a release that would read its trailers as stored refuses it
    s = Session(tmp_path / "store", tiny_model)
    s._embedder = embedder
    ids = [c.id for c in s.store.chunks()][:3]
    none = s.query(QUESTION, chunks=ids, method="none", max_new_tokens=2)
    assert none.recomputed_tokens == 2 * len(ids)
    some = s.query(QUESTION, chunks=ids, method="infoflow", recompute_ratio=0.1, max_new_tokens=2)
    assert some.recomputed_tokens >= 2 * len(ids) + 1
    from sparsecache.query.budget import Costs

    s.costs = Costs(a_full=10.0, p=2.0, a_store=20.0, s=0.2)  # a TTFT budget pays for the trailers first
    budget = s.query(QUESTION, chunks=ids, max_new_tokens=1, prefill_under=0)  # the default: infoflow, a budget
    bought = s.costs.ratio(budget.context_tokens, 0.5)
    assert budget.recompute_ratio == pytest.approx(bought - 2 * len(ids) / budget.context_tokens, abs=1e-4)
    s.costs = None
    head, tail = _real_ids(tiny_model, w)
    got = s.query(QUESTION, chunks=ids[:2], method="infoflow", recompute_ratio=1.0, max_new_tokens=1)
    text = [[t for t in toks if t >= 0] for toks in s.store.tokens(ids[:2][::-1])]
    want, _ = full_prefill(s.store.prefix()[0] + [t for c in text for t in head + c + tail] + q_ids(tiny_model, QUESTION),
                           tiny_model)
    torch.testing.assert_close(got.logits, want, atol=2e-4, rtol=1e-4)


def test_learn_wrapper_linked_learns_a_linked_wrapper(tiny_model_dir, tmp_path):
    from sparsecache.cli.main import cli

    args = ["learn-wrapper", "--model", str(tiny_model_dir), "--device", "cpu", "--header", "1", "--trailer", "1",
            "--steps", "2", "--k", "2", "--prompts", "3", "--eval-every", "2", "--eval-questions", "1", "--linked"]
    r = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "w")])
    assert r.exit_code == 0, r.output
    w = Wrapper.load(tmp_path / "w")
    assert w.linked and w.lengths == (1, 1) and w.meta["recipe"]["linked"] is True
    refused = CliRunner().invoke(cli, [*args, "--trailer", "0", "--out", str(tmp_path / "x")])
    assert refused.exit_code != 0 and "--trailer >= 1" in refused.output
