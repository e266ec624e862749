"""The build stage (``leangraph.build.builder``): what each graph is built from, which graphs
train shared parameters, and a failed build releasing every graph it made."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from helpers import build_stage, sample
from models import Block

import leangraph
from leangraph._call import CaptureOptions, validate_call
from leangraph.backends import CpuBackend
from leangraph.build.builder import graph_sources, parameter_sharing
from leangraph.hooks import normalize_hooks
from leangraph.order import GraphId
from leangraph.probe import probe


def _sources(callables, sample_args, *, order=None, share_buffers=True):
    call = validate_call(callables, sample_args, None, order, None)
    options = CaptureOptions(
        num_warmup_iters=1, allow_unused_input=False, retain_graph_in_backward=False,
        share_buffers=share_buffers, debug_outputs=False, check_memory=False,
    )
    return graph_sources(call, probe(call), normalize_hooks(None, call.callables), options)


def _sharing(callables, sample_args, order=None):
    call = validate_call(callables, sample_args, None, order, None)
    return [(s.peers, s.shared_param_ids) for s in parameter_sharing(call, probe(call))]


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_sources_hold_detached_samples_keeping_requires_grad():
    x = sample()
    hidden = x * 1  # not a leaf
    (source,) = _sources(double, (hidden,))
    (static,) = source.samples
    assert static.grad_fn is None and static.requires_grad
    assert static.data_ptr() == hidden.data_ptr()  # the sample's memory, not a copy
    (frozen,) = _sources(double, (sample(requires_grad=False),))
    assert not frozen.samples[0].requires_grad


def test_a_sample_given_to_two_graphs_is_copied_only_where_samples_are_the_static_inputs():
    x = sample()
    shared = _sources((Block(4), Block(4)), ((x,), (x,)))
    assert [s.samples[0].data_ptr() for s in shared] == [x.data_ptr()] * 2
    private = _sources((Block(4), Block(4)), ((x,), (x,)), share_buffers=False)
    assert private[0].samples[0].data_ptr() == x.data_ptr()
    assert private[1].samples[0].data_ptr() != x.data_ptr()
    assert torch.equal(private[1].samples[0], x.detach())


class Shifted(torch.nn.Module):
    """A layer that takes part of its own state as an argument (a positional table)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("table", torch.randn(4, 4))

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + shift


