"""Measurements behind `sparsecache bench ...`: each returns a dict of plain numbers."""

from __future__ import annotations

import time

import torch

from .dictionary import Dictionary, initial_atoms
from .omp import _omp_block, batch_omp, batch_size_for, gram, reconstruct


def _heldout_signals(kind: str, count: int) -> torch.Tensor:
    """Real pre-RoPE K or V signals [count, 192] of the default model on held-out text."""
    from .dictionary import collect_signals
    from .model import default_prefix_ids, load_model
    from .text import builtin_documents

    model = load_model()
    sig, _ = collect_signals(model, builtin_documents("heldout"), 1, 256, max(count // model.n_layers + 256, 4096),
                             default_prefix_ids(model))
    rows = torch.randperm(sig[kind].shape[0], generator=torch.Generator().manual_seed(0))[:count]
    return sig[kind][rows].float()


def _rate(fn, items: int, repeats: int = 3) -> float:
    """Best-of-`repeats` items per second of fn()."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return items / best


def bench_omp(dict_path, atoms: int, sparsity: int, count: int, sklearn_n: int, kind: str, device: str) -> dict:
    """Batch-OMP and scikit-learn's orthogonal_mp_gram on the same signals, plus decode speed."""
    import numpy as np
    from sklearn.linear_model import orthogonal_mp_gram

    if dict_path:
        D = Dictionary.load(dict_path).atoms(kind)
        atoms = D.shape[1]
        y = _heldout_signals(kind, count)
    else:  # atoms are other signals than the ones coded, or some would be coded exactly
        pool = _heldout_signals(kind, count + atoms)
        y, D = pool[:count], initial_atoms(pool[count:], atoms, "data", torch.Generator().manual_seed(1))
    dev = torch.device(device)
    y_dev, D_dev = y.to(dev), D.to(dev)
    G = gram(D_dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run():
        out = batch_omp(y_dev, D_dev, sparsity, G)
        sync()
        return out

    idx, coef = run()  # warm-up (numba compile / CUDA init)
    rate = _rate(run, count)
    sub_torch = y_dev[: min(count, 2048)]
    step = batch_size_for(atoms, sparsity)

    def run_torch():  # the vectorised torch formulation (what runs on GPUs), for comparison
        for i in range(0, sub_torch.shape[0], step):
            _omp_block(sub_torch[i : i + step] @ D_dev, G, sparsity)
        sync()

    torch_rate = _rate(run_torch, sub_torch.shape[0], repeats=1)
    sub = y[:sklearn_n].double().numpy()
    Gd, Dd = G.double().cpu().numpy(), D.double().numpy()
    t = time.perf_counter()
    sk = orthogonal_mp_gram(Gd, Dd.T @ sub.T, n_nonzero_coefs=sparsity)  # (atoms, n)
    sk_rate = sklearn_n / (time.perf_counter() - t)
    ours = reconstruct(idx[:sklearn_n].cpu(), coef[:sklearn_n].cpu(), D).double().numpy()
    res_ours = np.square(sub - ours).sum()
    res_sk = np.square(sub - (Dd @ sk).T).sum()
    big_idx, big_coef = idx.repeat(8, 1), coef.repeat(8, 1)

    def decode():
        reconstruct(big_idx, big_coef, D_dev)
        sync()

    return {
        "device": str(dev), "atoms": atoms, "dim": y.shape[1], "sparsity": sparsity, "n": count,
        "threads": torch.get_num_threads(),
        "vectors_per_s": rate, "sklearn_vectors_per_s": sk_rate, "speedup": rate / sk_rate,
        "torch_path_vectors_per_s": torch_rate,
        "decode_vectors_per_s": _rate(decode, big_idx.shape[0]),
        "residual_ratio_vs_sklearn": float(res_ours / max(res_sk, 1e-30)),
    }
