import sys, time, sparsecache, torch, numpy as np
from sparsecache.kvstore import KVStore
from sparsecache.model import load_model
from sparsecache.model.kvmodel import chunk_context_ids, use_soft_tokens, extract_kv
from sparsecache.wrapper.apply import store_wrapping
s = KVStore.open(sys.argv[1])
r = s.reader if hasattr(s, "reader") else s
ids = r.chunk_ids(np.arange(63))
toks = r.tokens(ids)
print(len(toks), sum(map(len, toks)), sorted(map(len, toks))[::8])
model = load_model("default")
use_soft_tokens(model, s.soft())
header, trailer = store_wrapping(s.backend, model)
prefix = chunk_context_ids(model, s.config.prefix, s.config.anchor) + header
print("prefix", len(prefix))
def t(f):
    t0 = time.perf_counter(); f(); return round(time.perf_counter() - t0, 2)
def ac():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return extract_kv(model, toks, prefix, 8192)
from sparsecache.codec.omp import batch_omp, Screening
D = torch.nn.functional.normalize(torch.randn(1920, 8192), dim=0)
batch_omp(torch.randn(512, 1920), D, 80, screening=Screening())
print("numba pool started", flush=True)
print("fp32", t(lambda: extract_kv(model, toks, prefix, 8192)), flush=True)
print("bf16", t(ac), t(ac), flush=True)
print("fp32 again", t(lambda: extract_kv(model, toks, prefix, 8192)), flush=True)
import numba; print(numba.threading_layer())
