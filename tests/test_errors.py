"""Every misuse in docs/errors.md, one test per entry (CPU backend), and faults during warm-up
and capture: the exception propagates with a note naming phase and callable, and nothing is
left broken.

Each test checks the exception type and that the message names the callable (or argument
position), what was expected and what was got. Test names start with the entry's id.
"""

from __future__ import annotations

import copy
import pathlib
import pickle
import re
from typing import Any

import pytest
import torch

import leangraph
from leangraph import GraphedCallable, GraphResetError
from helpers import NOTES, blocks, graphed_blocks, needs_notes, notes, raises, sample
from leangraph.backends import CpuBackend
from models import Block

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "errors.md"

# Two chunks of one layer, two microbatches: graph (chunk c, microbatch m) is at 2 (c-1) + m.
ORDER = [1, 2, -2, -1, 1, 2, -2, -1]
mgc = leangraph.make_graphed_callables


# ------------------------------------------------------------------------- catalogue


def test_catalogue_entries_each_have_a_test():
    ids = re.findall(r"^\| ([A-Z]\d+) \|", DOCS.read_text(), flags=re.MULTILINE)
    assert len(ids) == len(set(ids)) and len(ids) >= 30, ids
    # Each entry's test lives in the test file of the module that raises it.
    here = pathlib.Path(__file__).resolve().parent
    sources = "".join(path.read_text() for path in sorted(here.glob("test_*.py")))
    missing = [i for i in ids if not re.search(rf"def test_{i.lower()}_", sources)]
    assert not missing, f"catalogue entries without a test: {missing}"


# ------------------------------------------------------------------------- validation


def test_v16_backend_choice():
    with raises(ValueError, "backend must be 'cuda', 'cpu' or None, got 'tpu'"):
        mgc(Block(4), (sample(),), backend="tpu")
    with raises(ValueError, "backend 'cpu' has no memory pool; pass pool=None"):
        mgc(Block(4), (sample(),), pool=(0, 1))
    meta = torch.nn.Linear(4, 4, device="meta")
    with raises(ValueError, "backend 'cpu' needs CPU sample tensors, got tensors on meta"):
        mgc(meta, (torch.randn(2, 4, device="meta"),))
    if not torch.cuda.is_available():
        with raises(RuntimeError, "backend 'cuda' needs a CUDA GPU"):
            mgc(Block(4), (sample(),), backend="cuda")


