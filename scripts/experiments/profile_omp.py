"""Where the GPU OMP's time goes: torch.profiler over one batch of each formulation.

    python scripts/experiments/profile_omp.py --device cuda --dim 192 --sparsity 16

Random unit atoms and Gaussian signals (the kernels' cost does not depend on the data);
prints the kernels that take the most device time, per formulation.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from sparsecache.codec.omp import omp_block, omp_block_gemm, batch_size_for, gemm_batch_size_for, gram


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--atoms", type=int, default=8192)
    ap.add_argument("--sparsity", type=int, default=16)
    a = ap.parse_args()
    dev = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    D = torch.randn(a.dim, a.atoms, generator=g)
    D = (D / D.norm(dim=0)).to(dev)
    G = gram(D)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sort = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    for name, bs, fn in (
        ("gemm-float16", gemm_batch_size_for(a.atoms), lambda y: omp_block_gemm(y, D, G, a.sparsity, "float16")),
        ("gemm-float32", gemm_batch_size_for(a.atoms), lambda y: omp_block_gemm(y, D, G, a.sparsity, "float32")),
        ("batch-omp", batch_size_for(a.atoms, a.sparsity), lambda y: omp_block(y @ D, G, a.sparsity)),
    ):
        y = torch.randn(bs, a.dim, generator=g).to(dev)
        fn(y)  # warm-up
        if dev.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            fn(y)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        print(f"\n=== {name}: batch {bs}, dim {a.dim}, atoms {a.atoms}, s {a.sparsity}")
        print(prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
