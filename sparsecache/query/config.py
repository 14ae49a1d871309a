"""What one query does with its retrieved chunks (`QueryConfig`), kept free of heavy imports
so the CLI can offer the choices without loading torch or transformers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..dtypes import DTYPE, DTYPES  # noqa: F401  (the query's dtype names: the CLI and Session read them here)
from ..errors import ConfigError
from . import methods
from .methods.base import EXCLUSIVE_OPTIONS

METHODS = methods.names()  # the registry's (`sparsecache.query.methods`), in the order the CLI offers them
SCORERS = methods.names(recomputes=True)  # recompute_ratio applies
ORDERS = ("given", "reverse")
FIRST_LAYER = ("tokens", "codes")
SOURCES = ("codes", "raw")
# #69's rule: the default is chosen among configurations at <= half of full prefill's TTFT (`calibrate` and
# `bench fidelity`'s rule), and, chosen by it (#79), the default query recomputes what that half buys
# (`budget.py`'s cost model)
TTFT_BUDGET = 0.5
REORDERS = ("none", "attention")
TOP_K = 8  # chunks a query retrieves (Session.query, `sparsecache query --top-k`)
# #69's rule (BENCHMARKS.md, "Fidelity to full prefill"): among the configurations at <= half of full prefill's
# TTFT at k = 8 on a 2-core CPU, the highest lower bound of *kept* (the share of the questions full prefill
# answers right with confidence that the configuration answers right too) on the dev splits; a method that
# drops chunks was eligible only if it kept the needed ones. One default for `query`, `Session`, `serve` and
# the vLLM connector: it keeps every retrieved chunk, so the connector serves it too.
DEFAULT_METHOD = "infoflow"
MAX_NEW_TOKENS = 64  # tokens a query generates


@dataclass(frozen=True)
class QueryConfig:
    """How a query lays out and fuses retrieved chunks; validated on construction.

    - method: a name in the registry (`sparsecache.query.methods`), or None for the store's
      measured choice (`sparsecache calibrate`), resolved by the session (`over`): `none` (decoded KV as is), a
      scorer (`a3`, `infoflow`, `cacheblend`, `cacheclip`: recompute the tokens it selects),
      `cake` (recompute the first chunks by prefill while the last ones are read and decoded,
      on two threads), `full` (prefill everything, no cache), `raw` (exact fp16 KV), …;
    - recompute_ratio: the fraction of chunk tokens a scorer recomputes (None: the method's
      own default, `ratio`);
    - group_window / group_min: CacheClip grouping (window 1 turns it off; min 0 takes whole
      windows by score mass up to the budget, M > 0 CacheClip's windows with >= M top tokens);
    - score_layer: the layer a scorer reads (None: a3/cacheblend 1, infoflow 3/4 of the depth);
    - order: `given` (best chunk first) or `reverse` (best chunk next to the question);
    - reorder: `attention` lays the chunks out by the question's attention instead, the most
      important next to the question (InfoFlow's reordering; decoded codes only);
    - paths: superposition's chunks kept (None: the method's own default);
    - prefill_under: contexts of fewer tokens are prefilled instead (`cheap.py`; None: its rule);
    - ttft_budget: with no recompute_ratio, a scorer recomputes the share of the chunk tokens whose
      predicted TTFT is this fraction of full prefill's (`budget.py`'s cost model for the session's
      device and model; None, or a device with no measured costs: the method's own ratio);
    - source: `codes` (the store's) or `raw` (exact fp16 K/V per chunk, `raw.py`) under a decoded method: the
      same method over both splits its loss into the codec's share and the blend's;
    - first_layer: `tokens` recomputes layer 0's K/V of the decoded chunks from their token ids
      (exact and nearly free: nothing attends before layer 0's projections), `codes` reads it from
      the codes like every other layer (what every query did before 2026-12-05).
    A method's own options (cake_split, selector_*, paths) are refused with any other method.
    """

    method: str | None = DEFAULT_METHOD  # #69's rule (above), at the ratio ttft_budget buys (else the method's own)
    recompute_ratio: float | None = None  # None: the method's own (`Method.ratio`: infoflow 0.1, superposition 0.5, others 0.25)
    group_window: int = 8
    group_min: int = 0
    score_layer: int | None = None
    order: str = "reverse"  # measured: best chunk next to the question (docs/benchmarks-history.md, "Context order")
    reorder: str = "none"
    cake_split: int | None = None  # cake: chunks recomputed; None: the closed form from the session's measured
    # rates, or, before any query has measured them, wherever the two threads meet
    # cacheclip: a small model's full-context pass picks the tokens (CacheClip's auxiliary selector):
    selector_model: str | None = None  # a local HF model with the same tokenizer; None: the main model...
    selector_layers: int | None = None  # ...truncated to its first N layers (None: a quarter of them)
    # superposition: the chunks kept, those whose own path makes the question likeliest (None: the method's default)
    paths: int | None = None
    # cheap contexts (#69, `cheap.py`): retrieved contexts under this many tokens are prefilled
    # (method full) instead of read from the store; None: the rule by model and device, 0: never
    prefill_under: int | None = None
    # the recompute ratio from a time budget (`budget.py`): half of full prefill's predicted TTFT, #69's rule's
    # choice on the dev splits (#79: BENCHMARKS.md, "The TTFT budget among the candidates"); None: the method's own
    ttft_budget: float | None = TTFT_BUDGET
    # layer 0 of decoded chunks from their tokens (exact) or from the codes
    # (docs/benchmarks-history.md, "Layer 0 from the tokens")
    first_layer: str = "tokens"
    # what a decoded method reads per chunk: the store's codes, or exact fp16 K/V computed after the same prefix and
    # header (`raw.py`): the same fusion over both splits a method's loss into the codec's and the blend's (#79)
    source: str = "codes"
    # the confidence gate (#94 item 4): more where the blended context's own signal says the answer needs it.
    # gate_coverage: a scorer recomputes more, up to GATE_MAX_RATIO times its ratio, until the tokens it recomputes hold
    # this share of its scores over the chunks (the question's attention, for infoflow); gate_margin: a query whose
    # first token leads the runner-up by less than this many nats is prefilled instead (`query` and `Session` only)
    gate_coverage: float | None = None
    gate_margin: float | None = None
    # Resolved once, when the config is made (never given): the method's registered spec, the recompute ratio in
    # effect (the one given, else the method's own) and whether it recomputes anything; None while the method is.
    spec: methods.Method | None = field(init=False, repr=False, compare=False)
    ratio: float | None = field(init=False, repr=False, compare=False)
    recomputes: bool | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("spec", "ratio", "recomputes"):
            object.__setattr__(self, name, None)  # a frozen dataclass's derived fields
        # method None (the store's choice): what depends on the method is checked once `over` names it
        if self.method is not None and self.method not in methods.REGISTRY:
            raise ConfigError(f"--method must be one of {', '.join(methods.names())}, got {self.method!r}")
        if self.recompute_ratio is not None and not 0.0 <= self.recompute_ratio <= 1.0:
            raise ConfigError(f"--recompute-ratio must be in [0, 1], got {self.recompute_ratio}")
        if self.group_window < 1 or (self.group_window > 1 and not 0 <= self.group_min <= self.group_window):
            raise ConfigError(f"need 0 <= --group-min ({self.group_min}) <= --group-window ({self.group_window})")
        if self.order not in ORDERS:
            raise ConfigError(f"--order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.reorder not in REORDERS:
            raise ConfigError(f"--reorder must be one of {', '.join(REORDERS)}, got {self.reorder!r}")
        spec = methods.get(self.method) if self.method is not None else None
        if spec is not None:
            ratio = spec.ratio if self.recompute_ratio is None else self.recompute_ratio
            object.__setattr__(self, "spec", spec)
            object.__setattr__(self, "ratio", ratio)
            object.__setattr__(self, "recomputes", spec.recomputes and ratio > 0)
            for name in EXCLUSIVE_OPTIONS:
                if getattr(self, name) is not None and name not in spec.options:
                    owners = [m for m in methods.names() if name in methods.get(m).options]
                    raise ConfigError(f"--{name.replace('_', '-')} applies to --method {' or '.join(owners)}, "
                                      f"not {self.method}")
        if self.cake_split is not None and self.cake_split < 0:
            raise ConfigError("--cake-split is a number of chunks >= 0")
        if self.selector_layers is not None and self.selector_layers < 1:
            raise ConfigError(f"--selector-layers must be >= 1, got {self.selector_layers}")
        if self.prefill_under is not None and (isinstance(self.prefill_under, bool) or self.prefill_under < 0):
            raise ConfigError(f"--prefill-under must be a number of tokens >= 0, got {self.prefill_under}")
        if self.ttft_budget is not None and (isinstance(self.ttft_budget, bool) or not 0 < self.ttft_budget <= 1):
            raise ConfigError(f"--ttft-budget must be in (0, 1] (a fraction of full prefill's TTFT), "
                              f"got {self.ttft_budget}")
        if self.first_layer not in FIRST_LAYER:
            raise ConfigError(f"first_layer must be one of {', '.join(FIRST_LAYER)}, got {self.first_layer!r}")
        if self.source not in SOURCES:
            raise ConfigError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if spec is not None and self.source != "codes" and self.source not in spec.sources:
            raise ConfigError(f"source {self.source} applies to the decoded methods, not --method {self.method}")
        if self.gate_coverage is not None and not 0 < self.gate_coverage <= 1:
            raise ConfigError(f"--gate-coverage must be in (0, 1], got {self.gate_coverage}")
        if self.gate_margin is not None and self.gate_margin < 0:
            raise ConfigError(f"--gate-margin must be >= 0 (nats), got {self.gate_margin}")
        if spec is not None and self.gate_coverage is not None and not spec.recomputes:
            raise ConfigError(f"--gate-coverage raises a scorer's ratio; --method {self.method} recomputes no tokens")
        if spec is not None and self.gate_margin is not None and self.method == "full":
            raise ConfigError("--gate-margin escalates to full prefill; --method full is full prefill")
        if self.paths is not None and self.paths < 1:
            raise ConfigError(f"--paths must be >= 1, got {self.paths}")
        if spec is not None and self.reorder != "none" and not spec.reorders:
            raise ConfigError(f"--reorder {self.reorder} lays out decoded chunks; it does not apply to --method {self.method}")

    def over(self, base: "QueryConfig") -> "QueryConfig":
        """This config where it names a method; else `base`'s method (a store's measured choice) with
        these settings, at this recompute ratio where one is given, else `base`'s (and at `base`'s
        TTFT budget where it was chosen at one and this config asks for the default's)."""
        if self.method is not None:
            return self
        ratio = self.recompute_ratio if self.recompute_ratio is not None else base.recompute_ratio
        return dataclasses.replace(self, method=base.method, recompute_ratio=ratio,
                                   ttft_budget=chosen_budget(self.ttft_budget, ratio, base))

    def layer(self, n_layers: int) -> int:
        """The layer a scorer reads in a model of `n_layers`: --score-layer, else the method's own."""
        if self.score_layer is not None:
            if not 0 <= self.score_layer < n_layers:
                raise ConfigError(f"--score-layer must be in [0, {n_layers - 1}]")
            return self.score_layer
        return self.spec.layer(n_layers)


def chosen_budget(asked: float | None, ratio: float | None, chosen: QueryConfig) -> float | None:
    """The TTFT budget a query spends over a store's calibrated choice `chosen` (`over`, and `serve`'s
    `served_calibration`): the choice's own where it was made at a budget, no ratio is in effect and
    the default budget is asked (no other was), else `asked`."""
    if ratio is None and asked == TTFT_BUDGET and chosen.ttft_budget is not None:
        return chosen.ttft_budget
    return asked


def calibrated(records: Mapping, device: str) -> QueryConfig | None:
    """The query configuration `sparsecache calibrate` chose for this kind of device (`cpu`,
    `cuda`) and stored with the version (`Store.calibration()`: {device kind: record}), or None
    where it measured none for it (a choice measured on another device is not used) or named a
    method this sparsecache does not have."""
    record = device_record(records, device)
    if not record or record.get("method") not in methods.REGISTRY:
        return None
    # a fixed ratio where one was chosen, else the budget the choice was measured at (#79: calibrate's
    # grid holds the default budget); records from before budgets ran at a ratio or the method's own
    return QueryConfig(method=record["method"], recompute_ratio=record.get("recompute_ratio"),
                       ttft_budget=record.get("query_ttft_budget"))


def device_record(records: Mapping, device: str) -> Mapping | None:
    """The stored calibration record for this kind of device (`cuda:1` reads `cuda`'s), or None."""
    return records.get(device.split(":")[0])


def calibration_line(record: Mapping) -> str:
    """One line on a stored choice: what, how well, how fast, where and when it was measured."""
    lo, hi = record.get("kept_ci95") or (None, None)
    kept = "exact (full prefill's own computation)" if record.get("exact") else \
        f"kept {record['kept']:.2f} [{lo:.2f}, {hi:.2f}] of {record['confident']} confident answers"
    return (f"{record['label']}: {kept}, TTFT {record['ttft_vs_full']:.2f}x full prefill's; target {record['target']:g} "
            f"within {record['ttft_budget']:g}x, {record['questions']} cloze questions at k = {record['top_k']}; "
            f"measured on {record['machine']} ({record['device']}), {record['measured'][:10]}, version "
            f"{record['measured_at']}" + (f"; {MISSED}" if missed_target(record) else ""))


MISSED = "it MISSED its target (recorded with --accept-best: the best candidate, not one that met it)"


def missed_target(record: Mapping) -> bool:
    """Whether a stored choice did not meet its target (`calibrate --accept-best` recorded the best
    candidate anyway); records from before `met_target` was kept count as met."""
    return record.get("met_target") is False


# The QueryConfig fields a served request (the server's `sparsecache` option, the vLLM
# connector's kv_transfer_params and extra config) may set, with the types each takes.
SERVED_FIELDS = {"method": (str,), "recompute_ratio": (int, float, type(None)), "group_window": (int,),
                 "group_min": (int,), "score_layer": (int, type(None)), "selector_layers": (int, type(None)),
                 "prefill_under": (int, type(None)), "first_layer": (str,), "ttft_budget": (int, float, type(None)),
                 "gate_coverage": (int, float, type(None))}


def served_config(given: Mapping, base: QueryConfig | None = None, where: str = "the request") -> QueryConfig:
    """The typed QueryConfig of a served request: `base` (default: QueryConfig's defaults) with the
    fields of SERVED_FIELDS that `given` (parsed JSON) sets. Only a method the vLLM connector
    can serve is accepted (`full`, `raw`, `cake`, superposition and reordering are `sparsecache
    query`'s); anything else is a ConfigError naming `where`."""
    base = base if base is not None else QueryConfig()
    fields = {k: given[k] for k in SERVED_FIELDS if k in given}
    for k, v in fields.items():
        if isinstance(v, bool) or not isinstance(v, SERVED_FIELDS[k]):
            raise ConfigError(f"{where}: {k} must be {_type_names(SERVED_FIELDS[k])}, got {v!r}")
    served = methods.names(connector=True)  # the registry's methods that blend a decoded context
    method = fields.get("method", base.method)
    if method not in served:  # before QueryConfig's own check, which names query's methods too
        raise ConfigError(f"{where}: method must be one of {', '.join(served)}, got {method!r}")
    return dataclasses.replace(base, **fields)


def _type_names(types: tuple[type, ...]) -> str:
    names = {str: "a string", int: "a number", float: "a number", type(None): "null"}
    return " or ".join(dict.fromkeys(names[t] for t in types))
