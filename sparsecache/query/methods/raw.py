"""`raw`: each chunk's exact fp16 K/V, computed alone (a TurboRAG/LMCache-style store of
uncompressed per-chunk KV, made on first use beside the store: `sparsecache.query.raw`):
what the codec is measured against."""

from . import register
from .base import Decoded


class Raw(Decoded):
    name = "raw"
    summary = "exact uncompressed per-chunk KV"
    baseline = True
    connector = False  # the connector's exact-KV option is `source: raw`, with any method
    reorders = False

    def context(self, qc, ids, q_ids, cfg, watch):
        ctx, nbytes = qc.raw.context(qc.store, ids, qc.model, qc.device, watch)
        return ctx, nbytes, ids


register(Raw())
