"""The liveness plan (``leangraph.plan``): the order expanded into per-graph steps with births
and deaths, and the one fold of what is alive (``live_during``, ``live_after``, ``lifetimes``,
``max_live``, ``max_live_per_chunk``), checked against sequences worked out by hand."""

from leangraph.order import StepKind, parse_order
from leangraph.plan import build_plan, build_unordered_plan

ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
# Chunk 1 has two layers, chunk 2 one; two microbatches. Graphs: chunk 1's (m0 l0, m0 l1,
# m1 l0, m1 l1) are 0..3, chunk 2's (m0, m1) are 4 and 5; callables 0, 1 (chunk 1) and 2.
SMALL = [1, 1, 2, -2, -1, 2, -2, -1]
# Per step: (step, graph, callable, born, dies, position of its order entry).
SMALL_STEPS = [
    ("F c1 m0 l0", 0, 0, (0,), (), 0),
    ("F c1 m0 l1", 1, 1, (1,), (), 0),
    ("F c1 m1 l0", 2, 0, (2,), (), 1),
    ("F c1 m1 l1", 3, 1, (3,), (), 1),
    ("F c2 m0 l0", 4, 2, (4,), (), 2),
    ("B c2 m0 l0", 4, 2, (), (4,), 3),
    ("B c1 m0 l1", 1, 1, (), (1,), 4),
    ("B c1 m0 l0", 0, 0, (), (0,), 4),
    ("F c2 m1 l0", 5, 2, (5,), (), 5),
    ("B c2 m1 l0", 5, 2, (), (5,), 6),
    ("B c1 m1 l1", 3, 1, (), (3,), 7),
    ("B c1 m1 l0", 2, 0, (), (2,), 7),
]


def _plan(order, callables, samples, layers=None):
    layout, steps = parse_order(order, num_callables=callables, num_samples=samples,
                                num_layers_per_chunk=layers)
    return build_plan(layout, steps)


def _rows(steps):
    return [(str(s), s.graph, s.callable_index, s.born, s.dies, s.order_step.position)
            for s in steps]


def test_an_order_expands_into_layer_steps_with_births_and_deaths():
    plan = _plan(SMALL, 3, 6, [2, 1])
    assert plan.ordered and not plan.split_backward
    # Warm-up and capture both follow the order.
    assert _rows(plan.capture) == SMALL_STEPS
    assert _rows(plan.warmup) == SMALL_STEPS


def test_live_during_counts_a_steps_own_deaths_and_live_after_does_not():
    plan = _plan(SMALL, 3, 6, [2, 1])
    during = [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4},
              {0, 1, 2, 3}, {0, 2, 3}, {2, 3, 5}, {2, 3, 5}, {2, 3}, {2}]
    after = [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}, {0, 1, 2, 3},
             {0, 2, 3}, {2, 3}, {2, 3, 5}, {2, 3}, {2}, set()]
    assert plan.live_during(plan.capture) == [frozenset(s) for s in during]
    assert plan.live_after(plan.capture) == [frozenset(s) for s in after]
    keep_all = [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}] + [set(range(5))] * 4 + [set(range(6))] * 4
    assert plan.live_during(plan.capture, keep_all=True) == [frozenset(s) for s in keep_all]
    assert plan.max_live(plan.capture) == 5
    assert plan.max_live(plan.capture[:2]) == 2 and plan.max_live(()) == 0


