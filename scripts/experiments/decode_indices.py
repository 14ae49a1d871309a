"""Codec.decode time of the same K/V codes with 13-bit packed vs Elias–Fano indices (one thread,
best of 10 interleaved runs), on 1,024 tokens of this README through the default model.

    OMP_NUM_THREADS=1 python scripts/experiments/decode_indices.py
"""

import time
import torch
from sparsecache.codec.coding import Codec
from sparsecache.codec.dictionary import Dictionary
from sparsecache.model import extract_kv, load_model

torch.set_num_threads(1)
d = Dictionary.load("dictionaries/smollm2-135m-n8192-s32-L5")
m = load_model()
ids = m.tokenizer(open("README.md").read())["input_ids"][:1024]
(k, v), = extract_kv(m, [ids])
cs = {ind: Codec(d, "float8", indices=ind) for ind in ("packed", "elias-fano")}
codes = {ind: {kind: c.encode(x, kind) for kind, x in (("k", k), ("v", v))} for ind, c in cs.items()}
best = {}
for r in range(10):
    for ind, c in cs.items():
        t = time.perf_counter()
        for kind in "kv":
            c.decode(codes[ind][kind], kind)
        best[ind] = min(best.get(ind, 9), time.perf_counter() - t)
for ind in cs:
    print(ind, f"K+V decode of 1024 tokens: {best[ind] * 1e3:.1f} ms, index bytes/token "
          f"{sum(codes[ind][x].indices.nbytes for x in 'kv') / 1024:.0f}, total code bytes/token "
          f"{sum(codes[ind][x].nbytes for x in 'kv') / 1024:.0f}")
