"""The fixed passes as CUDA graphs (#95 item 2): the question's pass, the scoring pass and the
recomputation, replayed instead of launched kernel by kernel.

On a GPU these passes run a few dozen tokens through every layer: ~1.7 ms per layer at the 8B
shape, which is kernel launches, not arithmetic. A CUDA graph replays a pass's kernels in one
launch, but only at the shapes and memory addresses it was captured with. So a query's passes do
not run on its own cache (whose length and tensors are the query's); they run on a *workspace*:

- the context's K/V are copied into per-layer buffers, once per query, and the passes write and
  read there, over a fixed capacity (the context's length rounded up to
  `GraphConfig.capacity_step`) and a scratch area after it: the buffers are the longest context's,
  and a shorter one uses their first positions, so their addresses never change; when the query's
  passes are done, the first positions (context and question) are copied back into the query's
  cache as new tensors (`Graphs.mirror`);
- a pass of T tokens is padded to a bucket (`bucket`: 16, 24, 32, 48, … up to
  `GraphConfig.max_tokens`); the padding tokens come first in the run (so the last token is the
  question's last, whose logits are kept) and sit at scratch positions past the capacity, where
  no real token sees them (a query at position p sees keys at positions <= p);
- attention always spans the whole workspace, masked by position (`StaticPass`): the keys past
  the context are zeros or stale, and no real query sees them.

One graph is captured per (capacity, bucket, kind): a first query at a new shape captures (after
two warm-up runs), later ones replay. Everything else (the decode, selection, generation) runs as
before. Without capture (`Graphs(capture=False)`, the default off CUDA) the same static passes run
eagerly: that is what the CPU tests check against the ordinary passes, so the capture itself is
the only part a CPU cannot test.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .stack import Stack, as_stack, attention, attention_probs


@dataclass(frozen=True)
class GraphConfig:
    capacity_step: int = 1024  # workspace capacity: the context (and question) rounded up to this many positions
    max_tokens: int = 4096  # a longer pass runs on the workspace without a graph
    max_graphs: int = 48  # captured graphs kept (least recently used dropped); each holds its activations


def bucket(n: int, largest: int) -> int | None:
    """The padded size of a pass of n tokens: the smallest of 16, 24, 32, 48, 64, … (powers of two
    and 1.5 times them) that holds n, at most a third of it padding; None above `largest`."""
    size = 16
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size if size <= largest else None


class StaticPass:
    """A `stack.Pass` over a workspace of fixed capacity, without host synchronisation: each
    layer's K/V of the tokens are written at their positions (`index_copy_`) and attention spans
    the whole workspace, masked by position. With `probe`, that layer's attention also leaves the
    question's attention mass on every workspace position in `scores` (float32 [capacity], summed
    over heads and over the tokens `real` marks), and the layers after it are not run."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: torch.Tensor,
                 probe: int | None = None, real: torch.Tensor | None = None):
        self.keys, self.values, self.positions = keys, values, positions
        self.probe, self.real = probe, real
        self.scores: torch.Tensor | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, self.positions, k.to(keys.dtype))
        values.index_copy_(2, self.positions, v.to(values.dtype))
        if layer == self.probe:
            probs = attention_probs(q, keys, self.positions, scale, window, softcap)  # (1, nh, T, C)
            self.scores = (probs[0] * self.real[None, :, None]).sum((0, 1))
            return torch.zeros_like(q)  # nothing after this layer's K/V is read
        return attention(q.to(keys.dtype), keys, values, self.positions, scale, window, softcap).to(q.dtype)


class Workspace:
    """Per-layer K/V buffers (1, H, positions, D) at fixed addresses, and the static inputs of each
    bucket's pass (token ids, positions, which tokens are real). A query uses the first
    `capacity + scratch` positions (`keys`, `values`: views, so their addresses are the buffers'
    whatever the capacity): a longer context than the buffers hold makes new ones."""

    def __init__(self, stack: Stack, positions: int, scratch: int):
        shape = (1, stack.n_kv_heads, positions, stack.head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=stack.dtype, device=stack.device) for _ in range(stack.n_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=stack.dtype, device=stack.device) for _ in range(stack.n_layers)]
        self.scratch = scratch
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.cache: DynamicCache | None = None  # the query cache it mirrors now
        self.length = 0  # positions of it that the query's cache will hold (context, then the question)
        self.use(positions - scratch)

    def use(self, capacity: int) -> None:
        """This query's capacity: attention spans its first `capacity` positions and the scratch after them."""
        self.capacity, self.size = capacity, capacity + self.scratch
        self.keys = [b[:, :, : self.size] for b in self.k_buffers]
        self.values = [b[:, :, : self.size] for b in self.v_buffers]

    @property
    def positions(self) -> int:
        return self.k_buffers[0].shape[-2]

    def fill(self, ids: torch.Tensor, positions: torch.Tensor, size: int):
        """The static inputs of a `size`-token pass holding `ids` at `positions`, the padding first."""
        dev = self.keys[0].device
        if size not in self.inputs:
            self.inputs[size] = (torch.zeros(size, dtype=torch.long, device=dev),
                                 torch.zeros(size, dtype=torch.long, device=dev),
                                 torch.zeros(size, dtype=torch.float32, device=dev))
        tok, pos, real = self.inputs[size]
        pad = size - ids.numel()
        tok[:pad] = 0
        tok[pad:].copy_(ids)
        pos[:pad].copy_(torch.arange(self.size - pad, self.size, device=dev))  # scratch: past every real position
        pos[pad:].copy_(positions)
        real[:pad] = 0
        real[pad:] = 1
        return tok, pos, real


