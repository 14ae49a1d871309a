"""Cheap contexts: when prefilling the retrieved chunks costs less than reading them (#69).

The store pays for itself by replacing the prefill of the retrieved tokens with a read, a
decode and a partial recomputation. For a few short chunks that trade loses: the decode and
the recomputation's scoring have fixed costs, and prefilling a few hundred tokens of a small
model is fast. Below a number of context tokens a query simply prefills them (`method full`),
which is full prefill's answer at full prefill's (small) cost.

The rule, by tokens, model and device (`prefill_under`):

- on a CPU, contexts under CPU_TOKENS tokens for the default model, and under CPU_TOKENS x
  REFERENCE_PARAMS / parameters for another (parameters outside the input embeddings: prefill's
  cost per token grows with them, the store path's fixed costs do not);
- on a GPU, under GPU_TOKENS tokens scaled the same way: for the default 135M model a GPU
  prefills 16K tokens as fast as the store can be read and decoded (H200, bf16: 92 ms against
  75-121 ms), so it prefills every context it can hold;
- `QueryConfig.prefill_under` (`query --prefill-under N`, the server's and connector's option)
  overrides it: N tokens, 0 never prefills instead.

Benchmarks that measure a named method pass `prefill_under=0`, so what they time is the method.
"""

from __future__ import annotations

# SmolLM2-135M, the default model, where the figures below were measured: its parameters outside the
# input embeddings (a lookup, not compute; `KVModel.compute_parameters`)
REFERENCE_PARAMS = 106_203_456
# CPU: the store path's default (infoflow r = 0.1, wrapped) and full prefill meet near 90 context tokens on a
# 2-vCPU AMD EPYC with the CPU to itself (#69, BENCHMARKS.md "Fidelity to full prefill": 10 questions each,
# full prefill 598 / 1,068 / 2,095 ms at ~300 / 590 / 1,130 tokens, the default 350 / 483 / 810 ms; the fitted
# lines cross at ~90). Superposition, the default before, cost more: there the crossover was ~700-800 tokens.
CPU_TOKENS = 96
# GPU: the default model prefills 16K tokens as fast as the store path delivers them (H200, 2026-11-27)
GPU_TOKENS = 16_384


def prefill_under(parameters: int, device_type: str, given: int | None = None) -> int:
    """Context tokens below which a query prefills the retrieved chunks instead of reading them:
    `given` when set (0: never), else the rule of this module for a model of `parameters`
    parameters on a `device_type` ("cpu", "cuda", ...) device."""
    if given is not None:
        return given
    base = CPU_TOKENS if device_type == "cpu" else GPU_TOKENS
    return int(base * REFERENCE_PARAMS / max(parameters, 1))


def rule_text() -> str:
    """The rule in one sentence, for `--help`."""
    return (f"Default: prefill contexts under {CPU_TOKENS} tokens on a CPU and {GPU_TOKENS} on a GPU for a "
            f"model of SmolLM2-135M's size, scaled by its {REFERENCE_PARAMS // 1_000_000}M non-embedding parameters "
            "over the model's; 0 never prefills instead.")
