"""vLLM serving RAG prompts through SparsecacheConnector, on the real default model (CPU build of vLLM).

One in-process engine serves every test here (building one costs ~20 s); requests choose the
KV source (exact per-chunk raw files or the store's codes) through their kv_transfer_params.
The connector's counters (vLLM's Prometheus metrics) show whether a request was served from
the store or fell back to prefill, so an equality can never pass by a silent fallback.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sparsecache.serving import PARAMS_KEY as PARAMS

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

QUESTIONS = ("What does this statement do?", "Give one example of its use.")
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from pydoc_data.topics import topics

    from sparsecache.cli.main import cli
    from sparsecache.session import Session

    root = tmp_path_factory.mktemp("vllm")
    (root / "corpus").mkdir()
    for t in ("assert", "break", "continue", "pass"):
        (root / "corpus" / f"{t}.txt").write_text(topics[t][:1200])
    r = CliRunner().invoke(cli, ["encode-corpus", str(root / "corpus"), "--store", str(root / "store")])
    assert r.exit_code == 0, r.output
    session = Session(root / "store")
    session.raw_files([c.id for c in session.store.chunks()])  # exact KV per chunk, beside the store
    return session


@pytest.fixture(scope="module")
def rag(store):
    from sparsecache.serving import RagPrompts

    return RagPrompts(store.store)


def connector_config(store_path, **extra) -> dict:
    return {"kv_connector": "SparsecacheConnector", "kv_connector_module_path": "sparsecache.vllm",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(store_path), "version_check_s": 0, **extra}}


def start_engine(model_path, store_path, max_model_len: int = 4096):
    """An in-process fp32 engine with the connector on `store_path` (ENGINE_ENV already set)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    # vLLM 0.32's start-up scan of every module (register_triton_kernel_overrides) crashes on
    # llvmlite's `ffi.lib`, whose __dict__ is a C-function proxy; encoding (numba) imported it
    # into this test process. Hide it while the engine starts; a serving process never has it.
    hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in ("llvmlite", "numba")}
    try:
        return LLM(str(model_path), dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                   enable_prefix_caching=False, max_model_len=max_model_len, disable_log_stats=False,
                   kv_transfer_config=KVTransferConfig(**connector_config(store_path)))
    finally:
        for k, v in hidden.items():
            sys.modules.setdefault(k, v)


@pytest.fixture(scope="module")
def llm(store):
    from sparsecache.gguf import default_model_dir

    saved = {k: os.environ.get(k) for k in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    try:
        yield start_engine(default_model_dir(), store.store.root)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def counters(llm) -> dict:
    return {m.name.removeprefix("vllm:sparsecache_"): m.value for m in llm.get_metrics() if "sparsecache" in m.name}


def generate(llm, req, params: dict | None, max_tokens: int = 16):
    """(token ids, first-token top-5 logprobs {token: logprob}, counter deltas) of one greedy request."""
    from vllm import SamplingParams

    before = counters(llm)
    extra = None if params is None else {"kv_transfer_params": params}
    out = llm.generate([req.vllm_prompt()], SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=5,
                                                           extra_args=extra), use_tqdm=False)[0].outputs[0]
    after = counters(llm)
    first = {t: lp.logprob for t, lp in out.logprobs[0].items()}
    return list(out.token_ids), first, {k: after[k] - before.get(k, 0) for k in after}


# One model's engine agreement, in its own process: vLLM keeps one KV connector per process
# (its first engine's). Argument 1 is a model (HF directory or GGUF), 2 a store encoded with it.
AGREEMENT_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[4])  # the tests directory: test_vllm's engine and request helpers
from test_vllm import ENGINE_ENV, generate, start_engine, with_source
os.environ.update(ENGINE_ENV)
import torch
from sparsecache.gguf import model_dir
from sparsecache.serving import RagPrompts
from sparsecache.session import Session

import sparsecache.blend as blend
import sparsecache.vllm.connector as connector
chosen = {"vllm": [], "query": []}
def recording(where, choose):
    def wrapped(*args, **kwargs):
        positions = choose(*args, **kwargs)
        chosen[where].append(positions.tolist())
        return positions
    return wrapped
