"""In-graph gradient accumulation (``fuse_grad_accumulation=True``; build/accumulation.py,
runtime/accumulation.py): gradients equal eager's bitwise in ``.grad`` and ``main_grad``, with
both ``zero_grad`` modes, drop-in and in pipeline orders; accumulator hooks fire once per
parameter per backward in eager's order; replaced gradients are refused (CPU backend; the
CUDA versions are in test_cuda.py)."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from helpers import assert_grads_unchanged, block_pair, fused_after_one_step, raises
from models import Block, TwoOutputs, assert_histories_equal, train_both

import leangraph
import leangraph.schedules

ZB = [1, 2, 1, -2, 2, -1, -2.5, -2, -1.5, -1, -2.5, -1.5]
# The two ways a fused replay fires the accumulators' hooks: autograd's relay, or leangraph
# calling the hooks registered from Python; every hook test holds for both.
HOOK_MODES = pytest.mark.parametrize("hooks", [True, "python"], ids=["relay", "python"])


def _log_hooks(module: torch.nn.Module, log: list[str]) -> None:
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: log.append(name))


@HOOK_MODES
@pytest.mark.parametrize("set_to_none", [True, False])
def test_drop_in_accumulates_like_eager_over_microbatches_and_steps(set_to_none, hooks):
    eager, graphed_module = block_pair()
    eager_log: list[str] = []
    graphed_log: list[str] = []
    _log_hooks(eager, eager_log)
    _log_hooks(graphed_module, graphed_log)
    graphed = leangraph.make_graphed_callables(
        graphed_module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, graphed_module)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for _ in range(3):  # gradient accumulation over microbatches
            x = torch.randn(4, 8, generator=gen)
            eager(x).square().sum().backward()
            graphed(x).square().sum().backward()
        assert graphed_log == eager_log and len(eager_log) == 3 * 6
        eager_log.clear()
        graphed_log.clear()
        for a, b in zip(eager.parameters(), graphed_module.parameters()):
            assert torch.equal(a.grad, b.grad)
        for optim in optims:
            optim.step()
            optim.zero_grad(set_to_none=set_to_none)
    for a, b in zip(eager.parameters(), graphed_module.parameters()):
        assert torch.equal(a, b)


def test_no_accumulation_outside_the_graph():
    """The replay's autograd hands the parameters no gradient: their ``.grad`` stays the
    buffer the graph adds into, the same tensor across microbatches and steps."""
    _, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    graphed(torch.randn(4, 8)).sum().backward()
    buffers = [p.grad for p in module.parameters()]
    assert all(b is not None for b in buffers)
    graphed(torch.randn(4, 8)).sum().backward()
    module.zero_grad(set_to_none=True)
    graphed(torch.randn(4, 8)).sum().backward()
    assert all(p.grad is b for p, b in zip(module.parameters(), buffers))


def _hook_state(module: torch.nn.Module) -> dict[str, tuple]:
    return {
        name: (p._backward_hooks, p._post_accumulate_grad_hooks, dict(vars(p)), p.grad)
        for name, p in module.named_parameters()
    }


@pytest.mark.parametrize("options", [
    {"fuse_grad_accumulation": True},
    {"fuse_grad_accumulation": True, "accumulator_hooks": "python"},
    {"overlap_grad_accumulation": True},
    {},
], ids=["fused-relay", "fused-python", "overlap", "default"])
def test_capture_and_reset_leave_the_parameters_hook_state_as_it_was(options):
    """Capture notes the order in which the backward reaches the parameters through tensor
    hooks it removes again; torch leaves an emptied hook dict behind, which capture takes
    away too, so a parameter that had no hooks has none (``_backward_hooks is None``)."""
    _, module = block_pair()
    before = _hook_state(module)
    assert all(hooks is None for hooks, *_ in before.values())
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), **options)
    module.zero_grad(set_to_none=True)  # capture's own gradient buffers aside
    assert _hook_state(module) == before
    graphed(torch.randn(4, 8)).sum().backward()
    leangraph.reset_all(graphed)
    module.zero_grad(set_to_none=True)
    assert _hook_state(module) == before


@HOOK_MODES
@pytest.mark.parametrize("set_to_none", [True, False, lambda step: step % 2 == 0],
                         ids=["none", "zero", "alternating"])
def test_interleaved_order_trains_exactly_and_hooks_follow_eager(set_to_none, hooks):
    order = leangraph.schedules.interleaved_1f1b(
        pp_size=2, vp_size=2, rank=0, num_microbatches=4)
    logs: dict[str, list] = {}
    history, graphed = train_both(order, [2, 2], width=8, microbatches=4, steps=3,
                                  set_to_none=set_to_none, hook_logs=logs,
                                  fuse_grad_accumulation=True, accumulator_hooks=hooks)
    assert_histories_equal(history, exact=True)
    # Once per parameter per backward (4 layers x 6 parameters x 4 microbatches), in order.
    assert [len(step) for step in logs["eager"]] == [96] * 3
    assert logs["graphed"] == logs["eager"]
    leangraph.reset_all(graphed)


@HOOK_MODES
def test_zero_bubble_weight_steps_accumulate_in_graph_with_hooks_at_the_weight_step(hooks):
    logs: dict[str, list] = {}
    history, graphed = train_both(ZB, [1, 1], width=8, microbatches=2, steps=3, hook_logs=logs,
                                  fuse_grad_accumulation=True, accumulator_hooks=hooks)
    assert_histories_equal(history, exact=True)
    assert logs["graphed"] == logs["eager"]
    leangraph.reset_all(graphed)


class _Megatron:
    """The part of Megatron-core's DDP the fused path meets: ``main_grad`` buffers (fp32)
    zeroed in place, the ``grad_added_to_main_grad`` flag, and a gradient-ready hook on each
    parameter's accumulator node that adds ``.grad`` into ``main_grad`` unless the flag is
    set, clears ``.grad`` and (with ``overlap_grad_reduce``) requires one to be there."""

    def __init__(self, module: torch.nn.Module, overlap_grad_reduce: bool,
                 hooks: bool = True) -> None:
        self.params = list(module.parameters())
        self.ready: list[int] = []
        self._overlap = overlap_grad_reduce
        self._nodes: list = []
        for p in self.params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            p.grad_added_to_main_grad = False
        if hooks:
            self.register_hooks()

    def register_hooks(self) -> None:
        for index, p in enumerate(self.params):
            node = p.expand_as(p).grad_fn.next_functions[0][0]
            node.register_hook(self._hook(index, p, self._overlap))
            self._nodes.append(node)  # Megatron keeps them too: the hooks live on the node

    def _hook(self, index, p, overlap_grad_reduce):
        def hook(*_):
            if overlap_grad_reduce:
                assert p.grad is not None, "param.grad being None is not safe with overlap"
            if p.grad is not None and not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad.data)
            p.grad = None
            self.ready.append(index)
        return hook

    def zero_grad_buffer(self) -> None:
        for p in self.params:
            p.main_grad.zero_()
            p.grad_added_to_main_grad = False


@HOOK_MODES
@pytest.mark.parametrize("overlap_grad_reduce", [False, True])
def test_main_grad_follows_megatrons_protocol_exactly_in_bf16(overlap_grad_reduce, hooks):
    eager, module = block_pair(dtype=torch.bfloat16)
    ddp_eager = _Megatron(eager, overlap_grad_reduce)
    ddp_graphed = _Megatron(module, overlap_grad_reduce)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True),),
        fuse_grad_accumulation=True, accumulator_hooks=hooks)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        for _ in range(3):
            x = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
            eager(x).float().square().sum().backward()
            graphed(x).float().square().sum().backward()
        assert ddp_graphed.ready == ddp_eager.ready and len(ddp_eager.ready) == 3 * 6
        for a, b in zip(eager.parameters(), module.parameters()):
            assert b.main_grad.dtype == torch.float32
            assert torch.equal(a.main_grad, b.main_grad)
            assert a.grad is None and b.grad is None
        for ddp in (ddp_eager, ddp_graphed):
            ddp.ready.clear()
            ddp.zero_grad_buffer()


@pytest.mark.parametrize("use", ["beside", "before", "after"])
@pytest.mark.parametrize("overlap_grad_reduce", [False, True])
def test_main_grad_of_a_parameter_also_used_eagerly_in_the_pass_gets_both_gradients(
        overlap_grad_reduce, use):
    """Megatron's protocol with the relay, for a parameter the backward pass reaches through
    the graph and eagerly (beside the graph's output, feeding its input, reading its
    output): autograd adds the eager gradient into ``.grad``, and Megatron's hook must add it
    into ``main_grad`` as eager's adds the sum. The stand-in ``.grad`` (a broadcast zero)
    made autograd's in-place addition fail with torch's "more than one element of the
    written-to tensor refers to a single memory location", and the flag would have had the
    hook drop the eager gradient."""
    eager, module = block_pair()
    ddp_eager = _Megatron(eager, overlap_grad_reduce)
    ddp_graphed = _Megatron(module, overlap_grad_reduce)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)

    def loss(layer, m, x):
        weight = m.down.weight  # (8, 16)
        if use == "beside":
            return layer(x).square().sum() + (weight * 3).square().sum()
        if use == "before":
            return layer(x + weight[:, :8].sum()).square().sum()
        return (layer(x) @ weight).square().sum()

    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        for _ in range(3):
            x = torch.randn(4, 8, generator=gen)
            loss(eager, eager, x).backward()
            loss(graphed, module, x).backward()
        assert ddp_graphed.ready == ddp_eager.ready and len(ddp_eager.ready) == 3 * 6
        for a, b in zip(eager.parameters(), module.parameters()):
            torch.testing.assert_close(a.main_grad, b.main_grad, rtol=1e-6, atol=1e-5)
            assert a.grad is None and b.grad is None
            assert not b.grad_added_to_main_grad
        for ddp in (ddp_eager, ddp_graphed):
            ddp.ready.clear()
            ddp.zero_grad_buffer()
    # The first microbatch onto zeroed buffers: the two sums round alike.
    x = torch.randn(4, 8, generator=gen)
    loss(eager, eager, x).backward()
    loss(graphed, module, x).backward()
    for a, b in zip(eager.parameters(), module.parameters()):
        assert torch.equal(a.main_grad, b.main_grad)
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "relay"])
def test_main_grad_gets_the_eager_gradient_of_a_parameter_the_graph_leaves_unreached(fuse):
    """Megatron's protocol where the loss uses only the output ``body`` alone reaches, and
    eager code in the same pass reads ``head.weight``: its gradient is eager's only, and
    Megatron's hook must add it into ``main_grad``. The replay passes over the hooks of the
    parameters it leaves unreached; it passed over this one's too, so ``main_grad`` missed the
    eager gradient."""
    torch.manual_seed(0)
    eager = TwoOutputs()
    module = copy.deepcopy(eager)
    ddp_eager = _Megatron(eager, overlap_grad_reduce=False)
    ddp_graphed = _Megatron(module, overlap_grad_reduce=False)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(3, 8, requires_grad=True),), fuse_grad_accumulation=fuse)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(3, 8, generator=gen)
        for fn, m in ((eager, eager), (graphed, module)):
            y, _ = fn(x.clone().requires_grad_())
            (y.square().sum() + (m.head.weight * 3).square().sum()).backward()
    assert sorted(ddp_graphed.ready) == sorted(ddp_eager.ready)
    assert len(ddp_eager.ready) == 3 * 3  # body's two parameters and head.weight, 3 times
    for a, b in zip(eager.parameters(), module.parameters()):
        assert torch.equal(a.main_grad, b.main_grad)
        assert a.grad is None and b.grad is None
    assert torch.count_nonzero(module.head.weight.main_grad) > 0
    leangraph.reset_all(graphed)


@HOOK_MODES
def test_a_parameter_shared_by_two_graphs_fires_its_hooks_once_per_backward(hooks):
    torch.manual_seed(0)
    shared = torch.nn.Linear(8, 8)
    eager_layers = [shared, shared]
    graphed_shared = copy.deepcopy(shared)
    counts = {"eager": 0, "graphed": 0}
    shared.weight.register_post_accumulate_grad_hook(
        lambda _: counts.__setitem__("eager", counts["eager"] + 1))
    graphed_shared.weight.register_post_accumulate_grad_hook(
        lambda _: counts.__setitem__("graphed", counts["graphed"] + 1))
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(2))
    graphed = leangraph.make_graphed_callables(
        (graphed_shared, graphed_shared), samples, order=[1, -1], num_layers_per_chunk=[2],
        fuse_grad_accumulation=True, accumulator_hooks=hooks)
    x = torch.randn(4, 8, requires_grad=True)
    eager_layers[1](eager_layers[0](x)).sum().backward()
    graphed[1](graphed[0](x)).sum().backward()
    assert counts == {"eager": 1, "graphed": 1}
    assert torch.equal(shared.weight.grad, graphed_shared.weight.grad)


class _TiedBf16(torch.nn.Module):
    """A bf16 layer training a weight it shares with another layer, and a bias of its own."""

    def __init__(self, shared: torch.nn.Parameter) -> None:
        super().__init__()
        self.shared = shared
        self.bias = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.shared.t() + self.bias)


def _tied_bf16_stacks() -> tuple[torch.nn.ModuleList, torch.nn.ModuleList]:
    torch.manual_seed(0)
    shared = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16) / 3)
    eager = torch.nn.ModuleList([_TiedBf16(shared), _TiedBf16(shared)])
    return eager, copy.deepcopy(eager)  # deepcopy keeps the tie


@pytest.mark.parametrize("into", ["main_grad", "grad"])
@HOOK_MODES
def test_a_weight_tied_across_callables_accumulates_as_eager_bitwise_in_bf16(into, hooks):
    """Eager sums a tied weight's two bf16 gradients and then accumulates the sum once: into
    an fp32 ``main_grad`` (Megatron's hook) or onto a ``.grad`` holding earlier passes'. The
    graphs of the layers tying it hand autograd their gradients, so that every pass adds
    what eager's adds; the rest stay fused."""
    eager, stack = _tied_bf16_stacks()
    if into == "main_grad":
        ddp = [_Megatron(eager, overlap_grad_reduce=False), _Megatron(stack, False)]
    samples = tuple((torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True),)
                    for _ in range(2))
    graphed = leangraph.make_graphed_callables(
        tuple(stack), samples, order=[1, -1], num_layers_per_chunk=[2],
        fuse_grad_accumulation=True, accumulator_hooks=hooks)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):  # never zeroed: each pass adds onto the ones before
        x = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
        for layers in (eager, graphed):
            layers[1](layers[0](x.clone().requires_grad_())).float().square().sum().backward()
    for a, b in zip(eager.parameters(), stack.parameters()):
        got, expected = (b.main_grad, a.main_grad) if into == "main_grad" else (b.grad, a.grad)
        assert torch.equal(got, expected)
    if into == "main_grad":
        # Each pass readies every parameter once; within a layer, in autograd's order.
        passes = [[sorted(d.ready[i:i + 3]) for i in range(0, 12, 3)] for d in ddp]
        assert passes[1] == passes[0] and len(ddp[0].ready) == 4 * 3
    leangraph.reset_all(graphed)


