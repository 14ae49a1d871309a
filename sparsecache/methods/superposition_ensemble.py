"""`superposition-ensemble`: superposition's paths, each of the best `--paths` answering from
its own cache, their next-token distributions mixed at every step, weighted by the posterior
of the path given the question (P(question | path), a uniform prior): the output-level
ensemble of superposition prompting's pruned paths. Nothing is recomputed; each kept path is
exact per-chunk KV plus the question, so the cost over `superposition` is decoding `--paths`
caches instead of one."""

from . import register
from .base import Prefilled
from .superposition import PathMethod


class Mixture:
    """Decodes the kept paths side by side (`generate.Continuation`'s calls): the mixed next-token
    log-probabilities after each token, fed to every path at its own position."""

    def __init__(self, paths: list, scores: list[float], q_len: int, model):
        import torch

        from ..generate import Continuation

        self.steps = [Continuation(ctx.cache, ctx.length + q_len, model) for ctx, _ in paths]
        self.log_weights = torch.tensor(scores, dtype=torch.float32).log_softmax(0)
        self.first = self.mix([logits for _, logits in paths])

    def mix(self, logits: list):
        import torch

        logp = torch.stack([x.float().log_softmax(-1) for x in logits])
        return torch.logsumexp(logp + self.log_weights.to(logp.device)[:, None], 0)

    def __call__(self, token: int, offset: int):
        return self.mix([step(token, offset) for step in self.steps])

    def rewind(self) -> None:
        for step in self.steps:
            step.rewind()


class SuperpositionEnsemble(PathMethod):
    name = "superposition-ensemble"
    summary = ("as superposition, each of the --paths best paths (default 2) answering from its own cache, their "
               "next-token distributions mixed by P(question | path)")
    paths = 2

    def prefilled(self, session, ids, q_ids, cfg, watch) -> Prefilled:
        chunks, scores, paths, best = self.best_paths(session, ids, q_ids, cfg, watch)
        with watch.step("select"):
            mixture = Mixture([paths[i] for i in best], [scores[i] for i in best], len(q_ids), session.model)
        ctx = paths[best[-1]][0]
        return Prefilled(mixture.first, ctx.cache, ctx.length, 0, chunks.nbytes, [chunks.ids[i] for i in best],
                         step=mixture)


register(SuperpositionEnsemble())
