"""Baseline compressors against plain reference implementations and hand-counted bytes."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecache.bench.baselines import CrossLayerSVD, Fp8, Fp16, Kivi, LayerSVD, default_baselines


def kivi_reference(x: np.ndarray, bits: int, group: int, kind: str) -> np.ndarray:
    """KIVI by loops: keys grouped along tokens per channel, values along channels per token."""
    out = np.empty_like(x)
    L, T, m = x.shape
    levels = 2 ** bits - 1
    for layer in range(L):
        rows = x[layer].T if kind == "k" else x[layer]  # (rows, n): groups run along n
        dst = np.empty_like(rows)
        for r in range(rows.shape[0]):
            for a in range(0, rows.shape[1], group):
                g = rows[r, a : a + group]
                lo = np.float32(np.float16(g.min()))
                scale = np.float32(np.float16((g.max() - lo) / levels))
                q = np.clip(np.round((g - lo) / max(scale, 1e-8)), 0, levels)
                dst[r, a : a + group] = q * scale + lo
        out[layer] = dst.T if kind == "k" else dst
    return out


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_kivi_matches_loop_reference(bits, kind):
    x = torch.randn(2, 70, 48) * torch.linspace(0.1, 5, 48)  # uneven channels; 70 = 2 groups + a tail
    got = Kivi(bits).roundtrip(x, kind).numpy()
    want = kivi_reference(x.numpy(), bits, 32, kind)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([2, 4]), T=st.integers(1, 80), m=st.sampled_from([8, 32, 40]),
       kind=st.sampled_from("kv"), seed=st.integers(0, 2**16))
def test_kivi_error_is_within_half_a_step(bits, T, m, kind, seed):
    x = torch.randn(2, T, m, generator=torch.Generator().manual_seed(seed)) * 3
    err = (Kivi(bits).roundtrip(x, kind) - x).abs()
    span = (x.abs().max() * 2).item()  # no group spans more than this
    assert err.max().item() <= span / (2 ** bits - 1) / 2 * 1.01 + 1e-3


def test_kivi_bytes_by_hand():
    # 2 layers, 64 tokens, 64 channels at 2 bits: 2048 data bytes; keys: 2·64 channels·2 token
    # groups, values: 2·64 tokens·2 channel groups, 4 bytes (fp16 scale + zero) per group.
    assert Kivi(2).nbytes(2, 64, 64, "k") == 2048 + 256 * 4
    assert Kivi(2).nbytes(2, 64, 64, "v") == 2048 + 256 * 4
    assert Kivi(4).nbytes(30, 512, 192, "k") * 2 * 3.2 == pytest.approx(2 * 2 * 30 * 512 * 192)


def truncated_reference(x: np.ndarray, r: int) -> np.ndarray:
    mean = x.mean(0, keepdims=True)
    U, S, Vt = np.linalg.svd(x - mean, full_matrices=False)
    return (U[:, :r] * S[:r]) @ Vt[:r] + mean


def test_layer_svd_is_the_eckart_young_truncation():
    x = torch.randn(3, 40, 16) @ torch.randn(16, 16)
    got = LayerSVD(5).roundtrip(x, "k").numpy()
    for layer in range(3):
        np.testing.assert_allclose(got[layer], truncated_reference(x[layer].numpy(), 5), atol=2e-2, rtol=1e-2)
    full = LayerSVD(16).roundtrip(x, "v")
    assert ((full - x).square().sum() / x.square().sum()).item() < 1e-5  # fp16 factors only


def test_cross_layer_svd_shares_a_token_basis_per_group():
    x = torch.randn(5, 40, 8)
    xkv = CrossLayerSVD(rank=3, group=2)
    assert [list(g) for g in xkv.groups(5)] == [[0, 1], [2, 3], [4]]
    got = xkv.roundtrip(x, "k")
    for g in xkv.groups(5):
        wide = x[g.start : g.stop].permute(1, 0, 2).reshape(40, -1).numpy()
        want = truncated_reference(wide, 3).reshape(40, len(g), 8).transpose(1, 0, 2)
        np.testing.assert_allclose(got[g.start : g.stop].numpy(), want, atol=2e-2, rtol=1e-2)
        centred = got[g.start : g.stop].permute(1, 0, 2).reshape(40, -1)
        assert torch.linalg.matrix_rank(centred - centred.mean(0)) <= 3
    # bytes: per group T·r + r·d + d fp16 values (d = layers·m)
    assert xkv.nbytes(5, 40, 8, "k") == 2 * ((40 * 3 + 3 * 16 + 16) * 2 + (40 * 3 + 3 * 8 + 8))


def test_fp8_saturates_and_fp16_is_a_cast():
    x = torch.tensor([[[0.1, -3.0, 1000.0, -1e6]]])
    y = Fp8().roundtrip(x, "k")
    assert torch.isfinite(y).all() and y[0, 0, 2] == 448 and y[0, 0, 3] == -448
    assert torch.equal(y[..., :2], x[..., :2].to(torch.float8_e4m3fn).float())
    assert torch.equal(Fp16().roundtrip(x, "v"), x.half().float())
    assert Fp8().nbytes(30, 512, 192, "k") * 2 == Fp16().nbytes(30, 512, 192, "k")


def test_default_baselines_bracket_the_ratios():
    raw = Fp16().nbytes(30, 512, 192, "k")
    ratios = sorted(raw / b.nbytes(30, 512, 192, "k") for b in default_baselines())
    assert ratios[0] == 1 and ratios[-1] > 15 and len({b.label for b in default_baselines()}) == len(ratios)