# ------------------------------------------------------------------------- warm-up / capture


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
    for index in range(count):
        which = index if order is None else index // 2
        x = torch.randn(2, 4, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        torch.manual_seed(index)
        out = graphed[index](x)
        torch.manual_seed(index)
        ref = reference[which](x_ref)
        assert torch.equal(out, ref)
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
    # Chunk 2's third forward: the probe's, then warm-up's of microbatches 0 and 1.
    layers = [Faulty(), Faulty(fail_at=3)]
    raised = _failing_call(layers, order=ORDER, samples=tuple((sample(),) for _ in range(4)))
    assert raised is layers[1].raised
    assert (
        "leangraph: raised during warm-up of graph (chunk 2, microbatch 1, layer 0), at "
        "warm-up pass 0"
    ) in notes(raised)
    assert len(made) == 4 and all(released(p) for p in made)
    _works_again(layers, order=ORDER, graphs=4)


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


# ------------------------------------------------------------------------- replay


class Gates(torch.nn.Module):
    """Two parameters of one shape: a gradient routed to the wrong one would not be noticed."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4))
        self.b = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + x * x * self.b


def test_r10_a_parameter_frozen_at_capture_must_stay_frozen():
    gates = Gates()
    gates.a.requires_grad_(False)
    graphed = mgc(gates, (sample(),))
    gates.a.requires_grad_(True)
    with raises(
        ValueError,
        "callable 0 (Gates) parameter 'a' must have requires_grad=False as at capture",
        "got requires_grad=True",
    ):
        graphed(sample())
    gates.a.requires_grad_(False)
    graphed(sample()).sum().backward()
    assert gates.a.grad is None and gates.b.grad is not None


def test_a_parameter_frozen_after_capture_gets_no_gradient_and_the_others_theirs():
    torch.manual_seed(0)
    gates = Gates()
    eager = copy.deepcopy(gates)
    graphed = mgc(gates, (sample(),))
    for module in (gates, eager):
        module.a.requires_grad_(False)
    x = sample()
    graphed(x).sum().backward()
    eager(x).sum().backward()
    assert gates.a.grad is None
    torch.testing.assert_close(gates.b.grad, eager.b.grad, rtol=0, atol=0)


def test_r9_chained_input_must_be_the_previous_layers_output():
    layers = blocks(2)
    graphed = mgc(layers, ((sample(),), (sample(),)), order=[1, -1], num_layers_per_chunk=2)
    hidden = graphed[0](sample())
    with raises(
        ValueError,
        "graph (chunk 1, microbatch 0, layer 1) input 0 is the output buffer "
        "of graph (chunk 1, microbatch 0, layer 0)",
        "pass that graph's output itself, got another tensor",
        "share_buffers=False",
    ):
        graphed[1](hidden.detach().clone().requires_grad_())
    graphed[1](hidden).sum().backward()  # the output itself is fine
    free = mgc(
        blocks(2),
        ((sample(),), (sample(),)),
        order=[1, -1],
        num_layers_per_chunk=2,
        share_buffers=False,
    )
    free[1](sample()).sum().backward()  # without sharing, anything matching goes


# ------------------------------------------------------------------------- lifecycle


def test_l1_calling_a_reset_callable():
    graphed = graphed_blocks()
    graphed[1].forward.reset()
    with raises(GraphResetError, "callable 1 (Block): cannot call", "was reset"):
        graphed[1](sample())
    graphed[1].eval()  # a reset module does not fall back to eager either
    with raises(GraphResetError, "callable 1 (Block): cannot call"):
        graphed[1](sample())
    leangraph.reset_all(graphed)
    with raises(GraphResetError, "callable 0 (Block): cannot call"):
        graphed[0](sample())
    assert issubclass(GraphResetError, RuntimeError)


def test_l2_backward_through_a_reset_callable():
    graphed = graphed_blocks()
    out = graphed[2](graphed[1](graphed[0](sample())))
    graphed[1].forward.reset()
    with raises(GraphResetError, "callable 1 (Block): cannot run a backward", "was reset"):
        out.sum().backward()


def test_l3_second_backward_through_one_forward_replay():
    graphed = graphed_blocks(1)[0]
    loss = graphed(sample()).sum()
    loss.backward(retain_graph=True)
    with raises(
        RuntimeError,
        "callable 0 (Block): second backward through forward replay",
        "retain_graph_in_backward=True",
    ):
        loss.backward()


def test_l3_retain_graph_in_backward_allows_it():
    layers = blocks(1)
    reference = copy.deepcopy(layers[0])
    graphed = mgc(layers, ((sample(),),), retain_graph_in_backward=True)[0]
    x = sample()
    x_ref = x.detach().clone().requires_grad_()
    loss, loss_ref = graphed(x).sum(), reference(x_ref).sum()
    for _ in range(2):
        loss.backward(retain_graph=True)
        loss_ref.backward(retain_graph=True)
    assert torch.equal(x.grad, x_ref.grad)


def test_l4_replay_while_outputs_await_backward():
    graphed = graphed_blocks(1)[0]
    first = graphed(sample())
    with raises(RuntimeError, "callable 0 (Block)", "still await their backward"):
        graphed(sample())
    first.sum().backward()  # the refused replay changed nothing: the first backward still works
    second = graphed(sample())  # after the backward, a replay is fine
    del second
    graphed(sample())  # and so it is once the outputs are gone


def test_l4_outputs_that_do_not_require_grad_are_exempt():
    graphed = graphed_blocks(1)[0]
    with torch.no_grad():
        first = graphed(sample())
        second = graphed(sample())
    assert not first.requires_grad and not second.requires_grad
    frozen = mgc(Block(4).requires_grad_(False), (sample(requires_grad=False),))
    first = frozen(sample(requires_grad=False))
    second = frozen(sample(requires_grad=False))
    del first, second


def test_l4_forward_while_only_a_derived_tensor_awaits_backward():
    graphed = graphed_blocks(1)[0]
    loss1 = graphed(sample()).sum()  # the output is gone; its autograd graph is not
    with raises(
        RuntimeError,
        "callable 0 (Block): forward replayed while the outputs of its "
        "previous replay (1) still await their backward",
    ):
        graphed(sample())
    loss1.backward()


def test_l5_backward_after_a_newer_replay():
    # Only reachable when retain_graph_in_backward lets replays overlap a pending backward.
    graphed = graphed_blocks(1, retain_graph_in_backward=True)[0]
    loss1 = graphed(sample()).sum()
    loss2 = graphed(sample()).sum()
    with raises(
        RuntimeError,
        "callable 0 (Block): backward of forward replay 1 requested",
        "replayed again since (replay 2)",
    ):
        loss1.backward()
    loss2.backward()


def test_l6_graphed_callables_cannot_be_copied_or_pickled():
    graphed = graphed_blocks(2)
    with raises(TypeError, "callable 1 (Block): a graphed callable cannot be copied or pickled"):
        copy.deepcopy(graphed[1])
    with raises(TypeError, "callable 0 (Block): a graphed callable cannot be copied or pickled"):
        pickle.dumps(graphed[0].forward)


