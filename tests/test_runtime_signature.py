"""What a graphed callable accepts at replay (``leangraph.runtime.signature``): the captured
structure, tensors and constants, leaf by leaf, nothing broadcast, moved or cast; every
mismatch names the callable and the argument (docs/errors.md, R1-R8; R11 for constants; R16
for torch.func transforms)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import Doubling, Tagged, blocks, graphed_blocks, raises, sample, scale, three_graphs
from models import Block

import leangraph
from leangraph import GraphedCallable, GraphResetError

# Two chunks of one layer, two microbatches: graph (chunk c, microbatch m) is at 2 (c-1) + m.
ORDER = [1, 2, -2, -1, 1, 2, -2, -1]
mgc = leangraph.make_graphed_callables


def ordered_graphs() -> tuple[GraphedCallable, ...]:
    layers = blocks(2)
    return mgc(layers, tuple((sample(),) for _ in range(4)), order=ORDER)


def test_r1_positional_argument_count():
    graphed = graphed_blocks()
    x = sample()
    with raises(TypeError, "callable 0 (Block) takes 1 positional arguments as at capture, got 2"):
        graphed[0](x, x)
    with raises(TypeError, "callable 2 (Block) takes 1 positional arguments as at capture, got 0"):
        graphed[2]()


def test_r2_missing_or_extra_keyword_arguments():
    graphed = mgc((scale,), ((sample(),),), sample_kwargs=({"factor": torch.tensor(2.0)},))[0]
    x, factor = sample(), torch.tensor(3.0)
    with raises(
        TypeError, "callable 0 (scale) takes keyword arguments ['factor'] as at capture, got []"
    ):
        graphed(x)
    with raises(
        TypeError, "takes keyword arguments ['factor'] as at capture, got ['factor', 'offset']"
    ):
        graphed(x, factor=factor, offset=factor)
    with raises(TypeError, "takes keyword arguments ['factor'] as at capture, got ['scale']"):
        graphed(x, scale=factor)
    with raises(TypeError, "callable 0 (scale) takes 1 positional arguments as at capture, got 2"):
        graphed(x, factor)  # a keyword argument passed positionally
    assert torch.equal(graphed(x, factor=factor), x.detach() * 3)


@pytest.mark.parametrize(("value", "got"), [(None, "NoneType"), (1.0, "float"), (3, "int")])
def test_r3_non_tensor_where_a_tensor_was_captured(value, got):
    graphed = graphed_blocks()
    with raises(
        TypeError, "callable 1 (Block) input 0 must be a tensor as at capture", f"got {got}"
    ):
        graphed[1](value)


def test_r4_argument_structure():
    graphed = graphed_blocks()
    for value, got in (
        ([sample()], "a list of 1 leaf"),
        ((sample(), sample()), "a tuple of 2 leaves"),
        ({"x": sample()}, "a dict of 1 leaf"),
    ):
        with raises(
            TypeError,
            "callable 0 (Block) input 0 must keep its structure from capture (a tensor)",
            f"got {got}",
        ):
            graphed[0](value)


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float16, torch.bfloat16, torch.int16, torch.int64, torch.bool,
     torch.complex64],
)
def test_r5_dtype_must_be_the_captured_one(dtype):
    graphed = graphed_blocks()
    with raises(
        TypeError,
        f"callable 0 (Block) input 0 must keep dtype torch.float32 as at capture, got {dtype}",
        "make the samples in the dtype the callable receives",
    ):
        graphed[0](torch.ones(2, 4, dtype=dtype))


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x[index] * 1.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_r5_a_dtype_that_would_convert_exactly_is_refused_too(device):
    """Copied into the captured buffer, an fp16 input would be computed on in fp32 (eager
    returns fp16) and a bool mask where an int64 index was captured would index with 0 and 1
    (eager masks): either computes differently from eager, so neither replays."""
    x = torch.arange(4.0, device=device, requires_grad=True)
    graphed = mgc(gather, (x, torch.tensor([3, 2, 1, 0], device=device)))
    mask = torch.tensor([True, False, True, True], device=device)
    with raises(
        TypeError,
        "callable 0 (gather) input 1 must keep dtype torch.int64 as at capture, got torch.bool",
    ):
        graphed(x, mask)
    block = Block(4).to(device)
    graphed_block = mgc(block, (sample().to(device),))
    half = torch.randn(2, 4, device=device, dtype=torch.float16, requires_grad=True)
    with raises(TypeError, "input 0 must keep dtype torch.float32 as at capture, got "
                           "torch.float16"):
        graphed_block(half)
    # The refused calls left both graphs replayable with the captured dtypes.
    index = torch.tensor([0, 0, 2, 1], device=device)
    assert torch.equal(graphed(x, index), gather(x, index))
    assert graphed_block(half.detach().float()).dtype == torch.float32


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("share_buffers", [True, False])
@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR beta, nested prototype
def test_r25_an_argument_that_is_not_dense_is_refused_naming_it(device, share_buffers):
    """A sparse or mkldnn argument has the captured dtype, shape and device; its copy into
    the static input failed with torch's "Cannot access data pointer of Tensor that doesn't
    have storage", naming nothing. A nested one's sizes cannot even be compared."""
    torch.manual_seed(0)
    block = Block(4).to(device)
    reference = copy.deepcopy(block)
    graphed = mgc(block, (sample().to(device),), share_buffers=share_buffers)
    kwargs_graph = mgc(scale, (sample().to(device),),
                       sample_kwargs={"factor": torch.ones(2, 4, device=device)},
                       share_buffers=share_buffers)
    dense = torch.randn(2, 4, device=device)
    kinds = {
        "torch.sparse_coo tensor": dense.to_sparse(),
        "torch.sparse_csr tensor": dense.to_sparse_csr(),
        "nested tensor (torch.strided)": torch.nested.nested_tensor(list(dense)),
    }
    if device == "cpu" and torch.backends.mkldnn.is_available():
        kinds["torch._mkldnn tensor"] = dense.to_mkldnn()
    for named, value in kinds.items():
        with raises(TypeError, "callable 0 (Block) input 0 must be a dense (strided) tensor as "
                               f"at capture, got a {named}", "to_dense()"):
            graphed(value)
        with raises(TypeError, "callable 0 (scale) kwarg 'factor' must be a dense (strided) "
                               f"tensor as at capture, got a {named}"):
            kwargs_graph(dense, factor=value)
    # The refusals left nothing half done: the dense value replays as eager.
    assert torch.equal(graphed(dense), reference(dense))
    assert torch.equal(kwargs_graph(dense, factor=dense), dense * dense)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_r25_a_tensor_subclass_argument_is_refused_naming_it(device):
    """The replay would compute as for a plain tensor and return a plain one, where eager
    follows the subclass (a Doubling doubled the outputs, silently lost). An nn.Parameter
    computes as a plain tensor and replays like one."""
    torch.manual_seed(0)
    block = Block(4).to(device)
    reference = copy.deepcopy(block)
    graphed = mgc(block, (sample().to(device),))
    kwargs_graph = mgc(scale, (sample().to(device),),
                       sample_kwargs={"factor": torch.ones(2, 4, device=device)})
    dense = torch.randn(2, 4, device=device)
    for cls, how in ((Doubling, "overrides __torch_function__"),
                     (Tagged, "keeps its type through ops")):
        got = f"got a {cls.__qualname__} (a torch.Tensor subclass that {how})"
        with raises(TypeError, f"callable 0 (Block) input 0 must be a torch.Tensor as at "
                               f"capture, {got}", "as_subclass(torch.Tensor)"):
            graphed(dense.as_subclass(cls))
        with raises(TypeError, f"callable 0 (scale) kwarg 'factor' must be a torch.Tensor as at "
                               f"capture, {got}"):
            kwargs_graph(dense, factor=dense.as_subclass(cls))
    parameter = torch.nn.Parameter(dense.clone())
    out = graphed(parameter)
    assert type(out) is torch.Tensor and torch.equal(out, reference(dense))
    out.sum().backward()
    assert parameter.grad is not None


