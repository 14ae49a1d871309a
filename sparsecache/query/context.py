"""`QueryContext`: what a query method is handed, and nothing more: the model, the device,
the store version being read, the measured rates, the selector models and the raw-KV files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from ..kvstore import KVStore
    from ..model import KVModel
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
