"""How good a dictionary is, measured the same way everywhere (see DESIGN.md).

For each held-out passage: the chat template's shared prefix (exact, as the store keeps it),
then P passage tokens whose K/V are either exact or decode(encode(·)), keys rotated at their
true positions, then C continuation tokens scored by the model. Reported: NMSE of K and V
per layer, continuation perplexity with exact vs reconstructed context, mean
KL(exact ‖ reconstructed) of next-token distributions, top-1 agreement, compression ratio.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
from tqdm import tqdm

from ..codec.coding import Codec
from ..codec.dictionary import Dictionary
from ..dtypes import forward_dtype as resolve_forward_dtype
from ..errors import TextError
from ..model.kvmodel import KVModel, continuation_logits, default_prefix_ids, extract_kv, rotate_keys
from ..text.documents import read_documents, token_chunks
from .config import EvalConfig


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


class Tally:
    """Running sums of one method's fidelity over passages (the logits' sums kept per passage,
    which the intervals need)."""

    def __init__(self, n_layers: int):
        self.err = {k: torch.zeros(n_layers) for k in "kv"}
        self.ref = {k: torch.zeros(n_layers) for k in "kv"}
        self.kl = 0.0
        self.passages: list[tuple[float, float, float, int]] = []  # nll exact, nll, agreements, tokens

    def add_kv(self, name: str, exact: torch.Tensor, rec: torch.Tensor) -> None:
        self.err[name] += (exact - rec).square().sum((1, 2)).cpu()
        self.ref[name] += exact.square().sum((1, 2)).cpu()

    def add_logits(self, lp_exact: torch.Tensor, lp: torch.Tensor, target: torch.Tensor) -> None:
        self.kl += float((lp_exact.exp() * (lp_exact - lp)).sum())
        self.passages.append((float(-lp_exact.gather(1, target[:, None]).sum()),
                              float(-lp.gather(1, target[:, None]).sum()),
                              float((lp_exact.argmax(-1) == lp.argmax(-1)).sum()), len(target)))

    def report(self) -> dict:
        layers = {k: (self.err[k] / self.ref[k].clamp_min(1e-30)).tolist() for k in "kv"}
        nll_exact, nll, agree, count = (sum(c) for c in zip(*self.passages))
        return {
            "nmse_k": sum(layers["k"]) / len(layers["k"]),
            "nmse_v": sum(layers["v"]) / len(layers["v"]),
            "nmse_k_per_layer": layers["k"],
            "nmse_v_per_layer": layers["v"],
            "ppl_exact": float(torch.tensor(nll_exact / count).exp()),
            "ppl_reconstructed": float(torch.tensor(nll / count).exp()),
            "kl": self.kl / count,
            "top1_agreement": agree / count,
            "scored_tokens": count,  # what a top-1 share's standard error rests on ("tokens" counts coded ones)
            **self.intervals(),
        }

    def intervals(self) -> dict:
        """95% intervals of the perplexity change and of top-1 agreement, passages as clusters.

        A passage's tokens share one context, so their errors are not independent: the
        standard error of each ratio estimate (Σ per-passage sum ÷ Σ tokens) is taken over
        passages, not tokens. None with fewer than two passages."""
        n = len(self.passages)
        if n < 2:
            return {"ppl_change_ci95": None, "top1_ci95": None}
        nll_exact, nll, agree, tokens = (torch.tensor(c, dtype=torch.float64) for c in zip(*self.passages))
        dnll = nll - nll_exact

        def mean_se(x):
            m = x.sum() / tokens.sum()
            se = ((x - m * tokens).square().sum() * n / (n - 1)).sqrt() / tokens.sum()
            return float(m), float(se)

        m, se = mean_se(dnll)
        a, se_a = mean_se(agree)
        return {"ppl_change_ci95": [math.expm1(m - 1.96 * se), math.expm1(m + 1.96 * se)],
                "top1_ci95": [max(0.0, a - 1.96 * se_a), min(1.0, a + 1.96 * se_a)]}


@torch.inference_mode()
def fidelity(model: KVModel, methods: dict, windows: list[list[int]], prefix_tokens: int,
             progress: bool = True, forward_dtype: str = "float32") -> dict[str, dict]:
    """NMSE/perplexity/KL/top-1 of every method (anything with `roundtrip(kv, kind)`) on the
    same passages; the exact K/V and logits of a passage are computed once for all methods.
    With `forward_dtype` "bfloat16" the methods code the K/V of the encode's bfloat16-autocast
    forward (what such a store holds, `ingest.batch.code_batch`), measured against the exact."""
    prefix = default_prefix_ids(model)
    P0, P = len(prefix), prefix_tokens
    tallies = {name: Tally(model.n_layers) for name in methods}
    (pk, pv), = extract_kv(model, [prefix])  # the shared prefix, exact, as a store keeps it
    pos = torch.arange(P0 + P)

    def log_probs(k, v, cont):
        keys = rotate_keys(torch.cat([pk, k], 1), pos, model)
        return continuation_logits(model, keys, torch.cat([pv, v], 1), cont)[:-1].log_softmax(-1)

    for window in tqdm(windows, desc="fidelity", unit="passage", leave=False, disable=not progress):
        ctx, cont = window[:P], window[P:]
        (k, v), = extract_kv(model, [ctx], prefix)
        (kin, vin), = extract_kv(model, [ctx], prefix, forward_dtype=forward_dtype) if forward_dtype == "bfloat16" \
            else ((k, v),)
        lp_exact = log_probs(k, v, cont)
        target = torch.tensor(cont[1:], device=model.device)
        for name, method in methods.items():
            kr, vr = method.roundtrip(kin, "k"), method.roundtrip(vin, "v")
            if isinstance(method, FirstLayerExact):  # a reader recomputes layer 0 from the tokens, in float32
                kr[0], vr[0] = k[0], v[0]
            tally = tallies[name]
            tally.add_kv("k", k, kr)
            tally.add_kv("v", v, vr)
            tally.add_logits(lp_exact, log_probs(kr, vr, cont), target)
    return {name: t.report() for name, t in tallies.items()}


class FirstLayerExact:
    """A codec as a store's reader sees it (`QueryConfig.first_layer` "tokens"): every layer from
    the codes but layer 0, which a reader recomputes from the tokens. That recomputation is exact
    (`model.stack.first_layer_kv`, tested equal to the captured layer 0), so here layer 0 is the
    exact K/V the passage already has."""

    def __init__(self, codec: Codec):
        self.codec = codec

    def roundtrip(self, kv: torch.Tensor, kind: str) -> torch.Tensor:
        out = self.codec.roundtrip(kv, kind)
        out[0] = kv[0]
        return out


def evaluate_dictionary(model: KVModel, dictionary: Dictionary, texts=("builtin",),
                        cfg: EvalConfig = EvalConfig()) -> dict:
    """The fidelity report of `dictionary` on `texts` (see the module docstring for the keys).

    Each text is a domain, evaluated on its own passages: `domains` holds every domain's
    report and the top-level metrics are the worst domain's (lowest top-1 agreement), so a
    dictionary is judged on the text it serves worst. One text: its report, as before."""
    dictionary.check_model(model.fingerprint())
    codec = Codec(dictionary, cfg.coef_dtype, device=model.device, screening=cfg.screening)
    domains = {}
    for text in texts:
        windows = passages(model, [text], cfg)
        read = FirstLayerExact(codec) if cfg.first_layer == "tokens" else codec
        report = fidelity(model, {"codec": read}, windows, cfg.prefix_tokens,
                          forward_dtype=resolve_forward_dtype(cfg.forward_dtype, str(model.device)))["codec"]
        domains[domain_name(text)] = {**report, "passages": len(windows),
                                      "worst_layer_nmse_v": max(report["nmse_v_per_layer"]),
                                      "worst_layer_nmse_k": max(report["nmse_k_per_layer"])}
    worst = min(domains, key=lambda d: domains[d]["top1_agreement"])
    tokens = sum(d["passages"] for d in domains.values()) * cfg.prefix_tokens
    return {
        **domains[worst],
        "worst_domain": worst,
        "domains": domains,
        "ratio": compression_ratio(model, codec, tokens),
        "tokens": tokens,
        "passages": sum(d["passages"] for d in domains.values()),
        "config": asdict(cfg),
        "dictionary": {"atoms": dictionary.config.atoms, "sparsity": dictionary.config.sparsity,
                       "layers_per_signal": dictionary.config.layers_per_signal,
                       "fingerprint": dictionary.fingerprint()},
    }


def domain_name(text: str) -> str:
    """A domain's name in reports: 'builtin', or the text's file or folder name."""
    from pathlib import Path

    return text if text == "builtin" else Path(text).name or str(text)


def record_eval(d: Dictionary, report: dict, where) -> None:
    """Keep `evaluate_dictionary`'s report in the dictionary's metadata ("eval", without the
    per-layer lists) and save it to `where`."""
    d.meta["eval"] = {k: v for k, v in report.items() if not k.endswith("per_layer") and k != "domains"}
    d.meta["eval"]["domains"] = {name: {k: v for k, v in x.items() if not k.endswith("per_layer")}
                                 for name, x in report["domains"].items()}
    d.save(where)


def eval_dict(dictionary: str, model: str = "default", texts=("builtin",), cfg: EvalConfig = EvalConfig(),
              record: bool = False, device: str = "cpu") -> dict:
    """`sparsecache eval-dict`: load the dictionary at `dictionary` and the model, refuse a
    dictionary of another model, `evaluate_dictionary`, and with `record` keep the report in the
    dictionary's metadata (`record_eval`); the report."""
    from ..codec.dictionary import dictionary_dir
    from ..model.kvmodel import load_model

    d = Dictionary.load(dictionary)
    loaded = load_model(model, device=device)
    d.check_model(loaded.fingerprint())
    r = evaluate_dictionary(loaded, d, texts, cfg)
    if record:
        record_eval(d, r, dictionary_dir(dictionary))
    return r


