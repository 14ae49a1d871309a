"""Causal LMs as KV producers: loading, pre-RoPE K/V extraction, RoPE at chosen positions.

What `--model` names becomes a HuggingFace directory in `gguf.py` (the default model, and
GGUF files, are converted once into the user cache); this module loads it, checks that its
family is one sparsecache places correctly, fingerprints it and captures its K/V.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, ModelError
from .gguf import DEFAULT, model_dir, model_name

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text")
# RoPE variants whose angle depends on the position alone; "dynamic" and "longrope"
# rescale with the sequence length, so a chunk's keys could not be rotated at load time.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Config keys that decide the shape and meaning of K/V; the fingerprint hashes them.
_FINGERPRINT_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
    "rope_parameters", "rope_scaling", "rope_theta", "rms_norm_eps",
)


def check_config(config, where: str) -> None:
    if config.model_type not in SUPPORTED_TYPES:
        raise ModelError(
            f"{where}: unsupported architecture {config.model_type!r} "
            f"(supported RoPE decoders: {', '.join(SUPPORTED_TYPES)})"
        )
    for rope_type in _rope_types(config):
        if rope_type not in STATIC_ROPE_TYPES:
            raise ModelError(
                f"{where}: rope type {rope_type!r} depends on sequence length; "
                f"supported: {', '.join(STATIC_ROPE_TYPES)}"
            )
    if config.model_type == "gemma3_text":  # measured: 5.17 gives perplexity 4,910 where 5.19 gives 81, same weights
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__) < Version("5.19"):
            raise ModelError(f"{where}: Gemma 3 needs transformers >= 5.19 (found {transformers.__version__}, "
                             "which computes it wrongly)")


def _rope_types(config) -> list[str]:
    """The RoPE type of every rotary table: one, or one per layer type (Gemma 3's local and global)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_type = bool(rope) and all(isinstance(p, dict) for p in rope.values())
    return [p.get("rope_type", p.get("type", "default")) for p in (rope.values() if per_type else [rope])]


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding attention window W (a query at position p sees keys at positions
    p-W < j <= p), or None where it sees the whole context: per layer type where the family
    has them (Gemma 2/3, Qwen2/3), else the config's one window for every layer (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types[: config.num_hidden_layers]]
    return [window] * config.num_hidden_layers


def compute_parameters(config) -> int:
    """The weights a token's forward pass multiplies, from a decoder's config: attention (q, k, v,
    o) and a gated MLP per layer, plus the norms; not the input embeddings (a lookup). Exact for
    SmolLM2 (106,203,456), what the cheap-context rule scales by (`query.cheap`)."""
    config = getattr(config, "text_config", None) or config  # a multimodal config's language model
    h, layers = config.hidden_size, config.num_hidden_layers
    head = getattr(config, "head_dim", None) or h // config.num_attention_heads
    heads = config.num_attention_heads
    q, kv = heads * head, (getattr(config, "num_key_value_heads", None) or heads) * head
    mlp = getattr(config, "intermediate_size", None) or 4 * h
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * mlp + 2 * h
    return layers * per_layer + h


def kv_values(config) -> int:
    """K (or V) values a token's cache holds across all layers: layers x KV heads x head size (what
    the store path's read, decode and scoring scale by, `query.budget`)."""
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * heads * _head_dim(config)


@dataclass
class KVModel:
    """A loaded causal LM with the facts sparsecache needs about its KV cache."""

    hf: torch.nn.Module
    tokenizer: object
    name: str
    # soft tokens: the input embeddings [n, hidden] that token id -1-i stands for (a wrapped store's
    # header and trailer, `wrapper/apply.py`); None where no wrapped store is read
    soft: torch.Tensor | None = None

    @property
    def config(self):
        return self.hf.config

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype

    @property
    def compute_parameters(self) -> int:
        return compute_parameters(self.config)

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def n_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return _head_dim(self.config)

    @property
    def m(self) -> int:
        """Signal size of one layer: all KV heads of a token concatenated."""
        return self.n_kv_heads * self.head_dim

    @property
    def rope(self) -> "Rope":
        return Rope.of(self.hf.model.rotary_emb, self.config)

    @functools.cached_property
    def cache_arg(self) -> str:
        """What the forward calls its KV cache, argument and output: `cache` from transformers
        5.24 (where `past_key_values` is deprecated, to be removed in 5.40), before it
        `past_key_values`. `model.hf(**{m.cache_arg: cache})`, `getattr(out, m.cache_arg)`."""
        return "cache" if "cache" in inspect.signature(type(self.hf).forward).parameters else "past_key_values"

    def fingerprint(self) -> dict:
        """What a dictionary or store records to refuse being used with another model."""
        return config_fingerprint(self.config, self.name)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_fingerprint(config, name: str) -> dict:
    """A model's fingerprint from its transformers config: the keys that decide K/V's shape and meaning."""
    cfg = config.to_dict()
    subset = {k: cfg.get(k) for k in _FINGERPRINT_KEYS}
    if any(layer_windows(config)):  # only where windows exist, so other models keep their hash
        subset["layer_windows"] = layer_windows(config)
    digest = hashlib.sha256(json.dumps(subset, sort_keys=True, default=str).encode()).hexdigest()
    return {"name": name, "config_hash": digest[:16], "layers": config.num_hidden_layers,
            "m": config.num_key_value_heads * _head_dim(config)}


def resolve_device(name: str) -> str:
    """A device name with "auto" made concrete (cuda when present, else cpu); a CUDA device asked
    for where there is none is a ConfigError."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} asked for, but no CUDA device is available")
    return name


def query_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """The dtype a query runs the model in: one of `dtypes.DTYPES`, where "auto" is float32
    on a CPU (the reference) and bfloat16 on a GPU (BENCHMARKS.md, "On a GPU": its answers
    against float32's). A store's K/V are float32 whatever this says (its encode's forward:
    `encode-corpus --forward-dtype`)."""
    from ..dtypes import DTYPES

    if name not in DTYPES:
        raise ModelError(f"unknown dtype {name!r}: one of {', '.join(DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)


def load_model(name_or_path: str = DEFAULT, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> KVModel:
    """Load the default model, a local HuggingFace causal-LM directory or a GGUF file
    (`model_dir`), in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # ours report progress; a 0.1 s bar per load is noise
    path, config = _hf_config(name_or_path)
    check_config(config, str(path))
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelError(f"{path}: no weights (*.safetensors or *.bin)")
    # SDPA drops attention soft-capping (Gemma 2) without a word; eager computes the model as trained
    attn = "eager" if getattr(config, "attn_logit_softcapping", None) else None
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot load model: {str(e).splitlines()[0]}") from e
    hf.to(device).eval()
    return KVModel(hf=hf, tokenizer=tok, name=model_name(name_or_path, config, path))


def _hf_config(name_or_path) -> tuple[Path, object]:
    """The HuggingFace directory `--model` names (`model_dir`) and its config."""
    from transformers import AutoConfig

    path = model_dir(name_or_path)
    if not path.is_dir():
        raise ModelError(f"model directory not found: {path}")
    if not (path / "config.json").exists():
        raise ModelError(f"{path}: no config.json (not a HuggingFace model directory)")
    return path, AutoConfig.from_pretrained(path)


def model_fingerprint(name_or_path: str = DEFAULT) -> dict:
    """The fingerprint `load_model(name_or_path).fingerprint()` gives, from the config alone
    (a GGUF file is converted first, as `load_model` would)."""
    path, config = _hf_config(name_or_path)
    return config_fingerprint(config, model_name(name_or_path, config, path))


def default_prefix_ids(model: KVModel) -> list[int]:
    """Token ids of the chat template up to where the user's text starts (the shared prefix)."""
    tok = model.tokenizer
    marker = "\u2063SPARSECACHE\u2063"
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
        return tok(text.split(marker)[0], add_special_tokens=False)["input_ids"]
    return [tok.bos_token_id] if tok.bos_token_id is not None else []


def prefix_ids(model: KVModel, prefix: str | None) -> list[int]:
    """The shared prefix: the model's chat template up to the user's text, or `prefix` tokenized."""
    if prefix is None:
        return default_prefix_ids(model)
    return model.tokenizer(prefix, add_special_tokens=False)["input_ids"]


def chunk_context_ids(model: KVModel, prefix: str | None, anchor: str | None = None) -> list[int]:
    """What every chunk is encoded after: the shared prefix, then the store's anchor text if it
    has one (whose K/V is not kept: a query lays chunks out after the prefix alone)."""
    ids = prefix_ids(model, prefix)
    return ids + model.tokenizer(anchor, add_special_tokens=False)["input_ids"] if anchor else ids


def embed_ids(model: KVModel, ids: torch.Tensor) -> torch.Tensor:
    """Input embeddings of token ids [..., T], an id -1-i standing for soft token i (`KVModel.soft`)."""
    return embed_soft(model.hf.model.embed_tokens, ids, model.soft)


def embed_soft(embed, ids: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
    """`embed(ids)` (an engine's own token embedding, scaling included) with each id -1-i replaced
    by row i of `soft` [n, hidden], a wrapper's soft tokens as input embeddings."""
    # inside a CUDA graph (`graphs`) nothing may synchronise with the host
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if soft is None and capturing:
        return embed(ids)
    where = ids < 0
    if not capturing and not bool(where.any()):
        return embed(ids)
    if soft is None:
        raise ModelError("soft token ids (a wrapped store's header or trailer) but no wrapper loaded")
    out = embed(ids.clamp(min=0))
    table = soft.to(out.device, out.dtype)
    return torch.where(where[..., None], table[(-1 - ids).clamp(0, table.shape[0] - 1)], out)


def use_soft_tokens(model: KVModel, soft: torch.Tensor | None) -> None:
    """Let `model` read a wrapped store's soft tokens (`soft`, [n, hidden]; None: nothing to do).
    One model serves one wrapper: a second, different one is refused."""
    if soft is None:
        return
    if model.soft is not None and not torch.equal(model.soft.cpu(), soft.cpu()):
        raise ModelError("this model already reads a store with another wrapper: load the model once per wrapper")
    model.soft = soft.to(model.device)


def model_inputs(model: KVModel, ids: torch.Tensor) -> dict:
    """What a forward takes for token ids [B, T]: `input_ids`, or `inputs_embeds` where some are soft."""
    return {"inputs_embeds": embed_ids(model, ids)} if bool((ids < 0).any()) else {"input_ids": ids}


def qkv_states(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values [B, T, heads, D] of one attention module for its input `x`,
    as the module itself forms them before RoPE: separate or fused (Phi-3's qkv_proj)
    projections, then any per-head normalisation (Qwen3's q_norm / k_norm)."""
    if hasattr(attn, "qkv_proj"):
        q, k, v = _split_qkv(attn, attn.qkv_proj(x))
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))
    if hasattr(attn, "k_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def _split_qkv(attn: torch.nn.Module, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values [..., heads·D] of a fused qkv_proj output, in Phi-3's order."""
    kv = attn.config.num_key_value_heads * attn.head_dim
    return qkv.split([qkv.shape[-1] - 2 * kv, kv, kv], dim=-1)


def key_value_modules(attn: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """(module, fn(output) → {"k"|"v": [B, T, m]}) whose outputs are the keys the attention
    rotates (after any normalisation) and the values it reads."""
    if hasattr(attn, "qkv_proj"):
        return [(attn.qkv_proj, lambda out: dict(zip("kv", _split_qkv(attn, out)[1:])))]
    if hasattr(attn, "k_norm"):  # Qwen3, Gemma 3: per-head norm, applied here to k_proj's output
        # (layout-free, where the module's own k_norm sees [B, T, H, D] or [B, H, T, D] by family)
        return [(attn.k_proj, lambda out: {"k": attn.k_norm(out.unflatten(-1, (-1, attn.head_dim))).flatten(-2)}),
                (attn.v_proj, lambda out: {"v": out})]
    return [(attn.k_proj, lambda out: {"k": out}), (attn.v_proj, lambda out: {"v": out})]


@contextlib.contextmanager
def kv_taps(model: KVModel):
    """Record every layer's keys before RoPE (after any k_norm) and its values as cached."""
    taps: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.hf.model.layers):
        for module, pick in key_value_modules(layer.self_attn):
            def hook(_mod, _inp, out, i=i, pick=pick):
                for kind, x in pick(out).items():
                    taps[kind, i] = x
            handles.append(module.register_forward_hook(hook))
    try:
        yield taps
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def extract_kv(model: KVModel, chunks: list[list[int]], prefix_ids: list[int] = (),
               batch_tokens: int = 16384, forward_dtype: str = "float32",
               contexts: list[list[int]] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pre-RoPE keys and values of each chunk, computed after the shared prefix.

    Returns one (keys, values) pair per chunk, each [n_layers, T_chunk, m] float32 on the
    model's device; the prefix's own K/V is excluded. Chunks are right-padded into batches
    (causal attention keeps real tokens blind to the padding), and the prefix is run with
    each chunk so every chunk sees exactly the context it will be placed after.
    `contexts[i]` (optional) are tokens chunk i reads between the prefix and itself, whose K/V is
    not returned either (a store encoded after each chunk's neighbours: `ingest/after.py`).
    `forward_dtype` "bfloat16" runs the forward under bfloat16 autocast (the encode's
    `--forward-dtype`, resolved by `dtypes.forward_dtype`); the K/V returned are float32 either way.
    """
    prefix = list(prefix_ids)
    before = [prefix + list(c) for c in contexts] if contexts is not None else [prefix] * len(chunks)
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(chunks)  # type: ignore[list-item]
    widths = [len(b) + len(c) for b, c in zip(before, chunks)]
    order = sorted(range(len(chunks)), key=lambda i: widths[i])  # less padding
    pad = model.tokenizer.pad_token_id or 0
    autocast = torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=forward_dtype == "bfloat16")
    with kv_taps(model) as taps, autocast:
        for batch in _batches(order, widths, batch_tokens):
            width = max(widths[i] for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            for row, i in enumerate(batch):
                seq = before[i] + list(chunks[i])
                ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            model.hf.model(**model_inputs(model, ids.to(model.device)), use_cache=False)
            k = torch.stack([taps["k", l] for l in range(model.n_layers)], 1)  # (B, L, W, m)
            v = torch.stack([taps["v", l] for l in range(model.n_layers)], 1)  # (B, L, W, m)
            for row, i in enumerate(batch):
                span = slice(len(before[i]), widths[i])
                out[i] = (k[row, :, span].float(), v[row, :, span].float())
    return out


def _batches(order: list[int], widths: list[int], batch_tokens: int):
    batch: list[int] = []
    for i in order:
        width = widths[i]  # sorted ascending, so this is the batch max
        if batch and (len(batch) + 1) * width > batch_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


@dataclass(frozen=True)
class Rope:
    """One model family's RoPE at chosen positions, from its own rotary-embedding module
    (scaling types included). Needs the config only, so vLLM's worker can rotate too.

    Keys are [n_layers, T, m] (or [..., T, m] where every layer shares one table); a family
    with one table per layer type (Gemma 3: local base for sliding layers, global base with
    scaling for full ones) rotates layer `first_layer + i` with its own type's table.
    Partial rotary (Phi-3 family with partial_rotary_factor < 1) rotates the first rotary
    dims of each head, the width of the module's tables, and passes the rest."""

    rotary: torch.nn.Module
    n_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...] | None = None  # per layer, where tables differ by layer type

    @classmethod
    def of(cls, rotary: torch.nn.Module, config) -> "Rope":
        per_type = hasattr(rotary, "layer_types")  # Gemma 3's module takes the layer type per call
        types = tuple(config.layer_types[: config.num_hidden_layers]) if per_type else None
        return cls(rotary, config.num_key_value_heads, _head_dim(config), types)

    @classmethod
    def for_config(cls, config) -> "Rope":
        """The family's rotary module built from a transformers config alone (no weights)."""
        import importlib

        check_config(config, getattr(config, "_name_or_path", "") or config.model_type)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal_lm = getattr(importlib.import_module("transformers"), MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type])
        module = importlib.import_module(causal_lm.__module__)
        rotary = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding") and n[0] != "_")
        return cls.of(rotary(config), config)

    def tables(self, positions: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary dims] float32 at `positions` [T] for `layer`, on the positions' device."""
        dev = positions.device
        self.rotary.to(dev)
        probe = torch.empty(1, device=dev, dtype=torch.float32)
        cos, sin = self.rotary(probe, positions[None], *self._type_arg(layer))
        return cos[0].float(), sin[0].float()

    def embeddings(self, x: torch.Tensor, position_ids: torch.Tensor, n_layers: int) -> list:
        """(cos, sin) for each of the first `n_layers` decoder layers, as the model's own forward
        passes them (dtype of `x`): for running decoder layers one by one."""
        shared = {}
        for layer in range(n_layers):
            key = self._type_arg(layer)
            if key not in shared:
                shared[key] = self.rotary(x, position_ids, *key)
        return [shared[self._type_arg(layer)] for layer in range(n_layers)]

    def _type_arg(self, layer: int) -> tuple:
        return (self.layer_types[layer],) if self.layer_types else ()

    def _per_layer_tables(self, positions: torch.Tensor, first_layer: int, n: int):
        shared = {}
        for layer in range(first_layer, first_layer + n):
            key = self._type_arg(layer)
            if key not in shared:
                shared[key] = self.tables(positions, layer)
            yield shared[key]

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor, first_layer: int = 0) -> torch.Tensor:
        """RoPE on pre-RoPE keys at `positions` [T]; a new tensor, same shape and dtype."""
        positions = positions.to(keys.device)
        if self.layer_types is None:
            return self._rotated(keys, *self.tables(positions))
        return torch.stack([self._rotated(k, cos, sin) for k, (cos, sin)
                            in zip(keys, self._per_layer_tables(positions, first_layer, keys.shape[0]))])

    def _rotated(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, R), R = rotary dims <= D
        k = keys.float().unflatten(-1, (self.n_kv_heads, self.head_dim))  # (..., T, H, D)
        r = cos.shape[-1]
        rot = k[..., :r] * cos + _rotate_half(k[..., :r]) * sin
        return torch.cat([rot, k[..., r:]], dim=-1).flatten(-2).to(keys.dtype)

    def rotate_(self, keys: torch.Tensor, positions: torch.Tensor, first_layer: int = 0) -> torch.Tensor:
        """RoPE in place on float32 pre-RoPE keys [L, S, m] that the caller owns (layers
        first_layer.. of the model), in ~2.5 passes instead of ~7."""
        positions = positions.to(keys.device)
        if self.layer_types is None:
            return self._rotate_(keys, *self.tables(positions))
        for k, (cos, sin) in zip(keys, self._per_layer_tables(positions, first_layer, keys.shape[0])):
            self._rotate_(k, cos, sin)
        return keys

    def _rotate_(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Valid when both halves of each head share their angles (the rotate-half convention
        # of every supported family); anything else goes through the out-of-place form.
        half = cos.shape[-1] // 2
        if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
            keys.copy_(self._rotated(keys, cos, sin))
            return keys
        c, s = cos[:, None, :half], sin[:, None, :half]  # (S, 1, D/2)
        k = keys.view(*keys.shape[:-1], self.n_kv_heads, self.head_dim)  # (..., S, H, D)
        x1, x2 = k[..., :half], k[..., half: 2 * half]  # dims past the rotary ones stay as they are
        old = x1.clone()
        x1.mul_(c).addcmul_(x2, s, value=-1)  # x1·cos − x2·sin
        x2.mul_(c).addcmul_(old, s)  # x2·cos + x1·sin
        return keys


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_keys(keys: torch.Tensor, positions: torch.Tensor, model: KVModel) -> torch.Tensor:
    """Apply RoPE to pre-RoPE keys [n_layers, T, m] at `positions` [T]; same shape and dtype back."""
    return model.rope.rotate(keys, positions)


def cache_heads(x: torch.Tensor, model: KVModel) -> torch.Tensor:
    """One layer's [T, m] as the cache's (1, H, T, D) in its dtype and device: a view where no
    cast or move is needed (callers that keep it make it contiguous, or concatenate it).
    `model` is a KVModel or anything with its device, dtype, n_kv_heads and head_dim (a Stack)."""
    x = x.to(model.device, model.dtype).unflatten(-1, (model.n_kv_heads, model.head_dim))
    return x.transpose(0, 1)[None]


def kv_cache(keys: torch.Tensor, values: torch.Tensor, model: KVModel):
    """A transformers DynamicCache (batch 1) from post-RoPE keys and values [n_layers, T, m]
    (`model` as in `cache_heads`)."""
    from transformers import DynamicCache

    def heads(x: torch.Tensor) -> torch.Tensor:
        return cache_heads(x, model).contiguous()  # contiguous once, not per attention call

    return DynamicCache(ddp_cache_data=[(heads(k), heads(v)) for k, v in zip(keys, values)])


@torch.inference_mode()
def continuation_logits(model: KVModel, keys: torch.Tensor, values: torch.Tensor,
                        continuation: list[int]) -> torch.Tensor:
    """Logits [C, vocab] float32 of a continuation given a context's post-RoPE K/V [L, T, m]."""
    start = keys.shape[1]
    ids = torch.tensor([continuation], device=model.device)
    pos = torch.arange(start, start + len(continuation), device=model.device)[None]
    cache = kv_cache(keys, values, model)
    return model.hf(input_ids=ids, **{model.cache_arg: cache}, position_ids=pos, use_cache=True).logits[0].float()