connector.choose, blend.choose = recording("vllm", blend.choose), recording("query", blend.choose)

model, store, question = sys.argv[1:4]
session = Session(store, model)
rag = RagPrompts(session.store, model)
llm = start_engine(model_dir(model), store, max_model_len=2048)
ids = [c.id for c in session.store.chunks()]
one = rag.request(question, chunks=ids[:1])
tokens, first, _ = generate(llm, one, with_source(one, "raw"), max_tokens=8)
full_tokens, full_first, _ = generate(llm, one, None, max_tokens=8)
result = {"one_chunk": {"same_tokens": tokens == full_tokens,
                        "max_logprob_diff": max(abs(first[t] - full_first[t]) for t in full_first)}}
req = rag.request(question, chunks=ids)
for source, method in (("raw", "raw"), ("codes", "none")):
    tokens, first, delta = generate(llm, req, with_source(req, source), max_tokens=8)
    ours = session.query(question, chunks=ids, method=method, max_new_tokens=8)
    logprobs = torch.log_softmax(ours.logits, -1)
    result[source] = {"context_tokens": req.context_tokens, "delta": delta,
                      "same_answer": session.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer,
                      "max_logprob_diff": max(abs(lp - float(logprobs[t])) for t, lp in first.items())}
tokens, first, delta = generate(llm, req, with_source(req, "codes", method="infoflow", recompute_ratio=1.0), max_tokens=8)
full_tokens, full_first, _ = generate(llm, req, None, max_tokens=8)
result["blend-all"] = {"delta": delta, "same_tokens": tokens == full_tokens,
                       "max_logprob_diff": max(abs(first[t] - full_first[t]) for t in full_first)}
tokens, first, delta = generate(llm, req, with_source(req, "codes", method="infoflow"), max_tokens=8)
ours = session.query(question, chunks=ids, max_new_tokens=8)
logprobs = torch.log_softmax(ours.logits, -1)
result["blend"] = {"delta": delta, "ours_recomputed": ours.recomputed_tokens,
                   "same_positions": chosen["vllm"][-1] == chosen["query"][-1],
                   "same_answer": session.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer,
                   "max_logprob_diff": max(abs(lp - float(logprobs[t])) for t, lp in first.items())}
print("RESULT " + json.dumps(result))
"""


def engine_agreement(model: str, store_root, question: str, timeout: int = 900) -> dict:
    """AGREEMENT_SCRIPT's result for `model` over the store at `store_root`: one chunk of exact
    KV against vLLM's prefill, several chunks (raw, codes) against our own loop, ratio 1.0
    against vLLM's prefill, and the default blend against `query`'s."""
    proc = subprocess.run([sys.executable, "-c", AGREEMENT_SCRIPT, str(model), str(store_root), question,
                           str(Path(__file__).parent)], capture_output=True, text=True, timeout=timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


def with_source(req, source: str, **more) -> dict:
    """The request's kv_transfer_params with `source` and any other per-request options;
    method `none` (the KV as stored, no blending) unless `more` names one."""
    p = json.loads(json.dumps(req.kv_transfer_params))
    p["sparsecache"].update(source=source, **{"method": "none", **more})
    return p


def test_one_chunk_of_exact_kv_equals_vllm_full_prefill(llm, store, rag):
    """A chunk's KV is computed after the prefix alone, so with one chunk it is the KV full prefill
    makes: injecting it must give vLLM's own greedy answer, token for token (layout, positions, slots)."""
    for chunk in store.store.chunks():
        for q in QUESTIONS:
            req = rag.request(q, chunks=[chunk.id])
            injected, lp_injected, delta = generate(llm, req, with_source(req, "raw"))
            full, lp_full, _ = generate(llm, req, None)
            assert delta["tokens"] == req.context_tokens and delta["fallbacks"] == 0
            assert injected == full, (chunk.id, q)
            for t in lp_full:  # fp16 raw files against fp32 prefill
                assert abs(lp_injected[t] - lp_full[t]) < 2e-2