def report_lines(r: dict) -> list[str]:
    """`eval_dict`'s report as the CLI prints it: per domain where there are several, then the totals."""
    per_domain = [f"{name:>16}: ppl {100 * (x['ppl_reconstructed'] / x['ppl_exact'] - 1):+.1f}%{_ci(x)}   "
                  f"top-1 {100 * x['top1_agreement']:.1f}%   nmse k/v {x['nmse_k']:.3f}/{x['nmse_v']:.3f}   "
                  f"worst layer v {x['worst_layer_nmse_v']:.3f}" for name, x in r["domains"].items()]
    return (per_domain + [f"worst domain: {r['worst_domain']}"] if len(r["domains"]) > 1 else []) + [
        f"nmse_k {r['nmse_k']:.4f}   nmse_v {r['nmse_v']:.4f}",
        f"ppl exact {r['ppl_exact']:.3f}   reconstructed {r['ppl_reconstructed']:.3f}   "
        f"({100 * (r['ppl_reconstructed'] / r['ppl_exact'] - 1):+.2f}%{_ci(r)})",
        f"top-1 agreement {100 * r['top1_agreement']:.1f}%   KL {r['kl']:.4f}",
        f"ratio {r['ratio']['theoretical_excl_dict']:.2f}x (codes only), {r['ratio']['theoretical_incl_dict']:.2f}x "
        f"with dictionaries, over {r['tokens']} tokens",
    ]


def _ci(report: dict) -> str:
    """' [95%: +a … +b%]' for a report's perplexity change, '' when it has no interval."""
    ci = report.get("ppl_change_ci95")
    return "" if ci is None else f" [95%: {100 * ci[0]:+.1f} … {100 * ci[1]:+.1f}%]"