def test_lifetimes_run_from_a_forward_to_its_last_backward_or_cover_the_forward_alone():
    plan = _plan(SMALL, 3, 6, [2, 1])
    assert plan.lifetimes([True] * 6) == ((0, 7), (1, 6), (2, 11), (3, 10), (4, 5), (8, 9))
    mixed = [True, True, True, True, False, False]  # chunk 2 has no backward
    assert plan.lifetimes(mixed) == ((0, 7), (1, 6), (2, 11), (3, 10), (4, 4), (8, 8))
    assert plan.lifetimes([False] * 6) == ((0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (8, 8))


def test_with_weight_steps_outputs_die_at_the_weight_step():
    plan = _plan([1, 1, -1, -1.5, -1, -1.5], 1, 2)
    assert plan.split_backward
    assert [(str(s), s.born, s.dies) for s in plan.capture] == [
        ("F c1 m0 l0", (0,), ()), ("F c1 m1 l0", (1,), ()), ("B c1 m0 l0", (), ()),
        ("W c1 m0 l0", (), (0,)), ("B c1 m1 l0", (), ()), ("W c1 m1 l0", (), (1,))]
    assert [s.is_backward for s in plan.capture] == [False, False, True, True, True, True]
    assert plan.live_after(plan.capture) == [frozenset(s) for s in
                                             ({0}, {0, 1}, {0, 1}, {1}, {1}, set())]
    assert plan.lifetimes([True, True]) == ((0, 3), (1, 5))
    assert plan.max_live(plan.capture) == 2


def test_plan_expands_layers_and_tracks_lifetimes():
    layout, steps = parse_order(ORDER, num_callables=4, num_samples=12)
    plan = build_plan(layout, steps)
    assert [str(s) for s in plan.capture[:4]] == ["F c1 m0 l0", "F c1 m0 l1",
                                                  "F c2 m0 l0", "F c2 m0 l1"]
    backward = [str(s) for s in plan.capture if s.kind is StepKind.BACKWARD][:4]
    assert backward == ["B c2 m0 l1", "B c2 m0 l0", "B c1 m0 l1", "B c1 m0 l0"]
    # At most two microbatches of each chunk in flight: 2 chunks x 2 layers x 2.
    assert plan.max_live(plan.capture) == 8
    assert plan.live_after(plan.capture)[-1] == frozenset()


def test_plan_is_flat_in_microbatches_for_1f1b_like_orders():
    def order(m):
        return [1] + [x for _ in range(m - 1) for x in (1, -1)] + [-1]

    lives = []
    for m in (2, 4, 8, 16):
        layout, steps = parse_order(order(m), num_callables=3, num_samples=3 * m)
        lives.append(build_plan(layout, steps).max_live(build_plan(layout, steps).capture))
    assert lives == [6, 6, 6, 6]


def test_unordered_plan_warms_up_per_callable_and_captures_like_torch():
    plan = build_unordered_plan(3)
    assert [str(s) for s in plan.warmup] == ["F c1 m0 l0", "B c1 m0 l0", "F c1 m0 l1",
                                             "B c1 m0 l1", "F c1 m0 l2", "B c1 m0 l2"]
    assert plan.max_live(plan.warmup) == 1
    assert [str(s) for s in plan.capture] == ["F c1 m0 l0", "F c1 m0 l1", "F c1 m0 l2",
                                              "B c1 m0 l2", "B c1 m0 l1", "B c1 m0 l0"]


def test_unordered_plan_lives_and_lifetimes():
    plan = build_unordered_plan(3)
    assert not plan.ordered and not plan.split_backward
    assert [(s.graph, s.callable_index, s.born, s.dies) for s in plan.warmup] == [
        (0, 0, (0,), ()), (0, 0, (), (0,)), (1, 1, (1,), ()), (1, 1, (), (1,)),
        (2, 2, (2,), ()), (2, 2, (), (2,))]
    assert plan.live_after(plan.capture) == [frozenset(s) for s in
                                             ({0}, {0, 1}, {0, 1, 2}, {0, 1}, {0}, set())]
    assert plan.max_live(plan.capture) == 3
    assert plan.lifetimes([True] * 3) == ((0, 5), (1, 4), (2, 3))
    assert [s.kind for s in plan.capture] == [StepKind.FORWARD] * 3 + [StepKind.BACKWARD] * 3


def test_max_live_per_chunk_counts_each_chunks_graphs_at_its_own_peak():
    # Chunk 1 (two layers) peaks at 2 microbatches while chunk 2 is idle, then chunk 2 (one
    # layer) at 2 while chunk 1 is empty: per chunk 4 and 2 graphs, together never more than 4.
    order = [1, 1, -1, -1, 2, 2, -2, -2]
    layout, steps = parse_order(order, num_callables=3, num_samples=6, num_layers_per_chunk=[2, 1])
    plan = build_plan(layout, steps)
    chunk_of = [plan.layout.graph_id(g).chunk for g in range(6)]
    assert plan.max_live_per_chunk(plan.capture) == tuple(
        max(sum(chunk_of[g] == c for g in live) for live in plan.live_after(plan.capture))
        for c in (1, 2)
    )
    assert plan.max_live(plan.capture) == 4
    assert plan.max_live_per_chunk(plan.capture[:1]) == (1, 0)
    assert plan.max_live_per_chunk(()) == (0, 0)


def test_warming_keeps_the_full_pass_s_steps_of_the_chosen_graphs_in_its_order():
    plan = _plan(SMALL, 3, 6, [2, 1])
    assert plan.warmup == plan.full_pass == plan.capture  # until warming says which
    warm = plan.warming({0, 1, 4})  # microbatch 0 of each layer
    assert _rows(warm.warmup) == [row for row in SMALL_STEPS if row[1] in (0, 1, 4)]
    assert warm.full_pass == plan.full_pass and warm.capture == plan.capture
    assert warm.max_live(warm.warmup) == 3 and plan.max_live(plan.full_pass) == 5
    assert warm.warming(range(6)).warmup == plan.full_pass


def test_live_weights_sum_what_live_during_and_live_after_hold():
    plan = _plan(SMALL, 3, 6, [2, 1])
    weights = [3, 5, 7, 11, 13, 17]
    for keep_all in (False, True):
        during = plan.live_during(plan.capture, keep_all=keep_all)
        assert plan.live_weights(plan.capture, weights, keep_all=keep_all) == [
            sum(weights[g] for g in live) for live in during
        ]
    assert plan.live_weights(plan.capture, weights, after=True) == [
        sum(weights[g] for g in live) for live in plan.live_after(plan.capture)
    ]
    chunk_of = [plan.layout.graph_id(g).chunk for g in range(6)]
    assert plan.max_live_per_chunk(plan.capture) == tuple(
        max(sum(chunk_of[g] == c for g in live) for live in plan.live_after(plan.capture))
        for c in (1, 2)
    )
