"""``make_graphed_callables`` end to end (``leangraph.api``): torch's return forms, training
that equals eager autograd, and a failed call leaving nothing broken (docs/errors.md, W6, W7):
the original exception with a note naming phase and callable, every graph made so far reset,
RNG, ``.grad`` and training flags as they were (CPU backend)."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from helpers import NOTES, blocks, needs_notes, notes, sample
from models import Block, assert_histories_equal, train_both

import leangraph
from leangraph import GraphedCallable
from leangraph.backends import CpuBackend
from leangraph.order import parse_order

ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
MEGATRON_PP2_VP2_RANK0 = [1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1]
# Two chunks of one layer, two microbatches: graph (chunk c, microbatch m) is at 2 (c-1) + m.
TWO_CHUNKS = [1, 2, -2, -1, 1, 2, -2, -1]
mgc = leangraph.make_graphed_callables


@pytest.mark.parametrize(("order", "microbatches"), [(ORDER, 3), (MEGATRON_PP2_VP2_RANK0, 4)])
def test_ordered_training_matches_eager_exactly(order, microbatches):
    history, _ = train_both(order, [2, 2], width=8, microbatches=microbatches, steps=3)
    assert_histories_equal(history, exact=True)


def test_tuple_of_functions_and_kwargs():
    weight = torch.randn(3, 3, requires_grad=True)

    def scale(x, *, factor):
        return x * factor

    graphed = leangraph.make_graphed_callables(
        (scale,), ((torch.randn(3, requires_grad=True),),),
        sample_kwargs=({"factor": torch.tensor(2.0)},))
    assert isinstance(graphed, tuple) and isinstance(graphed[0], leangraph.GraphedCallable)
    x = torch.randn(3, requires_grad=True)
    out = graphed[0](x, factor=torch.tensor(3.0))
    out.sum().backward()
    assert torch.equal(out, x.detach() * 3) and torch.equal(x.grad, torch.full((3,), 3.0))
    with pytest.raises(TypeError, match=r"keyword arguments \['factor'\] as at capture, got \[\]"):
        graphed[0](x)
    del weight


@pytest.mark.parametrize("rank", [0, 1])
def test_looped_bfs_trains_exactly_through_an_explicit_order(rank):
    import torch.distributed.pipelining as pl

    from leangraph.schedules import from_pipelining

    # LoopedBFS runs backwards newest first: only an order that names microbatches says so.
    order = from_pipelining(pl.ScheduleLoopedBFS, 2, 4, rank, stages_per_rank=2, explicit=True)
    history, graphed = train_both(order, [2, 2], width=8, microbatches=4, steps=2)
    assert_histories_equal(history, exact=True)
    leangraph.reset_all(graphed)


class _Tap(torch.autograd.Function):
    """Identity whose backward reports to ``owner.on_backward`` (which may raise)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, owner: Faulty) -> torch.Tensor:
        ctx.owner = owner
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.owner.on_backward()
        return grad, None