@pytest.mark.parametrize("shape", [(1, 4), (4,), (2, 1), (3, 4), (2, 4, 1), (1, 2, 4)])
def test_r6_shape_is_never_broadcast(shape):
    graphed = graphed_blocks()
    with raises(ValueError, "callable 0 (Block) input 0 must keep shape (2, 4)", f"got {shape}"):
        graphed[0](torch.randn(*shape, requires_grad=True))


def test_r6_other_strides_of_the_same_shape_are_copied():
    layers = blocks(1)
    reference = copy.deepcopy(layers[0])
    graphed = mgc(layers, ((sample(),),))[0]
    x = torch.randn(4, 2).t().requires_grad_()  # (2, 4), not contiguous
    assert torch.equal(graphed(x), reference(x))


def test_r7_device_is_never_moved():
    graphed = graphed_blocks()
    with raises(ValueError, "callable 0 (Block) input 0 must stay on cpu, got meta"):
        graphed[0](torch.randn(2, 4, device="meta", requires_grad=True))


def test_r8_requires_grad_may_differ_and_an_ungraded_input_is_named_once():
    torch.manual_seed(0)
    graphed = graphed_blocks(1)
    out = graphed[0](sample(requires_grad=False))  # its gradient is simply not asked for
    out.sum().backward()
    frozen = mgc(Block(4), (sample(requires_grad=False),))
    x = sample()
    with pytest.warns(UserWarning, match=r"callable 0 \(Block\) input 0 requires grad at "
                                         r"replay but did not at capture"):
        frozen(x).sum().backward()
    assert x.grad is None  # torch's drop-in behaves the same: the graph has no such gradient
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per input: no second warning
        frozen(sample()).sum().backward()