def test_only_the_graphs_of_layers_tying_a_weight_leave_accumulating_to_autograd():
    """A third layer, untied, still adds its gradients in its graph into the buffer the call
    attached, so a ``.grad`` the caller replaces with a tensor it holds is refused (R14); the
    tied weight's accumulates as in eager, into whichever ``.grad`` it has."""
    eager, stack = _tied_bf16_stacks()
    third = torch.nn.Linear(8, 8, dtype=torch.bfloat16)
    eager_third = copy.deepcopy(third)
    samples = tuple((torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True),)
                    for _ in range(3))
    graphed = leangraph.make_graphed_callables(
        (*stack, third), samples, order=[1, -1], num_layers_per_chunk=[3],
        fuse_grad_accumulation=True)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for layers in ((*eager, eager_third), graphed):
        layers[2](layers[1](layers[0](x))).float().sum().backward()
    kept = {}
    for name, model in (("eager", eager), ("graphed", stack)):
        kept[name] = model[0].shared.grad = torch.ones(8, 8, dtype=torch.bfloat16)
    for layers in ((*eager, eager_third), graphed):
        layers[2](layers[1](layers[0](x))).float().sum().backward()
    assert stack[0].shared.grad is kept["graphed"]
    assert torch.equal(kept["graphed"], kept["eager"])
    third.weight.grad = kept_third = torch.zeros(8, 8, dtype=torch.bfloat16)
    with raises(RuntimeError, "parameter 'weight': .grad is another tensor than at capture"):
        graphed[2](graphed[1](graphed[0](x))).float().sum().backward()
    del kept_third
    leangraph.reset_all(graphed)


