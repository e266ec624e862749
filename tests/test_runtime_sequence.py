"""Replay order (``leangraph.runtime.sequence``): graphs replay in the order they were captured;
a forward or backward out of that order is refused naming the graph and the replay that must
come next, steps that can no longer come are passed over, and a pass abandoned midway may start
over (CPU backend)."""

from __future__ import annotations

import torch

from helpers import blocks, graphed_blocks, mgc, raises, sample


def test_r12_replays_follow_the_capture_order():
    layers = blocks(1)
    graphed = mgc(layers, tuple((sample(),) for _ in range(2)), order=[1, 1, -1, -1])
    with raises(
        RuntimeError,
        "graph (chunk 1, microbatch 1, layer 0): forward replayed out of capture order",
        "the next replay must be the forward of graph (chunk 1, microbatch 0, layer 0)",
    ):
        graphed[1](sample())  # microbatch 1 before microbatch 0
    first, second = graphed[0](sample()), graphed[1](sample())
    with raises(RuntimeError, "graph (chunk 1, microbatch 1, layer 0): backward replayed out of",
                "must be the backward of graph (chunk 1, microbatch 0, layer 0)"):
        second.sum().backward()  # the order runs microbatch 0's backward first
    first.sum().backward()
    second.sum().backward()
    unordered = graphed_blocks(2)
    with raises(RuntimeError, "callable 1 (Block): forward replayed out of capture order",
                "must be the forward of callable 0 (Block)"):
        unordered[1](sample())


def test_r12_steps_that_cannot_come_are_passed_over():
    layers = blocks(1)
    graphed = mgc(layers, tuple((sample(),) for _ in range(2)), order=[1, 1, -1, -1])
    with torch.no_grad():  # no backward can come for either
        graphed[0](sample())
        graphed[1](sample())
    graphed[0](sample())  # outputs dropped: its backward is passed over
    out = graphed[1](sample())
    out.sum().backward()
    graphed[1].reset()  # a reset graph's steps are passed over too
    graphed[0](sample()).sum().backward()
    graphed[0](sample()).sum().backward()


def test_r12_a_pass_abandoned_midway_may_start_over():
    graphed = mgc(blocks(1), tuple((sample(),) for _ in range(2)), order=[1, 1, -1, -1])
    graphed[0](sample())  # the pass is abandoned: output dropped, nothing in flight
    graphed[0](sample())  # so it may start over
    second = graphed[1](sample())  # microbatch 0's output dropped again; 1's is in flight
    with raises(RuntimeError, "graph (chunk 1, microbatch 0, layer 0): forward replayed out of",
                "must be the backward of graph (chunk 1, microbatch 1, layer 0)"):
        graphed[0](sample())
    second.sum().backward()
    graphed[0](sample()).sum().backward  # a new pass: forward, then its output dropped


def test_r12_an_abandoned_zero_bubble_pass_drains_its_due_weight_steps_and_starts_over():
    """``[1, -1, 1, -1, -1.5, -1.5]`` abandoned after microbatch 0's backward: its weight step
    is due, and holds the activations a new forward would overwrite. With nothing else in
    flight it may run now, out of order; then the pass starts over, and the later weight
    step's position is passed over."""
    graphed = mgc(blocks(1), tuple((sample(),) for _ in range(2)), order=[1, -1, 1, -1, -1.5, -1.5])
    graphed[0](sample()).sum().backward()  # then abandoned: microbatch 1 never comes
    with raises(RuntimeError, "forward replayed while the weight step of replay 1 has not run"):
        graphed[0](sample())
    graphed[0].backward_dw()  # drained
    for _ in range(2):  # a whole new pass, twice: the drained step no longer waits anywhere
        graphed[0](sample()).sum().backward()
        graphed[1](sample()).sum().backward()
        graphed[0].backward_dw()
        graphed[1].backward_dw()


def test_r12_a_weight_step_may_not_run_early_while_another_forward_awaits_its_backward():
    graphed = mgc(blocks(1), tuple((sample(),) for _ in range(2)), order=[1, -1, 1, -1, -1.5, -1.5])
    graphed[0](sample()).sum().backward()
    pending = graphed[1](sample())  # in flight: microbatch 0's weight step must wait its turn
    with raises(RuntimeError, "graph (chunk 1, microbatch 0, layer 0): weight step replayed out "
                "of capture order", "must be the backward of graph (chunk 1, microbatch 1"):
        graphed[0].backward_dw()
    pending.sum().backward()
    graphed[0].backward_dw()
    graphed[1].backward_dw()
