"""The fixed passes on a static workspace (`model.graphs`, #95 item 2): padded to buckets, attending
over a fixed capacity, the question's last token kept. Off CUDA nothing is captured, so these tests
check everything a CUDA graph replays except the capture itself."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsecache.model import default_prefix_ids, extract_kv
from sparsecache.model.cache import assemble
from sparsecache.model.generate import question_ids
from sparsecache.model.graphs import GraphConfig, bucket, enable, graphs_of
from support.models import assert_graphed_passes_equal_eager

TEXTS = ["The pass statement does nothing at all. It is a placeholder where a statement is required.",
         "A break statement ends the innermost loop early, skipping its else clause.",
         "The continue statement goes on with the next iteration of the loop."]


@given(st.integers(1, 5000))
def test_a_pass_is_padded_by_at_most_a_third_of_its_bucket(n):
    size = bucket(n, 4096)
    if n > 4096:
        assert size is None
    else:
        assert n <= size <= 4096 and (size == 16 or 3 * (size - n) < size)
        assert bucket(size, 4096) == size  # a bucket is its own


def context_of(model):
    prefix = default_prefix_ids(model)
    chunks = [model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    return lambda: assemble(prefix, extract_kv(model, [prefix])[0], chunks, extract_kv(model, chunks, prefix), model)


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("config", [GraphConfig(), GraphConfig(capacity_step=16, max_tokens=32)],
                         ids=["default", "small-workspace"])
def test_the_passes_on_a_workspace_equal_the_ordinary_ones(tiny_model, ratio, config):
    """Recomputing nothing (the question's pass alone), some tokens, or all of them; with the
    default workspace and with one whose capacity is just past the context and whose passes over
    32 tokens run unpadded."""
    q = question_ids(tiny_model, "What does the statement do?")
    assert_graphed_passes_equal_eager(tiny_model, context_of(tiny_model), q, ratio, 1, config)


def test_the_workspace_follows_the_context_and_is_one_query_at_a_time(tiny_model):
    make = context_of(tiny_model)
    graphs = enable(tiny_model, capture=False, config=GraphConfig(capacity_step=32))
    try:
        assert graphs_of(tiny_model) is graphs
        ctx, other = make(), make()
        with graphs.mirror(ctx, 8) as ws:
            assert graphs.active(ctx.cache) and not graphs.active(other.cache)
            assert ws.capacity >= ctx.length + 8 and ws.capacity % 32 == 0
            first = ws
        assert not graphs.active(ctx.cache)
        assert ctx.cache.get_seq_length() == ctx.length  # no pass ran: the context as it was
        long = assemble(default_prefix_ids(tiny_model), extract_kv(tiny_model, [default_prefix_ids(tiny_model)])[0],
                        [list(range(100, 200))], [tuple(torch.zeros(2, tiny_model.n_layers, 100, 32))], tiny_model)
        with graphs.mirror(long, 8) as ws:
            assert ws is not first and ws.capacity >= long.length + 8  # a longer context: new buffers
            second, address = ws, ws.keys[0].data_ptr()
        with graphs.mirror(make(), 8) as ws:  # a shorter one again: the same buffers, their first positions
            assert ws is second and ws.keys[0].data_ptr() == address and ws.capacity < second.positions - 32
    finally:
        enable(tiny_model, False)
    assert graphs_of(tiny_model) is None
