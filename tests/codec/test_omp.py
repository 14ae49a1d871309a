"""Batch-OMP (`codec.omp`) against a plain reference and scikit-learn's OMP: batching, degenerate
and zero signals, the Triton and graphed paths against eager torch, and atom screening (exact
when it screens every atom, deterministic, the default only where it pays)."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import orthogonal_mp_gram

from hypothesis import given, settings, strategies as st

from sparsecache.codec._omp_cpu import SAMPLE_STEP, kth_largest, kth_largest_sampled
from sparsecache.codec.omp import (EXACT, Screening, omp_block, omp_block_cpu, omp_block_gemm, batch_omp, gram,
                             reconstruct, reference_omp)
from sparsecache.testing import unit_atoms
from support import DEVICES

# Every formulation as f(Y [B, m], D [m, n], s) -> (indices, coefficients) on Y's device, CPU results.
BLOCKS = {
    "numba": lambda Y, D, s: omp_block_cpu(Y @ D, gram(D), s),
    # a quarter of the atoms as candidates, screened again every other step: exactly sparse
    # signals keep their atoms among the candidates, so this must find what exact OMP finds
    "numba-screened": lambda Y, D, s: omp_block_cpu(Y @ D, gram(D), s, Screening(D.shape[1] // 4, 2)),
    "torch": lambda Y, D, s: omp_block(Y @ D, gram(D), s),
    "gemm": lambda Y, D, s: omp_block_gemm(Y, D, gram(D), s),
    "gemm-fp16": lambda Y, D, s: omp_block_gemm(Y, D, gram(D), s, "float16"),
}
# (formulation, device) pairs: the numba kernel is CPU-only, the torch ones run everywhere.
CASES = [pytest.param(b, d, id=f"{b}-{d.id if hasattr(d, 'id') else d}", marks=getattr(d, "marks", ()))
         for b in BLOCKS for d in DEVICES if not b.startswith("numba") or d == "cpu"]


def run_block(block, device, Y, D, s):
    dev = device if isinstance(device, str) else device.values[0]
    idx, coef = BLOCKS[block](Y.to(dev), D.to(dev), s)
    return idx.cpu(), coef.cpu()


def sparse_problem(m=64, n=256, s=5, count=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = unit_atoms(m, n, seed)
    X = torch.zeros(count, n)
    for i in range(count):
        X[i, torch.randperm(n, generator=g)[:s]] = torch.randn(s, generator=g).sign() * (1 + torch.rand(s, generator=g))
    return D, X @ D.T, X


@pytest.mark.parametrize("n", [256, 300, 1000])  # one tile, a partial tile, several tiles
@pytest.mark.parametrize("block,device", CASES)
def test_matches_reference_and_sklearn_on_well_conditioned_problems(block, device, n):
    D, Y, X = sparse_problem(n=n)
    G = gram(D)
    idx, coef = run_block(block, device, Y, D, 5)
    ref_idx, ref_coef = reference_omp(Y, D, 5)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(coef, ref_coef, atol=1e-4, rtol=1e-4)
    sk = orthogonal_mp_gram(G.double().numpy(), (Y @ D).T.double().numpy(), n_nonzero_coefs=5)  # (n, count)
    for i in range(Y.shape[0]):
        support = np.nonzero(sk[:, i])[0]
        assert set(support) == set(idx[i].tolist())
        np.testing.assert_allclose(sk[idx[i].numpy(), i], coef[i].numpy(), atol=1e-4)
    torch.testing.assert_close(reconstruct(idx, coef, D), reconstruct(ref_idx, ref_coef, D), atol=1e-4, rtol=1e-4)
    if n == 256:  # incoherent enough for OMP to recover every exactly-sparse signal
        torch.testing.assert_close(reconstruct(idx, coef, D), Y, atol=1e-4, rtol=1e-4)


def test_batch_omp_is_batched_and_chunked():
    D, Y, _ = sparse_problem(count=100)
    a = batch_omp(Y, D, 5)
    b = batch_omp(Y, D, 5, batch_size=7)
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("select_dtype,slack", [("float32", 1.001), ("float16", 1.02)])
def test_residual_not_worse_than_sklearn_on_dense_signals(device, select_dtype, slack):
    # Not exactly sparse: supports can differ, but OMP's greedy residual should agree closely
    # (within 2% when the atom-choosing GEMM runs in fp16; the CPU kernel ignores select_dtype).
    D = unit_atoms(48, 512, 3)
    Y = torch.randn(64, 48, generator=torch.Generator().manual_seed(4))
    idx, coef = batch_omp(Y.to(device), D.to(device), 12, select_dtype=select_dtype)
    ours = (Y - reconstruct(idx.cpu(), coef.cpu(), D)).square().sum()
    G = gram(D).double().numpy()
    sk = orthogonal_mp_gram(G, (Y @ D).T.double().numpy(), n_nonzero_coefs=12)
    theirs = (Y.double() - torch.from_numpy(sk).T @ D.double().T).square().sum()
    assert ours <= theirs * slack


def test_degenerate_atoms_give_finite_codes():
    D = unit_atoms(16, 64)
    D[:, 1] = D[:, 0]  # exact duplicate
    D[:, 2] = (D[:, 0] + 1e-6 * D[:, 3]) / (D[:, 0] + 1e-6 * D[:, 3]).norm()  # near-duplicate
    Y = torch.cat([D[:, :1].T * 3.0, torch.zeros(1, 16), torch.randn(8, 16)])
    for block in BLOCKS:
        idx, coef = run_block(block, "cpu", Y, D, 8)
        assert torch.isfinite(coef).all()
        assert coef.abs().max() < 100
        torch.testing.assert_close(reconstruct(idx[:1], coef[:1], D), Y[:1], atol=1e-4, rtol=1e-4)
        assert coef[1].abs().max() == 0  # a zero signal gets zero coefficients


def test_decode_is_weighted_gather():
    D = unit_atoms(8, 32)
    idx = torch.tensor([[0, 5, 7], [31, 0, 2]])
    coef = torch.tensor([[1.0, -2.0, 0.5], [0.25, 0.0, 3.0]])
    expected = torch.stack([(D[:, i] * c).sum(1) for i, c in zip(idx, coef)])
    torch.testing.assert_close(reconstruct(idx, coef, D), expected)


def test_zero_signals_get_distinct_atoms():
    """Sorted-set index coding needs each code's atoms distinct, even when every correlation is 0."""
    D = unit_atoms(16, 64)
    Y = torch.cat([torch.zeros(2, 16), torch.randn(3, 16)])
    for block in BLOCKS:
        idx, coef = run_block(block, "cpu", Y, D, 8)
        assert all(len(set(r.tolist())) == 8 for r in idx)
        assert coef[:2].abs().max() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n", [300, 1024, 8192, 9000])  # partial tile, one tile, several, several + partial
