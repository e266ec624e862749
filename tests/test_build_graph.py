"""One graph under construction (``leangraph.build.graph``): what warm-up and capture refuse
in the callable's outputs and gradients (docs/errors.md, W1, W2, W4, W5), with the note naming
the phase."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import needs_notes, notes, raises, sample
from models import Block

import leangraph

mgc = leangraph.make_graphed_callables


def unused_input(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@needs_notes
@pytest.mark.parametrize("warmup", [3, 0])
def test_w1_outputs_must_depend_on_inputs_that_require_grad(warmup):
    phase = "warm-up" if warmup else "capture"
    with raises(
        ValueError,
        "callable 0 (unused_input): outputs do not depend on input 1",
        "allow_unused_input=True",
    ) as info:
        mgc((unused_input,), ((sample(), sample()),), num_warmup_iters=warmup)
    assert f"raised during {phase} of callable 0 (unused_input)" in notes(info.value)
    graphed = mgc((unused_input,), ((sample(), sample()),), allow_unused_input=True)[0]
    x, y = sample(), sample()
    graphed(x, y).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0)) and y.grad is None


def test_w2_outputs_must_depend_on_parameters_that_require_grad():
    with raises(
        ValueError,
        "callable 1 (TwoHeads): outputs do not depend on parameter 'unused.weight', "
        "parameter 'unused.bias', which require grad",
    ):
        mgc((Block(4), TwoHeads()), ((sample(),), (sample(),)))
    module = mgc(TwoHeads(), (sample(),), allow_unused_input=True)
    module(sample()).sum().backward()
    assert module.unused.weight.grad is None and module.used.weight.grad is not None


def test_w4_outputs_must_keep_their_structure():
    calls = []

    def flip(x: torch.Tensor):
        calls.append(None)
        return (x * 2,) if len(calls) % 2 else [x * 2]

    with raises(
        RuntimeError,
        "callable 0 (test_w4_outputs_must_keep_their_structure.<locals>"
        ".flip): outputs changed structure between runs: the probe's forward returned "
        "(leaf,), this run [leaf]; a graph replays one output structure",
    ):
        mgc((flip,), ((sample(),),))


def test_w4_outputs_must_keep_which_of_them_are_one_tensor():
    """A replay returns one tensor where the probe's forward returned one twice (as eager
    does), so a callable that returns two tensors there in a later run is refused."""
    calls = []

    def sometimes_twice(x: torch.Tensor):
        calls.append(None)
        y = x * 2
        return (y, y) if len(calls) == 1 else (y, y * 1)

    with raises(
        RuntimeError,
        "callable 0 (test_w4_outputs_must_keep_which_of_them_are_one_tensor.<locals>"
        ".sometimes_twice): outputs changed which of them are the same tensor between runs: "
        "output 1 is output 0 then every output a tensor of its own; a graph replays one "
        "aliasing of its outputs",
    ):
        mgc((sometimes_twice,), ((sample(),),))


def test_w4_outputs_must_keep_which_of_them_view_another():
    """A replay returns a view where the probe's forward returned one (as eager does), so a
    callable that returns a tensor of its own there in a later run is refused."""
    calls = []

    def sometimes_a_view(x: torch.Tensor):
        calls.append(None)
        y = x * 2
        return (y, y[0]) if len(calls) == 1 else (y, y[0].clone())

    with raises(
        RuntimeError,
        "callable 0 (test_w4_outputs_must_keep_which_of_them_view_another.<locals>"
        ".sometimes_a_view): outputs changed which of them are views of another between runs: "
        "output 1 views output 0 then no output a view of another; a graph replays one "
        "aliasing of its outputs",
    ):
        mgc((sometimes_a_view,), ((sample(),),))


def test_w5_grad_only_through_closure_tensors():
    weight = torch.randn(4, requires_grad=True)
    with raises(
        ValueError,
        "callable 0 (test_w5_grad_only_through_closure_tensors.<locals>.<lambda>): outputs "
        "need the gradient of 1 tensor(s) that are neither inputs nor parameters of the "
        "callable (tensor of shape (4,) (torch.float32): a closure tensor",
        "pass it as an argument, or graph an nn.Module that registers it",
    ):
        mgc((lambda x: x * weight,), ((sample(requires_grad=False),),))


class _TiedHead(torch.nn.Module):
    """A head whose output projection is an embedding's weight it does not register."""

    def __init__(self, embedding: torch.nn.Embedding) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self._outside = [embedding]  # a list: not a submodule, so not its parameter

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h) @ self._outside[0].weight.t()


def test_w5_outside_tensors_are_refused_where_inputs_and_parameters_need_gradients_too():
    """With an input or a parameter that needs a gradient too, the graphs would capture and
    leave the outside tensor without one: refused by the probe, before any warm-up."""
    weight = torch.randn(4, 4, requires_grad=True)
    with raises(ValueError, "outputs need the gradient of 1 tensor(s)", "a closure tensor"):
        mgc(lambda x: x @ weight, (sample(),))
    embedding = torch.nn.Embedding(10, 4)
    head = _TiedHead(embedding)
    with raises(ValueError, "callable 0 (_TiedHead): outputs need the gradient of 1 "
                "tensor(s) that are neither inputs nor parameters of the callable "
                "(parameter of shape (10, 4) (torch.float32)"):
        mgc(head, (sample(),))
    assert not isinstance(head.__dict__.get("forward"), leangraph.GraphedCallable)
    # Registered, the tie is the module's own parameter: graphed, with eager's gradients.
    head.embedding = embedding
    eager = copy.deepcopy(head)
    eager._outside = [eager.embedding]
    mgc(head, (sample(),))
    x = sample()
    head(x).sum().backward()
    eager(x.detach().requires_grad_()).sum().backward()
    assert torch.equal(embedding.weight.grad, eager.embedding.weight.grad)
    leangraph.reset_all(head)


def test_outputs_must_keep_their_shape_between_runs():
    calls = []

    def grows(x: torch.Tensor) -> torch.Tensor:
        calls.append(None)
        return x.repeat(len(calls), 1) * 2  # (2, 4) in the probe, (4, 4) in warm-up

    with raises(
        RuntimeError,
        "callable 0 (test_outputs_must_keep_their_shape_between_runs.<locals>.grows): outputs "
        "changed shape, dtype, device, layout or requires_grad between runs: (2, 4) "
        "torch.float32 "
        "requires_grad then (4, 4) torch.float32 requires_grad",
        "outputs that do not depend on the data",
    ):
        mgc((grows,), ((sample(),),))


@needs_notes
def test_an_output_that_stops_being_a_tensor_is_refused_in_warm_up():
    calls = []

    def drifts(x: torch.Tensor):
        calls.append(None)
        return (x * 2, x * 3 if len(calls) == 1 else 3)  # a tensor in the probe only

    with raises(
        RuntimeError,
        "callable 0 (test_an_output_that_stops_being_a_tensor_is_refused_in_warm_up.<locals>"
        ".drifts): outputs changed their constants or which leaves are tensors between runs: "
        "[<tensor>, <tensor>] then [<tensor>, 3]",
    ) as info:
        mgc((drifts,), ((sample(),),))
    assert "raised during warm-up of callable 0" in notes(info.value)
