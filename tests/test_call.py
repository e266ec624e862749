"""The validated record of a call (``leangraph._call``): every validation error (docs/errors.md,
V entries, raised before anything runs), the :class:`Call` it returns, and what capture alone
requires (:func:`check_capturable`)."""

from __future__ import annotations

import copy
import functools
import gc
from typing import Any

import pytest
import torch
from helpers import Doubling, Opaque, Tagged, blocks, raises, sample, scale
from models import Block

import leangraph
from leangraph import GraphedCallable
from leangraph._call import CaptureOptions, check_capturable, validate_call
from leangraph.order import Step, StepKind

# Two chunks of one layer, two microbatches: graph (chunk c, microbatch m) is at 2 (c-1) + m.
ORDER = [1, 2, -2, -1, 1, 2, -2, -1]
mgc = leangraph.make_graphed_callables


def test_v1_num_warmup_iters_must_be_a_non_negative_int():
    for bad in (-1, 1.5, True):
        with raises(ValueError, "num_warmup_iters must be an int >= 0", f"got {bad!r}"):
            mgc(Block(4), (sample(),), num_warmup_iters=bad)


def test_v2_autocast_cache_is_refused():
    layer = Block(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with raises(RuntimeError, "autocast cache", "cache_enabled=False"):
            mgc(layer, (sample(),))
    assert not isinstance(layer.__dict__.get("forward"), GraphedCallable)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        leangraph.reset_all(mgc(layer, (sample(),)))  # without the cache it is fine


def test_v3_callables_must_be_callable():
    with raises(TypeError, "callables[1] is a int", "not callable"):
        mgc((Block(4), 3), ((sample(),), (sample(),)))


def test_v4_a_graphed_module_cannot_be_graphed_again():
    layer = mgc(Block(4), (sample(),))
    for _ in range(2):  # before and after its reset
        with raises(ValueError, "callables[0] (Block) was already graphed"):
            mgc((layer,), ((sample(),),))
        leangraph.reset_all(layer)


def test_v30_a_module_holding_a_graphed_submodule_is_refused():
    outer = Block(4)
    mgc(outer.up, (sample(),))
    with raises(ValueError, "callables[0] (Block): submodule 'up' was graphed by "
                "make_graphed_callables", "Graph the outer module from eager submodules"):
        mgc(outer, (sample(),))
    assert "forward" not in outer.__dict__  # refused before anything was replaced
    leangraph.reset_all(outer.up)
    with raises(ValueError, "submodule 'up' was graphed"):  # reset or not
        mgc((Block(4), outer), ((sample(),), (sample(),)))


def test_v30_a_graphed_callable_is_refused_as_a_callable():
    graphed = mgc(lambda x: x * 2, (sample(),))
    with raises(ValueError, "callables[0] is a graphed callable (a result of "
                "make_graphed_callables)", "graph the eager callable it replays"):
        mgc(graphed, (sample(),))


def test_v30_a_forward_calling_a_graphed_callable_is_refused_before_warm_up():
    """A plain function calling a graphed callable got through: the CPU backend recorded the
    replay as kernels on the inner graph's static buffers, where CUDA's capture refuses a
    replay ("Cannot prepare for replay during capturing stage")."""
    inner = mgc(Block(4), (sample(),))
    calls = []

    def outer(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return inner(x) * 2

    with raises(ValueError, ".outer) calls a graphed callable (a result of",
                "graph the eager callable it replays instead") as info:
        mgc(outer, (sample(),))
    assert calls == [1]  # the probe's forward only
    del info  # its traceback holds the probe's output of the inner replay, awaiting a backward
    gc.collect()
    inner(sample()).sum().backward()  # the inner graph still replays in its order
    leangraph.reset_all(inner)


def test_v30_graphing_a_submodule_of_a_graphed_module_afterwards_is_fine():
    """The outer graph replays kernels of its own, never the submodule's forward: both
    train their shared parameters exactly as eager does."""
    torch.manual_seed(0)
    outer = Block(4)
    reference = copy.deepcopy(outer)
    mgc(outer, (sample(),))
    mgc(outer.up, (sample(),))
    x, y = sample(), sample()
    out = outer(x)
    outer.up(y).sum().backward()
    out.sum().backward()
    reference(x.detach()).sum().backward()
    reference.up(y.detach()).sum().backward()
    for p, q in zip(outer.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize(
    ("register", "kind"),
    [
        (lambda m: m.register_forward_hook(lambda *a: None), "_forward_hooks"),
        (lambda m: m.register_forward_pre_hook(lambda *a: None), "_forward_pre_hooks"),
        (lambda m: m.register_full_backward_hook(lambda *a: None), "_backward_hooks"),
        (lambda m: m.register_full_backward_pre_hook(lambda *a: None), "_backward_pre_hooks"),
    ],
)
@pytest.mark.parametrize("where", ["module", "submodule"])
def test_v5_modules_with_hooks_are_refused(register, kind, where):
    layers = blocks(3)
    handle = register(layers[2] if where == "module" else layers[2].up)
    place = "the module" if where == "module" else "submodule 'up'"
    with raises(ValueError, f"callables[2] (Block): {place} has {kind}", "remove them"):
        mgc(layers, tuple((sample(),) for _ in layers))
    handle.remove()
    leangraph.reset_all(mgc(layers, tuple((sample(),) for _ in layers)))


class Stats(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4, requires_grad=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_v6_buffers_that_require_grad_are_refused():
    with raises(ValueError, "callables[1] (Stats): buffer 'scale' requires grad"):
        mgc((Block(4), Stats()), ((sample(),), (sample(),)))


def test_v38_torchscript_modules_are_refused_before_warm_up():
    """A scripted or traced module's parameters sit behind C++ wrappers: the capture went
    through and the first replay failed inside leangraph ("descriptor 'get' for 'dict' objects
    doesn't apply to a 'OrderedDictWrapper' object")."""
    calls = []
    scripted = torch.jit.script(torch.nn.Linear(4, 4))
    traced = torch.jit.trace(torch.nn.Linear(4, 4), torch.randn(2, 4))
    with raises(ValueError, "callables[0] (RecursiveScriptModule): the module is a TorchScript "
                "module (RecursiveScriptModule, from torch.jit.script or torch.jit.trace)",
                "expected an eager nn.Module: graph the module before scripting or tracing it"):
        mgc(scripted, (sample(),), pre_warmup_hook=lambda: calls.append(1))
    with raises(ValueError, "callables[1] (Sequential): submodule '0' is a TorchScript module "
                "(TopLevelTracedModule"):
        mgc((Block(4), torch.nn.Sequential(traced, torch.nn.ReLU())), ((sample(),), (sample(),)),
            pre_warmup_hook=lambda: calls.append(1))
    assert calls == [] and not isinstance(scripted.__dict__.get("forward"), GraphedCallable)


def test_v7_the_same_module_twice_without_an_order():
    layer = Block(4)
    with raises(ValueError, "callables[1] is the same module as callables[0]"):
        mgc((layer, layer), ((sample(),), (sample(),)))


def test_v8_sample_args_must_be_a_tuple():
    with raises(TypeError, "sample_args must be a tuple, got Tensor"):
        mgc((Block(4),), sample())


@pytest.mark.parametrize(
    ("sample_args", "sample_kwargs", "kind", "message"),
    [
        # A single callable's samples are its own tuple and dict; they were named as the
        # sample_args[0] and sample_kwargs[0] leangraph wraps them into, which the caller
        # never wrote.
        (sample(), None, TypeError, r"sample_args of a single callable must be its tuple of "
         r"arguments, got Tensor \(wrap a single tensor as \(tensor,\)\)"),
        ({"x": sample()}, None, TypeError, r"sample_args of a single callable .*, got dict"),
        ((sample(),), [{}], TypeError, r"sample_kwargs of a single callable must be its dict "
         r"of keyword arguments or None, got list"),
    ],
)
def test_v8_a_single_callables_samples_are_named_as_given(sample_args, sample_kwargs, kind,
                                                          message):
    with pytest.raises(kind, match=message):
        mgc(Block(4), sample_args, sample_kwargs=sample_kwargs)


def test_v10_a_single_callable_with_an_order_of_several_microbatches_is_named_as_such():
    # The samples of a single callable are one tuple; this counted "1 entries" where the
    # caller had passed two.
    with raises(ValueError, "a single callable (not a tuple) has one tuple of sample arguments",
                "the order runs 2 microbatches", "pass callables as a tuple, (callable,)"):
        mgc(Block(4), ((sample(),), (sample(),)), order=[1, -1, 1, -1])


def test_a_single_module_with_an_order_of_one_microbatch_comes_back_as_its_graph():
    block = Block(4)
    graphed = mgc(block, (sample(),), order=[1, -1])
    assert isinstance(graphed, GraphedCallable) and "forward" not in block.__dict__
    x = sample()
    assert torch.equal(graphed(x), block(x))
    graphed.reset()


def test_v9_sample_args_count_without_an_order():
    with raises(ValueError, "sample_args has 1 entries for 2 callables"):
        mgc(blocks(2), ((sample(),),))
    with raises(ValueError, "sample_args has 3 entries for 2 callables"):
        mgc(blocks(2), tuple((sample(),) for _ in range(3)))


def test_v10_sample_args_count_with_an_order():
    with raises(
        ValueError, "sample_args has 3 entries but the order needs 4", "(2 layers x 2 microbatches)"
    ):
        mgc(blocks(2), tuple((sample(),) for _ in range(3)), order=ORDER)


@pytest.mark.parametrize(
    ("order", "layers", "parts"),
    [
        ([1, 2, -2, 0], None, ["order[3] = 0", "1-based"]),
        ([-1, 1, 2, -2], None, ["order[0] = -1: backward of chunk 1 with no outstanding forward"]),
        ([1, 3, -3, -1], [1, 1], ["order[1] = 3: unknown chunk 3, the model has 2 chunks"]),
        ([1.0, -1, 2, -2], None, ["order[0] = 1.0", "non-zero integers", "got float"]),
        ([True, -1, 2, -2], None, ["order[0] = True", "got bool"]),
        ([1, -1, 2, float("-inf")], None, ["order[3] = -inf", "non-zero integers", "got float"]),
        ([Step(StepKind.FORWARD, 1.0, 0), Step(StepKind.BACKWARD, 1.0, 0)], [2],
         ["order[0] = Step(", "chunk must be an int, got float 1.0"]),
        ([Step("F", 1, 0), Step("B", 1, 0)], [2],
         ["order[0] = Step(", "kind must be a leangraph.order.StepKind", "got str 'F'"]),
        ([Step(StepKind.FORWARD, 1, False), Step(StepKind.BACKWARD, 1, False)], [2],
         ["order[0] = Step(", "microbatch must be an int, got bool False"]),
        ([1, 2, -2], None, ["order runs 1 forwards but 0 backwards of chunk 1"]),
        ([1, 2, -2, -1, 2, -2], None, ["order runs 2 forwards of chunk 2 but 1 of chunk 1"]),
        ([1, 2, -2, -1], [1, 2], ["num_layers_per_chunk [1, 2] sums to 3 layers but 2 callables"]),
        ([1, 2, -2, -1], [2], ["order[1] = 2: unknown chunk 2, the model has 1 chunks"]),
        ([1, -1], [1, 1], ["order runs 0 forwards of chunk 2 but 1 of chunk 1"]),
        # Refused before anything is sized by the chunk id (a billion-entry table, an overflow).
        ([1, -1, 10**30, -(10**30)], None,
         ["order[2] = 1000000000000000000000000000000: chunk 10", "cannot be run by an order of 4 "
          "entries", "needs 2000000000000000000000000000000 entries at least"]),
        ([Step(StepKind.FORWARD, 10**9, 0), Step(StepKind.BACKWARD, 10**9, 0)], None,
         ["order[0] = F c1000000000 m0: chunk 1000000000 cannot be run by an order of 2 entries"]),
        ([1, 2, -2, -1], [0, 2], ["num_layers_per_chunk for chunk 1 must be an int >= 1, got 0"]),
        ([], None, ["order is empty"]),
        ("1,2,-2,-1", None, ["order must be a list of chunk ids, got str"]),
    ],
)
def test_v11_malformed_orders(order, layers, parts):
    with raises(ValueError, *parts):
        mgc(
            blocks(2),
            tuple((sample(),) for _ in range(2)),
            order=order,
            num_layers_per_chunk=layers,
        )


def test_v11_uneven_split_and_num_layers_without_an_order():
    with raises(
        ValueError, "3 callables cannot be split equally over 2 chunks", "pass num_layers_per_chunk"
    ):
        mgc(blocks(3), tuple((sample(),) for _ in range(3)), order=[1, 2, -2, -1])
    with raises(ValueError, "num_layers_per_chunk needs an order"):
        mgc(blocks(2), ((sample(),), (sample(),)), num_layers_per_chunk=1)


def test_v12_each_sample_args_entry_must_be_a_tuple():
    with raises(
        TypeError,
        "sample_args[1] must be a tuple of arguments, got Tensor",
        "wrap a single tensor as (tensor,)",
    ):
        mgc(blocks(2), ((sample(),), sample()))


@pytest.mark.parametrize(
    ("sample_args", "sample_kwargs", "where"),
    [
        ((sample(), Opaque()), {}, "sample_args[1][1]"),
        (([sample(), [1, Opaque()]],), {}, "sample_args[1][0][1][1]"),
        ((sample(),), {"mask": Opaque()}, "sample_kwargs[1]['mask']"),
    ],
)
def test_v13_sample_leaves_must_be_tensors_or_constants(sample_args, sample_kwargs, where):
    with raises(
        TypeError, f"{where}: an argument leaf must be a tensor or a constant", "got Opaque"
    ):
        mgc(
            (lambda x: x * 2, lambda *a, **k: a[0]),
            ((sample(),), sample_args),
            sample_kwargs=({}, sample_kwargs),
            allow_unused_input=True,
        )


def test_v14_sample_kwargs_count_and_type():
    with raises(ValueError, "sample_kwargs must have one dict per graph (1), got 2"):
        mgc((scale,), ((sample(),),), sample_kwargs=({}, {}))
    with raises(TypeError, "sample_kwargs[0] must be a dict, got list"):
        mgc((scale,), ((sample(),),), sample_kwargs=([],))
    # A key Python could not pass as a keyword (torch's probe failed: "keywords must be strings").
    with raises(TypeError, "sample_kwargs[0] must map keyword names (str) to arguments",
                "got the key 1 (int)"):
        mgc(scale, (sample(),), sample_kwargs={1: sample()})


def test_v15_one_device_for_samples_and_parameters():
    with raises(
        ValueError, "must share one device", "sample_args[0][0] is on cpu",
        "sample_args[1][0] is on meta"
    ):
        mgc(blocks(2), ((sample(),), (torch.randn(2, 4, device="meta"),)))
    with raises(ValueError, "must share one device", "sample_kwargs[0]['factor'] is on meta"):
        mgc((scale,), ((sample(),),), sample_kwargs=({"factor": torch.tensor(2.0, device="meta")},))
    # Two tensors of one sample are named apart, by their leaves (both were sample_args[0]).
    with raises(ValueError, "sample_args[0][0] is on cpu, but sample_args[0][1]['m'] is on meta"):
        mgc((lambda x, d: x * d["m"],), ((sample(), {"m": torch.ones(4, device="meta")}),))
    with raises(
        ValueError,
        "sample_args[0][0] is on meta",
        "callables[0] (Block) parameter 'norm.weight' is on cpu",
    ):
        mgc(Block(4), (torch.randn(2, 4, device="meta"),))


def _not_dense_kinds(device: str) -> dict[str, tuple[Any, str]]:
    """Tensors that are not dense with storage, by kind: how to make one from a dense
    tensor, and how the refusal names it."""
    kinds = {
        "sparse_coo": (lambda t: t.to_sparse(), "a torch.sparse_coo tensor"),
        "sparse_csr": (lambda t: t.to_sparse_csr(), "a torch.sparse_csr tensor"),
        "nested": (lambda t: torch.nested.nested_tensor(list(t)), "a nested tensor"),
    }
    if device == "cpu":
        kinds["quantized"] = (
            lambda t: torch.quantize_per_tensor(t, 0.1, 0, torch.qint8),
            "a quantized tensor (torch.qint8)",
        )
        if torch.backends.mkldnn.is_available():
            kinds["mkldnn"] = (lambda t: t.to_mkldnn(), "a torch._mkldnn tensor")
    return kinds


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR beta, quantize deprecated
def test_v27_a_sample_tensor_must_be_dense_with_storage(device):
    """A sparse, mkldnn, nested or quantized sample failed deep inside (torch's "Cannot
    access data pointer of Tensor that doesn't have storage"): refused naming the sample,
    before anything runs."""
    calls = []

    def double(x, y):
        calls.append(1)
        return x * 2 + y

    for kind, (make, named) in _not_dense_kinds(device).items():
        dense = torch.randn(2, 4, device=device)
        with raises(TypeError, "sample_args[0][1]: a sample tensor must be a dense (strided) "
                               f"tensor with storage, got {named}", "to_dense()"):
            mgc(double, (sample().to(device), make(dense)))
        with raises(TypeError, "sample_kwargs[0]['y']: a sample tensor must be a dense"):
            mgc(double, (sample().to(device),), sample_kwargs={"y": make(dense)})
        with raises(TypeError, "sample_args[0][1]: a sample tensor must be a dense", named):
            leangraph.plan_memory(double, (sample().to(device), make(dense)))
        assert not calls, kind  # refused before the probe's forward


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_v27_a_sample_tensor_subclass_is_refused_naming_it(device):
    """A graph replays its plain static buffers' kernels and returns plain tensors: a sample
    of a subclass eager would follow (its ops, or only its type) is refused before anything
    runs; an nn.Parameter, which computes as a plain tensor, is a sample like any."""
    calls = []

    def double(x, y):
        calls.append(1)
        return torch.nn.functional.linear(x, y)

    x, weight = sample().to(device), torch.randn(3, 4, device=device)
    for cls, how in ((Doubling, "overrides __torch_function__"),
                     (Tagged, "keeps its type through ops")):
        with raises(TypeError, f"sample_args[0][1]: a sample tensor must be a torch.Tensor, got "
                               f"a {cls.__qualname__} (a torch.Tensor subclass that {how})",
                    "as_subclass(torch.Tensor)"):
            mgc(double, (x, weight.as_subclass(cls)))
        with raises(TypeError, "sample_kwargs[0]['y']: a sample tensor must be a torch.Tensor"):
            mgc(double, (x,), sample_kwargs={"y": weight.as_subclass(cls)})
    assert not calls  # refused before the probe's forward
    graphed = mgc(double, (x, torch.nn.Parameter(weight)))
    assert torch.equal(graphed(x, weight), torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_v28_inference_tensors_and_inference_mode_are_refused(device):
    """Inference tensors as samples died in the probe with torch's "Inference tensors do not
    track version counter"; a capture under inference_mode made inference-tensor buffers,
    which a replay outside it could not write ("Inplace update to inference tensor outside
    InferenceMode"). Both are refused before anything runs; no_grad's forward-only graphs
    replay under inference_mode."""
    torch.manual_seed(0)
    eager = Block(4).to(device)
    module = copy.deepcopy(eager)
    with torch.inference_mode():
        made_there = torch.randn(2, 4, device=device)
    with raises(ValueError, "sample_args[0][0] is an inference tensor (made under "
                            "torch.inference_mode())", "make the samples, and call "
                            "make_graphed_callables, outside inference_mode"):
        mgc(module, (made_there,))
    with raises(ValueError, "sample_kwargs[0]['factor'] is an inference tensor"):
        mgc(scale, (sample().to(device),), sample_kwargs={"factor": made_there})
    normal = torch.randn(2, 4, device=device)
    with torch.inference_mode(), raises(
        RuntimeError, "make_graphed_callables must not run under torch.inference_mode()",
        "under torch.no_grad() for forward-only graphs",
    ):
        mgc(module, (normal,))
    assert not isinstance(module.__dict__.get("forward"), GraphedCallable)
    with torch.no_grad():  # what the refusals point to
        graphed = mgc(module, (normal,))
    x = torch.randn(2, 4, device=device)
    with torch.inference_mode():
        assert torch.equal(graphed(x), eager(x))
    with torch.no_grad():
        assert torch.equal(graphed(made_there), eager(made_there))


def test_v18_global_module_hooks_are_refused():
    from torch.nn.modules.module import register_module_forward_hook

    handle = register_module_forward_hook(lambda module, args, output: None)
    try:
        with pytest.raises(ValueError, match=r"callables\[0\] \(Block\): global module hooks are "
                                             r"registered \(_global_forward_hooks\)"):
            mgc(Block(4), (sample(),))
    finally:
        handle.remove()


def test_v19_callables_must_be_a_callable_or_a_tuple():
    with raises(TypeError, "callables must be a callable or a tuple of callables, got a list",
                "pass tuple(callables)"):
        mgc(list(blocks(2)), ((sample(),), (sample(),)))
    with raises(ValueError, "callables is empty"):
        mgc((), ())


def test_v20_a_parameter_tensor_hook_is_refused_before_warm_up():
    layer = torch.nn.Sequential()
    layer.lin = torch.nn.Linear(4, 4)
    calls = []
    layer.lin.weight.register_hook(lambda g: (calls.append(1), g * 2)[1])
    with pytest.raises(ValueError, match=r"callables\[0\] \(Sequential\): parameter 'lin.weight' has "
                                         r"a tensor hook \(register_hook\)"):
        leangraph.make_graphed_callables(layer, (torch.randn(2, 4),))
    assert calls == []  # refused before anything ran a backward


# ------------------------------------------------------------------------- the Call record


def test_validation_runs_no_callable():
    calls = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(None)
        return x * 2

    with raises(ValueError, "sample_kwargs must have one dict per graph (1), got 2"):
        mgc((counted,), ((sample(),),), sample_kwargs=({}, {}))
    with raises(ValueError, "must share one device"):
        mgc((counted, counted), ((sample(),), (torch.randn(2, 4, device="meta"),)))
    assert calls == []


def test_a_single_callable_comes_with_one_sample_tuple_and_one_kwargs_dict():
    x, factor = sample(), torch.tensor(2.0)
    given = {"factor": factor}
    call = validate_call(scale, (x,), given, None, None)
    assert call.single and call.callables == (scale,)
    ((args, kwargs),) = call.samples
    assert args == (x,) and args[0] is x and kwargs == {"factor": factor}
    given["offset"] = factor  # the record is the call's own: later edits do not reach it
    assert call.samples[0][1] == {"factor": factor}
    as_tuple = validate_call((scale,), ((x,),), ({"factor": factor},), None, None)
    assert not as_tuple.single and as_tuple.samples == call.samples


def test_sample_lists_are_accepted_where_tuples_are_and_become_tuples():
    x, y = sample(), sample()
    call = validate_call((Block(4), Block(4)), [[x], [y]], [{}, {}], None, None)
    assert call.samples == (((x,), {}), ((y,), {}))
    assert all(type(args) is tuple for args, _ in call.samples)
    # As in torch, only a tuple is several callables: a list of callables is refused (V19).
    with raises(TypeError, "callables must be a callable or a tuple of callables, got a list"):
        validate_call([Block(4)], ([x],), None, None, None)


def test_the_device_is_the_one_every_sample_and_parameter_is_on():
    meta = torch.nn.Linear(4, 4, device="meta")
    call = validate_call(meta, (torch.empty(2, 4, device="meta"),), None, None, None)
    assert call.device == torch.device("meta")
    # Nothing to go by (no tensor at all): the CPU.
    assert validate_call(lambda: None, (), None, None, None).device == torch.device("cpu")
    on_params = validate_call(meta, (), None, None, None)  # the parameters alone decide
    assert on_params.device == torch.device("meta")


def test_labels_name_graphs_by_callable_without_an_order_and_by_position_with_one():
    def local(x: torch.Tensor) -> torch.Tensor:
        return x

    call = validate_call(
        (local, Block(4), functools.partial(local)),
        ((sample(),), (sample(),), (sample(),)),
        None,
        None,
        None,
    )
    assert [call.label(g) for g in range(3)] == [
        "callable 0 (test_labels_name_graphs_by_callable_without_an_order_and_by_position_with_one"
        ".<locals>.local)",  # the qualified name
        "callable 1 (Block)",
        "callable 2 (partial)",  # no __qualname__: the type's name
    ]
    ordered = validate_call(blocks(2), tuple((sample(),) for _ in range(4)), None, ORDER, None)
    assert [ordered.label(g) for g in range(4)] == [
        "graph (chunk 1, microbatch 0, layer 0)",
        "graph (chunk 1, microbatch 1, layer 0)",
        "graph (chunk 2, microbatch 0, layer 0)",
        "graph (chunk 2, microbatch 1, layer 0)",
    ]


def test_graphs_run_the_callables_the_layout_assigns():
    # Two chunks of two layers, two microbatches: graphs go chunk -> microbatch -> layer.
    layers = blocks(4)
    call = validate_call(
        layers, tuple((sample(),) for _ in range(8)), None, [1, 1, 2, 2, -2, -2, -1, -1], 2
    )
    assert [call.callable_index(g) for g in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert [call.callable_of(g) for g in range(8)] == [layers[i] for i in (0, 1, 0, 1, 2, 3, 2, 3)]
    unordered = validate_call(layers, tuple((sample(),) for _ in range(4)), None, None, None)
    assert [unordered.callable_of(g) for g in range(4)] == list(layers)
    assert call.plan.ordered and not unordered.plan.ordered


def test_chainable_says_whether_leaf_0_is_positional_argument_0():
    x = sample()

    def anything(*args, **kwargs):
        return x

    call = validate_call(
        (anything,) * 5,
        ((x,), ((x, x),), (), (x, x), ([x],)),
        ({}, {}, {"x": x}, {"y": x}, {}),
        None,
        None,
    )
    assert call.chainable() == (True, False, False, True, False)


def test_check_capturable_refuses_what_the_caller_says_is_already_graphed():
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    call = validate_call((first, second), ((sample(),), (sample(),)), None, None, None)
    check_capturable(call, lambda module: False)
    with raises(ValueError, "callables[1] (Linear) was already graphed"):
        check_capturable(call, lambda module: module is second)


def test_with_an_order_one_module_may_serve_several_chunks():
    layer = Block(4)
    call = validate_call((layer, layer), tuple((sample(),) for _ in range(2)), None,
                         [1, 2, -2, -1], None)
    check_capturable(call, lambda module: False)  # tied chunks: no "same module twice"
    unordered = validate_call((layer, layer), ((sample(),), (sample(),)), None, None, None)
    with raises(ValueError, "callables[1] is the same module as callables[0]"):
        check_capturable(unordered, lambda module: False)


def test_capture_options_take_zero_warmup_iterations():
    options = CaptureOptions(
        num_warmup_iters=0, allow_unused_input=False, retain_graph_in_backward=False,
        share_buffers=True, debug_outputs=False, check_memory=True,
    )
    assert options.num_warmup_iters == 0 and options.pre_warmup_hook is None


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"share_buffers": "False"}, TypeError, "share_buffers must be a bool, got str 'False'"),
    ({"share_buffers": None}, TypeError, "share_buffers must be a bool, got NoneType None"),
    ({"check_memory": "no"}, TypeError, "check_memory must be a bool, got str 'no'"),
    ({"allow_unused_input": 0}, TypeError, "allow_unused_input must be a bool, got int 0"),
    ({"retain_graph_in_backward": 2}, TypeError, "retain_graph_in_backward must be a bool"),
    ({"debug_outputs": "x"}, TypeError, "debug_outputs must be a bool, got str 'x'"),
    ({"pre_warmup_hook": 3}, TypeError, "pre_warmup_hook must be callable or None, got int 3"),
    ({"post_warmup_hook": "f"}, TypeError, "post_warmup_hook must be callable or None"),
    ({"progress": 3}, TypeError, "progress must be callable or None, got int 3"),
    ({"generator_states": torch.Generator()}, TypeError,
     "generator_states must be a list or tuple of CUDA generators, got Generator"),
    ({"generator_states": None}, TypeError, "generator_states must be a list or tuple"),
    ({"capture_time_hooks": {"forward": [print]}}, TypeError,
     "capture_time_hooks must be a list or tuple of one dict (or None) per callable, got dict"),
    ({"capture_time_hooks": [3]}, TypeError, "capture_time_hooks[0] must be a dict of hook kinds"),
    ({"capture_time_hooks": [{"forward": print}]}, TypeError,
     "capture_time_hooks[0]['forward'] must be a list or tuple of callables"),
    ({"num_layers_per_chunk": 2.0, "order": [1, -1]}, TypeError,
     "num_layers_per_chunk must be an int or a list or tuple of ints, got float 2.0"),
    ({"num_layers_per_chunk": [1.0], "order": [1, -1]}, ValueError,
     "num_layers_per_chunk for chunk 1 must be an int >= 1, got 1.0"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_v26_option_types_are_checked_before_any_forward(options, error, message):
    forwards: list[int] = []

    class Counting(torch.nn.Linear):
        def forward(self, x):
            forwards.append(1)
            return super().forward(x)

    with pytest.raises(error) as info:
        leangraph.make_graphed_callables(
            (Counting(4, 4),), ((torch.randn(2, 4, requires_grad=True),),), **options)
    assert message in str(info.value)
    assert forwards == []