@pytest.mark.parametrize(
    "held", ["by the caller", "as a view into a bucket", "as a view of a kept base",
             "beside another view"])
def test_r14_replaced_grad_held_elsewhere_is_refused_naming_the_parameter(held):
    _, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    graphed(torch.randn(4, 8)).sum().backward()
    weight = module.up.weight
    bucket = torch.zeros(2 * weight.numel())
    base = torch.zeros(weight.shape[::-1])
    if held == "by the caller":
        kept = weight.grad = torch.zeros_like(weight)
    elif held == "as a view into a bucket":
        weight.grad = bucket[: weight.numel()].view_as(weight)
    elif held == "as a view of a kept base":
        weight.grad = base.t()  # eager accumulates into base's memory
    else:
        kept = base[0]
        weight.grad = base.t()
        del base
    with raises(RuntimeError, "parameter 'up.weight': .grad is another tensor than at capture, "
                "which something else holds too", "zero_grad()"):
        graphed(torch.randn(4, 8)).sum().backward()


def _swap_grad_memory(buffer: torch.Tensor, how: str) -> None:
    fresh = torch.ones_like(buffer)
    if how == "set_":
        buffer.set_(fresh)
    else:
        buffer.data = fresh


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("how", ["data", "set_", "data while cleared"])
def test_r14_a_grad_whose_memory_was_swapped_is_refused_and_the_backward_keeps_its_place(
    how, device
):
    """``.grad.data = t`` (or ``.grad.set_(t)``) keeps the tensor the graph adds into but not
    its memory: the graph would add into the captured memory, which is no longer the
    gradient, and eager's backward would add into the new one. Refused at the backward replay,
    before anything changed: with the memory given back the same backward trains as the same
    graphs without the swap (and, on the CPU, as eager: on CUDA cuBLAS may pick other
    kernels for these tiny matmuls under capture than eagerly)."""
    eager, module = block_pair()
    eager, module, unswapped = eager.to(device), module.to(device), copy.deepcopy(module).to(device)
    graphed, reference = (
        leangraph.make_graphed_callables(
            m, (torch.randn(4, 8, device=device, requires_grad=True),),
            fuse_grad_accumulation=True)
        for m in (module, unswapped))
    x0, x1 = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
    for fn in (graphed, reference, eager):
        fn(x0).sum().backward()
    buffer = module.up.weight.grad
    captured = buffer.detach()  # the captured memory, to give back
    if how == "data while cleared":
        for m in (module, unswapped, eager):  # the buffer is attached again at the next backward
            m.zero_grad(set_to_none=True)
        captured.zero_()  # what the attaching does; eager starts from None
    _swap_grad_memory(buffer, "data" if how.startswith("data") else how)
    out = graphed(x1)
    with raises(RuntimeError, "callable 0 (Block) parameter 'up.weight': the .grad tensor the "
                "backward graph adds into holds other memory than at capture (.grad.data = ... "
                "or .grad.set_(...) swapped it)", "Change the .grad in place"):
        out.sum().backward()
    buffer.data = captured
    out.sum().backward()  # the refused backward ran nothing: it may run now
    reference(x1).sum().backward()
    eager(x1).sum().backward()
    for (name, a), b, c in zip(module.named_parameters(), unswapped.parameters(),
                               eager.parameters()):
        assert torch.equal(a.grad, b.grad), name
        if device == "cpu":
            assert torch.equal(a.grad, c.grad), name
    assert module.up.weight.grad is buffer


