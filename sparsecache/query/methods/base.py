"""What a query method is, and the fusion the decoded-cache methods share.

A `Method` turns a query's chunk ids and question into the model's cache and the first
logits (`prefilled`). The families:

- `Method`: anything (`full` prefills the text, `cake` overlaps prefill and decoding);
- `Decoded`: the chunks' decoded codes (or another per-chunk K/V) at their global positions,
  optionally reordered by the question's attention, then fused (`Decoded.fuse`): the question prefilled,
  after recomputing what a scorer selects;
- `Scorer`: a `Decoded` method that scores every context token and recomputes the top
  `recompute_ratio` of them (grouped into windows);
- `AttentionScorer`: a `Scorer` whose score is the question's attention at one layer, so the
  questions of several contexts are scored in one run through the layers (`choose_many`).

Heavy imports (torch, the model code) live inside the functions: the registry is read by
the CLI before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ...model.cache import Context
    from ...stopwatch import Stopwatch
    from ..config import QueryConfig  # for annotations only: query.config validates against this registry
    from ..context import QueryContext

# A QueryConfig field that only some methods read: the methods that read it name it in
# `Method.options`, and QueryConfig refuses it set with any other.
EXCLUSIVE_OPTIONS = ("cake_split", "selector_model", "selector_layers", "paths")
GATE_MAX_RATIO = 2.0  # the coverage gate (`QueryConfig.gate_coverage`) raises a scorer's ratio at most this many times


@dataclass
class Prefilled:
    """What a method leaves for generation: the first logits and the model's cache (context
    and question), with what the answer reports."""

    logits: Any  # float32 next-token logits after the question
    cache: Any  # the model's cache: context + question
    context_tokens: int
    recomputed: int
    bytes_read: int
    context_ids: list[str]


class Method:
    """One query method. Subclasses set the attributes and implement `prefilled`."""

    name: str = ""
    summary: str = ""  # one line: what it does (the CLI's --help, the docs)
    recomputes: bool = False  # recompute_ratio applies: it recomputes the tokens it selects
    connector: bool = False  # the vLLM connector can serve it (it blends a decoded context)
    reorders: bool = False  # --reorder attention applies (it lays out decoded chunks)
    baseline: bool = False  # a reference the benchmarks compare the store's methods with
    options: tuple[str, ...] = ()  # EXCLUSIVE_OPTIONS fields it reads
    in_ttft_bench: bool = True  # `bench ttft` times it at every k
    in_calibrate_grid: bool = True  # `calibrate`'s default candidates try it (where the connector serves it)
    ratio: float = 0.25  # the recompute ratio a query that names none gets (a method may set its own: infoflow 0.1)
    sources: tuple[str, ...] = ()  # the per-chunk K/V it can read (QueryConfig.source): decoded methods' codes or raw

    def layer(self, n_layers: int) -> int:
        """The layer a scorer reads by default."""
        return min(1, n_layers - 1)

    def prefilled(self, qc: "QueryContext", ids: list[str], q_ids: list[int], cfg: "QueryConfig",
                  watch: "Stopwatch") -> Prefilled:
        """The chunks `ids` (in context order) and the question `q_ids` in `qc.model`'s cache,
        each step timed in `watch` (`session.STEPS`' names)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<query method {self.name}>"


class Decoded(Method):
    """The chunks' decoded codes at their global positions, fused with the question."""

    reorders = True
    connector = True
    sources = ("codes", "raw")

    def context(self, qc: "QueryContext", ids: list[str], q_ids: list[int], cfg: "QueryConfig", watch: "Stopwatch"):
        """(Context, bytes read, chunk ids in context order): the store's prefix and the chunks
        decoded on `qc.device` (or, with `cfg.source` raw, their exact fp16 K/V: `query.raw`),
        reordered by the question's attention if `cfg` says so."""
        from ..blend import attention_order, decode_chunks

        first = qc.model if cfg.first_layer == "tokens" else None

        def load():
            if cfg.source == "raw":  # the same fusion over exact K/V: what the codec alone loses
                qc.raw.make(qc.store, ids, qc.model)
                with watch.step("read"):
                    raw = qc.raw.chunks(qc.store, ids)
                with watch.step("transfer"):
                    return raw.to(qc.device)
            return decode_chunks(qc.store, ids, qc.device, watch, first)

        if qc.reuse is None:
            chunks = load()
        else:  # one question under many configurations (`Session.reusing`)
            qc.reuse.start((qc.store.version, tuple(ids)))
            chunks = qc.reuse.get(("decoded", cfg.first_layer if cfg.source == "codes" else "raw"), load)
        if cfg.reorder == "attention":
            with watch.step("select"):
                layer = infoflow_layer(qc.model.n_layers)
                budget = cfg.ratio if cfg.recomputes else REORDER_BUDGET
                chunks = chunks.reordered(attention_order(chunks, q_ids, qc.model, layer, budget))
        with watch.step("reconstruct"):
            ctx = chunks.assemble(qc.model)
        qc.rates.observe("decode_tokens_per_s", sum(map(len, chunks.tokens)),
                              sum(watch.get(s, 0.0) for s in ("read", "transfer", "reconstruct")))
        return ctx, chunks.nbytes, chunks.ids

    def prefilled(self, qc, ids, q_ids, cfg, watch) -> Prefilled:
        ctx, nbytes, ids = self.context(qc, ids, q_ids, cfg, watch)
        logits, positions = self.fuse(ctx, q_ids, cfg, qc.model, watch, qc.selector(cfg.selector_model), qc.reuse,
                                      qc.store.layout().links(ctx.spans))
        return Prefilled(logits, ctx.cache, ctx.length, int(positions.numel()), int(nbytes), list(ids))


    def fuse(self, ctx: "Context", q_ids: list[int], cfg: "QueryConfig", model, watch: "Stopwatch | None" = None,
             selector=None, reuse=None, links: list[int] | None = None):
        """Score, select and recompute per `cfg` (this method's config), the question prefilled in the
        recomputation's pass: (next-token logits, recomputed positions). Where nothing is recomputed it
        only prefills the question. `selector`, `reuse`: `Scorer.choose`'s. `links`: positions recomputed
        whatever the method chooses (a linked wrapper's trailers, `ContextLayout.links`), in the same pass."""
        import contextlib

        import torch

        from ...model.cache import recompute
        from ...model.generate import prefill
        from ...model.graphs import graphs_of
        from ...stopwatch import Stopwatch

        watch = watch if watch is not None else Stopwatch(model.device)
        positions = torch.zeros(0, dtype=torch.long)
        graphs = graphs_of(model)  # the same passes, padded, on a workspace, as CUDA graphs (`model.graphs`)
        with graphs.mirror(ctx, len(q_ids)) if graphs is not None else contextlib.nullcontext():
            if cfg.recomputes:
                with watch.step("select"):
                    positions = self.choose(ctx, q_ids, cfg, model, selector, reuse)
            if links:
                positions = torch.cat([positions.to(ctx.token_ids.device),
                                       torch.tensor(links, device=ctx.token_ids.device)]).unique()  # sorted
            if not (cfg.recomputes or links or graphs is not None):
                with watch.step("prefill"):
                    return prefill(ctx.cache, q_ids, model), positions
            with watch.step("recompute" if cfg.recomputes or links else "prefill"):  # the question rides along
                return recompute(ctx, positions, model, q_ids=q_ids), positions

# Reordering without recomputation scores a chunk by its top 15% of tokens (what InfoFlow selects).
REORDER_BUDGET = 0.15


def infoflow_layer(n_layers: int) -> int:
    """InfoFlow's scoring layer: three quarters of the depth (InfoFlow §4.2)."""
    return (3 * n_layers) // 4


class Scorer(Decoded):
    """Recomputes the top `recompute_ratio` of the chunk tokens by `scores`."""

    recomputes = True

    def scores(self, ctx: "Context", q_ids: list[int], cfg: "QueryConfig", stack,
               selector=None) -> "torch.Tensor":
        """float32 [S]: how much each context position needs recomputing."""
        raise NotImplementedError

    def choose(self, ctx: "Context", q_ids: list[int], cfg: "QueryConfig", model, selector=None,
               reuse=None) -> "torch.Tensor":
        """Sorted int64 positions this scorer selects under `cfg` among the chunk tokens for the question
        `q_ids` (which follows the context). `cacheclip` scores with `selector` (default: the model
        itself) over its first `cfg.selector_layers` layers (default: a quarter of them). With `reuse`
        (`context.Reuse`), the scores of this question are computed once."""
        from ...model.stack import as_stack

        stack = as_stack(model)

        def scores():
            return self.scores(ctx, q_ids, cfg, stack, selector)

        # the scores read the context's cache: its source (codes or exact K/V) and layer 0's are part of the key
        key = ("scores", tuple(q_ids), type(self).scores, cfg.layer(stack.n_layers), cfg.reorder, cfg.selector_model,
               cfg.selector_layers, cfg.first_layer, cfg.source)
        return self.pick(scores() if reuse is None else reuse.get(key, scores), ctx, cfg)

    def pick(self, scores: "torch.Tensor", ctx: "Context", cfg: "QueryConfig") -> "torch.Tensor":
        """Sorted int64 positions to recompute given the `scores` [S]: `positions` at `cfg.ratio`; with
        `cfg.gate_coverage` (the confidence gate), at a ratio raised in quarters of it, up to
        GATE_MAX_RATIO times it, until the positions hold that share of the scores over the chunk tokens."""
        positions = self.positions(scores, ctx, cfg.ratio, cfg)
        if cfg.gate_coverage is None:
            return positions
        mass, ratio, most = float(scores[ctx.prefix_len:].float().sum()), cfg.ratio, min(1.0, GATE_MAX_RATIO * cfg.ratio)
        while ratio < most and float(scores[positions].float().sum()) < cfg.gate_coverage * mass:
            ratio = min(most, ratio + cfg.ratio / 4)
            positions = self.positions(scores, ctx, ratio, cfg)
        return positions

    def positions(self, scores: "torch.Tensor", ctx: "Context", ratio: float, cfg: "QueryConfig") -> "torch.Tensor":
        """Sorted int64 positions to recompute: about `ratio` of the chunk tokens, the top ones by `scores`
        or the top windows (`blend.select`, grouped as `cfg` says)."""
        from ..blend import select

        return select(scores, ctx, ratio, cfg.group_window, cfg.group_min)


class AttentionScorer(Scorer):
    """Scores by the question's attention mass on each context token at one layer."""

    def scores(self, ctx, q_ids, cfg, stack, selector=None):
        from ..blend import attention_scores

        return attention_scores(ctx, q_ids, stack, cfg.layer(stack.n_layers))


# ---------------------------------------------------------------- several contexts at once


def choose_many(ctxs: list["Context"], q_ids: list[list[int]], cfgs: list["QueryConfig"], model) -> list:
    """`Scorer.choose` for several contexts, each by its config's scorer; those scored by the question's
    attention at the same layer run their questions through the layers together
    (`blend.attention_scores_many`)."""
    from ...model.stack import as_stack
    from ..blend import attention_scores_many

    stack = as_stack(model)
    out: list = [None] * len(ctxs)
    by_layer: dict[int, list[int]] = {}
    for i, cfg in enumerate(cfgs):
        if isinstance(cfg.spec, AttentionScorer):
            by_layer.setdefault(cfg.layer(stack.n_layers), []).append(i)
        else:
            out[i] = cfg.spec.choose(ctxs[i], q_ids[i], cfg, stack)
    for layer, idx in by_layer.items():
        scores = attention_scores_many([ctxs[i] for i in idx], [q_ids[i] for i in idx], stack, layer)
        for i, sc in zip(idx, scores):
            out[i] = cfgs[i].spec.pick(sc, ctxs[i], cfgs[i])
    return out