@pytest.mark.parametrize("source, method", [("raw", "raw"), ("codes", "none")])
def test_several_chunks_match_sparsecaches_own_loop(llm, store, rag, source, method):
    ids = [c.id for c in store.store.chunks()]
    for q in QUESTIONS:
        ours = store.query(q, chunks=ids, method=method, max_new_tokens=12)
        req = rag.request(q, chunks=ids)
        tokens, first, delta = generate(llm, req, with_source(req, source), max_tokens=12)
        assert delta["chunks"] == len(ids) and delta["fallbacks"] == 0
        logprobs = torch.log_softmax(ours.logits, -1)
        for t, lp in first.items():
            assert abs(lp - float(logprobs[t])) < 2e-3, (t, lp, float(logprobs[t]))
        assert store.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer


# ------------------------------------------------------------------ blending in the connector


def test_recomputing_every_chunk_token_is_vllms_own_prefill(llm, store, rag):
    """Ratio 1.0: the connector runs every chunk token through vLLM's own layers at its global
    position over the whole context: that is vLLM's full prefill, token for token."""
    ids = [c.id for c in store.store.chunks()]
    for chunks in (ids, ids[1:3], ids[::-1]):
        for q in QUESTIONS:
            req = rag.request(q, chunks=chunks)
            tokens, first, delta = generate(llm, req, with_source(req, "codes", method="infoflow", recompute_ratio=1.0))
            full, lp_full, _ = generate(llm, req, None)
            chunk_tokens = req.context_tokens - len(store.store.prefix()[0])
            assert delta["recomputed"] == chunk_tokens and delta["fallbacks"] == delta["load_errors"] == 0
            assert tokens == full, (chunks, q)
            for t in lp_full:  # only the prefix's KV comes from the store (computed by transformers)
                assert abs(first[t] - lp_full[t]) < 1e-3, (t, first[t], lp_full[t])