def test_without_sharing_a_sample_is_copied_where_a_replay_would_overwrite_memory():
    """Samples become the static inputs without sharing; one that overlaps another kept
    sample, a parameter or buffer, or itself gets a buffer of its own (of its layout), and
    the others stay the samples themselves."""
    base = torch.randn(4, 6)
    layer = Shifted()
    first, second = _sources(
        (layer,),
        ((base[:, 0:4], layer.table), (base[:, 2:6], layer.lin.weight.t())),
        order=[1, 1, -1, -1],
        share_buffers=False,
    )
    window, table = first.samples
    assert window.data_ptr() == base.data_ptr()  # the first user of that memory keeps it
    overlapping, weight = second.samples
    for copied, sample_tensor in ((table, layer.table), (overlapping, base[:, 2:6]),
                                  (weight, layer.lin.weight.t())):
        assert copied.untyped_storage().data_ptr() != sample_tensor.untyped_storage().data_ptr()
        assert torch.equal(copied, sample_tensor.detach())
    # A transposed sample keeps its dense layout; a window's gaps are not kept.
    assert weight.stride() == (1, 4) and overlapping.is_contiguous()
    disjoint = _sources((double, double), ((base[0],), (base[1],)), share_buffers=False)
    assert [s.samples[0].data_ptr() for s in disjoint] == [base[0].data_ptr(), base[1].data_ptr()]
    (expanded,) = _sources(double, (torch.zeros(1, 4).expand(3, 4),), share_buffers=False)
    assert expanded.samples[0].stride() == (4, 1)


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2 + y * 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_without_sharing_overlapping_samples_replay_as_eager(device):
    """Views of one tensor as two arguments (the second copy overwrote the first), windows of
    one tensor as two layers' samples (a wrong weight gradient), a slice of a parameter
    (every replay overwrote it) and an expanded sample (every replay failed inside copy_)."""
    torch.manual_seed(0)
    base = torch.randn(4, 4, device=device)
    graphed_add = leangraph.make_graphed_callables(
        add, (base.view(4, 4).requires_grad_(), base.view(4, 4).requires_grad_()),
        share_buffers=False)
    x, y = torch.randn(4, 4, device=device), torch.randn(4, 4, device=device)
    assert torch.equal(graphed_add(x, y), add(x, y))

    layers = [torch.nn.Linear(64, 64).to(device) for _ in range(2)]
    eager = copy.deepcopy(layers)
    seq = torch.randn(16, 96, device=device)
    graphed = leangraph.make_graphed_callables(
        tuple(layers), ((seq[:, 0:64],), (seq[:, 32:96],)), share_buffers=False)
    # In the layouts the graphs hold (on CUDA a GEMM's rounding follows its input's layout):
    # graph 0 keeps its strided sample, graph 1 a contiguous copy of the overlapping one.
    a, b = torch.randn(16, 96, device=device)[:, 0:64], torch.randn(16, 64, device=device)
    # Square: a plain sum's gradient is an expanded tensor, which eager's GEMM reads in
    # another kernel than the graph's dense seed (equal values, rounding off in the last bit).
    (graphed[0](a).square().sum() + graphed[1](b).square().sum()).backward()
    (eager[0](a).square().sum() + eager[1](b).square().sum()).backward()
    for mine, theirs in zip(layers, eager):
        assert torch.equal(mine.weight.grad, theirs.weight.grad)
        assert torch.equal(mine.bias.grad, theirs.bias.grad)

    owner = torch.nn.Linear(2, 2).to(device)  # not graphed: its weight is only a sample's base
    before = owner.weight.detach().clone()
    graphed_add = leangraph.make_graphed_callables(
        add, (torch.randn(2, 2, device=device, requires_grad=True), owner.weight[0:2]),
        share_buffers=False)
    zeros = torch.zeros(2, 2, device=device)
    assert torch.equal(graphed_add(x[:2, :2], zeros), add(x[:2, :2], zeros))
    assert torch.equal(owner.weight.detach(), before)

    lin = torch.nn.Linear(4, 4).to(device)
    reference = copy.deepcopy(lin)
    leangraph.make_graphed_callables(
        lin, (torch.zeros(1, 4, device=device).expand(3, 4).requires_grad_(),),
        share_buffers=False)
    h = torch.randn(3, 4, device=device)
    assert torch.equal(lin(h), reference(h))


def test_sources_run_a_modules_forward_and_name_the_graph():
    block = Block(4)
    module, function = _sources((block, double), ((sample(),), (sample(),)))
    assert module.fn == block.forward and function.fn is double
    assert (module.label, module.graph_id) == ("callable 0 (Block)", None)
    assert [n for n in module.param_names] == [n for n, _ in block.named_parameters()]
    assert function.params == () and function.param_names == ()
    ordered = _sources((Block(4),), ((sample(),), (sample(),)), order=[1, 1, -1, -1])
    assert [s.graph_id for s in ordered] == [GraphId(1, 0, 0), GraphId(1, 1, 0)]
    assert [s.module for s in ordered] == [None, None]


def test_a_layers_microbatches_train_its_parameters_together():
    block = Block(4)
    ids = frozenset(id(p) for p in block.parameters())
    sharing = _sharing((block,), tuple((sample(),) for _ in range(3)), order=[1, 1, 1, -1, -1, -1])
    assert sharing == [((1, 2), ids), ((0, 2), ids), ((0, 1), ids)]


