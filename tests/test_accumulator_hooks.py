"""``accumulator_hooks=False`` (with ``fuse_grad_accumulation=True``): replays run no autograd
accumulator, so training stays exact while no accumulator hook fires; a post-accumulate-grad
hook is refused, before warm-up (V24) or at the next backward (R15) (CPU backend; the CUDA
versions are in test_cuda_accumulation.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import leangraph
import leangraph.schedules
from helpers import raises
from models import Block, assert_histories_equal, train_both

ZB = [1, 2, 1, -2, 2, -1, -2.5, -2, -1.5, -1, -2.5, -1.5]


def _block_pair(width: int = 8):
    torch.manual_seed(0)
    eager = Block(width)
    return eager, copy.deepcopy(eager)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_interleaved_order_trains_exactly_without_accumulator_hooks(set_to_none):
    order = leangraph.schedules.interleaved_1f1b(
        pp_size=2, vp_size=2, rank=0, num_microbatches=4)
    history, graphed = train_both(order, [2, 2], width=8, microbatches=4, steps=3,
                                  set_to_none=set_to_none, fuse_grad_accumulation=True,
                                  accumulator_hooks=False)
    assert_histories_equal(history, exact=True)
    leangraph.reset_all(graphed)


def test_zero_bubble_weight_steps_train_exactly_without_accumulator_hooks():
    history, graphed = train_both(ZB, [1, 1], width=8, microbatches=2, steps=3,
                                  fuse_grad_accumulation=True, accumulator_hooks=False)
    assert_histories_equal(history, exact=True)
    leangraph.reset_all(graphed)


def _accumulator(param: torch.Tensor):
    return param.view_as(param).grad_fn.next_functions[0][0]


@pytest.mark.parametrize("hooks", [True, False])
def test_accumulator_node_hooks_fire_only_with_accumulator_hooks(hooks):
    """DDP and Megatron hook the accumulator nodes (held, as they hold them): with the relay
    each fires once per backward; without it none does, which is what the option trades."""
    _, module = _block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    fired: list[str] = []
    nodes = []
    for name, p in module.named_parameters():
        node = _accumulator(p)
        node.register_hook(lambda *_, name=name: fired.append(name))
        nodes.append(node)
    for _ in range(2):
        graphed(torch.randn(4, 8)).sum().backward()
    names = [name for name, _ in module.named_parameters()]
    assert sorted(fired) == (sorted(names * 2) if hooks else [])


def test_v24_a_post_accumulate_grad_hook_is_refused_before_warm_up():
    _, module = _block_pair()
    module.up.bias.register_post_accumulate_grad_hook(lambda _: None)
    warmed: list[bool] = []
    with raises(ValueError, "parameter 'up.bias' has a post-accumulate-grad hook, which "
                "accumulator_hooks=False would never run"):
        leangraph.make_graphed_callables(
            module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
            accumulator_hooks=False, pre_warmup_hook=lambda: warmed.append(True))
    assert warmed == []


def test_r15_a_post_accumulate_grad_hook_added_after_capture_is_refused_at_the_backward():
    _, module = _block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=False)
    graphed(torch.randn(4, 8)).sum().backward()
    before = [p.grad.clone() for p in module.parameters()]
    module.down.weight.register_post_accumulate_grad_hook(lambda _: None)
    out = graphed(torch.randn(4, 8)).sum()
    with raises(RuntimeError, "parameter 'down.weight' has a post-accumulate-grad hook"):
        out.backward()
    for p, grad in zip(module.parameters(), before):  # refused before the graph ran
        assert torch.equal(p.grad, grad)


def test_v24_option_misuse_is_refused():
    _, module = _block_pair()
    sample = (torch.randn(4, 8, requires_grad=True),)
    with raises(TypeError, "accumulator_hooks must be a bool, got int 0"):
        leangraph.make_graphed_callables(module, sample, fuse_grad_accumulation=True,
                                         accumulator_hooks=0)
    with raises(ValueError, "accumulator_hooks=False needs fuse_grad_accumulation=True"):
        leangraph.make_graphed_callables(module, sample, accumulator_hooks=False)


@pytest.mark.parametrize("case", ["fused-without-hooks", "split-backward"])
def test_an_input_without_grad_still_trains_the_parameters(case):
    """The parameters are no inputs of the replay's autograd node here; a stand-in makes the
    outputs require grad when no input does, as eager's would."""
    eager, module = _block_pair()
    sample = (torch.randn(4, 8, requires_grad=True),)
    if case == "split-backward":
        graphed = leangraph.make_graphed_callables(
            (module,), (sample,), order=[1, -1, -1.5])[0]
    else:
        graphed = leangraph.make_graphed_callables(
            module, sample, fuse_grad_accumulation=True, accumulator_hooks=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(4, 8, generator=gen)  # requires no grad
        eager(x).square().sum().backward()
        out = graphed(x)
        assert out.requires_grad
        out.square().sum().backward()
        if case == "split-backward":
            graphed.backward_dw()
    for a, b in zip(eager.parameters(), module.parameters()):
        assert torch.equal(a.grad, b.grad)
