"""Learning global K/V dictionaries: calibration signals from a model, the training loop,
checkpoints, and adaptation of a dictionary to a corpus.

Learning follows the paper's Algorithm 1 (sparse-code a mini-batch with OMP under the
current dictionary, take a gradient step on ||Y − DX||², renormalise atoms), with changes
kept because held-out NMSE said so (see BENCHMARKS.md):
- atoms start as normalised data samples, not noise;
- signals are scaled to unit norm for training, so the loss is the mean per-vector NMSE
  and large-norm tokens do not dominate (OMP is scale-equivariant; nothing is stored);
- the gradient of each atom is divided by a running mean of its usage energy Σx², a
  diagonal preconditioner that makes one learning rate fit rare and popular atoms alike;
- atoms unused for `dead_after` steps are replaced by the worst-coded signals of the batch;
- cosine learning-rate decay, validation NMSE on held-out text, early stopping, checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..durable import publish_file, write_atomic
from ..errors import ConfigError
from .config import AdaptConfig, DictConfig, TrainConfig  # noqa: F401  (AdaptConfig: learn's API)
from .dictionary import KINDS, Dictionary
from .omp import batch_omp, reconstruct


def nmse(signals: torch.Tensor, dictionary_atoms: torch.Tensor, sparsity: int, G=None) -> float:
    """Pooled NMSE Σ‖y − ŷ‖² / Σ‖y‖² of coding `signals` [N, d] with OMP."""
    idx, coef = batch_omp(signals, dictionary_atoms, sparsity, G)
    err = (signals.float() - reconstruct(idx, coef, dictionary_atoms)).square().sum()
    return float(err / signals.float().square().sum().clamp_min(1e-30))


def _unit_rows(y: torch.Tensor) -> torch.Tensor:
    return y / y.norm(dim=1, keepdim=True).clamp_min(1e-12)


def _sample(signals: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    rows = torch.randint(0, signals.shape[0], (count,), generator=gen)
    return signals[rows].float()


def initial_atoms(signals: torch.Tensor, atoms: int, init: str, gen: torch.Generator) -> torch.Tensor:
    """[d, atoms] unit-norm columns: normalised data samples (default) or Gaussian noise."""
    if init == "data":
        d = _unit_rows(_sample(signals, atoms, gen)).T
    else:
        d = torch.randn(signals.shape[1], atoms, generator=gen)
    return (d / d.norm(dim=0, keepdim=True).clamp_min(1e-12)).contiguous()


@dataclass
class _KindState:
    """Learning state of one dictionary (K or V) between steps; checkpointed."""

    atoms: torch.Tensor
    energy: torch.Tensor  # running mean of Σ x_j² per atom (the preconditioner)
    last_used: torch.Tensor  # step at which each atom was last chosen
    best_atoms: torch.Tensor
    best_val: float = float("inf")


def fresh_state(atoms: torch.Tensor, best_val: float = float("inf")) -> _KindState:
    """The learning state `learn` starts `atoms` [d, n] from (on their device)."""
    n, dev = atoms.shape[1], atoms.device
    return _KindState(atoms, torch.ones(n, device=dev), torch.zeros(n, dtype=torch.long, device=dev), atoms.clone(),
                      best_val)


def train_step(state: _KindState, y: torch.Tensor, sparsity: int, lr: float, step: int,
               cfg: TrainConfig) -> float:
    """One Algorithm-1 step on batch y [B, d]; updates `state` in place, returns batch NMSE."""
    D = state.atoms
    if cfg.normalize:
        y = _unit_rows(y)
    idx, coef = batch_omp(y, D, sparsity)
    R = y - reconstruct(idx, coef, D)  # (B, d)
    loss = float(R.square().sum() / y.square().sum().clamp_min(1e-30))
    n, d = D.shape[1], D.shape[0]
    flat = idx.reshape(-1)
    # −½∇_D ||Y − DX||² = R Xᵀ, accumulated per atom without forming the dense X.
    grad = torch.zeros(n, d, device=D.device).index_add_(0, flat, (coef[..., None] * R[:, None, :]).reshape(-1, d))
    if cfg.precondition:
        used = torch.zeros(n, device=D.device).index_add_(0, flat, coef.reshape(-1).square())
        state.energy.mul_(0.9).add_(used, alpha=0.1)
        grad /= (state.energy + 1e-3 * state.energy.mean().clamp_min(1e-12))[:, None]
    D += lr * grad.T
    state.last_used[flat] = step
    _replace_dead(D, R, state, step, cfg.dead_after)
    D /= D.norm(dim=0, keepdim=True).clamp_min(1e-12)
    return loss


def _replace_dead(D: torch.Tensor, R: torch.Tensor, state: _KindState, step: int, dead_after: int) -> None:
    """Atoms unused for `dead_after` steps take the directions of the worst-coded residuals."""
    dead = torch.nonzero(step - state.last_used > dead_after)[:, 0]
    if dead.numel() == 0:
        return
    err = R.square().sum(1)
    worst = err.argsort(descending=True)[: min(dead.numel(), R.shape[0] // 8, int((err > 1e-8).sum()))]
    dead = dead[: worst.numel()]
    D[:, dead] = _unit_rows(R[worst]).T
    state.last_used[dead] = step
    state.energy[dead] = state.energy.mean()


def lr_at(step: int, cfg: TrainConfig, kind: str = "k") -> float:
    """Cosine decay from the kind's peak rate to peak · lr_final_fraction over cfg.steps."""
    peak = cfg.lr_v if kind == "v" and cfg.lr_v is not None else cfg.lr
    t = min(step / max(cfg.steps, 1), 1.0)
    lo = peak * cfg.lr_final_fraction
    return lo + 0.5 * (peak - lo) * (1 + math.cos(math.pi * t))