def test_triton_atom_choice_equals_torch(dtype, n):
    from sparsecache.codec._omp_cuda import argmax_abs

    g = torch.Generator().manual_seed(n)
    a = torch.randn(257, n, generator=g).to(dtype)
    a[0] = 0  # all ties: the first unchosen index wins
    a[1, 5] = a[1, 7] = -a[1].abs().max() - 1  # a tie at the maximum, negative
    chosen = torch.stack([torch.randperm(n, generator=g)[:6] for _ in range(257)])
    chosen[0] = torch.arange(6)
    score = a.float().abs()
    score.scatter_(1, chosen, -1.0)
    want = score.argmax(1)
    marked = a.clone().cuda()
    marked.scatter_(1, chosen.cuda(), float("nan"))
    assert torch.equal(argmax_abs(marked).cpu(), want)
    assert want[0] == 6 and want[1] == 5


@pytest.mark.cuda
def test_graphed_blocks_equal_eager_blocks():
    """The CUDA-graph replay codes like the eager loop, for full and zero-padded batches,
    and a second dictionary gets its own graph."""
    from sparsecache.codec.omp import GRAPHS

    for seed in (0, 1):
        D, Y, _ = sparse_problem(n=1000, count=70, seed=seed)
        D, Y = D.cuda(), Y.cuda()
        G = gram(D)
        eager = batch_omp(Y, D, 5, G, batch_size=32)
        graphed = batch_omp(Y, D, 5, G, batch_size=32, graphed=True)  # 32 + 32 + 6 padded
        assert torch.equal(eager[0], graphed[0])
        torch.testing.assert_close(eager[1], graphed[1])
        assert any(k[0] == D.data_ptr() for k in GRAPHS)


def dense_problem(m=384, n=2048, count=48, seed=5):
    """Signals that are not sparse in the atoms: screening changes which atoms OMP picks.
    (A signal 5x smaller than the dictionary, as the default's 1,920 of 8,192; with signals
    20x smaller, at m = 96, screening cost 4-11% here: BENCHMARKS.md.)"""
    D = unit_atoms(m, n, seed)
    Y = torch.randn(count, m, generator=torch.Generator().manual_seed(seed + 1))
    return D, Y


