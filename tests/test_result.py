"""The result of one call (``leangraph.result``): its :class:`GraphedSet` from every form
``make_graphed_callables`` returns, torch's return forms back, ``reset_all`` and
``memory_report`` of a result, a subset or the set (CPU backend)."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from helpers import graphed_blocks, raises, sample
from models import Block

import leangraph
from leangraph import GraphedCallable, GraphedSet

mgc = leangraph.make_graphed_callables


def test_l7_reset_all_on_something_else():
    graphed = graphed_blocks(1)
    with raises(TypeError, "reset_all: entry 1 is a Linear, expected a GraphedCallable"):
        leangraph.reset_all([graphed[0], torch.nn.Linear(2, 2)])
    with raises(TypeError, "reset_all: entry 0 is a int"):
        leangraph.reset_all(3)


def test_l7_reset_all_walks_nested_results_of_several_calls_and_checks_every_entry_first():
    first, second = graphed_blocks(2), graphed_blocks(2)
    third = mgc((double, triple), ((sample(),), (sample(),)))
    with raises(TypeError, "reset_all: entry 1[1][0] is a Linear, expected a GraphedCallable"):
        leangraph.reset_all([first, [second[0], (torch.nn.Linear(2, 2),)]])
    members = [m.forward for m in (*first, *second)] + list(third)
    assert not any(m.is_reset for m in members)  # nothing was reset before the refusal
    leangraph.reset_all([first, [second[0], (second[1],)], GraphedSet.of(third[0])])
    assert all(m.is_reset for m in members)


def test_memory_report_rejects_foreign_objects():
    with pytest.raises(TypeError, match="entry 0 .* is not a result of"):
        leangraph.memory_report(torch.nn.Linear(2, 2))


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _forms():
    """Every return form, with what the set must hand back and its graphed callables."""
    torch.manual_seed(0)
    function = mgc(double, (sample(),))
    module = mgc(Block(4), (sample(),))
    functions = mgc((double, triple), ((sample(),), (sample(),)))
    modules = mgc((Block(4), Block(4)), ((sample(),), (sample(),)))
    ordered = mgc((Block(4),), ((sample(),), (sample(),)), order=[1, -1, 1, -1])
    return {
        "function": (function, [function]),
        "module": (module, [module.forward]),
        "functions": (functions, list(functions)),
        "modules": (modules, [m.forward for m in modules]),
        "ordered": (ordered, list(ordered)),
    }


def test_every_return_form_leads_to_its_set_and_back():
    forms = _forms()
    assert isinstance(forms["function"][0], GraphedCallable)
    assert isinstance(forms["module"][0], Block)
    sets = []
    for name, (result, members) in forms.items():
        graphed_set = GraphedSet.of(result)
        sets.append(graphed_set)
        returned = graphed_set.returned()
        if isinstance(result, tuple):
            assert type(returned) is tuple and len(returned) == len(result), name
            assert all(a is b for a, b in zip(returned, result)), name
        else:
            assert returned is result, name
        assert list(graphed_set.callables) == members, name
        # Any part of a result, and the set itself, lead to the same set.
        for part in [graphed_set, *members, *(result if isinstance(result, tuple) else ())]:
            assert GraphedSet.of(part) is graphed_set, (name, part)
        assert GraphedSet.of(list(members)) is graphed_set, name
    assert len({id(s) for s in sets}) == len(sets)  # one set per call


def test_the_set_knows_its_callables_without_keeping_them_alive():
    first, second = mgc((double, triple), ((sample(),), (sample(),)))
    graphed_set = GraphedSet.of(first)
    assert graphed_set.callables == (first, second)
    assert repr(graphed_set) == "<GraphedSet of 2 graphed callables on cpu>"
    del second
    gc.collect()
    assert graphed_set.callables == (first,)
    with raises(RuntimeError, "the result of this call was dropped; nothing kept it alive"):
        graphed_set.returned()


def test_the_set_holds_the_record_and_pool_of_its_call():
    events = []
    graphed = mgc((double,), ((sample(),),), progress=events.append, num_warmup_iters=1)
    graphed_set = GraphedSet.of(graphed)
    record = graphed_set.record
    assert record.device == "cpu" and graphed_set.pool is None and record.pool is None
    assert [(p.phase, p.step) for p in record.timeline] == [(e.phase, str(e.step)) for e in events]
    assert leangraph.memory_report(graphed).record is record


def test_a_set_adopts_its_callables_once():
    graphed_set = GraphedSet.of(mgc(double, (sample(),)))
    with raises(RuntimeError, "a GraphedSet adopts its callables once"):
        graphed_set.adopt([], [])


def test_reset_all_of_a_subset_resets_that_subset_and_the_sets_reset_every_callable():
    graphed = graphed_blocks(3)
    leangraph.reset_all((graphed[1],))
    assert [m.forward.is_reset for m in graphed] == [False, True, False]
    leangraph.reset_all(graphed[2].forward)  # a graphed callable alone
    assert [m.forward.is_reset for m in graphed] == [False, True, True]
    graphed_set = GraphedSet.of(graphed[0])
    graphed_set.reset()
    assert [m.forward.is_reset for m in graphed] == [True, True, True]
    graphed_set.reset()  # idempotent
    leangraph.reset_all(graphed_set)
    fresh = graphed_blocks(3)
    GraphedSet.of(fresh[2]).reset()  # the whole call, through any of its parts
    assert [m.forward.is_reset for m in fresh] == [True, True, True]


def test_reset_all_of_the_set_resets_every_callable_of_the_call():
    graphed = mgc((double, triple), ((sample(),), (sample(),)))
    leangraph.reset_all(GraphedSet.of(graphed[1]))
    assert [g.is_reset for g in graphed] == [True, True]


def test_memory_report_through_the_set_a_result_or_a_subset():
    # One layer, two microbatches, one at a time: both graphs use the one input slot and the
    # one gradient seed (2 x 4 floats each).
    torch.manual_seed(0)
    graphed = mgc((Block(4),), ((sample(),), (sample(),)), order=[1, -1, 1, -1])
    per_buffer = 2 * 4 * 4
    for report in (leangraph.memory_report(graphed), GraphedSet.of(graphed).memory_report(),
                   leangraph.memory_report(GraphedSet.of(graphed))):
        assert [c.label for c in report.callables] == [
            "graph (chunk 1, microbatch 0, layer 0)", "graph (chunk 1, microbatch 1, layer 0)"]
        assert [c.static_bytes for c in report.callables] == [2 * per_buffer] * 2
        assert report.static_bytes == 2 * per_buffer  # shared storage counted once
        assert report.pool_reserved_bytes is None and report.pool_allocated_bytes is None
    subset = leangraph.memory_report((graphed[1],))
    assert [c.label for c in subset.callables] == ["graph (chunk 1, microbatch 1, layer 0)"]
    graphed[0].reset()
    report = leangraph.memory_report(graphed)
    assert [(c.static_bytes, c.is_reset) for c in report.callables] == [
        (0, True), (2 * per_buffer, False)]
    assert report.static_bytes == 2 * per_buffer


def test_memory_report_counts_buffers_held_in_flight_apart():
    # Both microbatches in flight: two input slots, still one gradient seed.
    torch.manual_seed(0)
    graphed = mgc((Block(4),), ((sample(),), (sample(),)), order=[1, 1, -1, -1])
    report = leangraph.memory_report(graphed)
    per_buffer = 2 * 4 * 4
    assert [c.static_bytes for c in report.callables] == [2 * per_buffer] * 2
    assert report.static_bytes == 3 * per_buffer


def test_memory_report_counts_a_storage_shared_by_views_once():
    # Without sharing the samples are the static inputs: two views of one 64-byte storage.
    # Each callable also holds its own seed, output and input gradient (32 bytes each).
    base = torch.randn(2, 2, 4, requires_grad=True)
    graphed = mgc((double, triple), ((base[0],), (base[1],)), share_buffers=False)
    report = leangraph.memory_report(graphed)
    assert [c.static_bytes for c in report.callables] == [64 + 3 * 32] * 2
    assert report.static_bytes == 64 + 2 * 3 * 32


@pytest.mark.parametrize(
    ("entry", "name"),
    [
        (torch.nn.Linear(2, 2), "Linear"),  # a module leangraph never graphed
        (lambda x: x, "function"),
        ("forward", "str"),
    ],
)
def test_a_foreign_entry_is_refused_naming_the_caller_and_its_position(entry, name):
    graphed = mgc(double, (sample(),))
    for caller, call in (("GraphedSet.of", GraphedSet.of), ("reset_all", leangraph.reset_all),
                         ("memory_report", leangraph.memory_report)):
        with raises(TypeError, f"{caller}: entry 1 is a {name}, expected a GraphedCallable",
                    "not a result of leangraph.make_graphed_callables"):
            call((graphed, entry))
    assert not graphed.is_reset  # nothing was reset before the refusal


def test_a_module_whose_forward_is_not_leangraphs_is_refused():
    module = torch.nn.Linear(2, 2)
    module.forward = lambda x: x  # an instance forward, but not a graphed callable
    with raises(TypeError, "GraphedSet.of: entry 0 is a Linear"):
        GraphedSet.of(module)


def test_entries_of_two_calls_are_refused_by_the_set():
    first = mgc((double,), ((sample(),),))
    second = mgc((triple,), ((sample(),),))
    with raises(TypeError, "GraphedSet.of: the entries come from 2 make_graphed_callables calls"):
        GraphedSet.of((first[0], second[0]))


def test_memory_report_refuses_entries_of_two_calls():
    """A report has one capture record (timeline, peaks, pool): that of one call."""
    first = mgc((double,), ((sample(),),))
    second = mgc((triple,), ((sample(),),))
    with pytest.raises(TypeError, match="2 make_graphed_callables calls"):
        leangraph.memory_report((first[0], second[0]))


def test_a_list_of_results_is_refused_saying_to_pass_one_result():
    """memory_report and GraphedSet.of take one call's result; a list of results (what
    reset_all takes) names the entry that is a result of its own, not a tuple as if it were
    a foreign object."""
    first = mgc((double, triple), ((sample(),), (sample(),)))
    second = mgc((triple,), ((sample(),),))
    for caller, call in (("memory_report", leangraph.memory_report),
                         ("GraphedSet.of", GraphedSet.of)):
        with raises(TypeError, f"{caller}: entry 0 is a tuple, a result of its own; pass the "
                    "result of one make_graphed_callables call (or its GraphedSet)"):
            call([first, second])
        with raises(TypeError, f"{caller}: entry 1 is a GraphedSet"):
            call([first[0], GraphedSet.of(second)])
    assert leangraph.memory_report(first).callables[0].label == "callable 0 (double)"


def test_memory_report_of_an_empty_result_raises_a_type_error():
    """An empty tuple names no call to report on (``make_graphed_callables((), ())`` is refused,
    V19: no call returns one)."""
    with pytest.raises(TypeError):
        leangraph.memory_report(())


def test_l6_the_set_cannot_be_copied_or_pickled_either():
    """Like its callables: a copy would be a second owner of the call's record and pool (and
    pickling failed on a weak reference, naming nothing)."""
    graphed = graphed_blocks(2)
    graphed_set = graphed[0].forward.graphed_set
    for copier in (copy.copy, copy.deepcopy, pickle.dumps):
        with raises(TypeError, "<GraphedSet of 2 graphed callables on cpu>: a GraphedSet "
                    "cannot be copied or pickled", "by its state_dict()"):
            copier(graphed_set)
    leangraph.reset_all(graphed)
