"""Does a learned wrapper hurt running text? (#52 item 5, held-out text.)

Held-out calibration text (the built-in corpus's held-out part, never trained on) cut into
prompts of k consecutive 256-token pieces and the 32 tokens that follow; the continuation's
perplexity and top-1 agreement with full prefill of the same pieces, read from:
  plain     each piece encoded alone after the prefix (what a store's `none` reads, exact K/V)
  wrapped   each piece wrapped, prefix | header piece trailer | ... (exact K/V)

    python scripts/experiments/wrapper_text.py WRAPPER_DIR [--prompts 20] [--k 8] [--model M] [--out FILE.json]
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wrapper", type=Path)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--model", default="default", help="the wrapper's model (as `--model` elsewhere)")
    args = p.parse_args()

    from sparsecache.wrapper.learn import TEXT_PIECE, text_fidelity
    from sparsecache.model import default_prefix_ids, load_model
    from sparsecache.text.documents import builtin_documents
    from sparsecache.wrapper.apply import Wrapper

    model = load_model(args.model)
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
    texts = [{"chunks": [w_[i * TEXT_PIECE:(i + 1) * TEXT_PIECE] for i in range(args.k)], "text": w_[args.k * TEXT_PIECE:]}
             for w_ in prompts]
    full = text_fidelity(model, prefix, texts, as_full=True)
    runs = {"full": {**full, "text_top1": 1.0}, "plain": text_fidelity(model, prefix, texts, full=full["top1"]),
            "wrapped": text_fidelity(model, prefix, texts, w.header, w.trailer, full=full["top1"])}
    out = {name: {"ppl": r["text_ppl"], "top1_agreement_with_full": r["text_top1"], "tokens": r["text_tokens"]}
           for name, r in runs.items()}
    out = {"model": model.name, "prompts": len(prompts), "k": args.k, "piece_tokens": TEXT_PIECE, "wrapper": str(args.wrapper), **out}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
