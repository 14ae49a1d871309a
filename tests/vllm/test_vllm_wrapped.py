"""vLLM serving a store encoded with a learned wrapper, on the real default model (CPU build of vLLM).

The wrapper here is made of real tokens' embeddings (`initial_wrapper`), so a wrapped chunk is
exactly `prefix | head tokens | chunk | tail tokens`, a sequence vLLM can prefill itself from
token ids: what the connector serves from placeholder ids plus the store's KV must be that
prefill, token for token. The connector's counters show that nothing fell back to prefill.
"""


import pytest
import torch
from support.cli import invoke
from support.engine import engine, generate, with_source

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

QUESTION = "What does this statement do?"
HEAD, TAIL = 4, 2


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory, default_model):
    from pydoc_data.topics import topics

    from sparsecache.query.session import Session
    from sparsecache.wrapper.apply import initial_wrapper

    root = tmp_path_factory.mktemp("vllm-wrapped")
    (root / "corpus").mkdir()
    for t in ("assert", "break", "pass"):
        (root / "corpus" / f"{t}.txt").write_text(topics[t][:900])
    w = initial_wrapper(default_model, HEAD, TAIL)
    w.save(root / "wrapper")
    r = invoke("encode-corpus", root / "corpus", "--store", root / "store", "--wrapper", root / "wrapper")
    assert r.exit_code == 0, r.output
    session = Session(root / "store", default_model)
    session.raw_files([c.id for c in session.store.chunks()])
    return session, w


@pytest.fixture(scope="module")
def rag(wrapped):
    from sparsecache.vllm.serving import RagPrompts

    return RagPrompts(wrapped[0].store)


@pytest.fixture(scope="module")
def llm(wrapped):
    from sparsecache.model.gguf import default_model_dir

    with engine(default_model_dir(), wrapped[0].store.root) as llm:
        yield llm


def _as_text(req, session):
    """The request with each placeholder run replaced by the real tokens the wrapper embeds
    (`initial_wrapper`'s texts): the wrapped sequence as plain token ids, which vLLM prefills itself."""
    tok = session.model.tokenizer
    head = tok("The following passage is one of several documents.", add_special_tokens=False)["input_ids"]
    tail = tok("\n\n", add_special_tokens=False)["input_ids"]
    head, tail = (head * HEAD)[:HEAD], (tail * TAIL)[:TAIL]
    ids = list(session.store.prefix()[0])
    for toks in session.store.tokens(req.params["chunks"]):
        ids += head + [t for t in toks if t >= 0] + tail
    return {"prompt_token_ids": ids + req.prompt_token_ids[req.context_tokens:]}


def test_wrapped_chunks_served_from_the_store_are_vllms_prefill_of_the_wrapped_text(llm, wrapped, rag):
    """k = 1 from exact per-chunk KV, and k = 3 with every chunk and soft token recomputed (r = 1):
    the answer vLLM gives from placeholders + store KV is its own prefill of the wrapped text."""
    session, _ = wrapped
    ids = [c.id for c in session.store.chunks()]
    for chunks, params in (([ids[0]], dict(source="raw")), ([ids[1]], dict(source="raw")),
                           (ids, dict(source="codes", method="infoflow", recompute_ratio=1.0))):
        req = rag.request(QUESTION, chunks=chunks)
        assert req.wrapper and all(t >= 0 for t in req.prompt_token_ids)
        served, lp_served, delta = generate(llm, req, with_source(req, **params))
        prefill, lp_prefill, _ = generate_text(llm, _as_text(req, session))
        assert delta["tokens"] == req.context_tokens and delta["fallbacks"] == delta["load_errors"] == 0
        if params.get("recompute_ratio"):
            prefix = len(session.store.prefix()[0])
            assert delta["recomputed"] == req.context_tokens - prefix  # soft tokens included
        assert served == prefill, (chunks, params)
        tol = 2e-2 if params["source"] == "raw" else 1e-3  # raw files are fp16
        for t in lp_prefill:
            assert abs(lp_served[t] - lp_prefill[t]) < tol


def test_decoded_wrapped_chunks_answer_as_sparsecaches_own_loop(llm, wrapped, rag):
    session, _ = wrapped
    ids = [c.id for c in session.store.chunks()]
    ours = session.query(QUESTION, chunks=ids, method="none", max_new_tokens=12, prefill_under=0)
    req = rag.request(QUESTION, chunks=ids)
    tokens, first, delta = generate(llm, req, with_source(req, "codes"), max_tokens=12)
    assert delta["chunks"] == len(ids) and delta["fallbacks"] == 0
    assert req.context_tokens == ours.context_tokens
    logprobs = torch.log_softmax(ours.logits, -1)
    for t, lp in first.items():
        assert abs(lp - float(logprobs[t])) < 2e-3, (t, lp, float(logprobs[t]))
    assert session.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer


def test_a_cheap_context_is_prefilled_as_text_and_one_with_soft_tokens_is_read(llm, wrapped, rag):
    """The connector leaves a cheap context (`query.cheap`) to vLLM's prefill only where the prompt is
    text (`RagRequest.as_text`, what `serve` sends): then the answer is vLLM's own prefill of it. Laid
    out with the wrapper's placeholders, the same context is read from the store, cheap or not."""
    session, _ = wrapped
    req = rag.request(QUESTION, chunks=[c.id for c in session.store.chunks()])
    text = req.as_text()
    assert text.context_tokens < req.context_tokens and text.prompt_token_ids[text.context_tokens:] == \
        req.prompt_token_ids[req.context_tokens:]
    cheap = {"method": "infoflow", "prefill_under": 10 ** 6}
    served, _, delta = generate(llm, text, with_source(text, "codes", **cheap))
    assert delta["prefilled_cheap"] == 1 and delta["tokens"] == delta["fallbacks"] == 0
    assert served == generate_text(llm, {"prompt_token_ids": text.prompt_token_ids})[0]
    _, _, delta = generate(llm, req, with_source(req, "codes", **cheap))
    assert delta["prefilled_cheap"] == delta["fallbacks"] == 0 and delta["tokens"] == req.context_tokens


def generate_text(llm, prompt: dict, max_tokens: int = 16):
    """(token ids, first-token top-5 logprobs, None) of vLLM's own greedy prefill of `prompt`."""
    from vllm import SamplingParams

    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), {t: lp.logprob for t, lp in out.logprobs[0].items()}, None
