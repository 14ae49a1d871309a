"""Does a learned wrapper hurt running text? (#52 item 5, held-out text.)

Held-out calibration text (the built-in corpus's held-out part, never trained on) cut into
prompts of k consecutive 256-token pieces and the 32 tokens that follow; the continuation's
perplexity and top-1 agreement with full prefill of the same pieces, read from:
  plain     each piece encoded alone after the prefix (what a store's `none` reads, exact K/V)
  wrapped   each piece wrapped, prefix | header piece trailer | ... (exact K/V)

    python scripts/experiments/wrapper_text.py WRAPPER_DIR [--prompts 20] [--k 8] [--out FILE.json]
"""

import argparse
import json
import math
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wrapper", type=Path)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch

    from sparsecache.learn_wrapper import TEXT_PIECE
    from sparsecache.model import default_prefix_ids, load_model
    from sparsecache.text import builtin_documents
    from sparsecache.wrapper import Wrapper, continuation_logits, wrapped_kv

    model = load_model()
    w = Wrapper.load(args.wrapper)
    w.check_model(model)
    prefix = default_prefix_ids(model)
    need = args.k * TEXT_PIECE + 33
    prompts, stream = [], []
    for d in builtin_documents("heldout"):
        stream += model.tokenizer(d.text + "\n\n", add_special_tokens=False)["input_ids"]
        while len(stream) >= need and len(prompts) < args.prompts:
            prompts.append(stream[:need])
            stream = stream[need:]
    stats = {name: {"nll": 0.0, "top1_vs_full": 0, "n": 0} for name in ("full", "plain", "wrapped")}
    with torch.no_grad():
        for window in prompts:
            pieces = [window[i * TEXT_PIECE:(i + 1) * TEXT_PIECE] for i in range(args.k)]
            cont = window[args.k * TEXT_PIECE:]
            ctx = prefix + [t for piece in pieces for t in piece]
            full = model.hf(input_ids=torch.tensor([ctx + cont[:-1]])).logits[0, -(len(cont) - 1):].float()
            target = torch.tensor(cont[1:])
            runs = {"full": full}
            for name, (h, t) in (("plain", (None, None)), ("wrapped", (w.header, w.trailer))):
                keys, values = wrapped_kv(model, pieces, prefix, h, t)
                runs[name] = continuation_logits(model, keys, values, cont[:-1])  # each predicts cont[1:], as full
            for name, logits in runs.items():
                s = stats[name]
                s["nll"] += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
                s["top1_vs_full"] += int((logits.argmax(-1) == runs["full"].argmax(-1)).sum())
                s["n"] += len(target)
    out = {name: {"ppl": math.exp(s["nll"] / s["n"]), "top1_agreement_with_full": s["top1_vs_full"] / s["n"],
                  "tokens": s["n"]} for name, s in stats.items()}
    out = {"prompts": len(prompts), "k": args.k, "piece_tokens": TEXT_PIECE, "wrapper": str(args.wrapper), **out}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
