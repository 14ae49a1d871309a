import sys, time
import sparsecache, torch
from sparsecache.model import default_prefix_ids, extract_kv, load_model
from sparsecache.text.documents import builtin_documents, token_chunks
model = load_model("default")
prefix = default_prefix_ids(model)
chunks = token_chunks(builtin_documents("heldout"), model.tokenizer, 350)[:16]
def fwd(dt, bt):
    t0 = time.perf_counter(); r = extract_kv(model, chunks, prefix, bt, forward_dtype=dt); return round(time.perf_counter() - t0, 2), r
for dt in ("bfloat16", "float32"):
    fwd(dt, 1)
    for bt in (1, 16384, 1, 16384):
        print(dt, bt, fwd(dt, bt)[0], flush=True)
# batch invariance: chunk 3 alone vs in a batch
for dt in ("bfloat16", "float32"):
    a = extract_kv(model, chunks[3:4], prefix, 1, forward_dtype=dt)[0][0]
    b = extract_kv(model, chunks[:8], prefix, 1, forward_dtype=dt)[3][0]
    c = extract_kv(model, chunks[:8], prefix, 16384, forward_dtype=dt)[3][0]
    print(dt, "alone vs alone-in-list equal:", torch.equal(a, b), "batched max diff", (a - c).abs().max().item())
