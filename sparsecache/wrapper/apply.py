"""Learned chunk wrappers (KV Packet): a few soft tokens around every independently encoded chunk.

A wrapper is `header` [H, d] and `trailer` [T, d]: vectors in the model's input-embedding space
(after any embedding scale, Gemma's included), shared by every chunk. A chunk is encoded as
`prefix | header | chunk | trailer`, and a query lays the wrapped chunks out one after another,
`prefix | header chunk₁ trailer | header chunk₂ trailer | … | question`, at consecutive global
positions, so the header's K/V is the same for every chunk (it sees only the prefix and itself).
The model is never changed: the wrapper is learned by self-distillation (`learn.py`)
so that the wrapped chunks, read without recomputing anything, answer as full prefill does.

A *linked* wrapper's trailer is not read as stored: a query recomputes every chunk's trailer
tokens in place, after every chunk before them (KVLink's link tokens, the model frozen), so they
can carry what one chunk says to the chunks after it; it is learned that way (`learn.py`), and a
store encoded with it says so in its wrapper digest (`store.layout.LINKED`), which a query reads
(`ContextLayout.linked`).

This module holds the artifact (safetensors + JSON, found by the model's fingerprint like a
dictionary) and the wrapped layout, differentiable for training and the same for answering.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..durable import write_atomic
from ..errors import ConfigError
from ..model.fingerprint import same_model
from ..model.kvmodel import KVModel, kv_cache, kv_taps, use_soft_tokens
from ..store.layout import LINKED
from .config import DEFAULT_WRAPPERS

# Wrappers that ship, beside the dictionaries (the repository's dictionaries/; a wheel holds the default
# model's alone, as it does its dictionary), found by the model's fingerprint (`--wrapper shipped`); a new
# store gets its model's by default (DEFAULT_WRAPPERS)
SHIPPED_WRAPPERS = ("smollm2-135m-wrapper-h16-t0-neutral", "gemma-3-270m-wrapper-h16-t0",
                    "qwen2.5-coder-0.5b-wrapper-h16-t0-neutral")
# shipped wrappers measured to cost answers with the default query configuration: `--wrapper shipped` warns
CAUTIONS = {"qwen2.5-coder-0.5b-wrapper-h16-t0-neutral": (
    "on Qwen's one-chunk dev questions (#94, 2026-12-07) the default query configuration kept 64% of full "
    "prefill's confident answers from a store encoded with this wrapper, 75% from a plain store; Qwen's stores "
    "are plain by default (--wrapper none)")}
WRAPPER_FILE = "wrapper.safetensors"
META_FILE = "wrapper.json"
FORMAT_VERSION = 1


@dataclass
class Wrapper:
    """header [H, d] and trailer [T, d] float32, plus the model they were learned for and how."""

    header: torch.Tensor
    trailer: torch.Tensor
    model: dict  # the model's fingerprint
    meta: dict = field(default_factory=dict)  # the recipe and its evaluation record
    linked: bool = False  # the trailer is recomputed at query time after every chunk before it (module docstring)

    @property
    def lengths(self) -> tuple[int, int]:
        return self.header.shape[0], self.trailer.shape[0]

    def table(self) -> torch.Tensor:
        """[H + T, d] float32: the soft tokens ids -1 … -(H + T) stand for (`KVModel.soft`)."""
        return torch.cat([self.header, self.trailer]).detach().float().cpu()

    def ids(self) -> tuple[list[int], list[int]]:
        """The header's and the trailer's token ids in a wrapped store (soft tokens: negative)."""
        H, T = self.lengths
        return soft_ids(H, T)

    def digest(self) -> str:
        """What a store records to refuse another wrapper: a hash of the soft tokens' values."""
        import hashlib

        H, T = self.lengths
        return f"{H}+{T}{LINKED if self.linked else ''}:" + hashlib.sha256(self.table().numpy().tobytes()).hexdigest()[:16]

    def save(self, out: str | Path) -> Path:
        from safetensors.torch import save

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / WRAPPER_FILE, save({"header": self.header.detach().float().cpu().contiguous(),
                                               "trailer": self.trailer.detach().float().cpu().contiguous()}))
        write_atomic(out / META_FILE, json.dumps({"format": FORMAT_VERSION, "model": self.model,
                                                   "header": self.lengths[0], "trailer": self.lengths[1],
                                                   **({"linked": True} if self.linked else {}), **self.meta}, indent=1))
        return out

    @classmethod
    def load(cls, path: str | Path) -> "Wrapper":
        from safetensors.torch import load_file

        path = Path(path)
        path = path.parent if path.name in (WRAPPER_FILE, META_FILE) else path
        if not (path / META_FILE).exists():
            raise ConfigError(f"{path} is not a wrapper (no {META_FILE}): learn one with `sparsecache learn-wrapper`")
        meta = json.loads((path / META_FILE).read_text())
        tensors = load_file(str(path / WRAPPER_FILE))
        model = meta.pop("model")
        linked = bool(meta.pop("linked", False))
        for key in ("format", "header", "trailer"):
            meta.pop(key, None)
        return cls(tensors["header"], tensors["trailer"], model, meta, linked)

    def check_model(self, model: KVModel) -> None:
        if not same_model(model.fingerprint(), self.model):
            raise ConfigError(f"this wrapper was learned for {self.model.get('name')}, not {model.name}")
        if self.header.shape[1] != model.config.hidden_size:
            raise ConfigError(f"wrapper width {self.header.shape[1]} != the model's hidden size {model.config.hidden_size}")


