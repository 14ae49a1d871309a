"""One plan per question: prefill or read the store, with which method and ratio, over which layout.

A query's configuration names a method and, by default, a TTFT budget rather than a ratio. What
actually runs depends on the context it is given: a context short enough that prefilling it costs
less than the store path is prefilled (`cheap.py`), and a budget becomes the recompute ratio it buys
at this context's length (`budget.py`). Both use the TTFT cost model for the model on this kind of
device (`calibrate`'s refit where the store has one). `plan` makes that decision once; `Session`,
`sparsecache serve` and the vLLM connector all ask it, so the three cannot drift apart:

    p = plan(cfg, store, model_config, "cpu", context_tokens)
    p.prefill        # True: prefill the chunks' text (`method full`), the store path is dearer here
    p.config         # what runs: `full` for a prefilled context, else the method at the ratio in effect
    p.layout         # prefix | header chunk trailer … | question (`store.ContextLayout`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from . import cheap
from .budget import Costs, budgeted, costs_for
from .config import QueryConfig

if TYPE_CHECKING:  # importing the store package loads torch: the CLI's --help imports this module
    from ..store.context_layout import ContextLayout

FROM_STORE = "store"  # `plan(costs=...)` not given: the store's calibration, else the measured constants


@dataclass(frozen=True)
class Plan:
    """What one question's context gets."""

    blend: QueryConfig  # the store path's config: the method, its budget turned into the ratio in effect
    layout: ContextLayout
    chunk_tokens: int  # the chunks as laid out (each with a wrapped store's header), the prefix left out
    prefilled_under: int | None = None  # the cheap-context threshold when the context is under it

    @property
    def prefill(self) -> bool:
        """Whether the context is prefilled instead of read from the store (a cheap context)."""
        return self.prefilled_under is not None

    @property
    def config(self) -> QueryConfig:
        """What runs: full prefill of a cheap context (in the config's order), else `blend`."""
        if self.prefill:
            return QueryConfig(method="full", order=self.blend.order, prefill_under=self.blend.prefill_under)
        return self.blend

    @property
    def context_tokens(self) -> int:
        """The tokens before the question: the prefix and the chunks."""
        return len(self.layout.prefix) + self.chunk_tokens

    @property
    def recompute_ratio(self) -> float | None:
        """The share of chunk tokens the store path recomputes (None where it recomputes nothing or prefills)."""
        return None if self.prefill or not self.blend.recomputes else self.blend.ratio


def plan(cfg: QueryConfig, store, model_config, device_type: str, context_tokens: int,
         costs: Costs | None | str = FROM_STORE, chunks: int = 0) -> Plan:
    """The plan for a context of `context_tokens` tokens before the question (the prefix and the chunks as
    `store.layout()` lays them out) under `cfg` (its method named), for a model of HF config `model_config`
    on a `device_type` device. `costs`: the TTFT cost model to decide with (default: `costs_of`).
    `chunks`: how many chunks the context holds (a linked store's queries recompute each one's trailer,
    which a TTFT budget pays for first)."""
    from ..model.kvmodel import compute_parameters

    if cfg.method is None:
        raise ValueError("plan: the config's method must be named (Session.configured names it)")
    device_type = device_type.split(":")[0]
    if costs == FROM_STORE:
        costs = costs_of(store, model_config, device_type)
    layout = store.layout()
    n = context_tokens - len(layout.prefix)  # the cheap-context threshold counts the chunks alone
    under = cheap.applies(cfg, n, compute_parameters(model_config), device_type, costs)
    # the cost model counts the context as answers report it: the prefix too
    fixed = len(layout.links([(0, layout.trailer)] * chunks))  # the trailers every query recomputes
    return Plan(budgeted(cfg, context_tokens, costs, fixed), layout, n, under)


def check_question(question) -> None:
    """A question a plan can use: a string with some text; a ConfigError (one line) otherwise, before
    anything is retrieved or loaded."""
    if not isinstance(question, str):
        raise ConfigError(f"the question must be text, got {type(question).__name__}")
    if not question.strip():
        raise ConfigError("the question is empty")


def costs_of(store, model_config, device_type: str) -> Costs | None:
    """What a plan predicts with (`budget.costs_for`): `calibrate`'s refit on this kind of device where the
    store's version has one, else the device kind's measured constants for this model (None where none are)."""
    return costs_for(store.calibration(), device_type.split(":")[0], model_config)


def prefill_under(cfg: QueryConfig, model_config, device_type: str, costs: Costs | None) -> int:
    """The context tokens under which `cfg`'s queries prefill instead of reading the store
    (`cheap.for_config`: its own setting, else where the TTFT cost model predicts the store path at the
    config's ratio faster)."""
    from ..model.kvmodel import compute_parameters

    return cheap.for_config(cfg, compute_parameters(model_config), device_type.split(":")[0], costs)
