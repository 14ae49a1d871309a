import sys, json

import sparsecache  # noqa
import torch
from sparsecache.model import default_prefix_ids, extract_kv, load_model
from sparsecache.text.documents import builtin_documents, token_chunks
model = load_model("default")
prefix = default_prefix_ids(model)
chunks = token_chunks(builtin_documents("heldout"), model.tokenizer, 256)[:8]
ref = extract_kv(model, chunks, prefix)
model.hf.to(torch.bfloat16)
low = extract_kv(model, chunks, prefix)
out = {}
for i, kind in enumerate("kv"):
    a = torch.cat([r[i] for r in ref], 1); b = torch.cat([r[i] for r in low], 1).float()
    per_layer = (((a - b) ** 2).sum((1, 2)) / (a ** 2).sum((1, 2))).tolist()
    out[kind] = {"nmse": float(((a - b) ** 2).sum() / (a ** 2).sum()), "worst_layer": max(per_layer)}
print(out)
json.dump(out, open("bf16-forward-kv-nmse.json", "w"))
