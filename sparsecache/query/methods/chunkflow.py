"""`chunkflow`: infoflow's scores spent chunk by chunk. The chunks that hold the most of the
question's attention (at three quarters of the depth) are recomputed whole, attending to
everything before them, while they fit the budget; what is left goes to infoflow's token-level
choice in the other chunks (#94 item 1). Where no chunk fits (a budget under one chunk's share of
the context) it chooses what infoflow chooses."""

from . import register
from .base import AttentionScorer, infoflow_layer


class ChunkFlow(AttentionScorer):
    name = "chunkflow"
    summary = "as infoflow, but the chunks the question attends to most are recomputed whole first"
    in_ttft_bench = False  # its time is infoflow's at the same ratio: the same passes, other positions
    in_calibrate_grid = False  # a #94 lever: a candidate by default once #69's rule chooses it on dev
    ratio = 0.25  # two chunks of eight: a whole chunk needs a budget of at least its share of the context

    def layer(self, n_layers: int) -> int:
        return infoflow_layer(n_layers)

    def positions(self, scores, ctx, ratio, cfg):
        from ..blend import select_chunks

        return select_chunks(scores, ctx, ratio, cfg.group_window, cfg.group_min)


register(ChunkFlow())
