"""`infoflow`: recompute the tokens the question attends to most at three quarters of the
depth, under the global RoPE geometry (InfoFlow §4.2, Eq. 7). The default of `query`, `Session`,
`serve` and the connector (#69's rule, BENCHMARKS.md "Fidelity to full prefill")."""

from . import register
from .base import AttentionScorer, infoflow_layer


class InfoFlow(AttentionScorer):
    name = "infoflow"
    summary = "as a3, at 3/4 of the depth (InfoFlow; the default)"
    # #69's rule on the entity suite's dev split (k = 8, wrapped store): the highest lower bound of kept among the
    # configurations at <= half of full prefill's TTFT on a 2-core CPU (r = 0.1: 0.39x; 0.15: 0.41x; 0.2: 0.52x)
    ratio = 0.1

    def layer(self, n_layers: int) -> int:
        return infoflow_layer(n_layers)


register(InfoFlow())