def test_r14_a_main_grad_whose_memory_was_swapped_is_refused():
    _, module = block_pair()
    _Megatron(module, overlap_grad_reduce=False)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    graphed(torch.randn(4, 8)).sum().backward()
    module.down.bias.main_grad.data = torch.zeros(8)
    with raises(RuntimeError, "parameter 'down.bias': the main_grad tensor the backward graph "
                "adds into holds other memory than at capture", "Change the main_grad in place"):
        graphed(torch.randn(4, 8)).sum().backward()


@HOOK_MODES
def test_a_new_grad_nothing_else_holds_is_adopted_and_trains_as_eager(hooks):
    """A ``.grad`` that only the parameter refers to (assigned afresh, or made by autograd for
    an eager backward, here an eval-mode step through the eager fallback) takes the buffer's
    place, its values kept: no one can tell the two apart."""
    eager, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    inputs = [torch.randn(4, 8) for _ in range(4)]
    for fn, m in ((graphed, module), (eager, eager)):
        fn(inputs[0]).sum().backward()
        m.up.weight.grad = torch.full_like(m.up.weight, 0.5)  # nothing else holds it
        fn(inputs[1]).sum().backward()
        m.zero_grad(set_to_none=True)
        m.eval()  # the eager fallback's backward makes a .grad of its own
        fn(inputs[2]).sum().backward()
        m.train()
        fn(inputs[3]).sum().backward()
    for (name, a), b in zip(module.named_parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_a_new_grad_of_another_layout_nothing_else_holds_is_adopted_as_at_capture():
    """A fresh ``.grad`` with other strides than the parameter's (eager accumulates into it,
    with a warning) was refused as "held elsewhere"; its values are adopted, as capture
    adopts such a ``.grad``, and training goes on as eager's."""
    eager, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    inputs = [torch.randn(4, 8) for _ in range(3)]
    for fn, m in ((graphed, module), (eager, eager)):
        fn(inputs[0]).sum().backward()
        shape = m.up.weight.shape
        m.up.weight.grad = torch.empty_strided(shape, (1, shape[0])).fill_(0.5)
        with warnings.catch_warnings():  # eager's: "Grad strides do not match bucket view"
            warnings.simplefilter("ignore")
            fn(inputs[1]).sum().backward()
            # A view of a tensor nothing else holds is one too (its base lives on in C++).
            m.up.weight.grad = m.up.weight.grad.t().contiguous().t()
            m.down.weight.grad = torch.full((2 * m.down.weight.numel(),), 0.25)[
                : m.down.weight.numel()].view_as(m.down.weight)
            fn(inputs[2]).sum().backward()
    for (name, a), b in zip(module.named_parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_replaced_main_grad_and_a_parameter_frozen_since_capture_are_refused():
    _, module = block_pair()
    _Megatron(module, overlap_grad_reduce=False)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    module.down.bias.main_grad = torch.zeros(8)
    out = graphed(torch.randn(4, 8)).sum()
    with raises(RuntimeError, "parameter 'down.bias': main_grad is another tensor than at capture"):
        out.backward(retain_graph=True)
    del module.down.bias.main_grad  # named as deleted, not as "another tensor"
    with raises(RuntimeError, "parameter 'down.bias': main_grad was deleted (or set to None) "
                "since capture", "got no main_grad"):
        out.backward()
    _, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    module.norm.weight.requires_grad_(False)
    with raises(RuntimeError, "parameter 'norm.weight' must require grad as at capture, got requires_grad=False"):
        graphed(torch.randn(4, 8)).sum().backward()


@HOOK_MODES
def test_a_main_grad_added_after_capture_is_refused_at_the_backward(hooks):
    """The graph adds into the ``.grad`` buffer capture chose for a parameter without
    ``main_grad``; one attached since (a DDP wrapper built after graphing) would get no
    gradient, where eager's Megatron-style hook would add into it."""
    _, module = block_pair()
    graphed, before = fused_after_one_step(module, hooks)
    module.down.weight.main_grad = torch.zeros(8, 8)
    out = graphed(torch.randn(4, 8)).sum()
    with raises(RuntimeError, "callable 0 (Block) parameter 'down.weight' got a main_grad "
                "since capture (torch.float32 of shape (8, 8) on cpu;", "so main_grad would "
                "get none. Attach main_grad before capture (wrap the model first), or delete it"):
        out.backward(retain_graph=True)
    assert_grads_unchanged(module, before)  # refused before the graph ran
    module.down.weight.main_grad = None  # not a tensor: no main_grad, as at capture
    out.backward()


def test_a_replaced_main_grad_is_named_with_what_was_expected_and_got():
    _, module = block_pair()
    _Megatron(module, overlap_grad_reduce=False)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    module.up.weight.main_grad = torch.zeros(3, dtype=torch.bfloat16)
    with raises(RuntimeError, "parameter 'up.weight': main_grad is another tensor than at "
                "capture; with fuse_grad_accumulation=True the backward graph adds into the "
                "main_grad it saw then (torch.float32 of shape (16, 8) on cpu), got "
                "torch.bfloat16 of shape (3,) on cpu", "Zero main_grad in place"):
        graphed(torch.randn(4, 8)).sum().backward()


def test_existing_grad_is_adopted_and_accumulation_continues_from_it():
    eager, module = block_pair()
    x = torch.randn(4, 8)
    eager(x).sum().backward()
    module(x).sum().backward()
    before = [p.grad for p in module.parameters()]
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    y = torch.randn(4, 8)
    eager(y).sum().backward()
    graphed(y).sum().backward()
    for a, b, g in zip(eager.parameters(), module.parameters(), before):
        assert b.grad is g and torch.equal(a.grad, b.grad)


def test_v22_option_and_main_grad_misuse_raise_before_warm_up():
    _, module = block_pair()
    warmed: list[bool] = []
    with raises(TypeError, "fuse_grad_accumulation must be a bool, got int 1"):
        leangraph.make_graphed_callables(
            module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=1)
    module.up.weight.main_grad = torch.zeros(3)
    with raises(ValueError, "parameter 'up.weight': fuse_grad_accumulation=True adds its gradient "
                "into main_grad, which must be a floating-point tensor of shape (16, 8) on cpu; "
                "got torch.float32 of shape (3,) on cpu"):
        leangraph.make_graphed_callables(
            module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
            pre_warmup_hook=lambda: warmed.append(True))
    assert warmed == []


@pytest.mark.parametrize("value", ["oops", [0.0] * 8, 0.0])
def test_v22_a_main_grad_that_is_no_tensor_is_refused_not_passed_over(value):
    """Only None means no main_grad: anything else set there is a mistake, which the graphs
    would silently leave out (adding into ``.grad`` instead)."""
    _, module = block_pair()
    module.up.weight.main_grad = value
    with raises(ValueError, "parameter 'up.weight': fuse_grad_accumulation=True adds its gradient "
                "into main_grad, which must be a floating-point tensor of shape (16, 8) on cpu; "
                f"got {type(value).__name__}"):
        leangraph.make_graphed_callables(
            module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)


def test_a_main_grad_of_none_keeps_the_replays_on_the_path_without_the_full_check(
        monkeypatch):
    """A parameter whose ``main_grad`` is None accumulates into ``.grad`` as one without it,
    and its replays skip the per-parameter check, which is for a changed target."""
    from leangraph.runtime.accumulation import InGraphAccumulation

    eager, module = block_pair()
    for p in module.parameters():
        p.main_grad = None
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    checked = []
    full_check = InGraphAccumulation._check_target
    monkeypatch.setattr(InGraphAccumulation, "_check_target",
                        lambda self, *a: checked.append(a) or full_check(self, *a))
    for _ in range(3):
        x = torch.randn(4, 8)
        for fn in (eager, graphed):
            fn(x).square().sum().backward()
    assert len(checked) == len(list(module.parameters()))  # at the first, which attaches .grad
    for a, b in zip(eager.parameters(), module.parameters()):
        assert torch.equal(a.grad, b.grad) and b.main_grad is None
    leangraph.reset_all(graphed)


def test_a_main_grad_that_is_no_tensor_set_after_capture_is_refused_at_the_backward():
    _, module = block_pair()
    graphed, before = fused_after_one_step(module, True)
    module.down.weight.main_grad = [0.0] * 8
    out = graphed(torch.randn(4, 8)).sum()
    with raises(RuntimeError, "callable 0 (Block) parameter 'down.weight' got a main_grad "
                "since capture (list;"):
        out.backward(retain_graph=True)
    assert_grads_unchanged(module, before)
    del module.down.weight.main_grad
    out.backward()


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(8, 8)
        self.unused = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_an_unused_parameter_keeps_no_grad_as_in_eager():
    torch.manual_seed(0)
    eager = _WithUnused()
    module = copy.deepcopy(eager)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), allow_unused_input=True,
        fuse_grad_accumulation=True)
    for _ in range(2):
        x = torch.randn(4, 8)
        eager(x).sum().backward()
        graphed(x).sum().backward()
    assert module.unused.weight.grad is None and eager.unused.weight.grad is None
    assert torch.equal(module.used.weight.grad, eager.used.weight.grad)


