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


def expected_alive(order, layers_per_chunk, passes, *, probes=1, warm_first_only=False):
    """Replay the order by hand: at each forward call, the tags awaiting backward.

    Before warm-up the probe runs each layer's forward ``probes`` times (once per sample
    layout), layer after layer, with nothing alive. The last of
    ``passes`` is the capture; with ``warm_first_only`` the warm-up passes before it run
    microbatch 0 of each chunk only (every microbatch's sample has one layout).
    """
    names = [f"c{c}l{l}" for c, count in enumerate(layers_per_chunk, 1) for l in range(count)]
    calls = dict.fromkeys(names, probes)
    observed: list[set[str]] = [set() for _ in range(probes) for _ in names]
    for index in range(passes):
        pending = {}  # chunk -> FIFO of lists of tags
        alive: set[str] = set()
        seen: dict[int, int] = {}  # per order entry: how often it came so far
        for entry in order:
            chunk = abs(entry)
            counts = seen.setdefault(entry, 0)
            seen[entry] = counts + 1
            if warm_first_only and index < passes - 1 and counts > 0:
                continue
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
    # A shape per microbatch: no two graphs of a layer are alike, so warm-up runs them all.
    samples = tuple(
        (torch.randn(layout.graph_id(g).microbatch + 1, 3, requires_grad=True),)
        for g in range(layout.num_graphs)
    )
    graphed = leangraph.make_graphed_callables(probes, samples, order=order, num_warmup_iters=2)
    # The probes, then two warm-up passes and the capture pass that all follow the order.
    expected = expected_alive(order, layers, passes=3, probes=layout.num_microbatches)
    assert recorder.observed == expected
    assert recorder.alive() == set(), "outputs outlived make_graphed_callables"
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("order", [ORDER, MEGATRON_PP2_VP2_RANK0])
def test_warmup_runs_each_layer_once_per_sample_layout_in_the_order(order):
    recorder = Recorder()
    probes = tuple(Probe(f"c{c}l{l}", recorder) for c in (1, 2) for l in range(2))
    layout, _ = parse_order(order, num_callables=4, num_samples=4 * order.count(1))
    samples = tuple((torch.randn(3, requires_grad=True),) for _ in range(layout.num_graphs))
    graphed = leangraph.make_graphed_callables(probes, samples, order=order, num_warmup_iters=2)
    # Microbatches alike run the same kernels: one probe and one warm-up per layer and pass,
    # in the order's sequence of microbatch 0; capture records every graph.
    expected = expected_alive(order, (2, 2), passes=3, warm_first_only=True)
    assert recorder.observed == expected
    microbatches = layout.num_microbatches
    assert [p.calls for p in probes] == [1 + 2 + microbatches] * 4
    assert recorder.alive() == set()
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


class Counted(torch.nn.Module):
    """Counts its forwards per input stride and ``scale`` constant."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.seen: list[tuple[tuple[int, ...], float]] = []

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.seen.append((x.stride(), scale))
        return x * self.weight * scale


def test_graphs_with_another_layout_or_constant_are_warmed_up_too():
    layer = Counted()
    samples = (
        (torch.randn(4, 4, requires_grad=True),),
        (torch.randn(4, 4, requires_grad=True),),  # alike microbatch 0
        (torch.randn(4, 4).t().requires_grad_(),),  # another stride: (1, 4)
        (torch.randn(4, 4, requires_grad=True),),
    )
    kwargs = ({}, {}, {}, {"scale": 2.0})  # another constant
    graphed = leangraph.make_graphed_callables(
        (layer,), samples, sample_kwargs=kwargs, order=[1, 1, 1, 1, -1, -1, -1, -1],
        num_warmup_iters=2)
    probe_and_warmup = layer.seen[: 3 + 2 * 3]
    # Microbatches 0, 2 and 3 differ: each is probed once and warmed up in both passes;
    # microbatch 1 is microbatch 0's twin. Capture then runs all four (on the static buffers).
    assert probe_and_warmup == [((4, 1), 1.0), ((1, 4), 1.0), ((4, 1), 2.0)] * 3
    assert [scale for _, scale in layer.seen[9:]] == [1.0, 1.0, 1.0, 2.0]
    leangraph.reset_all(graphed)
