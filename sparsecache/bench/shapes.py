"""Where the store pays, by model size (#82): TTFT of the store path against full prefill for model
*shapes* with random weights (`sparsecache bench ttft --shape NAME`).

Only time is measured. A shape is a family's config at a real model's sizes (layers, widths, heads,
vocabulary, RoPE base), its weights random in the device's dtype, read with the default model's
tokenizer (its ids fit every shape's vocabulary); its dictionary is random unit atoms of the codec's
shape for it (layers per signal and sparsity chosen for about the default's 20x over fp16, since
OMP's and the decode's costs depend on the shape, not on what the atoms are). It encodes chunks of
~512 tokens into a local store and times full prefill, `none` and `infoflow` at the default ratio
and at 0.25, each beside what the machine can do: the decode's output bytes/s against its memory
copy bandwidth, prefill's FLOP/s against its measured matrix-product rate. On a GPU it also times
the decode of the largest k's chunks every way a GPU can decode (`coding.GPU_DECODES`: the gather, the
dense product, the CSR product and the fused Triton kernel), each one's K/V bytes written per second
against the copy bandwidth, and how far its K/V are from the gather's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..query import methods


@dataclass(frozen=True)
class Shape:
    """A model's sizes, and the codec's shape for it."""

    family: str  # a transformers config class prefix: Llama, Qwen2
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    tied: bool
    layers_per_signal: int
    sparsity: int
    extra: dict = field(default_factory=dict)

    def config(self):
        import transformers

        cls = getattr(transformers, f"{self.family}Config")
        return cls(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                   num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                   head_dim=self.head_dim, rope_theta=self.rope_theta, tie_word_embeddings=self.tied,
                   max_position_embeddings=32_768, **self.extra)


# The real models' sizes (their config.json); the codec's shape: L·m dimensions per signal at
# s atoms, about L·m / (1.05·s) times smaller than fp16 with fp8 coefficients and Elias–Fano indices.
SHAPES = {
    "toy": Shape("Llama", 4, 64, 128, 4, 2, 16, 49_152, 10_000.0, True, 2, 8),
    "smollm2-135m": Shape("Llama", 30, 576, 1536, 9, 3, 64, 49_152, 100_000.0, True, 10, 80),
    "qwen2.5-0.5b": Shape("Qwen2", 24, 896, 4864, 14, 2, 64, 151_936, 1_000_000.0, True, 12, 64),
    "llama-3.2-1b": Shape("Llama", 16, 2048, 8192, 32, 8, 64, 128_256, 500_000.0, True, 4, 96),
    "llama-3.2-3b": Shape("Llama", 28, 3072, 8192, 24, 8, 128, 128_256, 500_000.0, True, 2, 96),
    "llama-3.1-8b": Shape("Llama", 32, 4096, 14_336, 32, 8, 128, 128_256, 500_000.0, False, 2, 96),
}


def random_model(name: str, device="cpu", dtype=None):
    """The shape `name` as a KVModel with random weights (seed 0) in `dtype` on `device`, and the
    default model's tokenizer."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from ..model.gguf import model_dir
    from ..model.kvmodel import KVModel

    shape = SHAPES[name]
    dtype = dtype or torch.float32
    cls = getattr(transformers, f"{shape.family}ForCausalLM")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the device's dtype: an 8B model in fp32 first would not fit
    try:
        with torch.device(device):
            hf = cls(shape.config())
    finally:
        torch.set_default_dtype(previous)
    return KVModel(hf=hf.eval(), tokenizer=AutoTokenizer.from_pretrained(model_dir()), name=f"random:{name}")


def random_dictionary(model, name: str):
    """Random unit atoms of the codec's shape for `model` (8192 atoms), fingerprinted for it."""
    from ..codec.dictionary import DictConfig, Dictionary
    from ..testing import unit_atoms

    shape = SHAPES[name]
    dims = shape.layers_per_signal * model.m
    return Dictionary(unit_atoms(dims, 8192, 1), unit_atoms(dims, 8192, 2),
                      DictConfig(8192, shape.sparsity, shape.layers_per_signal), model.fingerprint())


def shape_methods() -> list[tuple[str, float]]:
    """What is timed: full prefill, `none`, and `infoflow` at the default ratio and at 0.25."""
    default = methods.get("infoflow").ratio
    return [("full", 0.0), ("none", 0.0), ("infoflow", default)] + ([("infoflow", 0.25)] if default != 0.25 else [])


