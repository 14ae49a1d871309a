"""The CUDA paths give what the CPU paths give: encode, decode, store reads, fusion, the CLI.

Every test here is marked `cuda` and skipped where no GPU is present (`pytest -m cuda` runs
them on a GPU machine). Device-agnostic unit tests (OMP) are parametrised over both devices
in their own modules instead.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from sparsecache.cli.main import cli

pytestmark = pytest.mark.cuda
QUESTION = "What does the global statement do?"


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def cuda_store(tiny_model_dir, tiny_dictionary_dir, tmp_path_factory):
    """The same corpus encoded on the GPU and on the CPU."""
    from support.corpora import write_corpus

    root = tmp_path_factory.mktemp("devices")
    corpus = write_corpus(root / "corpus")
    for dev in ("cuda", "cpu"):
        r = invoke("encode-corpus", corpus, "--store", root / dev, "--model", tiny_model_dir,
                   "--dict", tiny_dictionary_dir, "--chunk-tokens", 64, "--device", dev)
        assert r.exit_code == 0, r.output
    return root


def nmse(x, ref):
    return float((x - ref).square().sum() / ref.square().sum())


def test_codec_encode_on_cuda_is_as_good_as_on_cpu(tiny_model, tiny_dictionary):
    from sparsecache.codec.coding import Codec
    from sparsecache.model import extract_kv

    ids = tiny_model.tokenizer("The global statement declares names global. " * 20)["input_ids"]
    (k, v), = extract_kv(tiny_model, [ids])
    for kind, x in (("k", k), ("v", v)):
        cpu = Codec(tiny_dictionary, "float16", "cpu", indices="elias-fano")
        gpu = Codec(tiny_dictionary, "float16", "cuda", indices="elias-fano")
        codes = gpu.encode(x, kind)
        # fp16 atom choice on the GPU may pick other atoms in near-ties, never worse codes
        assert nmse(gpu.decode(codes, kind, "cpu"), x) <= nmse(cpu.roundtrip(x, kind), x) * 1.02 + 1e-6
        # decoding the same codes is the same function on both devices
        torch.testing.assert_close(gpu.decode(codes, kind).cpu(), cpu.decode(codes, kind), atol=1e-5, rtol=1e-5)


def test_store_decodes_on_cuda_like_on_cpu(cuda_store):
    from sparsecache.kvstore import KVStore

    s = KVStore.open(cuda_store / "cpu")
    ids = [c.id for c in s.chunks()][:5]
    for (kg, vg), (kc, vc) in zip(s.load_kv(ids, device="cuda"), s.load_kv(ids, device="cpu")):
        assert kg.device.type == "cuda"
        torch.testing.assert_close(kg.cpu(), kc, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vg.cpu(), vc, atol=1e-5, rtol=1e-5)


def test_gpu_encoded_store_holds_the_same_chunks(cuda_store):
    from sparsecache.kvstore import KVStore

    a, b = KVStore.open(cuda_store / "cuda"), KVStore.open(cuda_store / "cpu")
    assert [(c.doc_id, c.ordinal, c.token_length) for c in a.chunks()] == \
           [(c.doc_id, c.ordinal, c.token_length) for c in b.chunks()]
    assert a.info()["chunks"] == b.info()["chunks"]


@pytest.mark.parametrize("method", ["a3", "infoflow", "cacheblend", "cacheclip"])
def test_recomputing_everything_on_cuda_reproduces_full_prefill(cuda_store, tiny_model_dir, method):
    from sparsecache.query.session import Session

    s = Session(cuda_store / "cuda", str(tiny_model_dir), "cuda", dtype="float32")
    ids = [c.id for c in s.store.chunks()][:4]

    def logits(m, r=0.0, **cfg):
        return s.query(QUESTION, chunks=ids, method=m, recompute_ratio=r, max_new_tokens=1, **cfg).logits

    torch.testing.assert_close(logits(method, 1.0), logits("full"), atol=1e-4, rtol=1e-4)
    # reordered by the question's attention, everything recomputed = full prefill of that order
    reordered = s.query(QUESTION, chunks=ids, method=method, recompute_ratio=1.0, max_new_tokens=1,
                        reorder="attention")
    full = s.query(QUESTION, chunks=reordered.context_ids, method="full", order="given", max_new_tokens=1)
    torch.testing.assert_close(reordered.logits, full.logits, atol=1e-4, rtol=1e-4)
    cpu = Session(cuda_store / "cuda", str(tiny_model_dir), "cpu")
    got = cpu.query(QUESTION, chunks=ids, method="none", max_new_tokens=1).logits
    torch.testing.assert_close(logits("none").cpu(), got.cpu(), atol=1e-3, rtol=1e-3)


def test_cake_on_cuda_overlaps_into_the_same_context(cuda_store, tiny_model_dir):
    """The loader decodes on its own CUDA stream: every split gives what the fixed methods give."""
    from sparsecache.query.session import Session

    s = Session(cuda_store / "cuda", str(tiny_model_dir), "cuda", dtype="float32")
    ids = [c.id for c in s.store.chunks()][:4]

    def logits(**cfg):
        return s.query(QUESTION, chunks=ids, max_new_tokens=1, **cfg).logits

    torch.testing.assert_close(logits(method="cake", cake_split=len(ids)), logits(method="full"),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits(method="cake", cake_split=0), logits(method="none"), atol=1e-4, rtol=1e-4)
    from sparsecache.query.overlap import Rates

    s.rates = Rates()  # nothing measured: the threads meet where they meet
    free = s.query(QUESTION, chunks=ids, max_new_tokens=1, method="cake")
    lengths = [s.store.chunk(c).token_length for c in free.context_ids]
    computed = next(n for n in range(len(ids) + 1) if sum(lengths[:n]) == free.recomputed_tokens)
    torch.testing.assert_close(free.logits, logits(method="cake", cake_split=computed), atol=1e-4, rtol=1e-4)


def test_query_cli_on_cuda(cuda_store, tiny_model_dir):
    r = invoke("query", cuda_store / "cuda", QUESTION, "--model", tiny_model_dir, "--device", "cuda",
               "--max-new-tokens", 3, "--top-k", 3, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert len(out["chunks"]) == 3 and out["recomputed_tokens"] > 0 and out["timings_ms"]["ttft"] > 0


def test_learn_dict_on_cuda(tiny_model_dir, text_file, tmp_path):
    from sparsecache.codec.dictionary import Dictionary

    r = invoke("learn-dict", "--model", tiny_model_dir, "--text", text_file, "--atoms", 64, "--sparsity", 4,
               "--layers-per-signal", 2, "--steps", 6, "--batch", 128, "--max-tokens", 3000,
               "--out", tmp_path / "d", "--device", "cuda")
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "d" / "dictionary.json").read_text())
    assert meta["heldout_nmse"]["k"] < 1.0
    assert Dictionary.load(tmp_path / "d").keys.device.type == "cpu"  # artifacts load on the CPU


@pytest.mark.slow
def test_default_model_kv_on_cuda_matches_cpu(default_model):
    from sparsecache.model import extract_kv, load_model

    gpu = load_model(device="cuda")
    ids = default_model.tokenizer("A context manager's __exit__ method returns a boolean. " * 8)["input_ids"]
    (kc, vc), = extract_kv(default_model, [ids])
    (kg, vg), = extract_kv(gpu, [ids])
    assert nmse(kg.cpu(), kc) < 1e-6 and nmse(vg.cpu(), vc) < 1e-6


def test_the_gpu_default_dtype_is_bfloat16_and_close_to_float32(cuda_store, tiny_model_dir):
    """A CUDA session's model runs in bfloat16 unless told otherwise; its answers from the
    same store are within bf16's rounding of the float32 reference's."""
    from sparsecache.query.session import Session

    half = Session(cuda_store / "cuda", str(tiny_model_dir), "cuda")
    ref = Session(cuda_store / "cuda", str(tiny_model_dir), "cuda", dtype="float32")
    assert half.model.dtype == torch.bfloat16
    ids = [c.id for c in ref.store.chunks()][:4]
    for method in ("none", "infoflow"):
        got, want = (s.query(QUESTION, chunks=ids, method=method, recompute_ratio=0.3, max_new_tokens=1).logits
                     for s in (half, ref))
        assert (got - want).abs().max() < 0.05 * want.abs().max()