def learn(train: dict[str, torch.Tensor], heldout: dict[str, torch.Tensor], config: DictConfig,
          tcfg: TrainConfig, model_fingerprint: dict, out: str | Path, device="cpu", resume: bool = False,
          data_summary: dict | None = None, progress: bool = True, init: Dictionary | None = None,
          scales: dict[str, torch.Tensor] | None = None) -> Dictionary:
    """Learn D_K and D_V from signals {"k": [N, d], "v": [N, d]}; checkpoints into `out`.

    Starts from `init`'s atoms when given (adaptation: its held-out NMSE is the bar to beat,
    so the result is never worse than `init` on the held-out signals), else from tcfg.init.
    The signals must already be multiplied by `scales`, which the result carries.
    Returns the dictionary with the best held-out NMSE per kind; also writes it to `out`.
    """
    from tqdm import tqdm

    device = torch.device(device)
    gen = torch.Generator().manual_seed(tcfg.seed)
    val = {k: _sample(heldout[k], tcfg.val_signals, gen).to(device) for k in KINDS}
    ckpt = Path(out) / "checkpoint"
    start, history, states = 0, [], {}
    if resume and (ckpt / "state.json").exists():
        start, history, states = _load_checkpoint(ckpt, device)
    # init's own held-out NMSE, from its atoms (not a checkpoint's best, which --resume loads)
    start_val = ({k: nmse(val[k], init.atoms(k).to(device), config.sparsity) for k in KINDS}
                 if init is not None else None)
    if not states:
        for k in KINDS:
            a = (init.atoms(k).clone() if init is not None else initial_atoms(train[k], config.atoms, tcfg.init, gen))
            a = a.to(device)
            states[k] = fresh_state(a, start_val[k] if init is not None else float("inf"))
    t0, stale = time.time(), 0
    bar = tqdm(range(start, tcfg.steps), initial=start, total=tcfg.steps, disable=not progress,
               desc="learn-dict", unit="step")
    for step in bar:
        step_gen = torch.Generator().manual_seed(tcfg.seed * 1_000_003 + step)  # resumable
        losses = {k: train_step(states[k], _sample(train[k], tcfg.batch, step_gen).to(device),
                                config.sparsity, lr_at(step, tcfg, k), step, tcfg) for k in KINDS}
        if (step + 1) % tcfg.val_every == 0 or step + 1 == tcfg.steps:
            vals = {k: nmse(val[k], states[k].atoms, config.sparsity) for k in KINDS}
            improved = False
            for k in KINDS:
                if vals[k] < states[k].best_val * (1 - 1e-3):
                    improved = True
                if vals[k] < states[k].best_val:
                    states[k].best_val, states[k].best_atoms = vals[k], states[k].atoms.clone()
            stale = 0 if improved else stale + 1
            history.append({"step": step + 1,
                            **{f"lr_{k}": lr_at(step, tcfg, k) for k in KINDS},
                            **{f"train_nmse_{k}": losses[k] for k in KINDS},
                            **{f"val_nmse_{k}": vals[k] for k in KINDS}})
            bar.set_postfix(k=f"{losses['k']:.4f}", v=f"{losses['v']:.4f}",
                            val_k=f"{vals['k']:.4f}", val_v=f"{vals['v']:.4f}")
            _save_checkpoint(ckpt, step + 1, history, states)
            if stale >= tcfg.patience:
                bar.write(f"early stop at step {step + 1}: no held-out gain in {stale} evaluations")
                break
    meta = {
        "normalisation": {
            "training": "each signal scaled to unit L2 norm" if tcfg.normalize else "none",
            "stored": "none: OMP codes are scale-equivariant, so codes carry each signal's scale",
        },
        "train": asdict(tcfg),
        "data": data_summary or {},
        "heldout_nmse": {k: states[k].best_val for k in KINDS},
        "init": "dictionary" if init is not None else tcfg.init,
        **({"started_from": {"fingerprint": init.fingerprint(), "texts": init.meta.get("data", {}).get("texts"),
                             "sparsity": init.config.sparsity, "heldout_nmse": start_val}} if init is not None else {}),
        "history": history,
        "train_seconds_this_run": round(time.time() - t0, 1),
    }
    d = Dictionary(states["k"].best_atoms.cpu(), states["v"].best_atoms.cpu(), config, model_fingerprint, meta,
                   scales).stored_as(tcfg.atoms_dtype)
    d.save(out)
    return d


