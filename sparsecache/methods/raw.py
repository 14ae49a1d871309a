"""`raw`: each chunk's exact fp16 K/V, computed alone (a TurboRAG/LMCache-style store of
uncompressed per-chunk KV, made on first use beside the store): what the codec is measured
against."""

from . import register
from .base import Decoded


class Raw(Decoded):
    name = "raw"
    summary = "exact uncompressed per-chunk KV"
    baseline = True
    connector = False  # the connector's exact-KV option is `source: raw`, with any method
    reorders = False

    def context(self, session, ids, q_ids, cfg, watch):
        ctx = session.raw_context(ids, watch)
        return ctx, ctx.timings_ms["bytes_read"], ids


register(Raw())
