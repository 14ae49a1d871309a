"""`legolink`: recompute the first tokens of every chunk, whatever the question (EPIC's LegoLink,
#94 item 3's baseline): the tokens that would otherwise attend only to their own chunk's start
become the links between chunks. EPIC recomputes at most 32 per chunk; a smaller ratio (or what a
TTFT budget buys) takes that share of each chunk's tokens instead, so it is compared with the
scorers at the same budget. No scoring pass."""

from . import register
from .base import Scorer

LEGOLINK_TOKENS = 32  # EPIC's cap per chunk


class LegoLink(Scorer):
    name = "legolink"
    summary = f"recompute the first tokens of every chunk, at most {LEGOLINK_TOKENS} (EPIC's LegoLink)"
    in_ttft_bench = False  # no scoring pass: infoflow's time less the pass, measured in bench fidelity
    in_calibrate_grid = False  # a #94 lever: a candidate by default once #69's rule chooses it on dev
    ratio = 1.0  # EPIC's: the first 32 of every chunk (or all of a shorter one)

    def scores(self, ctx, q_ids, cfg, stack, selector=None):
        import torch

        return torch.zeros(ctx.length, device=ctx.token_ids.device)  # the choice reads positions only

    def positions(self, scores, ctx, ratio, cfg):
        import torch

        lead = [torch.arange(a, a + min(LEGOLINK_TOKENS, round(ratio * (b - a))), device=scores.device)
                for a, b in ctx.spans]
        return torch.cat(lead) if lead else torch.zeros(0, dtype=torch.long, device=scores.device)


register(LegoLink())
