"""The codec (`codec.coding`): encode and decode against OMP then reconstruction, the coefficient
formats and index packings it stores, per-layer scales, and every decode kernel (the CPU kernel,
the GPU forms: dense, CSR and the fused Triton kernel, Elias-Fano unpacking) against the gather it
replaces; damaged rows refused."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsecache.codec.bitpack import pack_sorted_rows, row_bytes, unpack_sorted_rows
from sparsecache.codec.coding import COEF_FORMATS, Codec, coefficient_roundtrip
from sparsecache.codec.dictionary import DictConfig, Dictionary
from sparsecache.codec.omp import batch_omp, reconstruct, reconstruct_dense
from sparsecache.codec.signals import to_signals
from sparsecache.testing import unit_atoms
from support import REPO


def make_dict(m=32, layers=4, L=1, atoms=256, s=6):
    return Dictionary(unit_atoms(L * m, atoms, 1), unit_atoms(L * m, atoms, 2), DictConfig(atoms, s, L),
                      {"name": "t", "config_hash": "x", "layers": layers, "m": m})


@pytest.mark.parametrize("L", [1, 2, 4])
def test_encode_decode_equals_omp_then_reconstruct(L):
    d = make_dict(L=L)
    codec = Codec(d)
    kv = torch.randn(4, 10, 32)
    codes = codec.encode(kv, "k")
    assert codes.indices.shape == (4 // L, 10, row_bytes(6, 8)) and codes.indices.dtype == np.uint8
    assert codes.coefficients.dtype == np.float16
    sig = to_signals(kv, L).reshape(-1, 32 * L)
    idx, coef = batch_omp(sig, d.keys, 6)
    expected = reconstruct(idx, coef.half().float(), d.keys)  # fp16 coefficients, exact indices
    got = codec.decode(codes, "k")
    assert got.shape == kv.shape
    torch.testing.assert_close(to_signals(got, L).reshape(-1, 32 * L), expected)


def test_13_bit_codes_and_byte_count():
    d = make_dict(atoms=8192, s=16, m=16, layers=2)
    codec = Codec(d)
    assert codec.bits == 13 and codec.bytes_per_signal() == 26 + 32
    codes = codec.encode(torch.randn(2, 7, 16), "v")
    assert codes.nbytes == 2 * 7 * (26 + 32)


def test_fp32_coefficients_and_bad_dtype():
    d = make_dict()
    kv = torch.randn(4, 3, 32)
    c32 = Codec(d, "float32")
    assert c32.encode(kv, "k").coefficients.dtype == np.float32
    with pytest.raises(ValueError, match="dtype"):
        Codec(d, "int3")


def test_coefficient_formats():
    c = torch.randn(500, 16) * torch.logspace(-2, 1, 500)[:, None]  # signals of very different norms
    assert torch.equal(coefficient_roundtrip(c, "float16"), c.half().float())
    i8 = coefficient_roundtrip(c, "int8")
    step = c.abs().amax(1, keepdim=True) / 127
    assert ((i8 - c).abs() <= step * 0.51 + 1e-6).all()  # per-signal scale: relative to each signal
    f8 = coefficient_roundtrip(c, "float8")
    assert ((f8 - c).abs() <= c.abs() * 2 ** -4 + 2 ** -10).all()  # 3 mantissa bits, round to nearest
    assert {f: COEF_FORMATS[f](16) for f in COEF_FORMATS} == {"float16": 32, "float8": 16, "int8": 18}
    with pytest.raises(ValueError, match="coefficient format"):
        coefficient_roundtrip(c, "int4")


def test_float8_codec_stores_e4m3_bytes_and_decodes_like_the_bench_format():
    d = Dictionary(unit_atoms(32, 128, 1), unit_atoms(32, 128, 2), DictConfig(128, 4, 1), {})
    x = torch.randn(4, 10, 32) * 3
    c8, c16 = Codec(d, "float8"), Codec(d, "float16")
    codes = c8.encode(x, "k")
    assert codes.coefficients.dtype == np.uint8 and c8.bytes_per_signal() == c16.bytes_per_signal() - 4
    idx, coef = batch_omp(to_signals(x, 1).reshape(-1, 32), d.keys, 4)
    want = reconstruct(idx, coefficient_roundtrip(coef, "float8"), d.keys).view(4, 10, 32)
    torch.testing.assert_close(c8.decode(codes, "k"), want)


@pytest.mark.parametrize("L", [1, 2])
def test_elias_fano_codec_decodes_like_packed(L):
    """Sorted-set indices are lossless: the same atoms and coefficients, in another order."""
    d = make_dict(L=L, atoms=8192, s=16, m=16)
    kv = torch.randn(4, 9, 16)
    packed, ef = Codec(d, "float16"), Codec(d, "float16", indices="elias-fano")
    a, b = packed.encode(kv, "v"), ef.encode(kv, "v")
    assert b.indices.shape[-1] == 22 < a.indices.shape[-1] == 26  # 11 instead of 13 bits per index
    assert ef.bytes_per_signal() == packed.bytes_per_signal() - 4
    torch.testing.assert_close(ef.decode(b, "v"), packed.decode(a, "v"), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="index coding"):
        Codec(d, indices="rice")


def test_per_layer_scales_code_the_scaled_tensor_and_undo_the_scale():
    """With scales, decode(encode(x)) is the unscaled codec's roundtrip of x·s, divided by s."""
    plain = make_dict(L=2, layers=4)
    scales = {k: torch.tensor([20.0, 1.0, 0.5, 2.0]) for k in "kv"}
    scaled = Dictionary(plain.keys, plain.values, plain.config, plain.model, scales=scales)
    kv = torch.randn(4, 10, 32)
    s = scales["v"].view(-1, 1, 1)
    got = Codec(scaled).roundtrip(kv, "v")
    torch.testing.assert_close(got, Codec(plain).roundtrip(kv * s, "v") / s, rtol=1e-4, atol=1e-5)
    codes = Codec(scaled).encode(kv, "v")  # a slice of the groups decodes with its own layers' scales
    second = Codec(scaled).decode((codes.indices[1:], codes.coefficients[1:]), "v", groups=slice(1, 2))
    torch.testing.assert_close(second, got[2:], rtol=1e-4, atol=1e-5)
    assert scaled.fingerprint() != plain.fingerprint()


