"""`check-model`: the correctness gate a model passes before a dictionary or a store is built for it.

A store built from the wrong keys is silent garbage (keys captured after the wrong
projection, normalisation or rotation still decode to plausible numbers), so three
properties are checked on the model itself, in fp32, on a short held-out text:

(a) capture: the captured pre-RoPE keys, rotated to their positions, and the captured
    values equal what the model's own cache holds after a full forward;
(b) assembly: a cache assembled from exact per-chunk K/V at global positions, with every
    chunk token recomputed (ratio 1.0), gives full prefill's next-token logits;
(c) placement: one chunk's exact K/V after the prefix, nothing recomputed (ratio 0),
    gives full prefill's logits for that chunk.

`learn-dict` and `encode-corpus` run the check once per model fingerprint (the result is
kept in the user cache) and refuse a model that fails it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from ..durable import write_atomic
from ..errors import ModelError
from ..paths import cache_root
from .kvmodel import KVModel, default_prefix_ids, extract_kv, layer_windows

TOLERANCE = 1e-4  # relative: fp32 through a different order of the same operations stays ~1e-6
QUESTION = "What is this passage about?"


@dataclass
class Check:
    name: str
    what: str
    error: float  # relative: ‖got − expected‖∞ / ‖expected‖∞ (max over layers for (a))
    tolerance: float = TOLERANCE

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance


@dataclass
class ModelCheck:
    model: str
    fingerprint: dict
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict:
        return {"model": self.model, "fingerprint": self.fingerprint, "passed": self.passed,
                "checks": [{**asdict(c), "passed": c.passed} for c in self.checks]}


WINDOW_OVERHANG = 64  # sample tokens beyond the shortest sliding window
MAX_SAMPLE = 2048  # longer windows are not cut by the check (it would cost more than the rest)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def sample_ids(model: KVModel, tokens: int) -> list[int]:
    from ..text.documents import builtin_documents

    text = " ".join(d.text for d in builtin_documents("heldout"))
    # tokenise a prefix, not the whole held-out set (~22K tokens): a token is rarely 16 characters
    return model.tokenizer(text[: 16 * tokens], add_special_tokens=False)["input_ids"][:tokens]


@torch.inference_mode()
def check_model(model: KVModel, tokens: int = 96) -> ModelCheck:
    """Run checks (a) to (c) on `model` (see the module docstring). Where the model has
    sliding-window layers, the sample is longer than the shortest window (up to
    `MAX_SAMPLE` tokens), so the windows really cut the assembled context."""
    from .cache import assemble, recompute
    from .generate import full_prefill, prefill, question_ids

    shortest = min((w for w in layer_windows(model.config) if w), default=None)
    if shortest is not None and shortest + WINDOW_OVERHANG <= MAX_SAMPLE:
        tokens = max(tokens, shortest + WINDOW_OVERHANG)
    ids = sample_ids(model, tokens)
    prefix = default_prefix_ids(model)
    q = question_ids(model, QUESTION)
    chunks = [ids[i: i + len(ids) // 3] for i in range(0, 3 * (len(ids) // 3), len(ids) // 3)]

    seq = prefix + ids
    (k, v), = extract_kv(model, [seq])
    cache = getattr(model.hf(input_ids=torch.tensor([seq], device=model.device), use_cache=True), model.cache_arg)
    rotated = model.rope.rotate(k, torch.arange(len(seq), device=k.device))
    errors = []
    for layer in range(model.n_layers):
        ck = cache.layers[layer].keys[0].transpose(0, 1).flatten(-2)  # (T, m)
        cv = cache.layers[layer].values[0].transpose(0, 1).flatten(-2)
        kept = ck.shape[0]  # a sliding-window layer's cache keeps only the last tokens
        errors += [_rel(rotated[layer, -kept:], ck), _rel(v[layer, -kept:], cv)]
    capture = Check("capture", "captured K (rotated) and V equal the model's own cache", max(errors))

    prefix_kv = extract_kv(model, [prefix])[0] if prefix else _empty_kv(model)
    chunk_kv = extract_kv(model, chunks, prefix)
    ctx = assemble(prefix, prefix_kv, chunks, chunk_kv, model)
    recompute(ctx, torch.arange(len(prefix), ctx.length, device=model.device), model)
    full, _ = full_prefill(prefix + [t for c in chunks for t in c] + q, model)
    assembled = Check("recompute-all", "per-chunk K/V at global positions, ratio 1.0, equals full prefill",
                      _rel(prefill(ctx.cache, q, model), full))

    one = assemble(prefix, prefix_kv, chunks[:1], chunk_kv[:1], model)
    single = Check("single-chunk", "one chunk's K/V after the prefix, ratio 0, equals full prefill",
                   _rel(prefill(one.cache, q, model), full_prefill(prefix + chunks[0] + q, model)[0]))
    return ModelCheck(model.name, model.fingerprint(), [capture, assembled, single])


def _empty_kv(model: KVModel) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.zeros(model.n_layers, 0, model.m, device=model.device)
    return z, z.clone()


def _record_path(fingerprint: dict):
    return cache_root() / "checks" / f"{fingerprint['config_hash']}.json"


def record_check(result: ModelCheck) -> None:
    """Keep a check's result in the user cache for its model fingerprint (replacing any
    earlier one whole: processes checking at once leave one complete file)."""
    write_atomic(_record_path(result.fingerprint), json.dumps(result.to_dict(), indent=1))


def ensure_checked(model: KVModel) -> ModelCheck:
    """The check's result for this model fingerprint, run once and kept in the user cache;
    ModelError if the model fails it."""
    path = _record_path(model.fingerprint())
    if path.exists():
        saved = json.loads(path.read_text())
        result = ModelCheck(saved["model"], saved["fingerprint"],
                            [Check(c["name"], c["what"], c["error"], c["tolerance"]) for c in saved["checks"]])
    else:
        result = check_model(model)
        record_check(result)
    if not result.passed:
        failed = ", ".join(f"{c.name} (error {c.error:.2e} > {c.tolerance:.0e})" for c in result.checks if not c.passed)
        raise ModelError(f"{model.name} fails sparsecache's model check: {failed}; "
                         f"its K/V would be stored wrongly (`sparsecache check-model` explains)")
    return result
