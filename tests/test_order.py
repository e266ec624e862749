import pytest

from leangraph.order import GraphId, Layout, Step, StepKind, parse_order

ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]


def test_parse_valid_order():
    layout, steps = parse_order(ORDER, num_callables=4, num_samples=12)
    assert layout == Layout((2, 2), 3)
    assert [str(s) for s in steps[:6]] == ["F c1 m0", "F c2 m0", "F c1 m1", "F c2 m1",
                                           "B c2 m0", "B c1 m0"]
    assert steps[4].position == 4 and steps[4].kind is StepKind.BACKWARD


def test_layout_index_roundtrip_and_formula():
    layout = Layout((2, 3), 4)
    seen = set()
    for chunk, layers in enumerate(layout.layers_per_chunk, start=1):
        for m in range(4):
            for l in range(layers):
                index = layout.graph_index(chunk, m, l)
                prefix = 0 if chunk == 1 else 2
                assert index == prefix * 4 + m * layers + l
                assert layout.graph_id(index) == GraphId(chunk, m, l)
                seen.add(index)
    assert seen == set(range(layout.num_graphs)) and layout.num_graphs == 20


@pytest.mark.parametrize(
    ("order", "message"),
    [
        ([1, -1, -1], r"order\[2\] = -1: backward of chunk 1 with no outstanding forward"),
        ([1, 2.5, -1], r"order\[1\] = 2.5: entries must be non-zero integers"),
        ([1, 0, -1], r"order\[1\] = 0"),
        ([1, True], r"order\[1\] = True"),
        ([1, 3, -1, -3], r"order\[1\] = 3: unknown chunk 3"),
        ([1, 2, 1, -1, -2, -1], r"1 forwards of chunk 2 but 2 of chunk 1"),
        ([1, 2, -1], r"1 forwards but 0 backwards of chunk 2"),
        ([], "order is empty"),
        ("12", "order must be a list"),
    ],
)
def test_malformed_orders(order, message):
    with pytest.raises(ValueError, match=message):
        parse_order(order, num_callables=2, num_samples=4, num_layers_per_chunk=[1, 1])


def test_counts_must_match_sample_args():
    with pytest.raises(ValueError, match="sample_args has 11 entries but the order needs 12"):
        parse_order(ORDER, num_callables=4, num_samples=11)


def test_layers_per_chunk_checks():
    with pytest.raises(ValueError, match="cannot be split equally"):
        parse_order([1, 2, -2, -1], num_callables=3, num_samples=3)
    with pytest.raises(ValueError, match="sums to 4 layers but 3"):
        parse_order([1, 2, -2, -1], num_callables=3, num_samples=3, num_layers_per_chunk=2)
    layout, _ = parse_order([1, 2, -2, -1], num_callables=3, num_samples=3,
                            num_layers_per_chunk=[1, 2])
    assert layout.layers_per_chunk == (1, 2)


def _step(text):
    kind, chunk, microbatch = text.split()
    return Step(StepKind(kind), int(chunk[1:]), int(microbatch[1:]))


def test_explicit_steps_name_their_microbatches():
    order = [_step(t) for t in ("F c1 m0", "F c1 m1", "B c1 m1", "B c1 m0")]
    layout, steps = parse_order(order, num_callables=1, num_samples=2)
    assert layout == Layout((1,), 2)
    assert [(s.microbatch, s.position) for s in steps] == [(0, 0), (1, 1), (1, 2), (0, 3)]


@pytest.mark.parametrize(("texts", "message"), [
    (["F c1 m0", "B c1 m1"], r"order\[1\] = B c1 m1: its forward step has not run yet"),
    (["F c1 m0", "F c1 m0"], r"order\[1\] = F c1 m0: runs a second time"),
    (["F c1 m1", "B c1 m1"], r"chunk 1 runs microbatches \[1\]; they must be 0 .. M - 1"),
    (["F c1 m0", "B c1 m0", "W c1 m0", "W c1 m0"], r"order\[3\] = W c1 m0: runs a second time"),
])
def test_malformed_explicit_steps(texts, message):
    with pytest.raises(ValueError, match=message):
        parse_order([_step(t) for t in texts], num_callables=1, num_samples=1)


def test_orders_cannot_mix_chunk_ids_and_steps():
    with pytest.raises(ValueError, match=r"order\[1\]: an order is either all chunk ids or all"):
        parse_order([1, _step("B c1 m0")], num_callables=1, num_samples=1)