def test_r_ordered_labels_name_the_graph():
    graphed = ordered_graphs()
    with raises(
        ValueError,
        "graph (chunk 2, microbatch 1, layer 0) input 0 must keep shape (2, 4), got (3, 4)",
    ):
        graphed[3](torch.randn(3, 4, requires_grad=True))
    with raises(
        TypeError,
        "graph (chunk 1, microbatch 1, layer 0) takes 1 positional arguments as at capture, got 2",
    ):
        graphed[1](sample(), sample())
    leangraph.reset_all(graphed)
    with raises(GraphResetError, "graph (chunk 1, microbatch 0, layer 0): cannot call"):
        graphed[0](sample())


def test_r_nested_and_keyword_leaves_are_named():
    def pair(xs, *, mask):
        return xs[0] * xs[1] * mask

    graphed = mgc((pair,), (([sample(), sample()],),), sample_kwargs=({"mask": torch.ones(2, 4)},))[
        0
    ]
    with raises(
        ValueError,
        "callable 0 (test_r_nested_and_keyword_leaves_are_named.<locals>"
        ".pair) input 0[1] must keep shape (2, 4), got (2, 5)",
    ):
        graphed([sample(), torch.randn(2, 5, requires_grad=True)], mask=torch.ones(2, 4))
    with raises(TypeError, "kwarg 'mask' must keep dtype torch.float32", "got torch.float64"):
        graphed([sample(), sample()], mask=torch.ones(2, 4, dtype=torch.float64))