def residual(Y, D, idx, coef) -> float:
    return float((Y - reconstruct(idx, coef, D)).square().sum())


def test_screening_every_atom_is_exact_batch_omp():
    D, Y = dense_problem()
    exact = omp_block_cpu(Y @ D, gram(D), 24, EXACT)
    for screening in (Screening(D.shape[1], 4), Screening(D.shape[1] + 1, 1)):
        idx, coef = omp_block_cpu(Y @ D, gram(D), 24, screening)
        assert torch.equal(idx, exact[0]) and torch.equal(coef, exact[1])


@pytest.mark.parametrize("candidates,refresh", [(64, 4), (128, 16), (512, 16)])
def test_screened_codes_are_least_squares_on_distinct_atoms_close_to_exact(candidates, refresh):
    """Screening changes the support, never the solve: each code's coefficients are the
    least-squares fit of the signal on its atoms, the atoms are distinct, and the residual
    energy stays within 2% of exact Batch-OMP's (measured here: -0.1% to +1.3%; on the
    default model's K/V at the default screening, +0.1%: BENCHMARKS.md)."""
    D, Y = dense_problem()
    s = 48
    idx, coef = omp_block_cpu(Y @ D, gram(D), s, Screening(candidates, refresh))
    assert all(len(set(r.tolist())) == s for r in idx)
    for i in range(Y.shape[0]):
        Ds = D[:, idx[i]].double()
        ls = torch.linalg.lstsq(Ds, Y[i].double()[:, None]).solution[:, 0]
        torch.testing.assert_close(coef[i].double(), ls, atol=1e-4, rtol=1e-3)
    exact = omp_block_cpu(Y @ D, gram(D), s, EXACT)
    assert residual(Y, D, idx, coef) <= residual(Y, D, *exact) * 1.02


def test_screening_is_deterministic_and_independent_of_the_split():
    D, Y = dense_problem(count=30)
    a = batch_omp(Y, D, 16, screening=Screening(128, 8))
    b = batch_omp(Y, D, 16, batch_size=7, screening=Screening(128, 8))
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])  # α⁰'s GEMM rounds differently per batch shape


def test_bad_screening_is_a_config_error():
    with pytest.raises(ValueError, match="screening"):
        Screening(-1)
    with pytest.raises(ValueError, match="screening"):
        Screening(64, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=300), st.data())
def test_kth_largest_is_the_sorted_value(values, data):
    a = np.array(values, np.float32)
    k = data.draw(st.integers(1, len(a)))
    assert kth_largest(a.copy(), k) == np.sort(a)[::-1][k - 1]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(64 * SAMPLE_STEP, 12_000), st.floats(0.0, 0.9), st.booleans(),
       st.data())
def test_the_sampled_kth_largest_is_the_quickselects(seed, n, chosen_share, rounded, data):
    """A screening's selection (`kth_largest_sampled`) against kth_largest on the same values: Gaussian
    |α|, a share of chosen atoms at -1 (as a screening marks them), many ties where values are rounded,
    and k from 1 to past the sample's size (its fallback)."""
    rng = np.random.default_rng(seed)
    a = np.abs(rng.standard_normal(n)).astype(np.float32) * np.float32(rng.uniform(0.01, 10))
    a[rng.random(n) < chosen_share] = -1.0
    if rounded:
        a = np.round(a, 1)
    k = data.draw(st.integers(1, n))
    assert kth_largest_sampled(a.copy(), k, np.empty(n, np.float32)) == kth_largest(a.copy(), k)


def test_on_block_reports_every_coded_signal():
    D, Y = dense_problem(count=30)
    seen = []
    batch_omp(Y, D, 8, batch_size=7, on_block=seen.append, screening=Screening(128, 8))
    assert seen == [7, 7, 7, 7, 2]


def test_screening_is_the_default_only_where_the_signal_is_large_against_the_dictionary():
    """Measured on real K/V: +0.1-0.6% NMSE at 960-1,920 values per signal, +2-6% at 192 of 8,192."""
    assert Screening.default_for(1920, 8192) == Screening()  # the default dictionary (L10)
    assert Screening.default_for(960, 8192) == Screening()  # L5
    assert Screening.default_for(192, 8192) == EXACT  # L1
