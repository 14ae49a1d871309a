"""Does choosing atoms in the metric attention reads K and V through beat raw-space OMP?

Raw-space OMP minimises ‖x − Dα‖². What the model sees of a key error e is q·e, and of a value
error W_o·e, so the error that matters is ‖W(x − Dα)‖ for a per-channel weight W:

- K, query-weighted: RoPE rotates each channel pair (c, c+d/2) of q and k by the same angle,
  so over positions E(q·e)² ≈ Σ_pairs E|q_pair|²·|e_pair|² / 2: w_c = √(mean E q² of c's pair),
  from pre-RoPE queries of the query heads sharing the KV head, on training text;
- K, standardised: w_c = 1 / std(k_c), the usual outlier-channel fix (the issue's suggestion);
- V, output-weighted: w_c = ‖W_o columns reading channel c‖ over the query heads sharing it.

OMP then runs on Wx over the atoms WD (renormalised), and the coefficients are rescaled into
raw space: decoding is D·α as before, so the store format and the decode path do not change;
only the encoder does. Same shipped dictionary, fp8 coefficients, the frontier's passages.

    OMP_NUM_THREADS=2 python scripts/experiments/ablate_metric.py --json docs/benchmarks/ablate_metric.json
"""

from __future__ import annotations

import json
import sys

import click
import torch

from sparsecache.codec.coding import coefficient_roundtrip
from sparsecache.codec.dictionary import Dictionary, default_dictionary
from sparsecache.bench.evaluate import EvalConfig, fidelity, passages
from sparsecache.bench.frontier import Coder, FrontierConfig
from sparsecache.model import extract_kv, load_model
from sparsecache.codec.omp import batch_omp, gram, reconstruct
from sparsecache.codec.signals import from_signals, to_signals
from sparsecache.text.documents import read_documents, token_chunks


@torch.inference_mode()
def query_energy(model, windows) -> torch.Tensor:
    """E q² per (layer, KV-head channel) [n_layers, m], pair-averaged for RoPE, pre-RoPE queries."""
    taps, handles = {}, []
    for i, layer in enumerate(model.hf.model.layers):
        handles.append(layer.self_attn.q_proj.register_forward_hook(
            lambda _m, _i, out, i=i: taps.setdefault(i, []).append(out.float().square().mean((0, 1)))))
    try:
        for w in windows:
            model.hf(torch.tensor([w], device=model.device))
    finally:
        for h in handles:
            h.remove()
    hd, kvh = model.head_dim, model.n_kv_heads
    e = torch.stack([torch.stack(taps[i]).mean(0) for i in range(model.n_layers)])  # [layers, q_heads·hd]
    e = e.view(model.n_layers, kvh, -1, hd).mean(2)  # query heads sharing a KV head
    e = (e + e.roll(hd // 2, -1)) / 2  # a rotary pair shares one energy
    return e.reshape(model.n_layers, -1)


def output_weight(model) -> torch.Tensor:
    """‖W_o columns reading V channel c‖² summed over the query heads sharing it [n_layers, m]."""
    hd, kvh = model.head_dim, model.n_kv_heads
    out = []
    for layer in model.hf.model.layers:
        w = layer.self_attn.o_proj.weight.float().square().sum(0)  # [q_heads·hd]
        out.append(w.view(kvh, -1, hd).sum(1).reshape(-1))
    return torch.stack(out)


class Weighted:
    """OMP of W·x over normalised W·D per layer group; coefficients back in raw space."""

    def __init__(self, coder: Coder, weights: dict, coef: str = "float8"):
        self.coder, self.coef, self.cfg = coder, coef, coder.config
        self.groups = {}
        for kind, w in weights.items():  # w [n_layers, m] or None (raw space)
            if w is None:
                continue
            wg = to_signals(w[:, None, :], self.cfg.layers_per_signal)[:, 0]  # [G, L·m]
            wg = wg / wg.mean(1, keepdim=True)
            D = coder.atoms[kind]
            per = []
            for g in range(wg.shape[0]):
                A = wg[g, :, None] * D
                norms = A.norm(dim=0)
                A = A / norms
                per.append((wg[g], A, gram(A), norms))
            self.groups[kind] = per

    def roundtrip(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        if kind not in self.groups:
            return self.coder.roundtrip(x, kind, self.coef)
        sig = to_signals(x.float(), self.cfg.layers_per_signal)  # [G, T, L·m]
        out = torch.empty_like(sig)
        for g, (w, A, G, norms) in enumerate(self.groups[kind]):
            idx, c = batch_omp(sig[g] * w, A, self.cfg.sparsity, G)
            c = coefficient_roundtrip(c / norms[idx], self.coef)
            out[g] = reconstruct(idx, c, self.coder.atoms[kind])
        return from_signals(out, self.cfg.layers_per_signal)


@click.command()
@click.option("--dict", "dict_path", default=None, help="Dictionary (default: the shipped default).")
@click.option("--train-windows", default=16, show_default=True, help="Training passages for query statistics.")
@click.option("--json", "json_out", default=None, help="Write the results here too.")
def main(dict_path, train_windows, json_out):
    torch.manual_seed(0)
    model = load_model()
    d = Dictionary.load(dict_path or default_dictionary())
    coder = Coder(d, "ablate")
    fcfg = FrontierConfig()
    train = [w for w in token_chunks(read_documents(["builtin"], split="train"), model.tokenizer, 512)
             if len(w) == 512]
    train = train[:: max(1, len(train) // train_windows)][:train_windows]
    q = query_energy(model, train)
    keys = torch.cat([k for k, _ in extract_kv(model, train)], 1)  # [layers, T, m]
    std = keys.std(1)
    weights = {
        "raw": {},
        "K query-weighted": {"k": q.sqrt()},
        "K standardised": {"k": 1 / std},
        "V output-weighted": {"v": output_weight(model).sqrt()},
        "K query + V output": {"k": q.sqrt(), "v": output_weight(model).sqrt()},
    }
    methods = {name: Weighted(coder, w) for name, w in weights.items()}
    windows = passages(model, ("builtin",), EvalConfig(fcfg.passages, fcfg.prefix_tokens, fcfg.continuation_tokens))
    res = fidelity(model, methods, windows, fcfg.prefix_tokens)
    rows = {name: {k: v for k, v in r.items() if not k.endswith("per_layer")} for name, r in res.items()}
    for name, r in rows.items():
        ppl = r["ppl_reconstructed"] / r["ppl_exact"] - 1
        print(f"{name:22s} NMSE K {r['nmse_k']:.4f} V {r['nmse_v']:.4f}  ppl {100 * ppl:+.1f}%  "
              f"KL {r['kl']:.3f}  top-1 {100 * r['top1_agreement']:.1f}%", file=sys.stderr)
    out = {"dictionary": str(dict_path or default_dictionary()), "coefficients": "float8",
           "frontier_config": fcfg.__dict__, "train_windows": len(train), "rows": rows}
    if json_out:
        with open(json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