class Graphs:
    """The fixed passes of one `Stack` on workspaces, captured as CUDA graphs where `capture`
    (default: on a CUDA device). A query's passes run inside `mirror(ctx)`; `active(cache)` says
    whether a cache is mirrored now (what `cache.recompute` and `blend.attention_scores_many` ask)."""

    def __init__(self, model, capture: bool | None = None, config: GraphConfig = GraphConfig()):
        self.stack = as_stack(model)
        self.capture = self.stack.device.type == "cuda" if capture is None else capture
        self.config = config
        self.workspace: Workspace | None = None
        self.graphs: OrderedDict = OrderedDict()  # (capacity, size, kind) -> (graph, output)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.lock = threading.RLock()
        self.runs = self.replays = self.captures = 0  # passes run on a workspace; of them replayed; graphs captured

    def active(self, cache: DynamicCache) -> bool:
        ws = self.workspace
        return ws is not None and ws.cache is cache

    @contextlib.contextmanager
    def mirror(self, ctx, extra: int):
        """ctx's cache in a workspace with room for `extra` more positions (the question) while the
        block runs; at its end the positions the passes left (the context, and the question's K/V
        once a pass has run it) are the cache's, as new tensors. One query at a time."""
        with self.lock:
            ws = self._workspace(ctx.length + extra)
            for layer, k, v in zip(ctx.cache.layers, ws.keys, ws.values):
                n = layer.keys.shape[-2]
                k[:, :, :n].copy_(layer.keys)
                v[:, :, :n].copy_(layer.values)
            ws.cache, ws.length = ctx.cache, ctx.length
            try:
                yield ws
                for layer, k, v in zip(ctx.cache.layers, ws.keys, ws.values):
                    layer.keys, layer.values = k[:, :, : ws.length].clone(), v[:, :, : ws.length].clone()
            finally:
                ws.cache = None

    def _workspace(self, length: int) -> Workspace:
        """The workspace at the capacity `length` rounds up to: the same buffers for any capacity they
        hold (graphs of each capacity stay valid), new ones, and no graphs, for a longer context."""
        step, scratch = self.config.capacity_step, self.config.max_tokens // 2
        capacity = -(-length // step) * step
        if self.workspace is None or self.workspace.positions < capacity + scratch:
            self.workspace = None  # the old buffers go before the new ones are made
            self.graphs.clear()  # they read and write the old buffers
            self.workspace = Workspace(self.stack, capacity + scratch, scratch)
        self.workspace.use(capacity)
        return self.workspace

    # ------------------------------------------------------------ the passes

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens `ids` at `positions` (sorted; the question's last) through every layer, their K/V
        written into the mirrored workspace: float32 next-token logits [vocab] after the last."""
        ws = self.workspace
        out = self._run(ws, ids, positions, "logits")
        ws.length = max(ws.length, int(positions[-1]) + 1)
        return out

    @torch.inference_mode()
    def scores(self, ids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """float32 [S]: the attention mass tokens `ids` at `positions` (the question after the context)
        give each of the S context positions at `layer` (`blend.attention_scores`)."""
        return self._run(self.workspace, ids, positions, ("scores", layer))[: self.workspace.length]

    def _run(self, ws: Workspace, ids: torch.Tensor, positions: torch.Tensor, kind) -> torch.Tensor:
        stack = self.stack
        self.runs += 1
        size = bucket(ids.numel(), self.config.max_tokens)
        if size is None:  # too long for a graph: the same pass, unpadded, on the workspace
            return self._body(ws, ids.to(stack.device), positions.to(stack.device),
                              torch.ones(ids.numel(), device=stack.device), kind)
        tok, pos, real = ws.fill(ids.to(stack.device), positions.to(stack.device), size)
        if not self.capture:
            return self._body(ws, tok, pos, real, kind)
        key = (ws.capacity, size, kind)
        if key not in self.graphs:
            self._capture(key, lambda: self._body(ws, tok, pos, real, kind))
        self.graphs.move_to_end(key)
        graph, out = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out.clone()  # the pool's memory is the next graph's

    def _body(self, ws: Workspace, tok, pos, real, kind) -> torch.Tensor:
        if kind == "logits":
            return self.stack.run(tok, pos, StaticPass(ws.keys, ws.values, pos), logits=True)
        layer = kind[1]
        attend = StaticPass(ws.keys, ws.values, pos, probe=layer, real=real)
        self.stack.run(tok, pos, attend, n_layers=layer + 1)
        return attend.scores

    def _capture(self, key, body) -> None:
        side = torch.cuda.Stream(self.stack.device)
        side.wait_stream(torch.cuda.current_stream(self.stack.device))
        with torch.cuda.stream(side):  # warm-up off the capture (allocator, lazy initialisation)
            for _ in range(2):
                body()
        torch.cuda.current_stream(self.stack.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = body()
        self.graphs[key] = (graph, out)
        self.captures += 1
        while len(self.graphs) > self.config.max_graphs:
            self.graphs.popitem(last=False)


def graphs_of(model) -> Graphs | None:
    """The Graphs enabled on `model`'s stack (`enable`), or None."""
    return as_stack(model).graphs


def enable(model, on: bool = True, capture: bool | None = None, config: GraphConfig = GraphConfig()) -> Graphs | None:
    """Run `model`'s fixed passes as graphs from now on (off: as before). Returns its Graphs."""
    stack = as_stack(model)
    if not on:
        stack.graphs = None
        return None
    capture = stack.device.type == "cuda" if capture is None else capture
    g = stack.graphs
    if g is None or (g.capture, g.config) != (capture, config):  # other settings: its graphs are not these
        stack.graphs = Graphs(stack, capture, config)
    return stack.graphs