class Faulty(torch.nn.Module):
    """A Block that raises ``error`` at its ``fail_at``-th forward (or backward) call.

    Every forward draws from the RNG of its input's device, and before raising it flips a
    submodule's training flag: the state a failed ``make_graphed_callables`` must put back.
    """

    def __init__(
        self,
        width: int = 4,
        *,
        fail_at: int = 0,
        in_backward: bool = False,
        error: type[BaseException] = ValueError,
    ) -> None:
        super().__init__()
        self.inner = Block(width)
        self.fail_at, self.in_backward, self.error = fail_at, in_backward, error
        self.forwards = self.backwards = 0
        self.raised: BaseException | None = None

    def _maybe_fail(self, count: int) -> None:
        if count == self.fail_at:
            self.inner.up.training = False
            self.raised = self.error(f"boom at call {count}")
            raise self.raised

    def on_backward(self) -> None:
        self.backwards += 1
        if self.in_backward:
            self._maybe_fail(self.backwards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        noise = torch.rand_like(x)  # the RNG of x's device
        if not self.in_backward:
            self._maybe_fail(self.forwards)
        return _Tap.apply(self.inner(x), self) + 0 * noise


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every graph pair the CPU backend makes while the test runs."""
    built: list[Any] = []
    new_pair = CpuBackend.new_pair

    def recording(self: CpuBackend) -> Any:
        pair = new_pair(self)
        built.append(pair)
        return pair

    monkeypatch.setattr(CpuBackend, "new_pair", recording)
    return built


def released(pair: Any) -> bool:
    """Whether a graph pair was reset: a reset pair refuses to replay."""
    try:
        pair.replay_forward()
    except RuntimeError as error:
        return "reset or never captured" in str(error)
    return False


def _failing_call(layers, *, order=None, samples=None):
    """Run a failing make_graphed_callables; return what it raised and the state checks."""
    params = [p for layer in layers for p in layer.parameters()]
    for p in params:
        p.grad = torch.full_like(p, 7.0)
    grads = [p.grad for p in params]
    training = [m.training for layer in layers for m in layer.modules()]
    samples = samples or tuple((sample(),) for _ in layers)
    rng = torch.get_rng_state()
    with pytest.raises(BaseException) as info:
        mgc(tuple(layers), samples, order=order, num_warmup_iters=2)
    assert torch.equal(torch.get_rng_state(), rng), "CPU RNG state not restored"
    assert [m.training for layer in layers for m in layer.modules()] == training
    assert all(p.grad is g for p, g in zip(params, grads)), ".grad replaced"
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in params), ".grad changed"
    assert not any(isinstance(layer.__dict__.get("forward"), GraphedCallable) for layer in layers)
    for p in params:
        p.grad = None
    return info.value


def _capture_order(order, count: int) -> list[tuple[str, int]]:
    """("F" | "B", graph) in the order the graphs must replay: the order's steps (one layer per
    chunk here), or without one, every forward then every backward in reverse."""
    if order is None:
        return [("F", g) for g in range(count)] + [("B", g) for g in reversed(range(count))]
    layout, steps = parse_order(order, num_callables=count // 2, num_samples=count)
    return [
        (step.kind.value, layout.graph_index(step.chunk, step.microbatch, 0)) for step in steps
    ]


def _works_again(layers, *, order=None, graphs: int | None = None):
    """Eager work and a new capture of the same modules succeed, equal to eager copies."""
    for layer in layers:
        layer.fail_at = 0
    reference = copy.deepcopy(layers)
    x = torch.randn(2, 4)
    for layer in layers:  # eager work on the very modules
        layer(x).sum().backward()
    for p in (p for layer in (*layers, *reference) for p in layer.parameters()):
        p.grad = None
    count = graphs or len(layers)
    graphed = mgc(tuple(layers), tuple((sample(),) for _ in range(count)), order=order)
    runs = {}
    for kind, index in _capture_order(order, count):
        which = index if order is None else index // 2
        if kind == "F":
            x = torch.randn(2, 4, requires_grad=True)
            x_ref = x.detach().clone().requires_grad_()
            torch.manual_seed(index)
            out = graphed[index](x)
            torch.manual_seed(index)
            ref = reference[which](x_ref)
            assert torch.equal(out, ref)
            runs[index] = (x, out, x_ref, ref)
        else:
            x, out, x_ref, ref = runs.pop(index)
            out.backward(torch.ones_like(out))
            ref.backward(torch.ones_like(ref))
            assert torch.equal(x.grad, x_ref.grad)
    leangraph.reset_all(graphed)


# (phase, in_backward, fail_at) with num_warmup_iters=2: the probe calls each callable's
# forward once before warm-up; each pass then calls its forward and backward once, so forward
# call 2 or 3 and backward call 1 or 2 are warm-up, forward call 4 and backward call 3 capture.
PHASES = {
    "the probe": ("the probe", False, 1),
    "warm-up forward": ("warm-up", False, 2),
    "warm-up backward": ("warm-up", True, 1),
    "capture forward": ("capture", False, 4),
    "capture backward": ("capture", True, 3),
}


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
@pytest.mark.parametrize("where", list(PHASES))
def test_w6_a_failing_callable_leaves_nothing_broken(where, error, made):
    phase, in_backward, fail_at = PHASES[where]
    torch.manual_seed(0)
    layers = [Faulty(), Faulty(fail_at=fail_at, in_backward=in_backward, error=error), Faulty()]
    raised = _failing_call(layers)
    assert raised is layers[1].raised and type(raised) is error  # the original, unchanged
    assert str(raised) == f"boom at call {fail_at}"
    if phase == "the probe":  # before any graph is made
        assert made == []
        where_pattern = "its one forward before warm-up"
    else:
        assert len(made) == 3 and all(released(p) for p in made), "graphs made so far not reset"
        where_pattern = rf".*\({'B' if in_backward else 'F'} c1 m0 l1\)"
    if NOTES:
        assert re.search(
            rf"leangraph: raised during {phase} of callable 1 \(Faulty\), at {where_pattern}",
            notes(raised),
        ), notes(raised)
    _works_again(layers)


@needs_notes
def test_w6_ordered_note_names_the_graph(made):
    torch.manual_seed(0)
    # Chunk 2's third forward: the probe's, then warm-up's of microbatch 0 in passes 0 and 1
    # (microbatch 1's sample has its layout: warm-up runs it in neither).
    layers = [Faulty(), Faulty(fail_at=3)]
    raised = _failing_call(layers, order=TWO_CHUNKS, samples=tuple((sample(),) for _ in range(4)))
    assert raised is layers[1].raised
    assert (
        "leangraph: raised during warm-up of graph (chunk 2, microbatch 0, layer 0), at "
        "warm-up pass 1"
    ) in notes(raised)
    assert len(made) == 4 and all(released(p) for p in made)
    _works_again(layers, order=TWO_CHUNKS, graphs=4)


class _FailsAtCall(torch.nn.Module):
    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            self.fail()
        return self.lin(x)

    def fail(self) -> None:
        raise KeyboardInterrupt("interrupted at capture")


def test_w6_a_failed_fused_capture_gives_back_a_grad_of_another_layout():
    """In-graph accumulation attaches a buffer of its own as ``.grad`` where the parameter's
    had another layout; a failed call puts the caller's tensor back."""
    layer = _FailsAtCall(fail_at=5)  # the probe, 3 warm-up passes, then capture
    transposed = torch.ones(4, 8).t()  # (8, 4), not contiguous
    layer.lin.weight.grad = transposed
    with pytest.raises(KeyboardInterrupt, match="interrupted at capture"):
        mgc(layer, (sample(),), fuse_grad_accumulation=True)
    assert layer.calls == 5 and "forward" not in layer.__dict__
    assert layer.lin.weight.grad is transposed and torch.equal(transposed, torch.ones(8, 4))
    layer.fail_at = 0
    graphed = mgc(layer, (sample(),), fuse_grad_accumulation=True)  # on success it stays
    assert layer.lin.weight.grad is not transposed
    assert torch.equal(layer.lin.weight.grad, torch.ones(8, 4))
    leangraph.reset_all(graphed)


