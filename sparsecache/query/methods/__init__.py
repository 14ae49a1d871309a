"""The query methods: what a query does with its retrieved chunks, one module per method,
registered by name.

Every other part reads this registry: `QueryConfig` validates against it, the CLI offers its
names and summaries, `Session` and the vLLM connector dispatch through it, and the
benchmarks' method tables come from it. Adding a method is one module here that subclasses
`Method` (or `Decoded`, `Scorer`, `AttentionScorer` in `base`) and calls `register`, plus its
import below. Importing this package is light (no torch): a method's heavy imports live in
its functions, so the CLI can list the methods without loading a model.
"""

from __future__ import annotations

from .base import AttentionScorer, Decoded, Method, Prefilled, Scorer

REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add `method` under its name (a name is registered once)."""
    if method.name in REGISTRY:
        raise ValueError(f"query method {method.name!r} is registered twice")
    REGISTRY[method.name] = method
    return method


def get(name: str) -> Method:
    """The method registered as `name` (KeyError names the registered ones)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no query method {name!r}: one of {', '.join(REGISTRY)}") from None


def names(**flags: bool) -> tuple[str, ...]:
    """Registered names in registration order, those whose attributes equal `flags`
    (`names(connector=True)`: what the vLLM connector can do)."""
    return tuple(m.name for m in REGISTRY.values() if all(getattr(m, k) == v for k, v in flags.items()))


def summaries(only: tuple[str, ...] | None = None) -> str:
    """"name: summary; …" of the registered methods (or `only` these): `--help` text."""
    return "; ".join(f"{m.name}: {m.summary}" for m in REGISTRY.values() if only is None or m.name in only) + "."


def ratios(only: tuple[str, ...] | None = None) -> str:
    """"name r, …" for the methods that recompute (or `only` these): their default ratios, `--help` text."""
    return ", ".join(f"{m.name} {m.ratio:g}" for m in REGISTRY.values()
                     if m.recomputes and (only is None or m.name in only))


def bench_configs(ratio: float) -> dict[str, dict]:
    """One `Session.query` setting per method for the benchmarks' per-method tables, the
    baselines first, every scorer at `ratio`."""
    ordered = sorted(REGISTRY.values(), key=lambda m: not m.baseline)
    return {m.name: {"method": m.name, **({"recompute_ratio": ratio} if m.recomputes else {})} for m in ordered}


# The registration order is the order the CLI offers them in.
from . import none, a3, infoflow, chunkflow, legolink, cacheblend, cacheclip, cake, full, raw, superposition  # noqa: E402,F401,I001

__all__ = ["REGISTRY", "AttentionScorer", "Decoded", "Method", "Prefilled", "Scorer", "bench_configs", "get", "names",
           "ratios", "register", "summaries"]
