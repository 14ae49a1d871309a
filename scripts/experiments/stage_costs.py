"""What one step of each stage costs for a model on this machine, and what the whole would take.

#80 item 6 asks where a larger model stands without a GPU: rather than run each stage end to end
(hours to days on 2 cores), time one step of each and extrapolate by the recipes the smaller
models used. Measured: the conversion (first use only), loading, the forward that captures K/V
(learn-dict's extraction and the encode's first half), one mini-batch step of dictionary learning
(Batch-OMP + gradient update, K and V), the encode's OMP on the same tokens at the codec's shape
with random unit atoms (OMP's cost does not depend on what the atoms are), and full prefill of a
k = 8 context (one fidelity question's reference, and a wrapper step's teacher). Only time is
measured; nothing here says how well a dictionary would code the model.

    python scripts/experiments/stage_costs.py --model qwen2.5-coder-1.5b --layers-per-signal 14 \\
        --sparsity 64 --json stage-costs-1.5b.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from sparsecache.codec.coding import Codec
from sparsecache.codec.config import DictConfig, TrainConfig
from sparsecache.codec.dictionary import Dictionary
from sparsecache.codec.learn import fresh_state, train_step
from sparsecache.codec.signals import to_signals
from sparsecache.measure.machine import cpu_model
from sparsecache.model import default_prefix_ids, extract_kv, load_model
from sparsecache.model.gguf import model_dir
from sparsecache.text.documents import builtin_documents
from sparsecache.testing import unit_atoms

# the recipes the shipped dictionaries and runs used (dictionaries/README.md, BENCHMARKS.md)
LEARN_STEPS, LEARN_TOKENS = 250, 150_000
DEMO_TOKENS = 20_334  # the demo corpus (builtin:heldout)
FIDELITY_QUESTIONS = 830  # #80 item 4: >= 200 confident on (a) at Qwen 0.5B's 24% confident rate


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens captured and coded (chunks of 256)")
    ap.add_argument("--context", type=int, default=1100, help="tokens of the full-prefill context (k = 8)")
    ap.add_argument("--layers-per-signal", type=int, default=None, help="default: half the layers")
    ap.add_argument("--sparsity", type=int, default=64)
    ap.add_argument("--atoms", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1024, help="learn-dict's mini-batch")
    ap.add_argument("--json")
    args = ap.parse_args()

    out = {"model": args.model, "cpu": cpu_model(), "threads": torch.get_num_threads(),
           "note": "one step of each stage, timed; only time is measured"}
    _, out["convert_s"] = timed(lambda: model_dir(args.model))  # ~0 where the conversion is cached
    model, out["load_s"] = timed(lambda: load_model(args.model))
    n_layers, m = model.n_layers, model.m
    L = args.layers_per_signal or n_layers // 2
    out.update(n_layers=n_layers, m=m, layers_per_signal=L, sparsity=args.sparsity, atoms=args.atoms,
               parameters=sum(p.numel() for p in model.hf.parameters()), kv_fp16_bytes_per_token=4 * n_layers * m)
    print(json.dumps(out), flush=True)

    docs = builtin_documents("train")
    ids = model.tokenizer("\n\n".join(d.text for d in docs[:40]), add_special_tokens=False)["input_ids"]
    chunks = [ids[i:i + 256] for i in range(0, args.tokens, 256)]
    prefix = default_prefix_ids(model)
    kv, t = timed(lambda: extract_kv(model, chunks, prefix))
    T = sum(map(len, chunks))
    out["forward_tokens_per_s"] = T / t
    keys = torch.cat([k for k, _ in kv], 1)
    values = torch.cat([v for _, v in kv], 1)

    cfg = DictConfig(args.atoms, args.sparsity, L)
    d = Dictionary(unit_atoms(L * m, args.atoms, 1), unit_atoms(L * m, args.atoms, 2), cfg, model.fingerprint())
    codec = Codec(d, "float8")
    _, t = timed(lambda: (codec.encode(keys, "k"), codec.encode(values, "v")))
    out["omp_tokens_per_s"] = T / t
    out["encode_tokens_per_s"] = 1 / (1 / out["forward_tokens_per_s"] + 1 / out["omp_tokens_per_s"])

    tcfg = TrainConfig()
    step_s = 0.0
    for kind, x in (("k", keys), ("v", values)):
        y = to_signals(x, L).reshape(-1, L * m)[: args.batch]
        atoms = unit_atoms(L * m, args.atoms, 3)
        state = fresh_state(atoms)
        _, t = timed(lambda: train_step(state, y, args.sparsity, 0.1, 1, tcfg))
        step_s += t
    out["learn_step_s"] = step_s
    out["learn_batch_signals"] = int(min(args.batch, to_signals(keys, L).reshape(-1, L * m).shape[0]))

    context = (ids * 2)[: args.context]
    with torch.inference_mode():
        model.hf(input_ids=torch.tensor([context[:64]]))  # warm
        _, out["full_prefill_s"] = timed(lambda: model.hf(input_ids=torch.tensor([context])))

    out["estimates"] = {
        "learn_dict_h": (LEARN_TOKENS / out["forward_tokens_per_s"] + LEARN_STEPS * out["learn_step_s"]) / 3600,
        "encode_demo_corpus_min": DEMO_TOKENS / out["encode_tokens_per_s"] / 60,
        "fidelity_full_prefill_references_h": FIDELITY_QUESTIONS * out["full_prefill_s"] / 3600,
        "recipe": f"learn-dict {LEARN_STEPS} steps over {LEARN_TOKENS:,} tokens; the demo corpus {DEMO_TOKENS:,} "
                  f"tokens; {FIDELITY_QUESTIONS} questions' full prefill at {args.context} tokens",
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
