"""Query settings as `bench fidelity --methods` and `calibrate --candidates` write them: a
label, or `method:ratio` with `+reorder` / `+field=value` suffixes, and `@wrapped` for the
store encoded with a learned wrapper."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from . import methods

WRAPPED = "wrapped"  # `method@wrapped`: answered from the suite's store encoded with a learned wrapper
# The ratio a bare label recomputes at: the query default when the suite's tables were measured
# (2026-11-23); a method's own ratio (`Method.ratio`, infoflow's 0.1) is asked for as `infoflow:0.1`, or `infoflow+...`
# without a ratio.
RATIO = 0.15
# Every method at RATIO (and the selector, reordering and overlap) on the same trials; a label
# maps to `Session.query`'s settings.
METHODS = {**methods.bench_configs(RATIO),
           "infoflow+reorder": {"method": "infoflow", "recompute_ratio": RATIO, "reorder": "attention"}}


def parse_methods(spec: str, labels: dict[str, dict] | None = None) -> dict[str, dict]:
    """`label,...` from METHODS (or `labels`), or `method:ratio` with suffixes: `+reorder`
    reorders by attention, `+field=value` sets another QueryConfig field (`+paths=2`); any of
    them ending in `@wrapped` answers from the suite's store encoded with a learned wrapper.
    Without `:ratio` (`infoflow+ttft_budget=0.5`) the method recomputes its own ratio, or the one
    a `ttft_budget` buys at each question's context length."""
    from ..query.config import QueryConfig

    known = {**METHODS, **(labels or {})}
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        plain, at, where = item.partition("@")
        if at and where != WRAPPED:
            raise ConfigError(f"--methods: {item!r}: the only store suffix is @{WRAPPED}")
        store = {"store": WRAPPED} if at else {}
        if plain in known:
            out[item] = {**known[plain], **store}
            continue
        head, *extras = plain.split("+")
        name, _, ratio = head.partition(":")
        try:  # no ratio (`infoflow+ttft_budget=0.5`): the method's own, or what a TTFT budget buys
            cfg = {"method": name} | ({"recompute_ratio": float(ratio)} if ratio else {})
        except ValueError:
            raise ConfigError(f"--methods: {item!r} is neither a label ({', '.join(known)}) nor method:ratio") from None
        for extra in extras:
            key, eq, value = extra.partition("=")
            if extra == "reorder":
                cfg["reorder"] = "attention"
            elif eq and key in {f.name for f in dataclasses.fields(QueryConfig) if f.init}:
                cfg[key] = _field_value(value)
            else:
                raise ConfigError(f"--methods: unknown suffix +{extra} in {item!r} (+reorder or +field=value)")
        QueryConfig(**cfg)  # refused here, before any model loads
        out[item] = {**cfg, **store}
    if not out:
        raise ConfigError("--methods names no method")
    return out



def _field_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text