@pytest.mark.parametrize("share_buffers", [True, False])
def test_retained_backwards_accumulate_twice_as_eager_does(share_buffers):
    eager, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), retain_graph_in_backward=True,
        share_buffers=share_buffers, fuse_grad_accumulation=True)
    x = torch.randn(4, 8)
    out_eager, out = eager(x).square().sum(), graphed(x).square().sum()
    for _ in range(2):
        out_eager.backward(retain_graph=True)
        out.backward(retain_graph=True)
    for a, b in zip(eager.parameters(), module.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_compiled_module_accumulates_in_graph_exactly():
    eager, module = block_pair()
    compiled = torch.compile(module, backend="aot_eager")
    graphed = leangraph.make_graphed_callables(
        compiled, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    for _ in range(3):
        x = torch.randn(4, 8)
        eager(x).square().sum().backward()
        graphed(x).square().sum().backward()
    for a, b in zip(eager.parameters(), module.parameters()):
        assert torch.equal(a.grad, b.grad)


def _two_layer_hook_logs(register, *, before_capture: bool, hooks: bool | str = True):
    """Eager and fused-graphed runs of the same two chained layers, every parameter hooked by
    ``register(param, record)`` (before or after capture) and the gradient between the layers
    hooked too: each run's log of hook events, the eager and graphed layers, and the graphed
    callables (the caller resets them)."""
    torch.manual_seed(0)
    eager = [Block(8), Block(8)]
    layers = copy.deepcopy(eager)
    logs: dict[str, list[str]] = {"eager": [], "graphed": []}

    def hook_all() -> None:
        for name, modules in (("eager", eager), ("graphed", layers)):
            for index, module in enumerate(modules):
                for pname, p in module.named_parameters():
                    register(p, functools.partial(logs[name].append, f"{index}.{pname}"))

    if before_capture:
        hook_all()
    graphed = leangraph.make_graphed_callables(
        tuple(layers), ((torch.randn(4, 8, requires_grad=True),),) * 2, order=[1, -1],
        num_layers_per_chunk=2, fuse_grad_accumulation=True, accumulator_hooks=hooks)
    if not before_capture:
        hook_all()
    x = torch.randn(4, 8)
    for name, lookup in (("eager", eager), ("graphed", graphed)):
        hidden = lookup[0](x.clone().requires_grad_())
        hidden.register_hook(lambda _, log=logs[name]: log.append("between the layers"))
        lookup[1](hidden).square().sum().backward()
    return logs, eager, layers, graphed


@HOOK_MODES
def test_hooks_fire_right_after_their_layer_as_in_eager(hooks):
    """A layer's accumulators run as soon as its backward replay ran, before the previous
    layer's: the events of parameter hooks and of a hook on the gradient between the layers
    come in eager's order."""
    logs, _, _, graphed = _two_layer_hook_logs(
        lambda p, record: p.register_post_accumulate_grad_hook(lambda _: record()),
        before_capture=False, hooks=hooks)
    assert logs["graphed"] == logs["eager"]
    assert logs["eager"].index("between the layers") == 6  # after layer 1's six parameters
    leangraph.reset_all(graphed)


def test_where_nodes_cannot_be_renumbered_a_view_relay_keeps_eagers_order(monkeypatch):
    """The fallback relay (views of the parameters, ordered by their nodes' creation) fires
    the same hooks in the same order, after the rest of the backward pass."""
    import leangraph.build.accumulation as accumulation
    monkeypatch.setattr(accumulation, "_can_renumber", lambda nodes: False)
    order = leangraph.schedules.interleaved_1f1b(
        pp_size=2, vp_size=2, rank=0, num_microbatches=4)
    logs: dict[str, list] = {}
    history, graphed = train_both(order, [2, 2], width=8, microbatches=4, steps=2,
                                  hook_logs=logs, fuse_grad_accumulation=True)
    assert_histories_equal(history, exact=True)
    assert logs["graphed"] == logs["eager"]
    assert all(not g._record.fused.relay.nodes for g in graphed)  # the view relay
    leangraph.reset_all(graphed)


@HOOK_MODES
@pytest.mark.parametrize("before_capture", [True, False], ids=["before", "after"])
def test_hooks_on_accumulator_nodes_fire_right_after_their_layer_as_in_eager(
        hooks, before_capture):
    """Hooks on the accumulator nodes themselves, registered before or after capture (as
    Megatron-core's DDP does, wrapping before or after graphing), the nodes held as DDP's
    reducer and Megatron-core's DDP hold them: they too fire as soon as their layer's
    backward replay ran, in eager's order."""
    held = []

    def on_node(p, record):
        node = p.view_as(p).grad_fn.next_functions[0][0]
        node.register_hook(lambda *_: record())
        held.append(node)

    logs, eager, layers, graphed = _two_layer_hook_logs(
        on_node, before_capture=before_capture, hooks=hooks)
    assert logs["graphed"] == logs["eager"]
    assert logs["eager"].index("between the layers") == 6  # after layer 1's six parameters
    for a, b in zip(eager, layers):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa.grad, pb.grad)
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("hooks", [True, "python", False], ids=["relay", "python", "none"])
def test_r18_a_backward_pass_that_accumulates_into_no_parameter_is_refused(hooks):
    """``torch.autograd.grad`` leaves eager's ``.grad`` alone, and the fused graph would add
    every gradient: refused before it runs; a plain backward of the same replay then trains
    as eager's."""
    eager, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    x = torch.randn(4, 8, requires_grad=True)
    out = graphed(x).square().sum()
    with raises(RuntimeError, "callable 0 (Block): this backward pass accumulates no gradient "
                "into some or all of its parameters (torch.autograd.grad",
                "Use backward() without inputs"):
        torch.autograd.grad(out, x, retain_graph=True)
    assert all(p.grad is None for p in module.parameters())
    eager(x).square().sum().backward()
    out.backward()  # the refused pass left the replay's backward to run
    for a, b in zip(eager.parameters(), module.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("wrt", ["parameters", "input and parameters"])
def test_r18_autograd_grad_with_respect_to_the_parameters_is_refused_with_the_relay(wrt):
    """``torch.autograd.grad`` asked for the relay's parameters themselves: autograd captures
    their gradients instead of running their accumulators (torch's check of a captured leaf
    raised its own "A leaf node was passed to _will_engine_execute_node"); refused as R18,
    and a plain backward of the same replay then trains as eager's."""
    eager, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    x = torch.randn(4, 8, requires_grad=True)
    out = graphed(x).square().sum()
    inputs = list(module.parameters()) + ([x] if wrt != "parameters" else [])
    with raises(RuntimeError, "callable 0 (Block): this backward pass accumulates no gradient "
                "into some or all of its parameters (torch.autograd.grad"):
        torch.autograd.grad(out, inputs, retain_graph=True)
    assert all(p.grad is None for p in module.parameters())
    eager(x).square().sum().backward()
    out.backward()
    for a, b in zip(eager.parameters(), module.parameters()):
        assert torch.equal(a.grad, b.grad)
    leangraph.reset_all(graphed)


def test_r18_autograd_grad_of_a_parameter_also_used_outside_the_graph_with_python_hooks():
    """With ``accumulator_hooks="python"`` the replay checks that no accumulator of its
    parameters runs outside it; ``torch.autograd.grad`` asking for one that eager code uses
    too captured it, and torch's helper raised its own error there: refused as R18."""
    _, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks="python")
    weight = module.norm.weight
    out = graphed(torch.randn(4, 8) * weight).sum()
    with raises(RuntimeError, "callable 0 (Block): this backward pass accumulates no gradient "
                "into some or all of its parameters (torch.autograd.grad"):
        torch.autograd.grad(out, [weight])
    assert all(p.grad is None for p in module.parameters())
    leangraph.reset_all(graphed)


def test_r18_with_the_relay_a_backward_into_some_parameters_is_refused():
    """``backward(inputs=[...])`` accumulates into the parameters named only. The relay
    hands autograd every parameter, so it sees which; without it (``"python"``, False) the
    replay is on no path to a parameter and autograd does not run it (docs/concepts.md)."""
    _, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True)
    out = graphed(torch.randn(4, 8)).sum()
    with raises(RuntimeError, "this backward pass accumulates no gradient into some or all"):
        out.backward(inputs=[module.up.weight])
    assert module.up.weight.grad is None


