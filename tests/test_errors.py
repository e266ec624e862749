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