class _LeaksModes(_FailsAtCall):
    """Switches grad mode and autocast off the context-manager way, then raises."""

    def fail(self) -> None:
        torch.set_grad_enabled(False)
        torch.set_autocast_enabled("cpu", True)
        torch.set_autocast_dtype("cpu", torch.float16)
        torch.set_autocast_cache_enabled(False)
        raise KeyboardInterrupt("interrupted")


@pytest.mark.parametrize("fail_at", [1, 2, 5])  # the probe, warm-up, capture
def test_w6_a_callable_that_leaves_grad_mode_or_autocast_switched_gets_them_put_back(fail_at):
    dtype = torch.get_autocast_dtype("cpu")
    layer = _LeaksModes(fail_at)
    try:
        with pytest.raises(KeyboardInterrupt, match="interrupted"):
            mgc(layer, (sample(),))
        assert layer.calls == fail_at
        assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == dtype and torch.is_autocast_cache_enabled()
    finally:
        torch.set_grad_enabled(True)
        torch.set_autocast_enabled("cpu", False)
        torch.set_autocast_dtype("cpu", dtype)
        torch.set_autocast_cache_enabled(True)
    layer.fail_at = 0
    leangraph.reset_all(mgc(layer, (sample(),)))  # and capture works again


def test_w6_success_leaves_grads_and_training_flags_alone():
    layers = blocks(2)
    for p in layers[0].parameters():
        p.grad = torch.ones_like(p)
    layers[1].up.eval()
    graphed = mgc(layers, ((sample(),), (sample(),)))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in layers[0].parameters())
    assert all(p.grad is None for p in layers[1].parameters())
    assert [m.training for m in layers[1].modules()] == [True, True, False, True]
    leangraph.reset_all(graphed)