class HFStyle(torch.nn.Module):
    """A layer called as HF and Megatron layers are: flags, None masks, (hidden, None) out."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, hidden, *, attention_mask=None, use_cache=False, scale=1.0, past=(None,)):
        out = self.lin(hidden) * scale
        if attention_mask is not None:
            out = out * attention_mask
        return out, (None if not use_cache else out)


def test_r11_constants_replay_as_captured_and_a_different_one_is_named():
    torch.manual_seed(0)
    layer = HFStyle()
    reference = copy.deepcopy(layer)
    kwargs = {"attention_mask": None, "use_cache": False, "scale": 0.5, "past": (None,)}
    graphed = mgc(layer, (sample(),), sample_kwargs=kwargs)
    x = sample()
    hidden, cache = graphed(x, **kwargs)
    expected, _ = reference(x.detach(), **kwargs)
    assert cache is None and torch.equal(hidden, expected)
    hidden.sum().backward()
    with raises(ValueError, "callable 0 (HFStyle) kwarg 'use_cache' must be the constant False",
                "got True"):
        graphed(sample(), **{**kwargs, "use_cache": True})
    with raises(ValueError, "kwarg 'scale' must be the constant 0.5", "got 2.0"):
        graphed(sample(), **{**kwargs, "scale": 2.0})
    with raises(ValueError, "kwarg 'attention_mask' must be the constant None", "got a tensor"):
        graphed(sample(), **{**kwargs, "attention_mask": torch.ones(2, 4)})
    with raises(ValueError, "kwarg 'past'[0] must be the constant None", "got 3"):
        graphed(sample(), **{**kwargs, "past": (3,)})
    with raises(ValueError, "kwarg 'scale' must be the constant 0.5", "got 1"):
        graphed(sample(), **{**kwargs, "scale": 1})  # an int is not the float it equals


def test_r11_positional_constants_and_ordered_graphs():
    def shift(x, by, flag):
        return x + by if flag else x

    graphed = mgc((shift,), ((sample(), 2, True),))[0]
    x = sample()
    assert torch.equal(graphed(x, 2, True), x + 2)
    with raises(ValueError, "input 2 must be the constant True", "got False"):
        graphed(x, 2, False)


def divide(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / eps


def test_r11_float_constants_compare_by_exact_value():
    """-0.0 == 0.0 in Python, but x / -0.0 is -inf where x / 0.0 is +inf: a float constant is
    the value captured, sign of zero included; and NaN, which is never == itself, is the NaN
    captured (complex constants part by part)."""
    x = torch.ones(3, requires_grad=True)
    zero = mgc(divide, (x, 0.0))
    with raises(ValueError, "callable 0 (divide) input 1 must be the constant 0.0 it was at "
                            "capture, got -0.0"):
        zero(x, -0.0)
    assert torch.equal(zero(x, 0.0), divide(x, 0.0))
    negative_zero = mgc(divide, (x, -0.0))
    with raises(ValueError, "input 1 must be the constant -0.0 it was at capture, got 0.0"):
        negative_zero(x, 0.0)
    assert torch.equal(negative_zero(x, -0.0), torch.full((3,), -torch.inf))
    nan = mgc(divide, (x, float("nan")))
    assert nan(x, float("nan")).isnan().all()
    with raises(ValueError, "input 1 must be the constant nan it was at capture, got 1.0"):
        nan(x, 1.0)
    complex_zero = mgc(divide, (x, complex(1.0, 0.0)))
    with raises(ValueError, "must be the constant (1+0j) it was at capture, got (1-0j)"):
        complex_zero(x, complex(1.0, -0.0))
    assert torch.equal(complex_zero(x, complex(1.0, 0.0)), divide(x, complex(1.0, 0.0)))


@pytest.mark.parametrize(
    ("arg", "error", "message"),
    [
        (torch.randn(2, 5, requires_grad=True), ValueError, r"input 0 must keep shape \(2, 4\)"),
        (torch.randn(2, 4, dtype=torch.float64, requires_grad=True), TypeError, "dtype"),
        (torch.ones(2, 4, dtype=torch.float16), TypeError, "keep dtype torch.float32 as at"),
        (1.0, TypeError, "input 0 must be a tensor as at capture, got float"),
        ([torch.randn(2, 4)], TypeError, r"input 0 must keep its structure from capture \(a "
                                         r"tensor\), got a list of 1 leaf"),
    ],
)
def test_replay_rejects_mismatched_arguments(arg, error, message):
    _, graphed = three_graphs()
    with pytest.raises(error, match=message):
        graphed[0](arg)


def test_keyword_arguments_may_come_in_any_order():
    def affine(x, *, scale, shift):
        return x * scale + shift

    sample = {"scale": torch.tensor(2.0), "shift": torch.tensor(1.0)}
    (graphed,) = leangraph.make_graphed_callables(
        (affine,), ((torch.randn(3, requires_grad=True),),), sample_kwargs=(sample,))
    x = torch.randn(3, requires_grad=True)
    out = graphed(x, shift=torch.tensor(10.0), scale=torch.tensor(3.0))
    assert torch.equal(out, x.detach() * 3 + 10)
    out.sum().backward()


class _Concat(torch.nn.Module):
    def forward(self, x: torch.Tensor, **parts: torch.Tensor) -> torch.Tensor:
        return x * torch.cat(list(parts.values()))


@pytest.mark.parametrize("kind", ["function", "module"])
def test_r2_a_callable_taking_kwargs_sees_their_order_so_it_must_be_captures(kind):
    """``**kwargs`` keep the caller's order, which the callable may follow (concatenating
    them): eager would compute another result for another order, so only a callable whose
    keywords bind by name accepts any order."""

    def concat(x, **parts):
        return x * torch.cat(list(parts.values()))

    fn = concat if kind == "function" else _Concat()
    sample_kwargs = {"a": torch.randn(3), "b": torch.randn(3)}
    graphed = mgc(fn, (torch.randn(6, requires_grad=True),), sample_kwargs=sample_kwargs)
    x, a, b = torch.randn(6), torch.zeros(3), torch.ones(3)
    assert torch.equal(graphed(x, a=a, b=b), concat(x, a=a, b=b))
    with raises(
        TypeError,
        "takes **kwargs, so it sees the order of the keyword arguments that land there",
        "pass ['a', 'b'] in their order at capture, got ['b', 'a']",
    ):
        graphed(x, b=b, a=a)


def test_r2_keywords_that_bind_to_named_parameters_take_any_order_beside_kwargs():
    """Only the keywords that land in ``**kwargs`` keep their order (a transformers decoder
    layer takes ``attention_mask=``, ``position_ids=`` by name and the rest as ``**kwargs``):
    named ones bind in any order."""

    def layer(x, mask=None, scale=None, **extra):
        return x * mask * scale + sum(extra.values())

    sample_kwargs = {"mask": torch.randn(4), "scale": torch.randn(4), "bias": torch.randn(4)}
    graphed = mgc(layer, (torch.randn(4, requires_grad=True),), sample_kwargs=sample_kwargs)
    x, mask, scale, bias = (torch.randn(4) for _ in range(4))
    assert torch.equal(graphed(x, scale=scale, bias=bias, mask=mask), layer(x, mask, scale, bias=bias))


# ------------------------------------------------------------------------- binding


def minus(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2 * x - y


def nested(a, pair, *, mask, opts):
    return a * pair[0] + pair[1]["w"] * mask + opts["scale"]


def nested_sample(width: int = 4):
    """A sample call of ``nested``: (args, kwargs) with leaves in every kind of position."""
    args = (sample(width), [sample(width), {"w": sample(width)}])
    kwargs = {"mask": torch.ones(2, width), "opts": {"scale": sample(width)}}
    return args, kwargs


def test_positional_tensors_bind_in_order_and_are_the_callers_own():
    graphed = mgc((minus,), ((sample(), sample()),))[0]
    x, y = sample(), sample()
    out = graphed(x, y)  # bare tensors, as captured: the positional fast path
    assert torch.equal(out, 2 * x.detach() - y.detach())
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((2, 4), 2.0)) and torch.equal(y.grad, -torch.ones(2, 4))


def test_containers_and_keywords_bind_in_capture_order_and_are_the_callers_own():
    args, kwargs = nested_sample()
    graphed = mgc((nested,), (args,), sample_kwargs=(kwargs,))[0]
    args, kwargs = nested_sample()
    shuffled = {"opts": kwargs["opts"], "mask": kwargs["mask"]}  # keyword order is free
    out = graphed(*args, **shuffled)
    a, (b, d), c = args[0], args[1], kwargs["opts"]["scale"]
    assert torch.equal(out, (a * b + d["w"] * kwargs["mask"] + c).detach())
    out.sum().backward()
    assert torch.equal(a.grad, b.detach()) and torch.equal(b.grad, a.detach())
    assert torch.equal(d["w"].grad, kwargs["mask"]) and torch.equal(c.grad, torch.ones(2, 4))


@pytest.mark.parametrize(
    ("where", "name"),
    [
        ("a", "input 0"),
        ("pair0", "input 1[0]"),
        ("w", "input 1[1]['w']"),
        ("mask", "kwarg 'mask'"),
        ("scale", "kwarg 'opts'['scale']"),
    ],
)
def test_every_leaf_is_named_by_its_path(where, name):
    args, kwargs = nested_sample()
    graphed = mgc((nested,), (args,), sample_kwargs=(kwargs,))[0]
    args, kwargs = nested_sample()
    wide = torch.randn(2, 5, requires_grad=where != "mask")
    if where == "a":
        args = (wide, args[1])
    elif where == "pair0":
        args[1][0] = wide
    elif where == "w":
        args[1][1]["w"] = wide
    elif where == "mask":
        kwargs["mask"] = wide
    else:
        kwargs["opts"]["scale"] = wide
    with raises(ValueError, f"callable 0 (nested) {name} must keep shape (2, 4), got (2, 5)"):
        graphed(*args, **kwargs)


def test_structure_errors_name_the_argument_and_both_structures():
    args, kwargs = nested_sample()
    graphed = mgc((nested,), (args,), sample_kwargs=(kwargs,))[0]
    args, kwargs = nested_sample()
    with raises(
        TypeError,
        "callable 0 (nested) input 1 must keep its structure from capture (a list of 2 leaves: "
        "[tensor, {'w': tensor}]), got a tuple of 2 leaves: (tensor, {'w': tensor})",
    ):
        graphed(args[0], tuple(args[1]), **kwargs)
    with raises(
        TypeError,
        "callable 0 (nested) kwarg 'opts' must keep its structure from capture (a dict of 1 "
        "leaf: {'scale': tensor}), got a list of 1 leaf: [tensor]",
    ):
        graphed(*args, mask=kwargs["mask"], opts=[kwargs["opts"]["scale"]])


def test_a_positional_capture_refuses_keywords_naming_what_it_takes():
    graphed = mgc((minus,), ((sample(), sample()),))[0]
    x, y = sample(), sample()
    with raises(TypeError, "callable 0 (minus) takes 2 positional arguments as at capture, got 1"):
        graphed(x, y=y)
    with raises(TypeError, "callable 0 (minus) takes keyword arguments [] as at capture, "
                           "got ['z']"):
        graphed(x, y, z=y)


def test_checks_run_in_the_documented_order():
    """Positional count, keyword names, structure, then leaf by leaf (in capture order):
    tensor-ness, dtype, shape, device (requires_grad may differ, R8)."""
    args, kwargs = nested_sample()
    graphed = mgc((nested,), (args,), sample_kwargs=(kwargs,))[0]
    args, kwargs = nested_sample()
    a, pair = args
    with raises(TypeError, "takes 2 positional arguments as at capture, got 1"):
        graphed(a, mask=kwargs["mask"])  # count, keywords and structure all wrong
    with raises(TypeError, "takes keyword arguments ['mask', 'opts'] as at capture, got ['mask']"):
        graphed(a, tuple(pair), mask=kwargs["mask"])  # keywords and structure wrong
    with raises(TypeError, "input 1 must keep its structure"):
        graphed(a, tuple(pair), mask=kwargs["mask"], opts=[1.0])  # structure first among kwargs
    bad = torch.randn(3, 4, dtype=torch.float64, device="meta")  # every leaf check fails
    with raises(TypeError, "input 0 must keep dtype torch.float32 as at capture, got "
                           "torch.float64"):
        graphed(bad, pair, **kwargs)
    with raises(ValueError, "input 0 must keep shape (2, 4), got (3, 4)"):
        graphed(bad.float(), pair, **kwargs)
    with raises(ValueError, "input 0 must stay on cpu, got meta"):
        graphed(torch.randn(2, 4, device="meta"), pair, **kwargs)
    pair[1]["w"] = None  # a later leaf: the first leaf's mismatch is the one reported
    with raises(ValueError, "input 0 must keep shape (2, 4), got (3, 4)"):
        graphed(bad.float(), pair, **kwargs)
    with raises(TypeError, "input 1[1]['w'] must be a tensor as at capture, got NoneType"):
        graphed(a, pair, **kwargs)


def test_a_refused_call_changes_nothing():
    graphed = mgc((minus,), ((sample(), sample()),))[0]
    x, y = sample(), sample()
    out = graphed(x, y)
    with raises(ValueError, "input 1 must keep shape"):
        graphed(sample(), torch.randn(3, 4, requires_grad=True))
    assert torch.equal(out, 2 * x.detach() - y.detach())
    out.sum().backward()  # the pending replay's backward is intact
    assert torch.equal(x.grad, torch.full((2, 4), 2.0)) and torch.equal(y.grad, -torch.ones(2, 4))


def test_a_structure_error_says_how_the_structures_differ():
    """Containers of the same type and leaf count can still differ inside."""

    def first(xs):
        return xs[0] * 2

    graphed = mgc((first,), (([sample(), (sample(), sample())],),), allow_unused_input=True)[0]
    with pytest.raises(TypeError, match="input 0 must keep its structure") as info:
        graphed([(sample(), sample()), sample()])
    message = str(info.value)
    captured, _, got = message.partition("from capture (")[2].partition("), got ")
    assert captured != got, f"the message does not say what differs: {message!r}"


def test_a_dict_argument_in_another_key_order_is_bound_by_key_or_refused_saying_so():
    def weigh(opts):
        return opts["a"] * 2 + opts["b"]

    graphed = mgc((weigh,), (({"a": sample(), "b": sample()},),))[0]
    a, b = sample(), sample()
    try:
        out = graphed({"b": b, "a": a})
    except TypeError as error:
        message = str(error)
        captured, _, got = message.partition("from capture (")[2].partition("), got ")
        assert captured != got, f"the message does not say what differs: {message!r}"
    else:
        assert torch.equal(out, a.detach() * 2 + b.detach())


def test_a_signature_made_like_another_takes_its_names_only_for_the_same_structure():
    # Graphs of one layer (one per microbatch) share the walk of their call's structure; one
    # whose structure differs must still bind, and name its arguments, by its own.
    from torch.utils import _pytree as pytree

    from leangraph.runtime.signature import CallSignature

    x = torch.randn(2, 3)
    leaves, tree = pytree.tree_flatten(((x,), {}))
    first = CallSignature("graph a", leaves, tree)
    same = CallSignature("graph b", leaves, tree, like=first)
    assert [t is x for t in same.bind((x,), {})] == [True]
    with raises(TypeError, "graph b takes 1 positional arguments as at capture, got 2"):
        same.bind((x, x), {})
    keyed_leaves, keyed_tree = pytree.tree_flatten(((x,), {"factor": 2.0}))
    keyed = CallSignature("graph c", keyed_leaves, keyed_tree, like=first)
    assert [t is x for t in keyed.bind((x,), {"factor": 2.0})] == [True]
    with raises(ValueError, "graph c kwarg 'factor' must be the constant 2.0 it was at capture"):
        keyed.bind((x,), {"factor": 3.0})
    with raises(TypeError, "graph c takes keyword arguments ['factor'] as at capture"):
        keyed.bind((x,), {})
    # And the other way round: a positional-only call made like one with keywords.
    plain = CallSignature("graph d", leaves, tree, like=keyed)
    assert [t is x for t in plain.bind((x,), {})] == [True]
    with raises(TypeError, "graph d takes keyword arguments [] as at capture"):
        plain.bind((x,), {"factor": 2.0})


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_r16_a_torch_func_transform_is_refused_naming_the_callable(transform):
    graphed = graphed_blocks()
    x = sample()
    before = [t.clone() for t in graphed[0].forward.static_tensors()]
    if transform == "vmap":
        run = lambda: torch.func.vmap(graphed[0])(x.detach().unsqueeze(0))  # noqa: E731
    else:
        run = lambda: torch.func.grad(lambda v: graphed[0](v).sum())(x.detach())  # noqa: E731
    with raises(RuntimeError, "callable 0 (Block) cannot run under a torch.func transform"):
        run()
    after = graphed[0].forward.static_tensors()
    # Nothing was copied in. Bits, not values: a buffer no replay wrote yet holds whatever
    # the allocator left there, NaN patterns included, which torch.equal calls unequal.
    torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
    graphed[2](graphed[1](graphed[0](x))).sum().backward()  # outside it, replays as before
