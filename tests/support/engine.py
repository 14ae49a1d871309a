"""An in-process vLLM engine with the SparsecacheConnector, greedy requests through it with their
counters, and one model's agreement between vLLM and sparsecache's own loop in a process of its own."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path





ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


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


@contextlib.contextmanager
def engine(model_path, store_path, max_model_len: int = 4096):
    """`start_engine` under ENGINE_ENV, torn down on exit with everything vLLM keeps per process
    (the KV connector, the model-parallel groups): another module's engine then starts clean
    with its own store instead of failing on the groups this one left half destroyed."""
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    saved = {k: os.environ.get(k) for k in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    llm = None
    try:
        llm = start_engine(model_path, store_path, max_model_len)
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
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
sys.path.insert(0, sys.argv[4])  # the tests directory: support.engine's engine and request helpers
from support.engine import ENGINE_ENV, generate, start_engine, with_source
os.environ.update(ENGINE_ENV)
import torch
from sparsecache.model.gguf import model_dir
from sparsecache.vllm.serving import RagPrompts
from sparsecache.query.config import DEFAULT_METHOD
from sparsecache.query.session import Session

import sparsecache.query.methods.base as methods_base
import sparsecache.vllm.connector as connector
choose_many, fuse = methods_base.choose_many, methods_base.Decoded.fuse
chosen = {"vllm": [], "query": []}
def engine(*args, **kwargs):
    positions = choose_many(*args, **kwargs)
    chosen["vllm"].extend(p.tolist() for p in positions)
    return positions
def query(*args, **kwargs):
    logits, positions = fuse(*args, **kwargs)
    chosen["query"].append(positions.tolist())
    return logits, positions
connector.choose_many, methods_base.Decoded.fuse = engine, query

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
    ours = session.query(question, chunks=ids, method=method, max_new_tokens=8, prefill_under=0)
    logprobs = torch.log_softmax(ours.logits, -1)
    result[source] = {"context_tokens": req.context_tokens, "delta": delta,
                      "same_answer": session.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer,
                      "max_logprob_diff": max(abs(lp - float(logprobs[t])) for t, lp in first.items())}
tokens, first, delta = generate(llm, req, with_source(req, "codes", method="infoflow", recompute_ratio=1.0), max_tokens=8)
full_tokens, full_first, _ = generate(llm, req, None, max_tokens=8)
result["blend-all"] = {"delta": delta, "same_tokens": tokens == full_tokens,
                       "max_logprob_diff": max(abs(first[t] - full_first[t]) for t in full_first)}
tokens, first, delta = generate(llm, req, with_source(req, "codes", method=DEFAULT_METHOD), max_tokens=8)
ours = session.query(question, chunks=ids, method=DEFAULT_METHOD, max_new_tokens=8, prefill_under=0)  # what serve does by default
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
                           str(Path(__file__).resolve().parents[1])], capture_output=True, text=True, timeout=timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


def with_source(req, source: str, **more) -> dict:
    """The request's kv_transfer_params with `source` and any other per-request options;
    method `none` (the KV as stored, no blending) unless `more` names one, and the cheap-context
    rule off (these requests' few short chunks are under its threshold: they test the load path)."""
    p = json.loads(json.dumps(req.kv_transfer_params))
    p["sparsecache"].update(source=source, **{"method": "none", "prefill_under": 0, **more})
    return p