def _save_checkpoint(ckpt: Path, step: int, history: list, states: dict) -> None:
    """Tensors go to a file named by step; state.json, renamed last, names that file, so a
    crash at any point leaves state.json pointing at a complete, matching tensor file."""
    from safetensors.torch import save_file

    ckpt.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, s in states.items():
        tensors.update({f"{k}.atoms": s.atoms, f"{k}.energy": s.energy, f"{k}.last_used": s.last_used,
                        f"{k}.best_atoms": s.best_atoms})
    name = f"state-{step:07d}.safetensors"
    publish_file(ckpt / name, lambda tmp: save_file({n: t.contiguous().cpu() for n, t in tensors.items()}, str(tmp)))
    state = {"step": step, "tensors": name, "history": history,
             "best_val": {k: s.best_val for k, s in states.items()}}
    write_atomic(ckpt / "state.json", json.dumps(state))
    for old in ckpt.glob("state-*.safetensors"):
        if old.name != name:
            old.unlink()


def _load_checkpoint(ckpt: Path, device) -> tuple[int, list, dict]:
    from safetensors.torch import load_file

    state = json.loads((ckpt / "state.json").read_text())
    t = {n: v.to(device) for n, v in load_file(str(ckpt / state["tensors"])).items()}
    states = {k: _KindState(t[f"{k}.atoms"], t[f"{k}.energy"], t[f"{k}.last_used"], t[f"{k}.best_atoms"],
                            state["best_val"][k]) for k in KINDS}
    return state["step"], state["history"], states


# ---------------------------------------------------------------- calibration signals


