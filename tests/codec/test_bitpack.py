"""Bit packing of the atom indices: fixed width (the paper's 13-bit layout), Rice and Elias-Fano
rows, each round-tripped in numpy and torch against a plain reference, sized against its bound,
and refusing rows it cannot hold."""

from math import lgamma, log

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecache.codec.bitpack import (ef_low_bits, ef_row_bits, ef_row_bytes, pack_indices, pack_rows, pack_sorted_rows,
                                 packed_size, reference_pack, reference_sorted_pack, rice_bits, rice_decode,
                                 rice_encode, rice_parameter, row_bytes, sorted_codes, unpack_indices,
                                 unpack_sorted_rows, unpack_sorted_rows_torch,
                                 unpack_indices_torch, unpack_rows, unpack_rows_torch)


@st.composite
def values_and_bits(draw):
    bits = draw(st.integers(1, 16))
    vals = draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=200))
    return np.array(vals, dtype=np.int64), bits


@given(values_and_bits())
@settings(max_examples=200, deadline=None)
def test_roundtrip_numpy_torch_and_reference(vb):
    vals, bits = vb
    packed = pack_indices(vals, bits)
    assert packed.size == packed_size(len(vals), bits) == (len(vals) * bits + 7) // 8
    assert bytes(packed) == reference_pack(vals.tolist(), bits)
    np.testing.assert_array_equal(unpack_indices(packed, len(vals), bits), vals)
    got = unpack_indices_torch(torch.from_numpy(packed), len(vals), bits)
    np.testing.assert_array_equal(got.numpy(), vals)


@given(st.integers(1, 16), st.integers(1, 40), st.integers(1, 20), st.data())
@settings(max_examples=100, deadline=None)
def test_rows_roundtrip(bits, s, n, data):
    vals = np.array(data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=n * s, max_size=n * s))).reshape(n, s)
    packed = pack_rows(vals, bits)
    assert packed.shape == (n, row_bytes(s, bits))
    np.testing.assert_array_equal(unpack_rows(packed, s, bits), vals)
    np.testing.assert_array_equal(unpack_rows_torch(torch.from_numpy(packed), s, bits).numpy(), vals)
    assert bytes(packed[0]) == reference_pack(vals[0].tolist(), bits)


def test_13_bit_layout_is_the_papers():
    # 8 indices of 13 bits fill exactly 13 bytes; the stream is idx0[12:0] || idx1[12:0] || ...
    vals = np.array([8191, 0, 1, 4096, 1234, 7, 8000, 42])
    packed = pack_indices(vals, 13)
    assert packed.size == 13
    stream = "".join(format(int(v), "013b") for v in vals)
    assert [int(stream[i : i + 8], 2) for i in range(0, 104, 8)] == packed.tolist()


def test_value_too_large_and_bad_bits():
    with pytest.raises(ValueError):
        pack_indices(np.array([8192]), 13)
    with pytest.raises(ValueError):
        pack_indices(np.array([1]), 17)
    with pytest.raises(ValueError):
        unpack_indices(np.zeros(1, np.uint8), 8, 13)


@settings(max_examples=40, deadline=None)
@given(n_bits=st.integers(4, 14), s=st.integers(1, 40), rows=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_rice_roundtrip_and_size(n_bits, s, rows, seed):
    rng = np.random.default_rng(seed)
    n = 2 ** n_bits
    s = min(s, n)
    idx = np.stack([rng.choice(n, s, replace=False) for _ in range(rows)])
    coef = rng.standard_normal(idx.shape)
    srt, c = sorted_codes(idx, coef)
    assert (np.diff(srt, axis=1) > 0).all()
    for r in range(rows):  # coefficients follow their atoms
        assert dict(zip(idx[r], coef[r])) == dict(zip(srt[r], c[r]))
    k = rice_parameter(srt)
    code = rice_encode(srt, k)
    assert np.array_equal(rice_decode(code, rows, s), srt)
    bits = rice_bits(srt, k)
    assert code.unary.nbytes == -(-(bits - srt.size * k) // 8)  # the quotient stream, to the byte
    assert all(rice_bits(srt, k) <= rice_bits(srt, j) for j in range(17))


def test_rice_beats_fixed_width_near_the_log_factorial_bound():
    rng = np.random.default_rng(0)
    s = 32
    idx = np.stack([rng.choice(8192, s, replace=False) for _ in range(4000)])
    srt, _ = sorted_codes(idx, idx)
    per_index = rice_bits(srt, rice_parameter(srt)) / srt.size
    bound = 13 - lgamma(s + 1) / log(2) / s  # log2(C(n, s)) / s ≈ 13 − log2(s!)/s
    assert bound < per_index < bound + 0.3 < 13


def test_rice_rejects_unsorted_rows():
    with pytest.raises(ValueError, match="ascending"):
        rice_encode(np.array([[3, 3, 5]]), 2)


@settings(max_examples=150, deadline=None)
@given(universe=st.integers(1, 70000), s=st.integers(1, 70), rows=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_elias_fano_rows_roundtrip_numpy_torch_and_reference(universe, s, rows, seed):
    rng = np.random.default_rng(seed)
    s = min(s, universe)
    srt = np.sort(np.stack([rng.choice(universe, s, replace=False) for _ in range(rows)]), axis=1)
    packed = pack_sorted_rows(srt, universe)
    assert packed.shape == (rows, ef_row_bytes(s, universe)) and packed.dtype == np.uint8
    assert [bytes(r) for r in packed] == [reference_sorted_pack(r.tolist(), universe) for r in srt]
    assert np.array_equal(unpack_sorted_rows(packed, s, universe), srt)
    assert torch.equal(unpack_sorted_rows_torch(torch.from_numpy(packed), s, universe), torch.from_numpy(srt))


def test_elias_fano_size_is_the_textbook_bound():
    """≤ 2 + ceil(log2(n/s)) bits per value; at 8192 atoms: 12 / 11 / 10 / 9 bits at s = 8 / 16 / 32 / 64."""
    for s in range(1, 200):
        for n in (256, 8192, 65536):
            if s <= n:
                assert ef_row_bits(s, n) <= s * (2 + max(0, int(np.ceil(np.log2(n / s)))))
    assert [ef_row_bytes(s, 8192) * 8 / s for s in (8, 16, 32, 64)] == [12, 11, 10, 9]
    assert ef_low_bits(32, 8192) == 8


def test_elias_fano_rejects_unsorted_repeated_or_out_of_range():
    for bad in ([[3, 3, 5]], [[5, 3, 4]], [[0, 1, 8]], [[-1, 2, 3]]):
        with pytest.raises(ValueError):
            pack_sorted_rows(np.array(bad), 8)
    with pytest.raises(ValueError, match="set bits"):  # a damaged row is an error, never wrong indices
        unpack_sorted_rows_torch(torch.zeros(3, ef_row_bytes(4, 64), dtype=torch.uint8), 4, 64)
