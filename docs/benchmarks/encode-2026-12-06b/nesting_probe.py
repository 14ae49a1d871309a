import sys, time, ctypes
import sparsecache, torch
from sparsecache.model import default_prefix_ids, extract_kv, load_model
from sparsecache.text.documents import builtin_documents, token_chunks
model = load_model("default")
prefix = default_prefix_ids(model)
chunks = token_chunks(builtin_documents("heldout"), model.tokenizer, 256)[:12]
def fwd():
    t0 = time.perf_counter(); extract_kv(model, chunks, prefix, 8192, forward_dtype="bfloat16"); return round(time.perf_counter() - t0, 2)
gomps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l})
libs = {g.split("/")[-2]: ctypes.CDLL(g) for g in gomps}
glob = ctypes.CDLL(None)
st = lambda: {k: (l.omp_get_max_active_levels(), l.omp_get_nested()) for k, l in libs.items()}
fwd(); print("before", fwd(), st(), glob.omp_get_nested())
from sparsecache.codec import numba_pool
numba_pool.start()
print("started", st(), glob.omp_get_nested())
m = sys.argv[1]
if m == "torchlevels": libs["lib"].omp_set_max_active_levels(1)
if m == "torchnested": libs["lib"].omp_set_nested(0)
if m == "globlevels": glob.omp_set_max_active_levels(1)
print(m, fwd(), fwd(), st())
