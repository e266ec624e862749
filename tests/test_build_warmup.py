"""The warm-up liveness invariant, observed from inside the callables at every call; module
buffers the warm-up passes write into are put back."""

from __future__ import annotations

import copy
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


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Normed(torch.nn.Module):
    """BatchNorm's running statistics and num_batches_tracked, and a step counter of its own,
    all updated in place by every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        # No ReLU at the end: on CUDA an ordered chain of layers whose output is saved for
        # backward fails its capture with buffer sharing (a bug of its own, not this test's).
        return self.norm(self.lin(x))


def _buffers(modules) -> list[torch.Tensor]:
    return [b for m in modules for b in m.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_warmup_iters", [0, 1, 3])
@pytest.mark.parametrize("ordered", [False, True], ids=["drop-in", "ordered"])
def test_warmup_leaves_module_buffers_as_the_caller_had_them(device, num_warmup_iters, ordered):
    """Samples are random values nobody trains on: after the call every buffer holds what it
    held before, in the tensor it was (references kept to it stay valid)."""
    if device == "cuda" and num_warmup_iters == 0:
        pytest.skip("a CUDA capture needs a warm-up: cuBLAS creates its backward handle lazily")
    torch.manual_seed(0)
    layers = tuple(Normed().to(device) for _ in range(2))
    for layer in layers:  # statistics of their own, not the defaults a bug could restore
        layer.norm.running_mean.normal_()
        layer.norm.num_batches_tracked.fill_(7)
    before = [b.clone() for b in _buffers(layers)]
    held = _buffers(layers)
    samples = tuple((torch.randn(8, 4, device=device, requires_grad=True) * 100,)
                    for _ in range(4 if ordered else 2))
    order = dict(order=[1, 1, -1, -1], num_layers_per_chunk=2) if ordered else {}
    graphed = leangraph.make_graphed_callables(
        layers, samples, num_warmup_iters=num_warmup_iters, **order)
    after = _buffers(layers)
    assert all(a is h for a, h in zip(after, held))
    assert all(torch.equal(a, b) for a, b in zip(after, before)), (after, before)
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_warmup_leaves_module_buffers_as_they_were(device):
    torch.manual_seed(0)
    layer = Normed().to(device)
    before = [b.clone() for b in layer.buffers()]
    original = layer.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = original(x)
        if int(layer.steps) > 2:  # the probe's forward, then warm-up's first; its second raises
            raise ValueError("boom in warm-up")
        return out

    layer.forward = forward  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="boom in warm-up"):
        leangraph.make_graphed_callables(
            layer, (torch.randn(8, 4, device=device, requires_grad=True),))
    assert all(torch.equal(a, b) for a, b in zip(layer.buffers(), before))


@pytest.mark.parametrize("device", DEVICES)
def test_training_after_capture_equals_eager_bitwise_running_statistics_included(device):
    torch.manual_seed(0)
    eager = torch.nn.Sequential(Normed(), Normed(), torch.nn.Linear(4, 2)).to(device)
    model = copy.deepcopy(eager)
    leangraph.make_graphed_callables(
        (model[0], model[1]),
        ((torch.randn(8, 4, device=device, requires_grad=True),),
         (torch.randn(8, 4, device=device, requires_grad=True),)))
    # Nothing to copy over from the graphed model: warm-up left its statistics alone.
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), eager.buffers()))
    gen = torch.Generator(device=device).manual_seed(1)
    data = [torch.randn(8, 4, device=device, generator=gen) for _ in range(4)]
    results = []
    for net in (eager, model):
        optim = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x in data:
            optim.zero_grad()
            loss = net(x).square().mean()
            loss.backward()
            optim.step()
            losses.append(loss.detach())
        net.eval()
        with torch.no_grad():
            losses.append(net(data[0]))  # the running statistics at work
        net.train()
        results.append((losses, [p.detach() for p in net.parameters()], list(net.buffers())))
    for want, got in zip(*results):
        assert len(want) == len(got)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), (want, got)
    # The training steps' updates only (the eval forward counts a step of its own).
    assert int(model[0].norm.num_batches_tracked) == int(model[0].steps) - 1 == len(data)