def test_a_quiet_layer_is_coded_as_well_as_its_loud_partner_only_with_scales():
    """Inside an L-layer signal OMP minimises the group's total error: a layer with 1% of the
    energy is left almost uncoded (the default model's layer-0 V). Equal-energy scales fix it."""
    torch.manual_seed(0)
    d = make_dict(L=2, layers=2, atoms=512, s=8)
    kv = torch.randn(2, 64, 32)
    kv[0] *= 0.1
    rms = kv.square().mean((1, 2)).sqrt()
    scaled = Dictionary(d.keys, d.values, d.config, d.model, scales={k: rms.mean() / rms for k in "kv"})

    def layer_nmse(codec):
        err = (codec.roundtrip(kv, "k") - kv).square().sum((1, 2)) / kv.square().sum((1, 2))
        return err.tolist()

    quiet, loud = layer_nmse(Codec(d))
    assert quiet > 1 and loud < 0.3  # worse than storing zeros, as layer 0's V was (NMSE 2.6)
    quiet_s, loud_s = layer_nmse(Codec(scaled))
    assert quiet_s < 0.4 and abs(quiet_s - loud_s) < 0.1


@pytest.mark.parametrize("atoms_dtype", ["float16", "float32"])
@pytest.mark.parametrize("L", [1, 2])
def test_cpu_decode_kernel_equals_embedding_bag(atoms_dtype, L):
    """The CPU tile kernel gives what `embedding_bag` gives (the GPU's decode) within fp32
    summation order, for fp16 atoms (tiles in fp16, exact) and fp32 ones (tiles in fp32),
    with per-layer scales and for a slice of the layer groups."""
    from sparsecache.codec.signals import from_signals

    plain = make_dict(L=L, layers=4, atoms=300, s=7)
    scales = {k: torch.tensor([3.0, 1.0, 0.5, 2.0]) for k in "kv"}
    d = Dictionary(plain.keys, plain.values, plain.config, plain.model, scales=scales).stored_as(atoms_dtype)
    codec = Codec(d, "float8", indices="elias-fano")
    codes = codec.encode(torch.randn(4, 11, 32), "v")
    got = codec.decode(codes, "v")
    G, T = codes.indices.shape[:2]
    idx = torch.from_numpy(unpack_sorted_rows(codes.indices.reshape(G * T, -1), 7, 300))
    coef = torch.from_numpy(codes.coefficients).view(torch.float8_e4m3fn).float().reshape(G * T, -1)
    sig = reconstruct(idx, coef, d.atoms("v")).view(G, T, -1)
    expected = from_signals(sig, L) / scales["v"].view(-1, 1, 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    part = codec.decode((codes.indices[1:], codes.coefficients[1:]), "v", groups=slice(1, None))
    torch.testing.assert_close(part, expected[L:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("atoms_dtype", ["float16", "float32"])
@pytest.mark.parametrize("way", ["dense", "csr", "triton"])
def test_every_gpu_decode_equals_the_gather(atoms_dtype, way):
    """Each way a GPU can decode (`coding.GPU_DECODES`: the codes scattered into a dense matrix times the
    atoms, a CSR product, the fused Triton kernel) gives the gather's K/V within fp16 rounding of its output
    (fp16 atoms and e4m3 coefficients are exact in fp16), scales and group slices included; run here on the
    CPU with the compiled kernel off. Triton's kernel runs in its interpreter, in a process of its own
    (`TRITON_INTERPRET` is read when Triton is imported)."""
    if way != "triton":
        return check_gpu_decode(way, atoms_dtype)
    pytest.importorskip("triton")
    here = Path(__file__).parent
    out = subprocess.run([sys.executable, "-c", f"from test_codec import check_gpu_decode; "
                          f"check_gpu_decode('triton', '{atoms_dtype}'); print('ok')"],
                         env={**os.environ, "TRITON_INTERPRET": "1",
                              "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), str(REPO)])},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout + out.stderr)[-3000:]


def check_gpu_decode(way: str, atoms_dtype: str) -> None:
    plain = make_dict(L=2, layers=4, atoms=300, s=7)
    scales = {k: torch.tensor([3.0, 1.0, 0.5, 2.0]) for k in "kv"}
    d = Dictionary(plain.keys, plain.values, plain.config, plain.model, scales=scales).stored_as(atoms_dtype)
    codec = Codec(d, "float8", indices="elias-fano")
    codec.cpu_kernel = False
    codes = codec.encode(torch.randn(4, 37, 32), "k")
    gather = codec.decode(codes, "k")
    codec.gpu_decode = way
    got = codec.decode(codes, "k")
    part = codec.decode((codes.indices[1:], codes.coefficients[1:]), "k", groups=slice(1, None))
    tol = 1e-3 if atoms_dtype == "float16" else 1e-5
    torch.testing.assert_close(got, gather, rtol=tol, atol=tol * float(gather.abs().max()))
    torch.testing.assert_close(part, gather[2:], rtol=tol, atol=tol * float(gather.abs().max()))


@pytest.mark.parametrize("way", ["csr", "triton"])
def test_a_decode_that_reads_unchecked_refuses_a_damaged_index(way):
    plain = make_dict(L=2, layers=4, atoms=300, s=7)
    codec = Codec(plain, "float16")
    codec.cpu_kernel, codec.gpu_decode = False, way
    idx, coef = torch.tensor([[1, 2, 300, 4, 5, 6, 7]]), torch.ones(1, 7)
    with pytest.raises(ValueError, match="out of range"):
        codec.reconstruct(idx, coef, (1, 1), "k", torch.device("cpu"))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 30), st.integers(1, 9), st.integers(1, 5), st.data())
def test_dense_reconstruction_in_blocks_sums_like_the_gather(rows, s, block_rows, data):
    """In any block size, a repeated index summed (as `embedding_bag` sums it), fp32 throughout."""
    n, m = 40, 6
    idx = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, n - 1), min_size=s, max_size=s),
                                          min_size=rows, max_size=rows)))
    coef = torch.randn(rows, s)
    atoms = torch.randn(m, n)
    got = reconstruct_dense(idx, coef, atoms.T.contiguous(), block_bytes=block_rows * n * 4)
    torch.testing.assert_close(got, reconstruct(idx, coef, atoms), rtol=1e-5, atol=1e-5)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.sampled_from([300, 8192]), st.integers(1, 6), st.data())
