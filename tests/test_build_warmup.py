"""The warm-up liveness invariant, observed from inside the callables at every call."""

from __future__ import annotations

import weakref

import pytest
import torch

import leangraph
from leangraph.order import parse_order

ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
MEGATRON_PP2_VP2_RANK0 = [1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1]


class Recorder:
    """Shared log of every forward output made by any probe, as weak references."""

    def __init__(self) -> None:
        self.outputs: list[tuple[str, weakref.ref[torch.Tensor]]] = []
        self.observed: list[set[str]] = []

    def alive(self) -> set[str]:
        return {tag for tag, ref in self.outputs if ref() is not None}


class Probe(torch.nn.Module):
    def __init__(self, name: str, recorder: Recorder) -> None:
        super().__init__()
        self.name = name
        self.recorder = recorder
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recorder.observed.append(self.recorder.alive())
        out = x * self.weight
        self.recorder.outputs.append((f"{self.name}#{self.calls}", weakref.ref(out)))
        self.calls += 1
        return out


def expected_alive(order, layers_per_chunk, passes):
    """Replay the order by hand: at each forward call, the tags awaiting backward.

    Before warm-up the probe runs each layer's forward once, with nothing alive.
    """
    names = [f"c{c}l{l}" for c, count in enumerate(layers_per_chunk, 1) for l in range(count)]
    calls = dict.fromkeys(names, 1)
    observed: list[set[str]] = [set() for _ in names]
    for _ in range(passes):
        pending = {}  # chunk -> FIFO of lists of tags
        alive: set[str] = set()
        for entry in order:
            chunk = abs(entry)
            if entry > 0:
                tags = []
                for layer in range(layers_per_chunk[chunk - 1]):
                    name = f"c{chunk}l{layer}"
                    observed.append(set(alive))
                    tag = f"{name}#{calls.get(name, 0)}"
                    calls[name] = calls.get(name, 0) + 1
                    alive.add(tag)
                    tags.append(tag)
                pending.setdefault(chunk, []).append(tags)
            else:
                alive.difference_update(pending[chunk].pop(0))
    return observed


@pytest.mark.parametrize("order", [ORDER, MEGATRON_PP2_VP2_RANK0])
def test_ordered_warmup_and_capture_keep_only_outputs_awaiting_backward(order):
    recorder = Recorder()
    layers = (2, 2)
    probes = tuple(Probe(f"c{c}l{l}", recorder) for c in (1, 2) for l in range(2))
    layout, _ = parse_order(order, num_callables=4, num_samples=4 * order.count(1))
    samples = tuple((torch.randn(3, requires_grad=True),) for _ in range(layout.num_graphs))
    graphed = leangraph.make_graphed_callables(probes, samples, order=order, num_warmup_iters=2)
    # The probe, then two warm-up passes and the capture pass that all follow the order.
    assert recorder.observed == expected_alive(order, layers, passes=3)
    assert recorder.alive() == set(), "outputs outlived make_graphed_callables"
    leangraph.reset_all(graphed)


def test_unordered_warmup_holds_one_callable_at_a_time():
    recorder = Recorder()
    probes = tuple(Probe(f"p{i}", recorder) for i in range(3))
    samples = tuple((torch.randn(3, requires_grad=True),) for _ in range(3))
    leangraph.make_graphed_callables(probes, samples, num_warmup_iters=2)
    probe_and_warmup = recorder.observed[:9]  # one probe forward, then two passes, each
    assert probe_and_warmup == [set()] * 9
    # Capture records all forwards, then the backwards (torch's contract).
    assert recorder.observed[9:] == [set(), {"p0#3"}, {"p0#3", "p1#3"}]
    assert recorder.alive() == set()


def test_no_grad_warmup_outputs_die_at_once():
    recorder = Recorder()
    probes = tuple(Probe(f"c1l{l}", recorder) for l in range(2))
    samples = tuple((torch.randn(3),) for _ in range(4))
    with torch.no_grad():
        graphed = leangraph.make_graphed_callables(probes, samples, order=[1, 1, -1, -1])
    assert all(alive == set() for alive in recorder.observed)
    with torch.no_grad():
        out = graphed[0](torch.ones(3))
    assert torch.equal(out, torch.ones(3))
