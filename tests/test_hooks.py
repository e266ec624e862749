"""Capture-time hooks run around warm-up and capture steps in schedule order, never at replay."""

from __future__ import annotations

import pytest
import torch

import leangraph


class Layer(torch.nn.Module):
    """Records whether its forward is running (as it is during stream capture), and logs
    ``run:<name>`` at each forward when given a log."""

    running = False

    def __init__(self, log: list[str] | None = None, name: str = "") -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.log, self.name = log, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.log is not None:
            self.log.append(f"run:{self.name}")
        Layer.running = True
        try:
            return x * self.weight
        finally:
            Layer.running = False


def _hooks(log: list[str], name: str) -> dict[str, list]:
    def hook(kind):
        def record(module, *args):
            # (Outside stream capture on CUDA: test_cuda.py; the CPU backend captures none.)
            assert not Layer.running, "a hook ran inside the recorded forward"
            log.append(f"{kind}:{name}")
        return record
    return {kind: [hook(kind)] for kind in ("forward_pre", "forward", "backward_pre", "backward")}


def _expected(sequence: list[tuple[str, str]], passes: int) -> list[str]:
    """The hooks around each step, and each forward step's run of the callable between them."""
    one = []
    for kind, name in sequence:
        if kind == "F":
            one += [f"forward_pre:{name}", f"run:{name}", f"forward:{name}"]
        else:
            one += [f"backward_pre:{name}", f"backward:{name}"]
    return one * passes


@pytest.mark.parametrize("iters", [1, 2])
def test_ordered_hook_log_is_exact(iters):
    log: list[str] = []
    layers = (Layer(log, "c1"), Layer(log, "c2"))
    samples = tuple((torch.randn(3, requires_grad=True),) for _ in range(4))
    graphed = leangraph.make_graphed_callables(
        layers, samples, order=[1, 2, 1, -2, -1, 2, -2, -1], num_warmup_iters=iters,
        capture_time_hooks=[_hooks(log, "c1"), _hooks(log, "c2")],
        pre_warmup_hook=lambda: log.append("pre-warmup"),
        post_warmup_hook=lambda: log.append("post-warmup"))
    steps = [("F", "c1"), ("F", "c2"), ("F", "c1"), ("B", "c2"), ("B", "c1"), ("F", "c2"),
             ("B", "c2"), ("B", "c1")]
    # Microbatch 0's steps: both microbatches' samples have one layout, so warm-up runs each
    # callable's first graph only.
    warmup = [("F", "c1"), ("F", "c2"), ("B", "c2"), ("B", "c1")]
    # The probe runs each callable once, before any hook.
    assert log == (["run:c1", "run:c2", "pre-warmup"] + _expected(warmup, iters)
                   + ["post-warmup"] + _expected(steps, 1))
    count = len(log)
    outputs = {}
    graph = {("c1", 0): 0, ("c1", 1): 1, ("c2", 0): 2, ("c2", 1): 3}
    microbatch = {"c1": 0, "c2": 0}
    for kind, chunk in steps:  # one replay of the whole order, as capture ran it
        if kind == "F":
            index = graph[chunk, microbatch[chunk]]
            microbatch[chunk] += 1
            outputs.setdefault(chunk, []).append(graphed[index](torch.randn(3, requires_grad=True)))
        else:
            outputs[chunk].pop(0).sum().backward()
    assert len(log) == count, "hooks must never run at replay"


def test_unordered_hook_log_is_exact():
    log: list[str] = []
    layers = (Layer(log, "a"), Layer(log, "b"))
    samples = tuple((torch.randn(3, requires_grad=True),) for _ in range(2))
    leangraph.make_graphed_callables(layers, samples, num_warmup_iters=2,
                                     capture_time_hooks=[_hooks(log, "a"), _hooks(log, "b")])
    warmup = [("F", "a"), ("B", "a"), ("F", "b"), ("B", "b")]
    capture = [("F", "a"), ("F", "b"), ("B", "b"), ("B", "a")]
    assert log == ["run:a", "run:b"] + _expected(warmup, 2) + _expected(capture, 1)


def test_hook_entries_are_validated():
    samples = ((torch.randn(3, requires_grad=True),),)
    with pytest.raises(ValueError, match=r"capture_time_hooks has 2 entries for 1 callables"):
        leangraph.make_graphed_callables((Layer(),), samples, capture_time_hooks=[None, None])
    with pytest.raises(ValueError, match=r"capture_time_hooks\[0\]: unknown hook kinds \['after'\]"):
        leangraph.make_graphed_callables((Layer(),), samples,
                                         capture_time_hooks=[{"after": []}])