def test_compiled_elias_fano_unpack_equals_the_numpy_one(count, universe, rows, data):
    from sparsecache.codec.coding import unpack_sorted_cpu

    values = [sorted(data.draw(st.sets(st.integers(0, universe - 1), min_size=count, max_size=count)))
              for _ in range(rows)]
    packed = pack_sorted_rows(np.array(values), universe)
    got = unpack_sorted_cpu(torch.from_numpy(packed), count, universe)
    assert np.array_equal(got.numpy(), unpack_sorted_rows(packed, count, universe))
    assert got.tolist() == values


def test_damaged_elias_fano_rows_are_refused_not_decoded():
    d = make_dict(atoms=8192, s=16, m=16)
    codec = Codec(d, "float8", indices="elias-fano")
    codes = codec.encode(torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(0)), "k")
    damaged = codes.indices.copy()
    damaged[2, 3, -4:] = 0xFF  # the upper (unary) bit vector all ones: more values than the row holds
    with pytest.raises(ValueError, match="not Elias"):
        codec.decode((damaged, codes.coefficients), "k")


def test_out_of_range_atoms_are_refused_not_gathered():
    """The CPU kernel does not bounds-check: an index past the atoms (a packed row of 9 bits over
    300 atoms can hold up to 511) is refused as damaged codes, as embedding_bag refuses it."""
    d = make_dict(atoms=300, s=4)
    codec = Codec(d, "float16")
    codes = codec.encode(torch.randn(4, 3, 32), "k")
    bad = np.full_like(codes.indices, 0xFF)  # every 9-bit index = 511
    with pytest.raises(ValueError, match="out of range"):
        codec.decode((bad, codes.coefficients), "k")


