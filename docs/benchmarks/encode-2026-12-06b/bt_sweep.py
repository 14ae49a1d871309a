"""Forward time by batch_tokens and chunk length, in one process (run at 9bb7c56, where extract_kv batches on a CPU)."""
import sys, time, json
import sparsecache, torch
from sparsecache.model import default_prefix_ids, extract_kv, load_model
from sparsecache.text.documents import builtin_documents, token_chunks
from sparsecache.measure.machine import cpu_model
model = load_model("default")
prefix = default_prefix_ids(model)
out = {"cpu": cpu_model(), "rows": []}
for L in map(int, sys.argv[2].split(",")):
    chunks = [c for c in token_chunks(builtin_documents("heldout"), model.tokenizer, L) if len(c) > L // 2]
    chunks = chunks[:: max(1, len(chunks) // (8192 // L))][: max(8, 8192 // L)]
    n = sum(map(len, chunks))
    for dt in sys.argv[3].split(","):
        extract_kv(model, chunks[:2], prefix, 8192, forward_dtype=dt)
        res = {}
        for rep in range(2):
            for bt in (1, 1024, 2048, 8192):
                t0 = time.perf_counter(); extract_kv(model, chunks, prefix, bt, forward_dtype=dt)
                res.setdefault(bt, []).append(round(time.perf_counter() - t0, 2))
        row = {"chunk_tokens": L, "chunks": len(chunks), "tokens": n, "dtype": dt, "seconds_by_batch_tokens": res}
        out["rows"].append(row); print(row, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
