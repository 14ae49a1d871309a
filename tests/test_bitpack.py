import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecache.bitpack import (pack_indices, pack_rows, packed_size, reference_pack, row_bytes, unpack_indices,
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