@needs_notes
def test_w7_out_of_memory_passes_through_on_cpu():
    error = torch.OutOfMemoryError("fake")

    def hungry(x: torch.Tensor) -> torch.Tensor:
        raise error

    with pytest.raises(torch.OutOfMemoryError) as info:
        mgc((hungry,), ((sample(),),))
    assert info.value is error
    assert notes(info.value).startswith("leangraph: raised during the probe of callable 0 (")
    assert "memory_allocated" not in notes(info.value)  # allocator figures are CUDA's


def _capture(**kwargs):
    torch.manual_seed(0)
    layers = tuple(Block(8) for _ in range(4))
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(12))
    return leangraph.make_graphed_callables(layers, samples, order=ORDER, num_warmup_iters=2,
                                            **kwargs)


def test_capture_is_logged_on_the_leangraph_logger(caplog):
    with caplog.at_level("INFO", logger="leangraph"):
        _capture()
    assert any(r.name == "leangraph" and "captured 12 graphs on cpu" in r.getMessage()
               for r in caplog.records)


# ------------------------------------------------------------------------- return forms


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_single_function_comes_back_as_a_graphed_callable():
    graphed = mgc(double, (sample(),))
    assert isinstance(graphed, GraphedCallable) and graphed.graph_id is None
    x = sample()
    assert torch.equal(graphed(x), x.detach() * 2)


def test_a_single_module_comes_back_as_itself_with_a_graphed_forward():
    block = Block(4)
    graphed = mgc(block, (sample(),))
    assert graphed is block
    assert isinstance(block.__dict__["forward"], GraphedCallable)
    assert type(block).forward is Block.forward  # the class is untouched


def test_modules_without_an_order_come_back_as_themselves_functions_as_graphed_callables():
    layers = blocks(2)
    graphed = mgc((layers[0], double, layers[1]), ((sample(),),) * 3)
    assert type(graphed) is tuple and len(graphed) == 3
    assert graphed[0] is layers[0] and graphed[2] is layers[1]
    assert isinstance(graphed[1], GraphedCallable)
    assert [type(m.__dict__["forward"]) for m in layers] == [GraphedCallable] * 2


def test_with_an_order_every_graph_comes_back_and_modules_are_left_alone():
    layers = blocks(2)
    graphed = mgc(layers, tuple((sample(),) for _ in range(4)), order=TWO_CHUNKS)
    assert type(graphed) is tuple and len(graphed) == 4
    assert all(isinstance(g, GraphedCallable) for g in graphed)
    assert [g.label for g in graphed] == [
        "graph (chunk 1, microbatch 0, layer 0)", "graph (chunk 1, microbatch 1, layer 0)",
        "graph (chunk 2, microbatch 0, layer 0)", "graph (chunk 2, microbatch 1, layer 0)"]
    assert all("forward" not in layer.__dict__ for layer in layers)
    x = torch.randn(3, 2, 4)  # eager, any shape
    assert layers[0](x).shape == (3, 2, 4)


def test_a_single_module_in_a_tuple_comes_back_in_a_tuple():
    block = Block(4)
    graphed = mgc((block,), ((sample(),),))
    assert type(graphed) is tuple and len(graphed) == 1 and graphed[0] is block
