"""One chunk per forward against padded batches, by chunk length (run at 9bb7c56, where extract_kv still batched)."""
import time
import sparsecache, torch
from sparsecache.model import default_prefix_ids, extract_kv, load_model
from sparsecache.text.documents import builtin_documents, token_chunks
model = load_model("default")
prefix = default_prefix_ids(model)
print(sparsecache.__file__)
for L in (32, 64, 128, 256):
    chunks = [c for c in token_chunks(builtin_documents("heldout"), model.tokenizer, L) if len(c) > L // 2][:max(16, 4096 // L)]
    n = sum(map(len, chunks))
    for dt in ("bfloat16", "float32"):
        res = {}
        for bt in (1, 8192, 1, 8192):
            t0 = time.perf_counter(); extract_kv(model, chunks, prefix, bt, forward_dtype=dt); res.setdefault(bt, []).append(time.perf_counter() - t0)
        print(f"chunks<= {L} ({len(chunks)} chunks, {n} tokens) {dt}: alone {min(res[1]):.2f} s, batched {min(res[8192]):.2f} s", flush=True)
