"""Cheap contexts: when prefilling the retrieved chunks costs less than reading them (#69, #79).

The store pays for itself by replacing the prefill of the retrieved tokens with a read, a
decode and a partial recomputation. For a few short chunks that trade loses: the decode and
the recomputation's scoring have fixed costs, and prefilling a few hundred tokens of a small
model is fast. Below a number of context tokens a query simply prefills them (`method full`),
which is full prefill's answer at full prefill's (small) cost.

The rule is the TTFT cost model's own case where full prefill is cheaper (`budget.Costs.crossover`):
where the device kind has costs (on a CPU, the constants measured for the model's size, or the
store's `calibrate` refit), contexts shorter than the length from which the store path at the
ratio in effect is predicted faster are prefilled. On a GPU that means the constants one H100
measured for 3B and 8B shapes (the 3B model's store path was slower than prefill at every length:
every context is prefilled). For a model under half that size on a GPU, where fixed costs do not
shrink with the model, and on a device kind with no costs, contexts under GPU_TOKENS tokens for a
model of the default's size, scaled by its compute parameters over the model's: for the default
135M model a GPU prefills 16K tokens as fast as the store can be read and decoded (H200, bf16: 92 ms
against 75-121 ms). `QueryConfig.prefill_under` (`query --prefill-under N`, the server's and
connector's option) overrides it: N tokens, 0 never prefills instead. The threshold is compared
with the chunks' tokens (the prefix, a few dozen tokens every query has, is left out).

Benchmarks that measure a named method pass `prefill_under=0`, so what they time is the method.
"""

from __future__ import annotations

# SmolLM2-135M, the default model: its parameters outside the input embeddings (a lookup, not compute;
# `KVModel.compute_parameters`), what the GPU rule scales by
REFERENCE_PARAMS = 106_203_456
# GPU: the default model prefills 16K tokens as fast as the store path delivers them (H200, 2026-11-27)
GPU_TOKENS = 16_384
PREFILL_ALL = 1 << 30  # a threshold no context reaches: prefill every context (the store path is never cheaper)


def prefill_under(parameters: int, device_type: str, given: int | None = None, costs=None,
                  ratio: float = 0.0) -> int:
    """Context tokens below which a query prefills the retrieved chunks instead of reading them:
    `given` when set (0: never); else, with `costs` (`budget.Costs` for this model and device), where
    the store path at recompute ratio `ratio` stops being slower than full prefill (PREFILL_ALL where
    it never is faster); else the GPU rule for a model of `parameters` parameters."""
    if given is not None:
        return given
    if costs is not None:
        n = costs.crossover(ratio)
        return PREFILL_ALL if n is None else n
    return int(GPU_TOKENS * REFERENCE_PARAMS / max(parameters, 1))


def rule_ratio(cfg) -> float:
    """The recompute ratio the rule compares at for a QueryConfig `cfg`: the ratio in effect (0 where
    nothing is recomputed), r = 0 where a time budget is still to become a ratio (the budget's own
    cheap case, `budget.py`)."""
    unspent = cfg.ttft_budget is not None and cfg.recompute_ratio is None
    return cfg.ratio if cfg.recomputes and not unspent else 0.0


def for_config(cfg, parameters: int, device_type: str, costs=None) -> int:
    """`prefill_under` for a QueryConfig `cfg`: its own threshold, else the rule at `rule_ratio(cfg)`.
    What `Session` and the vLLM connector both decide by."""
    if cfg.prefill_under is not None:
        return cfg.prefill_under
    return prefill_under(parameters, device_type, None, costs, rule_ratio(cfg))


def applies(cfg, chunk_tokens: int, parameters: int, device_type: str, costs=None) -> int | None:
    """The threshold (`for_config`) when a context of `chunk_tokens` tokens (the chunks with a wrapped
    store's header, the prefix left out) is under it and so prefilled, else None: one decision for
    `Session`, the server and the vLLM connector. A config that already prefills (`method full`) is not
    a cheap case of anything."""
    if cfg.method == "full":
        return None
    under = for_config(cfg, parameters, device_type, costs)
    return under if 0 < under and chunk_tokens < under else None


def rule_text() -> str:
    """The rule in one sentence, for `--help`: what it decides by, not what it measured."""
    return ("Default: prefill contexts shorter than the length from which the TTFT cost model predicts the store "
            "path faster at the ratio in effect (with a TTFT budget, at r = 0): the constants measured for the "
            "model's size on this kind of device (sparsecache/query/measured_costs.json), or a store's own from "
            f"`calibrate`; where the device kind has none (a GPU and a small model), under {GPU_TOKENS} tokens for a "
            "model of SmolLM2-135M's size, scaled by its non-embedding parameters over the model's; "
            "0 never prefills instead.")