def time_decodes(store_path, device, n_chunks: int, repeats: int = 3, copy: float | None = None) -> dict:
    """The decode of the store's first `n_chunks` chunks each way of `coding.GPU_DECODES`, on `device`:
    per way its best time of `repeats` after a warm-up (`{way}_ms`), the float32 K/V bytes it wrote per
    second (`{way}_bytes_per_s`) and, given the device's measured `copy` bandwidth, their share of it
    (`{way}_of_copy_bandwidth`), and the largest difference of its K/V from the gather's against the largest
    magnitude (`{way}_max_rel_diff`); the tokens. A way the device cannot run (Triton missing) is left out,
    with why (`{way}_error`)."""
    import time

    import torch

    from ..codec.coding import GPU_DECODES
    from ..kvstore.view import KVStore

    store = KVStore.open(store_path)
    codes = store.read_codes([c.id for c in store.chunks()][:n_chunks])
    codec, dev = store.codec(), torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out, kv = {"tokens": int(sum(codes.lengths))}, {}
    try:
        for way in GPU_DECODES:
            codec.gpu_decode, codec.cpu_kernel, times = way, False, []
            try:
                for _ in range(repeats + 1):
                    sync()
                    t0 = time.perf_counter()
                    kv[way] = store.decode_codes(codes, dev)
                    sync()
                    times.append((time.perf_counter() - t0) * 1e3)
            except (ImportError, RuntimeError, ValueError) as e:  # no Triton, or a kernel the device lacks
                out[f"{way}_error"] = f"{type(e).__name__}: {e}"[:300]
                continue
            best = min(times[1:])
            written = sum(t.numel() * t.element_size() for pair in kv[way] for t in pair)
            out[f"{way}_ms"] = round(best, 3)
            out[f"{way}_bytes_per_s"] = written / (best / 1e3)
            if copy:
                out[f"{way}_of_copy_bandwidth"] = out[f"{way}_bytes_per_s"] / copy
    finally:
        codec.gpu_decode, codec.cpu_kernel = GPU_DECODES[0], True
    base = kv[GPU_DECODES[0]]
    scale = max(float(t.abs().max()) for pair in base for t in pair)
    for way in GPU_DECODES[1:]:
        if way in kv:
            diff = max(float((a - b).abs().max()) for p, q in zip(base, kv[way]) for a, b in zip(p, q))
            out[f"{way}_max_rel_diff"] = diff / scale
    timed = [w for w in GPU_DECODES if f"{w}_ms" in out]
    out["fastest"] = min(timed, key=lambda w: out[f"{w}_ms"])
    return out


