"""What `sparsecache serve` runs with: its config dataclass, where the CLI's defaults and the
connector's come from (no vLLM import: the CLI and the connector both read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..query.config import DEFAULT_METHOD, QueryConfig, served_config


@dataclass(frozen=True)
class ServeConfig:
    """What `sparsecache serve` runs with (the CLI's defaults come from here)."""

    store: str
    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 8000
    top_k: int = 8  # as `sparsecache query`
    method: str | None = None  # None: the store version's calibrated choice for this device (`calibrate`), else DEFAULT_METHOD
    recompute_ratio: float | None = None  # None: the method's own (QueryConfig.ratio)
    prefill_under: int | None = None  # cheap contexts: None the rule by model and device (`query.cheap`), 0 never
    ttft_budget: float | None = QueryConfig.ttft_budget  # the ratio from a fraction of full prefill's TTFT (`query.budget`)
    api_key: str | None = None
    dtype: str = "auto"  # auto: float32 on a CPU (what the store's codes were checked against), vLLM's choice on a GPU
    max_model_len: int | None = None
    kv_cache_gb: float | None = None  # None: on a CPU, `kv_cache_bytes`'s rule; on a GPU, vLLM's own default
    version_poll: float = 1.0  # seconds between looks for a new store version (in the background)
    store_timeout: float = 5.0  # seconds one store operation may take (a request's retrieval and layout: twice that)
    served_model_name: str | None = None
    vllm_args: tuple[str, ...] = ()

    def __post_init__(self):
        # method and ratio parsed once, into the typed value every request starts from
        given = {"method": self.method or DEFAULT_METHOD, "recompute_ratio": self.recompute_ratio,
                 "prefill_under": self.prefill_under, "ttft_budget": self.ttft_budget}
        blend = served_config(given, where="--method/--recompute-ratio/--prefill-under/--ttft-budget")
        object.__setattr__(self, "blend", blend)

    blend: QueryConfig = field(init=False, repr=False, compare=False)  # method and ratio, typed