def collect_signals(model, docs, layers_per_signal: int, chunk_tokens: int, max_tokens: int,
                    prefix_ids=(), cache: bool = True, scales: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """K/V coding signals {"k", "v"}: [tokens·groups, L·m] float16 on CPU, and a data summary.

    Keys are pre-RoPE; each layer is multiplied by its factor in `scales` when given. Chunks
    are taken in document order up to `max_tokens` tokens, in turn from each source when there
    are several (`interleaved_chunks`); the result is cached under the user cache, keyed by
    model, text and settings.
    """
    sig, lengths, summary = _layer_rows(model, docs, chunk_tokens, max_tokens, prefix_ids, cache)
    if layers_per_signal > 1 or scales is not None:
        for k in KINDS:  # one kind at a time, each replacing its rows as soon as it is done
            sig[k] = _regroup(sig[k], lengths, model.n_layers, layers_per_signal, None if scales is None else scales[k])
    return sig, summary


def _layer_rows(model, docs, chunk_tokens: int, max_tokens: int, prefix_ids, cache: bool):
    """({"k", "v"}: per-layer rows [Σ layers·T, m] float16, chunk lengths, data summary)."""
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    from ..model.kvmodel import extract_kv
    from ..paths import cache_root
    from ..text.documents import interleaved_chunks

    chunks = interleaved_chunks(docs, model.tokenizer, chunk_tokens)
    kept, total = [], 0
    for c in chunks:
        if total >= max_tokens:
            break
        kept.append(c)
        total += len(c)
    summary = {"documents": len(docs), "chunks": len(kept), "tokens": total, "chunk_tokens": chunk_tokens}
    lengths = [len(c) for c in kept]
    # Cached per layer (L = 1) and regrouped on load, so each L does not re-run the model.
    key = hashlib.sha256(json.dumps([model.fingerprint(), 1, list(prefix_ids), kept]).encode())
    path = cache_root() / "signals" / f"{key.hexdigest()[:20]}.safetensors"
    if cache and path.exists():
        t = load_file(str(path))
        sig = {"k": t["k"], "v": t["v"]}
    else:
        out = {"k": [], "v": []}
        step = 64
        for i in tqdm(range(0, len(kept), step), desc="extract KV", unit="batch", leave=False):
            for pair in extract_kv(model, kept[i : i + step], prefix_ids):
                for kind, x in zip(KINDS, pair):
                    out[kind].append(x.reshape(-1, x.shape[-1]).half().cpu())  # (layers·T, m)
        sig = {k: torch.cat(v) for k, v in out.items()}
        if cache:  # identical for every process that extracts it: the first one's file stays
            publish_file(path, lambda tmp: save_file(sig, str(tmp)), replace=False)
    return sig, lengths, summary


def _chunk_views(rows: torch.Tensor, lengths: list[int], n_layers: int):
    """Each chunk's [n_layers, T, m] view of per-layer signal rows (no copy)."""
    start = 0
    for T in lengths:
        yield rows[start : start + n_layers * T].view(n_layers, T, -1)
        start += n_layers * T


def _regroup(rows: torch.Tensor, lengths: list[int], n_layers: int, layers_per_signal: int,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per-layer signal rows (chunk by chunk, [layers, T, m] each) → L-layer signals, written
    into one preallocated tensor: 300K calibration tokens are 3.5 GB per kind, and a list of
    pieces plus their concatenation held two copies at once."""
    from .signals import to_signals

    d = layers_per_signal * rows.shape[-1]
    out = torch.empty(rows.shape[0] // layers_per_signal, d, dtype=rows.dtype)
    at = 0
    for x in _chunk_views(rows, lengths, n_layers):
        if scale is not None:
            x = (x.float() * scale.view(-1, 1, 1)).to(rows.dtype)
        g = to_signals(x, layers_per_signal).reshape(-1, d)
        out[at : at + g.shape[0]] = g
        at += g.shape[0]
    return out


def layer_scales(model, docs, chunk_tokens: int, max_tokens: int, prefix_ids=()) -> dict[str, torch.Tensor]:
    """Per-layer factors {"k", "v"} [n_layers] that give every layer the same RMS (the mean
    layer's, so coefficients keep their usual range) on `docs`."""
    sig, lengths, summary = _layer_rows(model, docs, chunk_tokens, max_tokens, prefix_ids, True)
    out = {}
    for k, rows in sig.items():  # summed chunk by chunk: a float copy of all rows would not fit in memory
        sq = torch.zeros(model.n_layers, dtype=torch.float64)
        for x in _chunk_views(rows, lengths, model.n_layers):
            sq += x.double().square().sum((1, 2))
        rms = (sq / (summary["tokens"] * rows.shape[-1])).sqrt().float().clamp_min(1e-12)
        out[k] = rms.square().mean().sqrt() / rms
    return out


def learn_dict(model, texts=("builtin",), config: DictConfig = DictConfig(), tcfg: TrainConfig = TrainConfig(),
               out: str | Path = "dictionary", device="cpu", resume: bool = False, progress: bool = True,
               init: Dictionary | None = None) -> Dictionary:
    """Learn K/V dictionaries for `model` from `texts` (files, dirs or "builtin"); see `learn`.

    With `init`, continues from that dictionary: its atoms, layer grouping and per-layer scales
    are kept, and `config` may change only the sparsity (see `init_config`)."""
    from ..text.documents import read_documents

    train_docs = read_documents(list(texts), split="train")
    if list(texts) == ["builtin"]:
        held_docs = read_documents(["builtin"], split="heldout")
    else:
        train_docs, held_docs = split_heldout(train_docs)
    return learn_documents(model, train_docs, held_docs, config, tcfg, out, device, resume, progress, init,
                           list(map(str, texts)))


def split_heldout(docs: list) -> tuple[list, list]:
    """(train, held-out) of user text: every tenth document, or the last of fewer than ten."""
    held = docs[::10] if len(docs) >= 10 else docs[-1:]
    return [d for d in docs if d not in held] or docs, held


def init_config(init: Dictionary, config: DictConfig) -> DictConfig:
    """The config to continue `init` with: its atoms and layer grouping (the shape of its
    atoms) and `config`'s sparsity, which is how many atoms a code uses, not part of them."""
    for key in ("atoms", "layers_per_signal"):
        if getattr(config, key) != getattr(init.config, key):
            raise ConfigError(f"the dictionary to continue from has {key} {getattr(init.config, key)}, "
                              f"not {getattr(config, key)}: it fixes that")
    return replace(init.config, sparsity=config.sparsity)


def learn_config(init: Dictionary | None = None, *, atoms: int | None = None, sparsity: int | None = None,
                 layers_per_signal: int | None = None, atoms_dtype: str | None = None,
                 **train) -> tuple[DictConfig, TrainConfig]:
    """What a `learn-dict` run learns and how: the sizes given (None: DictConfig's defaults) or,
    continuing `init`, its sizes with the sparsity given (a given size that differs from
    init's is a ConfigError naming the flag to drop); the atoms stored as given, else as
    init's, else TrainConfig's; `train` are TrainConfig's other fields."""
    given = {"atoms": atoms, "sparsity": sparsity, "layers_per_signal": layers_per_signal}
    if init is not None:
        clash = [f"--{k.replace('_', '-')} {v} (it has {getattr(init.config, k)})"
                 for k, v in given.items() if k != "sparsity" and v is not None and v != getattr(init.config, k)]
        if clash:
            raise ConfigError("the dictionary to continue from fixes its sizes: drop " + ", ".join(clash))
        config = replace(init.config, sparsity=sparsity or init.config.sparsity)
    else:
        config = DictConfig(**{k: v for k, v in given.items() if v is not None})
    atoms_dtype = atoms_dtype or (init.atoms_dtype if init is not None else TrainConfig.atoms_dtype)
    return config, TrainConfig(atoms_dtype=atoms_dtype, **train)


def learn_documents(model, train_docs, held_docs, config: DictConfig = DictConfig(), tcfg: TrainConfig = TrainConfig(),
                    out: str | Path = "dictionary", device="cpu", resume: bool = False, progress: bool = True,
                    init: Dictionary | None = None, texts: list[str] = ()) -> Dictionary:
    """`learn_dict` on documents already read (text.Document)."""
    from ..model.kvmodel import default_prefix_ids

    if init is not None:
        init.check_model(model.fingerprint())
        config = init_config(init, config)
    config.check_signal(model.n_layers, model.m)
    prefix = default_prefix_ids(model)
    if init is not None:
        scales = init.scales
    elif tcfg.layer_scales and config.layers_per_signal > 1:  # L = 1: a per-signal factor OMP ignores
        scales = layer_scales(model, train_docs, tcfg.chunk_tokens, tcfg.max_tokens, prefix)
    else:
        scales = None
    train, summary = collect_signals(model, train_docs, config.layers_per_signal, tcfg.chunk_tokens,
                                     tcfg.max_tokens, prefix, scales=scales)
    held, held_summary = collect_signals(model, held_docs, config.layers_per_signal, tcfg.chunk_tokens,
                                         max(tcfg.max_tokens // 10, 4096), prefix, scales=scales)
    summary = {"train": summary, "heldout": held_summary, "texts": list(texts)}
    return learn(train, held, config, tcfg, model.fingerprint(), out, device, resume, summary, progress,
                 init, scales)


def adapt(model, docs: list, init: Dictionary, acfg: AdaptConfig = AdaptConfig(), device="cpu",
          progress: bool = True) -> Dictionary:
    """`init` continued on `docs` (text.Document, a sample of a corpus) for acfg.steps steps.

    Every tenth document is held out, and the result is the best on it, so never worse there
    than `init`."""
    import tempfile

    train_docs, held_docs = split_heldout(docs)
    with tempfile.TemporaryDirectory(prefix="sparsecache-adapt-") as out:
        tcfg = replace(acfg.train_config(), atoms_dtype=init.atoms_dtype)  # a store's copy stays as compact
        d = learn_documents(model, train_docs, held_docs, init.config, tcfg, out, device,
                            progress=progress, init=init, texts=["corpus sample"])
    d.meta["adapt"] = {**asdict(acfg), "from": init.fingerprint()}
    return d