def bench_shape(name: str, workdir, ks=(4, 8, 16), repeats: int = 2, device="cpu", dtype=None,
                decodes: bool | None = None, graphs: bool | None = None, partial=None) -> dict:
    """Build the shape's model (a SHAPES name: random weights; a packaged model's name: its real
    weights and shipped dictionary), its dictionary and a store of ~512-token chunks in `workdir`
    (reused by a rerun with the same shape), then time every method at every k beside the machine's
    limits; with `decodes` (default: on a GPU) also `time_decodes` at the largest k; with `graphs`
    (default: on a GPU) the store's methods again with their fixed passes as CUDA graphs
    (`model.graphs`; off CUDA the same static passes run uncaptured), in `graphed`. `partial(result)`, if
    given, is called with the result so far before each of those two (a time limit loses only them)."""
    import torch

    from ..codec.coding import Codec
    from ..durable import write_atomic
    from ..ingest.config import EncodeOptions
    from ..ingest.encoder import encode_with
    from ..measure.machine import copy_rate, cpu_model, gemm_rate
    from ..model.kvmodel import compute_parameters
    from ..model.packaged import PACKAGED
    from ..store import StoreConfig
    from .storage import bench_corpus
    from .ttft import measure_ttft

    work = Path(workdir) / name
    real = name in PACKAGED or name == "default"
    model, d = real_model(name, device, dtype) if real else (random_model(name, device, dtype), None)
    d = d or random_dictionary(model, name)
    store = work / "store"
    report = work / "encode.json"
    if not report.exists():  # twice the tokens the largest k reads: chunks end at sentences, tokenizers differ
        bench_corpus(work / "corpus", int(max(ks) * 512 * 2))
        r = encode_with([str(work / "corpus")], store, d, model, StoreConfig(chunk_tokens=512),
                        EncodeOptions(device=device, progress=False))
        write_atomic(report, json.dumps(r.to_dict()))
    encode = json.loads(report.read_text())
    rows = measure_ttft(store, model, device, ks, repeats, shape_methods())
    params = compute_parameters(model.config)
    fp16 = 4 * model.n_layers * model.m  # K and V, 2 bytes each
    codec = Codec(d, "float8")
    stored = 2 * (model.n_layers // d.config.layers_per_signal) * codec.bytes_per_signal()
    flops, copy = gemm_rate(device, dtype=model.dtype), copy_rate(device)
    for row in rows:
        n = row["context_tokens"]
        if row["method"] == "full" and row["prefill"] > 0:  # prefill's matrix products and its attention
            heads = model.config.num_attention_heads
            attention = 2 * n * n * model.n_layers * heads * model.head_dim  # QK^T and AV, causal half
            row["prefill_flops_per_s"] = (2 * params * n + attention) / (row["prefill"] / 1e3)
            row["prefill_of_peak"] = row["prefill_flops_per_s"] / flops
        elif row["reconstruct"] > 0:  # the decode writes fp32 K and V of every context token
            row["decode_bytes_per_s"] = n * 2 * model.n_layers * model.m * 4 / (row["reconstruct"] / 1e3)
            row["decode_of_copy_bandwidth"] = row["decode_bytes_per_s"] / copy
        row |= per_layer(row, model.n_layers)
    out = {"shape": name, "weights": "real" if real else "random", "n_layers": model.n_layers, "m": model.m,
            "layers_per_signal": d.config.layers_per_signal, "sparsity": d.config.sparsity,
            "compute_parameters": params, "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
            "cpu": cpu_model(), "note": "only time is measured", "encode": encode,
            "store_bytes_per_token": stored, "fp16_kv_bytes_per_token": fp16, "ratio_vs_fp16": fp16 / stored,
            "gemm_flops_per_s": flops, "copy_bytes_per_s": copy, "rows": rows}
    cuda = torch.device(device).type == "cuda"
    optional = {"decodes": (decodes, lambda: time_decodes(store, device, max(ks), copy=copy)),
                "graphed": (graphs, lambda: time_graphed(store, model, device, ks, repeats, rows))}
    for part, (on, measure) in optional.items():
        if on if on is not None else cuda:
            if partial is not None:
                partial({**out, **summary(out)})
            out[part] = measure()
    return {**out, **summary(out)}


def time_graphed(store, model, device, ks, repeats: int, rows: list[dict]) -> dict:
    """The store's methods of `shape_methods` timed as `measure_ttft` times them, with the fixed passes
    on a workspace as CUDA graphs (`graphs.enable`; the first query at each k captures, the timed ones
    replay): rows with their time per layer and their fraction of full prefill's TTFT in `rows`, and how
    many graphs were captured and passes replayed; a run that fails says why (`error`), not fatal to the rest."""
    from ..model.graphs import enable
    from .ttft import measure_ttft

    full = {x["k"]: x["ttft"] for x in rows if x["method"] == "full"}
    graphs = enable(model)
    try:
        graphed = measure_ttft(store, model, device, ks, repeats, [m for m in shape_methods() if m[0] != "full"])
    except Exception as e:  # noqa: BLE001 -- a capture that fails (an operation a graph cannot hold) is a finding
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        enable(model, False)
    for row in graphed:
        row |= per_layer(row, model.n_layers) | {"of_full": row["ttft"] / full[row["k"]]}
    return {"rows": graphed, "captured": graphs.captures, "replays": graphs.replays, "passes": graphs.runs}


def per_layer(row: dict, n_layers: int) -> dict:
    """The fixed passes' time per layer they run through (#95 item 2: a handful of tokens per layer is
    launch overhead on a GPU): the scoring pass (`select`, through infoflow's scoring layer), the
    recompute and the question's pass (`first_token`), each through every layer."""
    from ..query.methods.base import infoflow_layer

    out = {}
    if row.get("select"):
        out["select_ms_per_layer"] = row["select"] / (infoflow_layer(n_layers) + 1)
    for part in ("recompute", "first_token"):
        if row.get(part) and row["method"] != "full":
            out[f"{part}_ms_per_layer"] = row[part] / n_layers
    return out


def real_model(name: str, device="cpu", dtype=None):
    """A packaged model (`--model NAME`) and its shipped dictionary: the real weights, for the table's
    real rows."""
    import torch

    from ..codec.dictionary import Dictionary, shipped_dictionary
    from ..model.kvmodel import load_model

    model = load_model(name, device=device, dtype=dtype or torch.float32)
    return model, Dictionary.load(shipped_dictionary(model.fingerprint()))


def crossover(rows: list[dict], method: str, ratio: float, costs) -> float | None:
    """The context length (tokens) from which the method's TTFT is under full prefill's
    (`Costs.crossover`): full prefill's parabola and the recomputation factor from the cost model
    fitted to these rows, the method's own fixed and per-token parts fitted to its rows. Below it
    prefilling is cheaper. None with fewer than two lengths, or where it never stays cheaper. Full
    prefill grows faster than linearly (attention), so lines through a few long contexts would put
    the crossover far too high."""
    import dataclasses

    import numpy as np

    pts = [(x["context_tokens"], x["ttft"]) for x in rows if x["method"] == method and x["ratio"] == ratio]
    if costs is None or len({n for n, _ in pts}) < 2:
        return None
    n, t = (np.array(v, dtype=float) for v in zip(*pts))
    s_tok, a = np.polyfit(n, t - ratio * costs.g * costs.variable(n), 1)
    return dataclasses.replace(costs, a_store=float(a), s=float(max(s_tok, 0.0))).crossover(ratio)


def costs_report(result: dict) -> dict:
    """The cost model (`query.budget`) fitted to these rows (full prefill, and infoflow at its ratios),
    and, for each of those rows, the TTFT it predicts beside the measured one: the fitted model's and
    the shipped defaults' scaled to this model (None where the device kind has none)."""
    from ..query.budget import Costs, default_costs

    rows = [x for x in result["rows"] if x["method"] in ("full", "infoflow")]
    full = [(x["context_tokens"], x["ttft"]) for x in rows if x["method"] == "full"]
    store = [(x["context_tokens"], x["ratio"], x["ttft"]) for x in rows if x["method"] == "infoflow"]
    try:
        fitted = Costs.fit(full, store)
    except ValueError:  # a single k: nothing to fit
        return {"fitted": None, "predictions": []}
    device = "cuda" if str(result["device"]).startswith("cuda") else "cpu"
    shipped = default_costs(device, result["compute_parameters"], result["n_layers"] * result["m"])

    def predict(c, x):
        if c is None:
            return None
        return c.full(x["context_tokens"]) if x["method"] == "full" else c.store(x["context_tokens"], x["ratio"])

    return {"fitted": fitted.to_dict(), "defaults": shipped and shipped.to_dict(),
            "predictions": [{"k": x["k"], "method": x["method"], "ratio": x["ratio"],
                             "context_tokens": x["context_tokens"], "ttft_ms": x["ttft"],
                             "fitted_ms": predict(fitted, x), "defaults_ms": predict(shipped, x)} for x in rows]}


def summary(result: dict) -> dict:
    """Per k: each method's TTFT as a fraction of full prefill's; the crossover per method; the cost
    model fitted to the rows, with its predictions."""
    from ..query.budget import Costs

    rows = result["rows"]
    full = {x["k"]: x["ttft"] for x in rows if x["method"] == "full"}
    fractions = [{"k": x["k"], "method": x["method"], "ratio": x["ratio"], "context_tokens": x["context_tokens"],
                  "ttft_ms": x["ttft"], "of_full": x["ttft"] / full[x["k"]]} for x in rows if x["method"] != "full"]
    costs = costs_report(result)
    fitted = costs["fitted"] and Costs(**costs["fitted"])
    cross = {f"{m}:{r}": crossover(rows, m, r, fitted)
             for m, r in dict.fromkeys((x["method"], x["ratio"]) for x in rows) if m != "full"}
    return {"fractions": fractions, "crossover_tokens": cross, "costs": costs}


def plot_shapes(results: list[dict], out) -> None:
    """TTFT as a fraction of full prefill's against compute parameters, one line per method and k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = dict.fromkeys((f["method"], f["ratio"], f["k"]) for r in results for f in r["fractions"])
    colours = {m: f"C{i}" for i, m in enumerate(dict.fromkeys((m, r) for m, r, _ in keys))}  # one per method
    styles = {k: s for k, s in zip(sorted({k for _, _, k in keys}), ("o:", "s--", "^-.", "D-", "v-", "x-"))}
    for method, ratio, k in keys:
        pts = sorted((r["compute_parameters"], f["of_full"]) for r in results for f in r["fractions"]
                     if (f["method"], f["ratio"], f["k"]) == (method, ratio, k))
        ax.plot(*zip(*pts), styles.get(k, "o-"), color=colours[(method, ratio)], label=f"{method} r={ratio} k={k}")
    ax.set_xscale("log")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("compute parameters (log)")
    ax.set_ylabel("TTFT / full prefill's")
    ax.set_title(f"Where the store pays ({results[0]['device']}, {results[0]['cpu']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
