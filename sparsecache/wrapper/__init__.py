"""The chunk wrapper: learned soft tokens encoded around every chunk so that chunks encoded
alone read as they would in context (KV Packet). Its settings (`config`), the neutral data it
learns from (`data`), learning it by self-distillation with the model frozen (`learn`), and
applying it: loading, encoding wrapped chunks, the placeholders a served prompt carries
(`apply`)."""

from .apply import (
    Wrapper,
    load_wrapper,
    placeholder_id,
    store_wrapping,
    wrapped_kv,
    wrapper_for,
)

__all__ = ["Wrapper", "load_wrapper", "placeholder_id", "store_wrapping", "wrapped_kv", "wrapper_for"]