def test_blending_runs_on_the_engines_own_model(llm):
    """No second copy: the stack the connector blends on is the model vLLM serves with."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    stack = get_kv_transfer_group().stack
    assert stack is not None and llm.apply_model(id) == [id(stack.model)]


def test_a_model_blending_cannot_drive_is_refused_at_start_up_with_one_line(llm, monkeypatch):
    """No plugin (the model never seen loading) or a model without the decoder-stack shape:
    the worker says why once and serves `none` (the scheduler's claims stay valid)."""
    import types

    import sparsecache.vllm.connector as connector

    said = []
    monkeypatch.setattr(connector.logger, "warning", lambda msg, *a: said.append(msg % a))
    config = types.SimpleNamespace(model_config=object())
    monkeypatch.setattr(connector, "loaded_model", lambda model_config: None)
    assert connector.SparsecacheConnector._stack(None, config) is None
    monkeypatch.setattr(connector, "loaded_model", lambda model_config: torch.nn.Linear(2, 2))
    assert connector.SparsecacheConnector._stack(None, config) is None
    assert len(said) == 2 and "entry point" in said[0] and "decoder stack" in said[1], said


@pytest.fixture
def chosen(monkeypatch):
    """Positions each engine's blending selected, in call order: {"vllm": [...], "query": [...]}."""
    import sparsecache.blend as blend
    import sparsecache.vllm.connector as connector

    seen = {"vllm": [], "query": []}

    def recording(where, choose):
        def wrapped(*args, **kwargs):
            positions = choose(*args, **kwargs)
            seen[where].append(positions.tolist())
            return positions
        return wrapped

    monkeypatch.setattr(connector, "choose", recording("vllm", blend.choose))
    monkeypatch.setattr(blend, "choose", recording("query", blend.choose))
    return seen


@pytest.mark.parametrize("method", ["a3", "infoflow", "cacheblend", "cacheclip"])
def test_each_method_selects_what_query_selects(llm, store, rag, chosen, method):
    """One implementation: the connector's blend on vLLM's layers and `query`'s on transformers'
    select the same tokens for the same chunks and question, and answer alike."""
    ids = [c.id for c in store.store.chunks()]
    for q in QUESTIONS:
        ours = store.query(q, chunks=ids, method=method, recompute_ratio=0.15, max_new_tokens=12)
        req = rag.request(q, chunks=ids)
        tokens, first, delta = generate(llm, req, with_source(req, "codes", method=method, recompute_ratio=0.15),
                                        max_tokens=12)
        assert chosen["vllm"][-1] == chosen["query"][-1] and delta["recomputed"] == ours.recomputed_tokens > 0
        logprobs = torch.log_softmax(ours.logits, -1)
        for t, lp in first.items():
            assert abs(lp - float(logprobs[t])) < 2e-3, (t, lp, float(logprobs[t]))
        assert store.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer


def test_a_blend_that_fails_after_the_claim_is_recomputed_by_vllm(llm, store, rag, monkeypatch):
    import sparsecache.vllm.connector as connector

    req = rag.request(QUESTIONS[0], chunks=[c.id for c in store.store.chunks()][:3])
    full, _, _ = generate(llm, req, None)

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in the recomputation")

    monkeypatch.setattr(connector, "recompute", broken)
    tokens, _, delta = generate(llm, req, with_source(req, "codes", method="infoflow"))
    assert delta["load_errors"] > 0 and delta["tokens"] == 0 and tokens == full


def test_concurrent_requests_in_one_step_each_get_their_own_blend(llm, store, rag):
    """Continuous batching: requests with different chunks and methods share engine steps;
    each answers as it does alone."""
    from vllm import SamplingParams

    ids = [c.id for c in store.store.chunks()]
    cases = [(QUESTIONS[0], ids, "infoflow"), (QUESTIONS[1], ids[:2], "a3"), (QUESTIONS[0], ids[2:], "none"),
             (QUESTIONS[1], ids[::-1], "cacheblend")]
    reqs = [rag.request(q, chunks=c) for q, c, _ in cases]
    params = [with_source(r, "codes", method=m) for r, (_, _, m) in zip(reqs, cases)]
    alone = [generate(llm, r, p) for r, p in zip(reqs, params)]
    before = counters(llm)
    outs = llm.generate([r.vllm_prompt() for r in reqs],
                        [SamplingParams(max_tokens=16, temperature=0, logprobs=5, extra_args={"kv_transfer_params": p})
                         for p in params], use_tqdm=False)
    after = counters(llm)
    assert after["requests"] - before["requests"] == len(cases) and after["fallbacks"] == before.get("fallbacks", 0)
    for out, (tokens, first, _) in zip(outs, alone):
        got = out.outputs[0]
        assert list(got.token_ids) == tokens
        assert all(abs(got.logprobs[0][t].logprob - first[t]) < 1e-4 for t in first if t in got.logprobs[0])


def test_blending_options_are_checked_per_request(llm, store, rag):
    req = rag.request(QUESTIONS[0], chunks=[c.id for c in store.store.chunks()][:2])
    full, _, _ = generate(llm, req, None)
    for bad in ({"method": "cake"}, {"method": "infoflow", "recompute_ratio": 2}, {"method": "nope"}):
        tokens, _, delta = generate(llm, req, with_source(req, "codes", **bad))
        assert delta["fallbacks"] == 1 and delta["tokens"] == 0 and tokens == full, bad


def test_a_mismatched_or_broken_request_is_prefilled_and_answered_correctly(llm, store, rag):
    ids = [c.id for c in store.store.chunks()]
    req = rag.request(QUESTIONS[0], chunks=ids[:2])
    full, _, _ = generate(llm, req, None)
    wrong_order = {"sparsecache": {"chunks": req.kv_transfer_params["sparsecache"]["chunks"][::-1]}}
    unknown = {"sparsecache": {"chunks": ids[:1] + ["no-such-chunk"]}}
    malformed = {"sparsecache": {"chunks": "not a list"}}
    for params in (wrong_order, unknown, malformed):
        tokens, _, delta = generate(llm, req, params)
        assert delta["fallbacks"] == 1 and delta["tokens"] == 0, params
        assert tokens == full, params
    edited = type(req)(list(req.prompt_token_ids), req.kv_transfer_params, req.chunks, req.context_tokens)
    edited.prompt_token_ids[req.context_tokens - 5] += 1  # one token of the last chunk differs
    tokens, _, delta = generate(llm, edited, req.kv_transfer_params)
    assert delta["fallbacks"] == 1 and tokens == generate(llm, edited, None)[0]


def test_a_store_damaged_after_the_claim_is_recomputed_by_vllm(llm, store, rag):
    """The scheduler checks tokens (intact), then the worker finds the codes' files fail their
    checksum: the blocks are reported, vLLM recomputes them, and the answer is full prefill's."""
    ids = [c.id for c in store.store.chunks()]
    req = rag.request(QUESTIONS[1], chunks=ids[:2])
    full, _, _ = generate(llm, req, None)
    files = [f for f in (store.store.root / store.store.data / "k_indices").rglob("*") if f.is_file()]
    saved = {f: f.read_bytes() for f in files}
    try:
        for f in files:
            f.write_bytes(b"garbage" + saved[f][7:])
        damaged = [generate(llm, req, with_source(req, "codes", method=m)) for m in ("none", "infoflow")]
    finally:
        for f, data in saved.items():
            f.write_bytes(data)
    for tokens, _, delta in damaged:  # loaded as stored, and blended
        assert delta["load_errors"] > 0 and delta["tokens"] == 0
        assert tokens == full
    assert generate(llm, req, with_source(req, "codes"))[2]["tokens"] == req.context_tokens  # repaired: served again


def test_rag_prompts_lay_out_prefix_chunks_question(store, rag):
    from sparsecache.blend import question_ids

    ids = [c.id for c in store.store.chunks()][:3]
    req = rag.request("why?", chunks=ids, order="given")
    expected = store.store.prefix()[0] + [t for toks in store.store.tokens(ids) for t in toks]
    assert req.prompt_token_ids == expected + question_ids(store.model, "why?")
    assert req.context_tokens == len(expected)
    assert req.kv_transfer_params == {"sparsecache": {"chunks": ids, "version": store.store.version}}
    assert rag.request("why?", chunks=ids).kv_transfer_params["sparsecache"]["chunks"] == ids[::-1]  # query's default
    hits = rag.request("What does pass do?", top_k=2)
    assert len(hits.chunks) == 2 and hits.kv_transfer_params["sparsecache"]["chunks"] == [h["id"] for h in hits.chunks]


def test_rag_prompts_refuse_a_store_of_another_model(store, tiny_model_dir):
    from sparsecache.errors import DictionaryMismatch
    from sparsecache.serving import RagPrompts

    with pytest.raises(DictionaryMismatch, match="encoded with model"):
        RagPrompts(store.store, model=str(tiny_model_dir))


def test_a_new_version_is_followed_and_stale_chunks_fall_back(llm, store, rag):
    """Runs last: it re-encodes the store under the running engine. A request laid out from the
    old version is still served from it (its chunks' KV matches its tokens); without a version,
    a chunk the new version no longer has is prefilled; one built against the new version is served."""
    from sparsecache.cli.main import cli
    from sparsecache.serving import RagPrompts

    corpus = store.store.root.parent / "corpus"
    edited = next(c.id for c in store.store.chunks() if "assert" in c.doc_id)
    other = next(c.id for c in store.store.chunks() if "assert" not in c.doc_id)
    stale = rag.request(QUESTIONS[0], chunks=[other, edited])
    (corpus / "assert.txt").write_text((corpus / "assert.txt").read_text() + "\nAn edit after publishing.")
    r = CliRunner().invoke(cli, ["encode-corpus", str(corpus), "--store", str(store.store.root)])
    assert r.exit_code == 0, r.output
    fresh_rag = RagPrompts(store.store.root)
    assert fresh_rag.store.version > store.store.version
    pinned = generate(llm, stale, stale.kv_transfer_params)[2]
    assert pinned["tokens"] == stale.context_tokens and not pinned.get("fallbacks")
    unpinned = {PARAMS: {k: v for k, v in stale.kv_transfer_params[PARAMS].items() if k != "version"}}
    tokens, _, delta = generate(llm, stale, unpinned)
    assert delta["fallbacks"] == 1 and tokens == generate(llm, stale, None)[0]
    gone = {PARAMS: {**stale.kv_transfer_params[PARAMS], "version": 10 ** 6}}
    assert generate(llm, stale, gone)[2]["fallbacks"] == 1
    fresh = fresh_rag.request(QUESTIONS[0], chunks=[c.id for c in fresh_rag.store.chunks()][:2])
    assert generate(llm, fresh, fresh.kv_transfer_params)[2]["tokens"] == fresh.context_tokens
