"""``overlap_grad_accumulation=True`` on a real GPU (skipped without one): autograd adds the
parameter gradients on the side stream the held accumulators were made under (their hooks run
with it current), the caller's stream waits for it when the backward pass ends, and training
is eager's bitwise."""

from __future__ import annotations

import copy

import pytest
import torch
from models import Block, assert_histories_equal, backward_through_stacks, train_both

import leangraph
import leangraph.schedules

pytestmark = pytest.mark.cuda

INTERLEAVED = leangraph.schedules.interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=4)


def test_an_interleaved_order_trains_bitwise_as_eager_on_cuda():
    logs: dict[str, list] = {}
    history, graphed = train_both(INTERLEAVED, [2, 2], width=256, microbatches=4, steps=3,
                                  device="cuda", set_to_none=lambda step: step % 2 == 0,
                                  hook_logs=logs, overlap_grad_accumulation=True)
    assert_histories_equal(history, exact=True)
    assert [sorted(s) for s in logs["graphed"]] == [sorted(s) for s in logs["eager"]]
    assert all(len(step) == 4 * 6 * 4 for step in logs["eager"])
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_additions_run_on_the_side_stream_and_the_caller_waits_for_them(overlap):
    torch.manual_seed(0)
    eager = Block(1024).cuda()
    module = copy.deepcopy(eager)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(64, 1024, device="cuda", requires_grad=True),),
        overlap_grad_accumulation=overlap)
    caller = torch.cuda.current_stream()
    streams: list[torch.cuda.Stream] = []
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda _: streams.append(torch.cuda.current_stream()))
    for _ in range(3):  # .grad set at the first, added to in place after
        x = torch.randn(64, 1024, device="cuda")
        graphed(x).square().sum().backward()
        eager(x).square().sum().backward()
        # No synchronisation: reading on the caller's stream right away must see every add.
        for a, b in zip(module.parameters(), eager.parameters()):
            assert torch.equal(a.grad, b.grad)
    assert len(streams) == 3 * len(list(module.parameters()))
    assert {s == caller for s in streams} == {not overlap}
    assert torch.cuda.current_stream() == caller
    module.forward.reset()


def test_a_late_addition_on_the_side_stream_reads_its_own_gradient_not_the_next_graphs():
    """Equal layers share parameter-gradient memory across graphs; each weight's accumulator
    here first keeps the side stream busy (as a slow hook would), so the addition reads its
    gradient long after the next backward graphs were launched on the caller's stream. Those
    must not have written that memory meanwhile: the gradients are eager's bitwise."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512).cuda() for _ in range(6)]
    eager = copy.deepcopy(layers)
    samples = tuple((torch.randn(16, 512, device="cuda", requires_grad=True),) for _ in layers)
    leangraph.make_graphed_callables(tuple(layers), samples, overlap_grad_accumulation=True)
    accumulators = [w.view_as(w).grad_fn.next_functions[0][0]
                    for w in (layer.weight for layer in layers)]
    for accumulator in accumulators:  # held by the graphed callables: the hooks stay
        accumulator.register_prehook(lambda grads: torch.cuda._sleep(5_000_000))
    for _ in range(3):
        backward_through_stacks((layers, eager), torch.randn(16, 512, device="cuda"))
    leangraph.reset_all(layers)