def test_tied_weights_make_graphs_peers_and_frozen_or_missing_parameters_do_not():
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    second.weight = first.weight
    tied = _sharing((first, second, double), ((sample(),),) * 3)
    weight = frozenset({id(first.weight)})
    assert tied == [((1,), weight), ((0,), weight), ((), frozenset())]
    first.weight.requires_grad_(False)  # frozen: no graph trains it, so nothing is shared
    assert _sharing((first, second, double), ((sample(),),) * 3) == [((), frozenset())] * 3


class Recording(CpuBackend):
    """The CPU backend, keeping every graph pair it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[Any] = []

    def new_pair(self) -> Any:
        pair = super().new_pair()
        self.pairs.append(pair)
        return pair


class FailsAt(torch.nn.Module):
    """``x * w`` that raises at its ``fail_at``-th forward (1-based)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.fail_at, self.calls = fail_at, 0
        self.error = ValueError("boom")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return x * self.weight


@pytest.mark.parametrize("fail_at", [2, 3], ids=["warm-up", "capture"])
def test_a_failed_build_releases_every_graph_it_made(fail_at):
    # The probe is forward 1 of the failing callable, warm-up forward 2, capture forward 3.
    backend = Recording()
    failing = FailsAt(fail_at)
    with pytest.raises(ValueError) as info:  # the last graph, so the others are captured first
        build_stage((Block(4), Block(4), failing), ((sample(),),) * 3, backend=backend)
    assert info.value is failing.error
    assert len(backend.pairs) == 3
    for pair in backend.pairs:
        with pytest.raises(RuntimeError, match="reset or never captured"):
            pair.replay_forward()


def test_a_build_hands_on_the_calls_capture_record():
    _, built = build_stage((Block(4), double), ((sample(),), (sample(),)), num_warmup_iters=2)
    record = built.capture
    # The first warm-up pass (later passes repeat it), then capture: F, B of each callable.
    assert [(p.phase, p.step) for p in record.timeline] == [
        ("warm-up", "F c1 m0 l0"), ("warm-up", "B c1 m0 l0"), ("warm-up", "F c1 m0 l1"),
        ("warm-up", "B c1 m0 l1"), ("capture", "F c1 m0 l0"), ("capture", "F c1 m0 l1"),
        ("capture", "B c1 m0 l1"), ("capture", "B c1 m0 l0")]
    assert record.device == "cpu" and record.warmup_seconds >= 0 and record.capture_seconds >= 0


class _Counting(torch.nn.Module):
    """A step counter kept by assignment: a new tensor at every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return self.lin(x)


@pytest.mark.parametrize("order", [None, [1, -1]])
def test_w13_a_forward_that_assigns_its_buffer_anew_is_refused_before_capture(order):
    # Refused only at the first replay before (R23), the module keeping the count warm-up
    # and capture had left bound (5 for 0): its eval-mode eager fallback went on from there.
    module = _Counting()
    count = module.count
    callables, samples = (module, (sample(),)) if order is None else ((module,), ((sample(),),))
    label = "callable 0 (_Counting)" if order is None else "graph (chunk 1, microbatch 0, layer 0)"
    with pytest.raises(ValueError, match=re.escape(
        f"{label}: its forward assigns a new tensor to buffer 'count' at every call (seen in "
        "warm-up); a replay runs only the captured kernels, so the buffer would never change, "
        "where eager's forward replaces it. Expected a forward that updates its buffers in "
        "place"
    )):
        leangraph.make_graphed_callables(callables, samples, order=order)
    assert module.count is count and float(count) == 0.0  # the caller's tensor, as it was
    assert "forward" not in module.__dict__


def test_a_buffer_made_lazily_at_the_first_forward_is_graphed():
    class LazyCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("cache", None)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.cache is None:  # made once (at the probe), then read
                self.cache = torch.full((4,), 2.0)
            return self.lin(x) * self.cache

    module = LazyCache()
    eager = copy.deepcopy(module)
    leangraph.make_graphed_callables(module, (sample(),))
    x = sample()
    assert torch.equal(module(x), eager(x))
    leangraph.reset_all(module)
