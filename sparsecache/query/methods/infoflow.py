"""`infoflow`: recompute the tokens the question attends to most at three quarters of the
depth, under the global RoPE geometry (InfoFlow §4.2, Eq. 7). `serve`'s and the connector's default."""

from . import register
from .base import AttentionScorer, infoflow_layer


class InfoFlow(AttentionScorer):
    name = "infoflow"
    summary = "as a3, at 3/4 of the depth (InfoFlow; serve's default)"

    def layer(self, n_layers: int) -> int:
        return infoflow_layer(n_layers)


register(InfoFlow())
