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


@pytest.mark.parametrize(
    ("method", "args", "message"),
    [
        # Each of these named another graph's valid position before (chunk 0 read the last
        # chunk's size; a microbatch or layer past its end ran into the next one).
        ("graph_index", (0, 0, 0), r"Layout.graph_index: chunk must be in \[1, 2\] \(chunk ids "
         r"are 1-based\), got 0"),
        ("graph_index", (3, 0, 0), r"chunk must be in \[1, 2\].*got 3"),
        ("graph_index", (1, 4, 0), r"Layout.graph_index: microbatch must be in \[0, 4\) "
         r"\(0-based\), got 4"),
        ("graph_index", (1, -1, 0), r"microbatch must be in \[0, 4\).*got -1"),
        ("graph_index", (1, 0, 2), r"Layout.graph_index: layer must be in \[0, 2\) \(0-based; "
         r"chunk 1 has 2 layer\(s\)\), got 2"),
        ("graph_index", (1.0, 0, 0), r"chunk must be in \[1, 2\].*got 1.0"),
        ("callable_index", (0, 0), r"Layout.callable_index: chunk must be in \[1, 2\]"),
        ("callable_index", (2, 3), r"Layout.callable_index: layer must be in \[0, 3\).*got 3"),
        # graph_id took 1.5 (GraphId(1, 0.0, 1.5)) and True; a str failed inside.
        ("graph_id", (1.5,), r"Layout.graph_id: graph index must be an int in \[0, 20\), got "
         r"float 1.5"),
        ("graph_id", (True,), r"graph index must be an int in \[0, 20\), got bool True"),
        ("graph_id", ("1",), r"graph index must be an int in \[0, 20\), got str '1'"),
        ("graph_id", (20,), r"graph index must be an int in \[0, 20\), got int 20"),
    ],
)
def test_v36_a_layout_index_outside_the_layout_is_refused(method, args, message):
    layout = Layout((2, 3), 4)
    with pytest.raises(IndexError, match=message):
        getattr(layout, method)(*args)


@pytest.mark.parametrize(
    ("chunks", "microbatches", "kind", "message"),
    [
        ((), 4, ValueError, r"Layout: layers_per_chunk must hold at least one chunk, each of at "
         r"least one layer, got \(\)"),
        ((2, 0), 4, ValueError, r"at least one layer, got \(2, 0\)"),
        ((2,), 0, ValueError, r"Layout: num_microbatches must be >= 1, got 0"),
        (2, 4, TypeError, r"Layout: layers_per_chunk must be a tuple of ints \(layers per "
         r"chunk\), got int 2"),
        ((2.0,), 4, TypeError, r"layers_per_chunk must be a tuple of ints.*got tuple \(2.0,\)"),
        ((2,), 4.0, TypeError, r"Layout: num_microbatches must be an int, got float 4.0"),
    ],
)
def test_v36_a_layout_no_order_can_have_is_refused(chunks, microbatches, kind, message):
    with pytest.raises(kind, match=message):
        Layout(chunks, microbatches)


def test_a_layout_given_a_list_holds_a_tuple_and_hashes():
    layout = Layout([2, 3], 4)
    assert layout.layers_per_chunk == (2, 3) and layout == Layout((2, 3), 4)
    numpy = pytest.importorskip("numpy")
    counted = Layout([numpy.int64(2), 3], numpy.int64(4))
    assert type(counted.num_microbatches) is int and repr(counted) == repr(layout)
    assert counted.graph_id(numpy.int64(5)) == layout.graph_id(5)
    assert hash(layout) == hash(Layout((2, 3), 4))