def test_two_calls_training_one_parameter_share_its_buffer():
    """Modules tied to the same parameters, graphed by two calls while ``.grad`` is None:
    the second call adds into the buffer the first allocated, so either's replay finds it
    attached as ``.grad`` and both train it as eager does."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    second.weight, second.bias = first.weight, first.bias
    eager = copy.deepcopy((first, second))
    graphed = [leangraph.make_graphed_callables(
        module, (torch.randn(rows, 8, requires_grad=True),), fuse_grad_accumulation=True)
        for module, rows in ((first, 4), (second, 2))]
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        for which, rows in ((0, 4), (1, 2), (0, 4)):
            x = torch.randn(rows, 8, generator=gen)
            eager[which](x).square().sum().backward()
            graphed[which](x).square().sum().backward()
        for a, b in zip(eager[0].parameters(), first.parameters()):
            assert torch.equal(a.grad, b.grad)
        for module in (*eager, first, second):
            module.zero_grad(set_to_none=step == 0)


@pytest.mark.parametrize("between", ["an eager backward", "zero_grad and an eager backward"])
@pytest.mark.parametrize("grad_at_first", [False, True], ids=["no-grad", "grad"])
def test_two_calls_share_the_buffer_whatever_grad_the_second_capture_finds(
        grad_at_first, between):
    """The same module graphed by two calls (one per batch size), with an eager backward of
    it between the captures (a step run eagerly, say): the second call found a ``.grad``
    autograd made and added into that, the first into its own buffer, so every replay after
    was refused (R14, '.grad is another tensor than at capture, which something else holds
    too'). The second call adds into the first's buffer, given the ``.grad`` values."""
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 8)
    eager = copy.deepcopy(module)
    if grad_at_first:  # the first call adopts this .grad as its buffer
        x = torch.randn(3, 8)
        for m in (eager, module):
            m(x).sum().backward()
    first = leangraph.make_graphed_callables(
        (module,), ((torch.randn(4, 8, requires_grad=True),),), order=[1, -1],
        fuse_grad_accumulation=True)[0]
    gen = torch.Generator().manual_seed(1)
    for m in (eager, module):
        if between.startswith("zero_grad"):
            m.zero_grad()
        m(torch.randn(2, 8, generator=torch.Generator().manual_seed(2))).square().sum().backward()
    second = leangraph.make_graphed_callables(
        (module,), ((torch.randn(2, 8, requires_grad=True),),), order=[1, -1],
        fuse_grad_accumulation=True)[0]
    for step in range(2):
        for graphed, rows in ((first, 4), (second, 2), (first, 4)):
            x = torch.randn(rows, 8, generator=gen)
            eager(x).square().sum().backward()
            graphed(x).square().sum().backward()
        for a, b in zip(eager.parameters(), module.parameters()):
            assert torch.equal(a.grad, b.grad)
        for m in (eager, module):
            m.zero_grad(set_to_none=step == 0)
    leangraph.reset_all((first, second))


@pytest.mark.parametrize("hooks", [True, "python", False], ids=["relay", "python", "none"])
def test_r14_a_tensor_hook_added_to_a_parameter_after_capture_is_refused(hooks):
    """Fused, the graph adds the gradient itself: a ``register_hook`` hook could neither see
    nor change it before it lands, as eager's does (the relay would call it with None)."""
    _, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    handle = module.up.weight.register_hook(lambda grad: grad * 2)
    before = module.up.weight.grad
    out = graphed(torch.randn(4, 8))
    try:
        out.sum().backward()
    except RuntimeError as exc:
        message = str(exc)  # the traceback, which holds the replay's node, goes with `exc`
    else:
        pytest.fail("no refusal")
    del out
    assert "parameter 'up.weight' got a tensor hook (register_hook) since capture" in message
    assert module.up.weight.grad is before  # refused before the graph ran
    handle.remove()
    graphed(torch.randn(4, 8)).sum().backward()


@pytest.mark.parametrize("hooks", [True, "python", False], ids=["relay", "python", "none"])
@pytest.mark.parametrize("optimizer", [
    functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
    functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
], ids=["adamw", "sgd-momentum"])
def test_parameters_only_an_output_without_gradient_reaches_keep_no_grad(hooks, optimizer):
    """Eager leaves ``.grad`` None for what only an output outside the loss reaches, so the
    optimizer skips it; the graph adds zeros into its buffer, which stays detached. Were it
    attached, AdamW would decay ``head`` and SGD's momentum move it."""
    torch.manual_seed(0)
    eager = TwoOutputs()
    module = copy.deepcopy(eager)
    logs: dict[str, list[str]] = {"eager": [], "graphed": []}
    if hooks == "python":  # the hooks replays call themselves fire as eager's
        _log_hooks(eager, logs["eager"])
        _log_hooks(module, logs["graphed"])
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    optims = [optimizer(m.parameters()) for m in (eager, module)]
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        for microbatch in range(2):
            x = torch.randn(4, 8, generator=gen)
            # Steps 0 and 2 leave the head out; step 1 uses it in one microbatch only.
            with_head = step == 3 or (step == 1 and microbatch == 1)
            for fn in (eager, graphed):
                y, h = fn(x)
                (y.square().sum() + (h.sum() if with_head else 0)).backward()
        for (name, a), b in zip(module.named_parameters(), eager.parameters()):
            assert (a.grad is None) == (b.grad is None), (step, name)
            assert b.grad is None or torch.equal(a.grad, b.grad), (step, name)
        for optim in optims:
            optim.step()
            optim.zero_grad()
        for a, b in zip(module.parameters(), eager.parameters()):
            assert torch.equal(a, b), step
    assert logs["graphed"] == logs["eager"]
    leangraph.reset_all(graphed)
