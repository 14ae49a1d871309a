"""Forward and alpha0 GEMM: fp32 against bf16, and the prefix's share (probe, not shipped)."""
import time, json, sys
import sparsecache  # noqa
import torch
from sparsecache.model import default_prefix_ids, extract_kv, load_model
from sparsecache.text.documents import builtin_documents, token_chunks
from sparsecache.measure.machine import cpu_model

model = load_model("default")
prefix = default_prefix_ids(model)
docs = builtin_documents("heldout")
chunks = token_chunks(docs, model.tokenizer, 256)
n = 0; sel = []
for c in chunks:
    sel.append(c); n += len(c)
    if n >= 8192: break
print("prefix tokens", len(prefix), "chunks", len(sel), "tokens", n, cpu_model(), flush=True)
def t(f, reps=2):
    f(); best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter(); f(); best = min(best, time.perf_counter() - t0)
    return best
res = {}
res["fwd_fp32_prefix"] = t(lambda: extract_kv(model, sel, prefix, 8192))
res["fwd_fp32_noprefix"] = t(lambda: extract_kv(model, sel, [], 8192))
model.hf.to(torch.bfloat16)
res["fwd_bf16_prefix"] = t(lambda: extract_kv(model, sel, prefix, 8192))
model.hf.to(torch.float32)
D = torch.randn(1920, 8192); Y = torch.randn(3 * n, 1920)
res["a0_fp32"] = t(lambda: Y @ D)
Db, Yb = D.bfloat16(), Y.bfloat16()
res["a0_bf16"] = t(lambda: Yb @ Db)
res["a0_bf16_out_f32"] = t(lambda: (Yb @ Db).float())
for k, v in res.items(): print(f"{k}: {v:.2f} s")
json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w"), indent=1)
