"""How good a dictionary is, measured the same way everywhere (see DESIGN.md).

For each held-out passage: the chat template's shared prefix (exact, as the store keeps it),
then P passage tokens whose K/V are either exact or decode(encode(·)), keys rotated at their
true positions, then C continuation tokens scored by the model. Reported: NMSE of K and V
per layer, continuation perplexity with exact vs reconstructed context, mean
KL(exact ‖ reconstructed) of next-token distributions, top-1 agreement, compression ratio.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from .codec import Codec
from .dictionary import Dictionary
from .errors import TextError
from .model import KVModel, continuation_logits, default_prefix_ids, extract_kv, rotate_keys
from .text import read_documents, token_chunks


@dataclass(frozen=True)
class EvalConfig:
    passages: int = 16
    prefix_tokens: int = 512
    continuation_tokens: int = 64
    coef_dtype: str = "float16"


def passages(model: KVModel, texts, cfg: EvalConfig) -> list[list[int]]:
    """Up to cfg.passages token windows of prefix + continuation length (held-out split for builtin)."""
    docs = read_documents(list(texts), split="heldout")
    windows = token_chunks(docs, model.tokenizer, cfg.prefix_tokens + cfg.continuation_tokens)
    windows = [w for w in windows if len(w) == cfg.prefix_tokens + cfg.continuation_tokens]
    if not windows:
        raise TextError(f"no passage of {cfg.prefix_tokens + cfg.continuation_tokens} tokens in the text")
    step = max(1, len(windows) // cfg.passages)  # spread over the text, not its first document
    return windows[::step][: cfg.passages]


def compression_ratio(model: KVModel, codec: Codec, tokens: int) -> dict:
    """fp16 K+V bytes of `tokens` tokens ÷ code bytes (theoretical), without and with dictionaries."""
    raw = tokens * 2 * model.n_layers * model.m * 2
    groups = model.n_layers // codec.config.layers_per_signal
    codes = tokens * 2 * groups * codec.bytes_per_signal()
    return {"theoretical_excl_dict": raw / codes,
            "theoretical_incl_dict": raw / (codes + codec.dictionary.nbytes()),
            "tokens": tokens}


@torch.inference_mode()
def evaluate_dictionary(model: KVModel, dictionary: Dictionary, texts=("builtin",),
                        cfg: EvalConfig = EvalConfig()) -> dict:
    """The fidelity report of `dictionary` on `texts` (see the module docstring for the keys)."""
    dictionary.check_model(model.fingerprint())
    codec = Codec(dictionary, cfg.coef_dtype, device=model.device)
    prefix = default_prefix_ids(model)
    P0, P = len(prefix), cfg.prefix_tokens
    err = {k: torch.zeros(model.n_layers) for k in "kv"}
    ref = {k: torch.zeros(model.n_layers) for k in "kv"}
    nll_exact = nll_rec = kl = agree = count = 0.0
    windows = passages(model, texts, cfg)
    (pk, pv), = extract_kv(model, [prefix])  # the shared prefix, exact, as a store keeps it
    for window in tqdm(windows, desc="eval-dict", unit="passage", leave=False):
        ctx, cont = window[:P], window[P:]
        (k, v), = extract_kv(model, [ctx], prefix)
        kr, vr = codec.roundtrip(k, "k"), codec.roundtrip(v, "v")
        for name, exact, rec in (("k", k, kr), ("v", v, vr)):
            err[name] += (exact - rec).square().sum((1, 2)).cpu()
            ref[name] += exact.square().sum((1, 2)).cpu()
        pos = torch.arange(P0 + P)
        logits = {}
        for label, kk, vv in (("exact", k, v), ("rec", kr, vr)):
            keys = rotate_keys(torch.cat([pk, kk], 1), pos, model)
            logits[label] = continuation_logits(model, keys, torch.cat([pv, vv], 1), cont)[:-1]
        target = torch.tensor(cont[1:], device=model.device)
        lp_e, lp_r = logits["exact"].log_softmax(-1), logits["rec"].log_softmax(-1)
        nll_exact += float(-lp_e.gather(1, target[:, None]).sum())
        nll_rec += float(-lp_r.gather(1, target[:, None]).sum())
        kl += float((lp_e.exp() * (lp_e - lp_r)).sum())
        agree += float((lp_e.argmax(-1) == lp_r.argmax(-1)).sum())
        count += len(target)
    nmse_layers = {k: (err[k] / ref[k].clamp_min(1e-30)).tolist() for k in "kv"}
    n_passages = len(windows)
    return {
        "nmse_k": sum(nmse_layers["k"]) / model.n_layers,
        "nmse_v": sum(nmse_layers["v"]) / model.n_layers,
        "nmse_k_per_layer": nmse_layers["k"],
        "nmse_v_per_layer": nmse_layers["v"],
        "ppl_exact": float(torch.tensor(nll_exact / count).exp()),
        "ppl_reconstructed": float(torch.tensor(nll_rec / count).exp()),
        "kl": kl / count,
        "top1_agreement": agree / count,
        "ratio": compression_ratio(model, codec, n_passages * P),
        "tokens": n_passages * P,
        "passages": n_passages,
        "config": asdict(cfg),
        "dictionary": {"atoms": dictionary.config.atoms, "sparsity": dictionary.config.sparsity,
                       "layers_per_signal": dictionary.config.layers_per_signal,
                       "fingerprint": dictionary.fingerprint()},
    }
