"""Debug mode (``debug_outputs=True``, ``leangraph.runtime.guard``): graph outputs that refuse
to be read once their validity window ends (their backward, their weight step, their graph's
next forward replay, or its reset); tensors computed from them are the caller's own and stay
valid."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import sample
from models import Block

import leangraph
from leangraph.runtime.guard import GuardedOutput

mgc = leangraph.make_graphed_callables


def test_debug_mode_catches_a_read_of_a_reused_output():
    torch.manual_seed(0)
    layers = tuple(Block(8) for _ in range(2))
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(4))
    graphed = leangraph.make_graphed_callables(layers, samples, order=[1, -1, 1, -1],
                                               debug_outputs=True)
    x = torch.randn(4, 8, requires_grad=True)
    out = graphed[1](graphed[0](x))
    kept = out * 1  # a derived tensor is the caller's own and stays valid
    out.sum().backward()
    with pytest.raises(RuntimeError, match=r"an output of graph \(chunk 1, microbatch 0, layer 1\)"
                                           r" \(replay 1\) was read after the backward of"):
        out + 1
    assert torch.isfinite(kept).all()


def _guarded(**kwargs):
    torch.manual_seed(0)
    return mgc((Block(4),), ((sample(),),), debug_outputs=True, **kwargs)[0]


def _refused(tensor: torch.Tensor, *parts: str) -> None:
    """Every way of reading ``tensor`` raises, naming ``parts``."""
    for read in (lambda t: t + 1, lambda t: t.sum(), lambda t: t.clone(),
                 lambda t: torch.cat([t, t]), lambda t: torch.equal(t, t)):
        with pytest.raises(RuntimeError, match="was read after") as info:
            read(tensor)
        for part in parts:
            assert part in str(info.value), (part, str(info.value))


def test_tensors_over_an_outputs_memory_are_guarded_as_it_is():
    """``out.detach()`` kept for logging, a slice, a view, a split: each reads the graph's
    buffer, so each raises once the window ends, where a copy stays the caller's own."""
    graphed = _guarded()
    out = graphed(sample())
    aliases = {"detach": out.detach(), "slice": out[0], "view": out.view(-1),
               "transpose": out.t(), "split": out.split(1)[0], "data": out.data}
    copies = {"clone": out.clone(), "scaled": out * 2, "cat": torch.cat([out, out])}
    expected = out.detach().clone()
    assert all(isinstance(a, GuardedOutput) for a in aliases.values())
    assert not any(isinstance(c, GuardedOutput) for c in copies.values())
    assert torch.equal(aliases["detach"], expected)  # valid inside the window
    same = out.mul_(1)  # an in-place op gives the output itself back
    assert same is out
    out.sum().backward()
    for name, alias in aliases.items():
        with pytest.raises(RuntimeError, match="was read after the backward of"):
            alias + 1
    assert torch.equal(copies["clone"], expected)


def test_a_view_of_a_guarded_output_still_carries_the_gradient():
    torch.manual_seed(0)
    block = Block(4)
    eager = copy.deepcopy(block)
    graphed = mgc((block,), ((sample(),),), debug_outputs=True)[0]
    x = sample()
    graphed(x)[:, :2].sum().backward()
    eager(x)[:, :2].sum().backward()
    for p, q in zip(block.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_outputs_are_guarded_only_in_debug_mode_and_derived_tensors_never():
    torch.manual_seed(0)
    plain = mgc((Block(4),), ((sample(),),))[0](sample())
    assert type(plain) is torch.Tensor
    out = _guarded()(sample())
    assert isinstance(out, GuardedOutput)
    assert type(out * 1) is torch.Tensor and type(out.sum()) is torch.Tensor


def test_an_output_reads_normally_until_its_backward_then_refuses():
    graphed = _guarded()
    x = sample()
    out = graphed(x)
    derived = out * 2  # read within the window
    assert torch.equal(out + 1, out.detach() + 1)
    expected = derived.detach().clone()
    out.sum().backward()
    _refused(out, "an output of callable 0 (Block) (replay 1)", "the backward of callable 0 "
             "(Block) ran", "clone them to keep them longer")
    assert torch.equal(derived, expected)  # the caller's own tensor stays valid


def test_without_a_backward_the_window_ends_at_the_next_forward_replay():
    graphed = _guarded()
    with torch.no_grad():
        first = graphed(sample())
        kept = first + 0
        second = graphed(sample())
    _refused(first, "(replay 1)", "callable 0 (Block) was replayed again")
    assert torch.isfinite(second + 1).all()  # the newer replay's outputs are valid
    assert torch.isfinite(kept).all()


def test_a_reset_ends_the_window():
    graphed = _guarded()
    out = graphed(sample())
    graphed.forward.reset()
    _refused(out, "its callable was reset")


def test_an_in_place_write_into_a_guarded_output_trains_as_without_the_guard():
    """``y.mul_(2)`` on a layer's output, which eager takes (a linear layer's backward reads
    no output): the guarded output was a view (``as_subclass``), which autograd refuses to
    have written in place as a custom Function's output, so debug mode raised where the
    graphs without it train."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    eager = copy.deepcopy(layer)
    guarded = mgc(layer, (sample(),), debug_outputs=True)
    for _ in range(2):
        x = sample()
        for fn in (guarded, eager):
            out = fn(x.detach().clone().requires_grad_())
            out.mul_(2)
            out.sum().backward()
    assert torch.equal(layer.weight.grad, eager.weight.grad)
    out = guarded(sample())
    out.mul_(2).sum().backward()
    _refused(out, "the backward of callable 0 (Linear) ran")
    pair = mgc((lambda x: (x * 2, x * 3),), ((sample(),),), debug_outputs=True)[0]
    x = sample()
    first, second = pair(x)
    first.mul_(2)
    second.add_(1)
    (first + second).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 7.0))


def test_the_first_end_of_the_window_is_the_one_reported():
    graphed = _guarded()
    out = graphed(sample())
    out.sum().backward()
    graphed.forward.reset()
    _refused(out, "the backward of callable 0 (Block) ran")


def test_all_outputs_of_one_replay_share_its_window():
    def halves(x):
        return x * 2, (x * 3, x.detach())

    graphed = mgc((halves,), ((sample(),),), debug_outputs=True)[0]
    a, (b, frozen) = graphed(sample())
    assert all(isinstance(t, GuardedOutput) for t in (a, b, frozen))
    (a + b).sum().backward()
    for output in (a, b, frozen):
        _refused(output, "the backward of callable 0")


def test_with_a_split_backward_the_window_ends_at_the_weight_step():
    torch.manual_seed(0)
    graphed = mgc((Block(4),), ((sample(),),), order=[1, -1, -1.5], debug_outputs=True)[0]
    out = graphed(sample())
    out.sum().backward()
    assert torch.isfinite(out + 1).all()  # the weight step still reads the activations
    graphed.backward_dw()
    _refused(out, "graph (chunk 1, microbatch 0, layer 0) (replay 1)",
             "the weight step of graph (chunk 1, microbatch 0, layer 0) ran")