def test_the_cpu_decode_reuses_its_memory_only_when_nothing_holds_the_last_result():
    """A CPU decode writes into the last decode's memory (faulted in once, #82) only when no tensor
    of that result is alive: a result still held, even through a view, is never overwritten, from
    this thread or another."""
    from concurrent.futures import ThreadPoolExecutor

    d = make_dict(L=1, layers=4, atoms=300, s=7)
    codec = Codec(d, "float8")
    rows = torch.stack([torch.randperm(300)[:7] for _ in range(4 * 11)]).to(torch.int32)

    def decode(seed):
        coef = torch.randn(4 * 11, 7, generator=torch.Generator().manual_seed(seed))
        return codec.reconstruct(rows, coef, (4, 11), "v", torch.device("cpu"))

    first = decode(0)
    kept = first.clone()
    second = decode(1)
    assert not torch.equal(second, kept) and torch.equal(first, kept)
    held, view = second.data_ptr(), second[1:]
    del second
    third = decode(2)
    assert third.data_ptr() not in (held, first.data_ptr())  # the second result lives on in its view
    reusable = third.data_ptr()
    del third, view
    assert decode(3).data_ptr() == reusable  # nothing holds the last result: its memory is reused
    seeds = range(10, 26)
    with ThreadPoolExecutor(4) as pool:  # concurrent decodes, each into memory nobody else holds
        results = list(pool.map(decode, seeds))
    assert len({r.data_ptr() for r in results}) == len(results)
    for seed, r in zip(seeds, results):
        assert torch.equal(r, decode(seed))
    assert torch.equal(first, kept)


def test_a_bfloat16_forward_codes_nearly_what_a_float32_forward_does(tiny_model, tiny_dictionary):
    """`code_batch` under bfloat16 autocast (`encode-corpus --forward-dtype bfloat16`, or auto on a
    CPU that multiplies bfloat16 natively): the K/V it codes are float32 and within bfloat16 rounding
    of the exact ones, so the decoded K/V are about as far from the exact as a float32 forward's codes."""
    import contextlib

    from sparsecache.codec.coding import Codec
    from sparsecache.ingest.batch import code_batch
    from sparsecache.model import extract_kv

    torch.manual_seed(0)
    chunks = [torch.randint(5, 250, (n,)).tolist() for n in (40, 64, 23)]
    prefix = [1, 2, 3]
    exact = extract_kv(tiny_model, chunks, prefix)
    k_exact = torch.cat([k for k, _ in exact], 1)
    codec = Codec(tiny_dictionary, "float32", "cpu")

    def err(dtype):
        codes = code_batch(tiny_model, codec, chunks, prefix, 4096, lambda _: contextlib.nullcontext(),
                           forward_dtype=dtype)[0]
        rec = codec.decode(codes, "k")
        return float(((rec - k_exact) ** 2).sum() / (k_exact ** 2).sum())

    (low,) = extract_kv(tiny_model, [chunks[0]], prefix, forward_dtype="bfloat16")
    assert low[0].dtype == torch.float32  # what the codec gets is float32 either way
    drift = float(((low[0] - exact[0][0]) ** 2).sum() / (exact[0][0] ** 2).sum())
    assert 0 < drift < 1e-3  # bfloat16's rounding, not a different computation
    f32, bf16 = err("float32"), err("bfloat16")
    assert bf16 < f32 * 1.05 + 1e-3, (f32, bf16)