def _shipped(names: tuple[str, ...], fingerprint: dict) -> Path | None:
    """The directory of the first of the shipped wrappers `names` learned for the model `fingerprint` describes."""
    from ..codec.dictionary import SHIPPED_DIR

    for name in names:
        meta = SHIPPED_DIR / name / META_FILE
        if meta.exists() and same_model(fingerprint, json.loads(meta.read_text()).get("model", {})):
            return meta.parent
    return None


def shipped_wrapper(fingerprint: dict) -> Path:
    """The directory of the wrapper shipped for the model `fingerprint` describes; ConfigError where none ships."""
    path = _shipped(SHIPPED_WRAPPERS, fingerprint)
    if path is None:
        raise ConfigError(f"no wrapper ships for model {fingerprint.get('name')}: learn one with "
                          "`sparsecache learn-wrapper --model MODEL --out DIR` and pass --wrapper DIR")
    return path


def load_wrapper(spec: str, fingerprint: dict) -> Wrapper:
    """The wrapper `spec` names: a `learn-wrapper` output directory, or 'shipped' (the one shipped
    for the model `fingerprint` describes)."""
    if spec != "shipped":
        return Wrapper.load(spec)
    path = shipped_wrapper(fingerprint)
    if path.name in CAUTIONS:
        import warnings

        warnings.warn(f"the shipped wrapper {path.name}: {CAUTIONS[path.name]}", stacklevel=2)
    return Wrapper.load(path)


def default_wrapper(fingerprint: dict) -> Path | None:
    """The shipped wrapper a new store of the model `fingerprint` describes is encoded with when
    none is named (DEFAULT_WRAPPERS), or None: that model's stores are plain by default."""
    return _shipped(DEFAULT_WRAPPERS, fingerprint)


def wrapper_for(store, given: str | None, model_path: str = "default") -> Wrapper | None:
    """The wrapper an encode of `store` uses, as `dictionary_for` picks a dictionary: `given`
    ('none': no wrapper; 'shipped' or a `learn-wrapper` directory), or with none given the store's
    own where it exists (None here: the store holds its soft tokens), else the model's default
    (`default_wrapper`). 'none' for a store built with a wrapper is refused, as any contradiction is."""
    from ..model.kvmodel import model_fingerprint
    from ..store import config_for, store_exists

    if given == "none":
        own = config_for(store).wrapper  # None where there is no store yet
        if own:
            raise ConfigError(f"{store} was built with wrapper={own}; --wrapper none would mix plain and "
                              "wrapped chunks: encode into a new store")
        return None
    if given is not None:
        return load_wrapper(given, model_fingerprint(model_path))
    if store_exists(store):
        return None
    path = default_wrapper(model_fingerprint(model_path))
    return Wrapper.load(path) if path else None


