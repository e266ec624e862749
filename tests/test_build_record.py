"""The build stage's hand-off (``leangraph.build.record``): one frozen :class:`GraphRecord` per
graph, saying what its replay needs and which static tensors it keeps allocated."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import build_stage, sample
from models import Block

from leangraph.build.record import ModuleBinding
from leangraph.order import GraphId


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_one_record_per_graph_in_graph_order():
    torch.manual_seed(0)
    _, built = build_stage((Block(4), Block(4)), tuple((sample(),) for _ in range(4)),
                           order=[1, 2, -2, -1, 1, 2, -2, -1])
    assert [r.index for r in built.records] == [0, 1, 2, 3]
    assert [r.label for r in built.records] == [
        "graph (chunk 1, microbatch 0, layer 0)", "graph (chunk 1, microbatch 1, layer 0)",
        "graph (chunk 2, microbatch 0, layer 0)", "graph (chunk 2, microbatch 1, layer 0)"]
    assert [r.graph_id for r in built.records] == [
        GraphId(1, 0, 0), GraphId(1, 1, 0), GraphId(2, 0, 0), GraphId(2, 1, 0)]
    assert built.capture.device == "cpu"


def test_records_are_frozen():
    _, built = build_stage(double, (sample(),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.records[0].released = False  # type: ignore[misc]


def test_outputs_that_need_no_gradient_get_no_seed_and_no_backward():
    def split(x):
        return x * 2, x.detach() * 3

    _, built = build_stage((split, lambda x: (x * 2).detach()), ((sample(),), (sample(),)))
    both, frozen = built.records
    assert both.output_requires_grad == (True, False) and both.has_backward
    assert both.static_grad_outputs[0] is not None and both.static_grad_outputs[1] is None
    assert len(both.static_grads) == 1  # the input's gradient
    assert frozen.output_requires_grad == (False,) and not frozen.has_backward
    assert frozen.static_grads == () and frozen.static_grad_outputs == (None,)


def test_trained_params_are_the_parameters_that_require_grad_in_their_order():
    block = Block(4)
    block.norm.weight.requires_grad_(False)
    _, built = build_stage(block, (sample(),))
    (record,) = built.records
    names = [name for name, _ in block.named_parameters()]
    assert list(record.param_names) == names
    assert record.param_trains == tuple(name != "norm.weight" for name in names)
    expected = [p for name, p in block.named_parameters() if name != "norm.weight"]
    assert len(record.trained_params()) == len(expected) == 5
    assert all(a is b for a, b in zip(record.trained_params(), expected))
    # A full backward: the input's gradient, then one per trained parameter.
    assert len(record.static_grads) == 1 + 5


def test_released_records_own_their_inputs_and_seeds_only():
    torch.manual_seed(0)
    x = sample()
    _, shared = build_stage((Block(4), Block(4)), ((x,), (sample(),)), order=[1, -1],
                            num_layers_per_chunk=2)
    first, chained = shared.records
    assert first.released and chained.released
    assert chained.chained_from == ("graph (chunk 1, microbatch 0, layer 0)",)
    assert first.chained_from == (None,)
    # The first layer's seed is the chained layer's input gradient buffer, which the chained
    # layer's backward writes: owned by neither once capture is done, copied by no replay.
    assert first.seed_from == "graph (chunk 1, microbatch 0, layer 1)"
    assert first.static_grad_outputs[0].data_ptr() == chained.static_grads[0].data_ptr()
    assert first.owned_tensors() == [first.static_inputs[0]]
    assert chained.seed_from is None
    assert chained.owned_tensors() == [chained.static_grad_outputs[0]]  # no input of its own


def test_records_kept_whole_without_sharing_own_everything():
    torch.manual_seed(0)
    _, kept = build_stage(Block(4), (sample(),), share_buffers=False)
    (record,) = kept.records
    assert not record.released
    owned = {id(t) for t in record.owned_tensors()}
    expected = [*record.static_inputs, *record.static_grad_outputs, *record.static_outputs,
                *record.static_grads]
    assert owned == {id(t) for t in expected} and len(owned) == 1 + 1 + 1 + 7


def test_a_module_binding_only_without_an_order():
    block = Block(4).eval()
    _, built = build_stage((block, double), ((sample(),), (sample(),)))
    binding, none = built.records[0].module, built.records[1].module
    assert isinstance(binding, ModuleBinding) and none is None
    assert binding.module() is block
    assert binding.eager_forward() == block.forward
    _, ordered = build_stage((Block(4),), ((sample(),),), order=[1, -1])
    assert ordered.records[0].module is None


def test_a_module_state_for_every_module_callable_with_or_without_an_order():
    block = Block(4).eval()
    block.up.train()
    _, built = build_stage((block, double), ((sample(),), (sample(),)))
    state, none = built.records[0].modules, built.records[1].modules
    assert none is None and state.root() is block
    assert [name for name, _ in state.submodules] == ["norm", "up", "down"]
    assert state.parents == (0, 0, 0) and state.local_names == ("norm", "up", "down")
    assert state.training == (False, False, True, False)
    _, ordered = build_stage((Block(4),), ((sample(),),), order=[1, -1])
    assert ordered.records[0].modules is not None


def test_split_backwards_keep_weight_gradients_apart():
    torch.manual_seed(0)
    _, built = build_stage((Block(4),), ((sample(),),), order=[1, -1, -1.5])
    (record,) = built.records
    assert record.split_backward
    assert len(record.static_grads) == 1  # the input-gradient graph: the input only
    assert len(record.static_weight_grads) == 6 and all(
        g is not None for g in record.static_weight_grads)
