"""Split backward (zero-bubble) orders end to end: -(c + 0.5) weight steps parsed, planned, given
buffers and trained exactly (backward_dw() itself: test_runtime_weight.py)."""

from __future__ import annotations

import pytest
import torch
from models import TORCH_ZERO_BUBBLE_SCHEDULES, Block, assert_histories_equal, train_both

import leangraph
import leangraph.schedules
from leangraph.buffers import BufferKey, plan_buffers
from leangraph.order import StepKind, parse_order
from leangraph.plan import build_plan

# 2 chunks x 1 layer, 2 microbatches; weight steps deferred past other work.
ZB = [1, 2, 1, -2, 2, -1, -2.5, -2, -1.5, -1, -2.5, -1.5]
# 3 microbatches, weight steps of chunk 2 batched late.
ZB3 = [1, 2, 1, 2, -2, -1, 1, -2, 2, -1.5, -1, -2.5, -2.5, -2, -1.5, -1, -2.5, -1.5]


def test_parse_weight_steps():
    layout, steps = parse_order(ZB, num_callables=2, num_samples=4)
    assert [str(s) for s in steps[6:9]] == ["W c2 m0", "B c2 m1", "W c1 m0"]
    plan = build_plan(layout, steps)
    assert plan.split_backward
    backward = next(s for s in plan.capture if s.kind is StepKind.BACKWARD)
    weight = next(s for s in plan.capture if s.kind is StepKind.WEIGHT and s.graph == backward.graph)
    assert backward.dies == () and weight.dies == (backward.graph,)


@pytest.mark.parametrize(("order", "message"), [
    ([1, -1.5, -1], r"order\[1\] = -1.5: weight step of chunk 1 with no outstanding backward"),
    ([1, -1, 1, -1, -1.5], r"2 backwards but 1 weight steps of chunk 1"),
    ([1, -1, -1.25], r"order\[2\] = -1.25: entries must be .* or -\(c \+ 0.5\)"),
    ([1, -1, 1.5], r"order\[2\] = 1.5"),
])
def test_malformed_weight_steps(order, message):
    with pytest.raises(ValueError, match=message):
        parse_order(order, num_callables=1, num_samples=order.count(1))


def test_weight_steps_need_one_layer_per_chunk():
    with pytest.raises(ValueError, match="chunk 1 has 2 layers, but an order with weight steps "
                                         "needs exactly one layer per chunk"):
        parse_order([1, -1, -1.5], num_callables=2, num_samples=2)


@pytest.mark.parametrize(("order", "microbatches"), [(ZB, 2), (ZB3, 3)])
def test_zero_bubble_training_matches_eager_exactly(order, microbatches):
    history, graphed = train_both(order, [1, 1], width=8, microbatches=microbatches, steps=3)
    assert_histories_equal(history, exact=True)
    leangraph.reset_all(graphed)


def test_seeds_are_not_shared_between_overlapping_backward_and_weight_spans():
    key = BufferKey((4, 8), torch.float32, torch.device("cpu"), True)
    layout, steps = parse_order(ZB3, num_callables=2, num_samples=6)
    plan = build_plan(layout, steps)
    buffers = plan_buffers(plan, [[key]] * 6, [[key]] * 6, chainable=[True] * 6)
    spans = {}
    for index, step in enumerate(plan.capture):
        if step.kind is StepKind.BACKWARD:
            spans[step.graph] = [index, None]
        elif step.kind is StepKind.WEIGHT:
            spans[step.graph][1] = index
    for a in spans:
        for b in spans:
            if a < b and buffers.seeds[a][0] == buffers.seeds[b][0]:
                (a0, a1), (b0, b1) = spans[a], spans[b]
                assert a1 < b0 or b1 < a0, (a, b)
    assert 1 < len(buffers.seed_keys) < 6


def test_memory_plan_keeps_activations_alive_until_the_weight_step():
    torch.manual_seed(0)
    layers = tuple(Block(8) for _ in range(2))
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(6))
    # The same schedule with each weight step right after its backward, and deferred.
    eager_w = [1, 2, 1, 2, -2, -2.5, -1, -1.5, 1, -2, -2.5, 2, -1, -1.5, -2, -2.5, -1, -1.5]
    deferred = [1, 2, 1, 2, -2, -1, 1, -2, 2, -1, -2, -1, -2.5, -2.5, -2.5, -1.5, -1.5, -1.5]
    early = leangraph.plan_memory(layers, samples, order=eager_w)
    late = leangraph.plan_memory(layers, samples, order=deferred)
    assert late.max_in_flight > early.max_in_flight
    assert late.capture_peak_bytes > early.capture_peak_bytes
    weight_steps = [s for s in late.steps if s.step.startswith("W")]
    # Warm-up's pass runs microbatch 0 of each layer, the capture every graph.
    assert [s.phase for s in weight_steps] == ["warm-up"] * 2 + ["capture"] * 6


@pytest.mark.parametrize("cls", TORCH_ZERO_BUBBLE_SCHEDULES, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("rank", [0, 1])
def test_torch_zero_bubble_schedules_train_exactly(cls, rank):
    # The rank's order from torch's own schedule, one layer per stage; the other rank's
    # stages are folded away (chunk 2 consumes chunk 1 in this process).
    order = leangraph.schedules.from_pipelining(cls, 2, 4, rank, stages_per_rank=2)
    history, graphed = train_both(order, [1, 1], width=8, microbatches=4, steps=2)
    assert_histories_equal(history, exact=True)
    leangraph.reset_all(graphed)