def soft_ids(header: int, trailer: int) -> tuple[list[int], list[int]]:
    """Token ids of a wrapper's header and trailer: soft token i is id -1-i (`model.embed_ids`)."""
    return [-1 - i for i in range(header)], [-1 - header - j for j in range(trailer)]


def plain_ids(ids: list[int]) -> list[int]:
    """Token ids without soft tokens: a wrapped chunk's own text, as full prefill reads it."""
    return [t for t in ids if t >= 0]


def placeholder_id(config) -> int:
    """The real token id an engine that takes only token ids (vLLM) is given in place of every soft
    token: the model's pad token (else its end-of-sequence token). The KV at those positions comes
    from the store, never from this id; a request the connector cannot serve is prefilled with it."""
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        t = getattr(config, name, None)
        t = t[0] if isinstance(t, (list, tuple)) and t else t
        if isinstance(t, int) and t >= 0:
            return t
    return 0


def with_placeholders(ids: list[int], fill: int) -> list[int]:
    """`ids` with every soft token id (< 0) replaced by the real id `fill` (`placeholder_id`)."""
    return [fill if t < 0 else t for t in ids]


def initial_wrapper(model: KVModel, header: int, trailer: int, linked: bool = False) -> Wrapper:
    """A wrapper whose soft tokens start as the embeddings of real text (a neutral sentence for the
    header, paragraph breaks for the trailer): training starts from what the model knows how to read."""
    tok = model.tokenizer

    def tokens(text: str, n: int) -> torch.Tensor:
        ids = tok(text, add_special_tokens=False)["input_ids"] or [0]
        ids = (ids * (n // len(ids) + 1))[:n]
        with torch.no_grad():
            ids = torch.tensor(ids, dtype=torch.long, device=model.device)  # long: [] would be float
            return model.hf.model.embed_tokens(ids).float().detach().clone()

    return Wrapper(tokens("The following passage is one of several documents.", header),
                   tokens("\n\n", trailer), model.fingerprint(), linked=linked)


def wrapped_ids(prefix: list[int], chunks: list[list[int]], header: int, trailer: int) -> tuple[list[int], list[int]]:
    """The token ids of `prefix | header chunk₁ trailer | …` (soft tokens negative, `soft_ids`) and the
    positions of the trailers' tokens in it: what a linked wrapper's query recomputes."""
    head, tail = soft_ids(header, trailer)
    ids, links = list(prefix), []
    for c in chunks:
        ids += head + list(c)
        links += range(len(ids), len(ids) + trailer)
        ids += tail
    return ids, links


def linked_logits(model: KVModel, keys: torch.Tensor, values: torch.Tensor, context_ids: list[int], links: list[int],
                  ids: list[int], soft: torch.Tensor):
    """(float32 [len(ids), vocab], the cache): `continuation_logits` of a linked wrapper's context,
    whose trailer positions `links` are recomputed in the same pass, after everything before them, as
    a query recomputes them; `soft` [H + T, d] the soft tokens' embeddings. Differentiable in the K/V
    and `soft` (`HFStack.forward`). The cache holds the recomputed trailers and `ids`' K/V after it."""
    from ..model.stack import Pass, as_stack

    dev, S = model.device, keys.shape[1]
    positions = torch.cat([torch.tensor(links, dtype=torch.long), torch.arange(S, S + len(ids))]).to(dev)
    tokens = torch.tensor([context_ids[p] for p in links] + list(ids), dtype=torch.long, device=dev)
    cache = kv_cache(keys, values, model)
    saved, model.soft = model.soft, soft.to(dev)
    try:
        return as_stack(model).forward(tokens, positions, Pass(cache, positions), logits="all")[-len(ids):], cache
    finally:
        model.soft = saved


def wrapped_kv(model: KVModel, chunks: list[list[int]], prefix: list[int], header: torch.Tensor | None,
               trailer: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE keys and values [n_layers, S, m] of `prefix | header chunk₁ trailer | … `, every
    chunk encoded on its own after `prefix | header` and placed at consecutive global positions
    (header/trailer None or empty: plain per-chunk K/V after the prefix, the `none` layout).

    Differentiable in `header` and `trailer` (the model's weights need no gradient); under
    `torch.no_grad()` it is what a query reads from a wrapped store before any compression."""
    prefix_kv, pieces = wrapped_pieces(model, chunks, prefix, header, trailer)
    keys = torch.cat([prefix_kv[0]] + [k for piece in pieces for k, _ in piece], 1)
    values = torch.cat([prefix_kv[1]] + [v for piece in pieces for _, v in piece], 1)
    return model.rope.rotate(keys, torch.arange(keys.shape[1], device=model.device)), values


def wrapped_pieces(model: KVModel, chunks: list[list[int]], prefix: list[int], header: torch.Tensor | None,
                   trailer: torch.Tensor | None) -> tuple[tuple[torch.Tensor, torch.Tensor], list]:
    """Pre-RoPE K/V [n_layers, T, m] of the prefix, and per chunk of its header and of its chunk
    with the trailer: what a wrapped store keeps (the prefix and one header exactly, the rest coded)."""
    dev = model.device
    embed = model.hf.model.embed_tokens
    dtype = embed.weight.dtype
    head = header.to(dev, dtype) if header is not None else torch.zeros(0, embed.embedding_dim, device=dev, dtype=dtype)
    tail = trailer.to(dev, dtype) if trailer is not None else head[:0]
    P, H = len(prefix), head.shape[0]
    pre = embed(torch.tensor(list(prefix), dtype=torch.long, device=dev))
    rows = [torch.cat([pre, head, embed(torch.tensor(c, dtype=torch.long, device=dev)), tail]) for c in chunks]
    width = max(r.shape[0] for r in rows)
    batch = torch.stack([torch.cat([r, r.new_zeros(width - r.shape[0], r.shape[1])]) for r in rows])
    with kv_taps(model) as taps:  # right padding: causal attention keeps real tokens blind to it
        model.hf.model(inputs_embeds=batch, use_cache=False)
        k = torch.stack([taps["k", i] for i in range(model.n_layers)], 1)  # (k, L, W, m) pre-RoPE
        v = torch.stack([taps["v", i] for i in range(model.n_layers)], 1)
    pieces = []
    for row, c in enumerate(chunks):
        head_span, body = slice(P, P + H), slice(P + H, P + H + len(c) + tail.shape[0])  # chunk and trailer
        pieces.append([(k[row, :, head_span], v[row, :, head_span]), (k[row, :, body], v[row, :, body])])
    return (k[0, :, :P], v[0, :, :P]), pieces


def continuation_logits(model: KVModel, keys: torch.Tensor, values: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), vocab]: the next-token logits after each of `ids`, run after a context's
    post-RoPE K/V [L, S, m] (differentiable through the K/V)."""
    return continued(model, kv_cache(keys, values, model), keys.shape[1], ids)


def continued(model: KVModel, cache, start: int, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), vocab]: the logits after each of `ids` run at positions `start`… after the
    context in `cache` (their K/V join it; differentiable through it)."""
    out = model.hf(input_ids=torch.tensor([ids], device=model.device),
                   position_ids=torch.arange(start, start + len(ids), device=model.device)[None],
                   **{model.cache_arg: cache}, use_cache=True)
    return out.logits[0].float()


def store_wrapping(backend, model: KVModel) -> tuple[list[int], tuple[int, ...]]:
    """The header ids (every chunk is encoded after them, following the prefix) and trailer ids
    (appended to every chunk) of the store on `backend`, its soft tokens loaded into `model`;
    ([], ()) for a store without a wrapper."""
    from ..store.layout import open_group

    g = open_group(backend, "prefix")
    if "soft" not in g:
        return [], ()
    soft = torch.from_numpy(g["soft"][:])
    use_soft_tokens(model, soft)
    H = sum(int(t) < 0 for t in g["token_ids"][:])
    header, trailer = soft_ids(H, soft.shape[0] - H)
    return header, tuple(trailer)
