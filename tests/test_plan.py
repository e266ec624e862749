from leangraph.order import StepKind, parse_order
from leangraph.plan import build_plan, build_unordered_plan

ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]


def test_plan_expands_layers_and_tracks_lifetimes():
    layout, steps = parse_order(ORDER, num_callables=4, num_samples=12)
    plan = build_plan(layout, steps)
    assert [str(s) for s in plan.capture[:4]] == ["F c1 m0 l0", "F c1 m0 l1",
                                                  "F c2 m0 l0", "F c2 m0 l1"]
    backward = [str(s) for s in plan.capture if s.kind is StepKind.BACKWARD][:4]
    assert backward == ["B c2 m0 l1", "B c2 m0 l0", "B c1 m0 l1", "B c1 m0 l0"]
    assert plan.warmup == plan.capture
    # At most two microbatches of each chunk in flight: 2 chunks x 2 layers x 2.
    assert plan.max_live(plan.capture) == 8
    assert plan.live_after(plan.capture)[-1] == frozenset()
    for step in plan.capture:
        assert step.born == ((step.graph,) if step.kind is StepKind.FORWARD else ())
        assert step.dies == ((step.graph,) if step.kind is StepKind.BACKWARD else ())


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


def test_max_live_per_chunk_counts_each_chunks_graphs_at_its_own_peak():
    # Chunk 1 (two layers) peaks at 2 microbatches while chunk 2 is idle, then chunk 2 (one
    # layer) at 2 while chunk 1 is empty: per chunk 4 and 2 graphs, together never more than 4.
    order = [1, 1, -1, -1, 2, 2, -2, -2]
    layout, steps = parse_order(order, num_callables=3, num_samples=6, num_layers_per_chunk=[2, 1])
    plan = build_plan(layout, steps)
    assert plan.max_live_per_chunk(plan.capture) == (4, 2)
    assert plan.max_live(plan.capture) == 4
    assert plan.max_live_per_chunk(plan.capture[:1]) == (1, 0)
    assert plan.max_live_per_chunk(()) == (0, 0)
