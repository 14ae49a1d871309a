"""`QueryContext`: what a query method is handed, and nothing more: the model, the device,
the store version being read, the measured rates, the selector models, the raw-KV files and,
where one caller asks many configurations of one question, what they may share (`Reuse`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from ..kvstore.view import KVStore
    from ..model.kvmodel import KVModel
    from .overlap import Rates
    from .raw import RawKV


@dataclass(frozen=True)
class QueryContext:
    model: "KVModel"
    device: "torch.device"
    store: "KVStore"  # the published version this query reads
    rates: "Rates"  # decode and prefill speeds, measured by every query (cake's split reads them)
    selector: Callable[[str | None], "KVModel | None"]  # cacheclip's auxiliary model by path (None: none)
    raw: "RawKV"  # the raw-KV baseline's files
    reuse: "Reuse | None" = None  # `Session.reusing`: decoded chunks and scores shared by one question's queries


@dataclass
class Reuse:
    """What queries over the same chunks share when a caller asks them under many configurations
    (`calibrate`'s fidelity pass): the decoded chunks, and each scorer's scores of a question. It
    holds one context at a time; the timings of a query that reused something are not its TTFT."""

    key: tuple | None = None
    items: dict = field(default_factory=dict)

    def start(self, key: tuple) -> None:
        """Queries over `key` (store version, chunk ids) from here: a new key drops the old one's items."""
        if key != self.key:
            self.key, self.items = key, {}

    def get(self, what, make: Callable[[], object]):
        """The item `what` of the current key, made once."""
        if what not in self.items:
            self.items[what] = make()
        return self.items[what]
