import sys, time, json
sys.path.insert(0, "scripts/experiments")
import sparsecache  # noqa
import torch
from omp_cpu_phases import heldout_problems
from sparsecache.codec.omp import Screening, batch_omp
torch.manual_seed(0)
codec, problems = heldout_problems(2048)
out = []
for M, R in [(512, 16), (384, 16), (768, 16), (512, 32), (1024, 32), (768, 80), (256, 8)]:
    row = {"M": M, "refresh": R}
    for kind, (y, D, G) in problems.items():
        Gt = torch.from_numpy(G); s = codec.config.sparsity; scr = Screening(M, R)
        batch_omp(y[:128], D, s, G=Gt, screening=scr)
        best = 1e9
        for _ in range(2):
            t0 = time.perf_counter(); idx, coef = batch_omp(y, D, s, G=Gt, screening=scr); best = min(best, time.perf_counter() - t0)
        rec = torch.einsum("ns,nsm->nm", coef, D.T[idx])
        row[kind] = {"s": round(best, 3), "nmse": float(((rec - y) ** 2).sum() / (y ** 2).sum())}
    print(row, flush=True); out.append(row)
json.dump(out, open("omp-screening-sweep.json", "w"), indent=1)
