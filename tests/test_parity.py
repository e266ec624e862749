"""Drop-in parity with ``torch.cuda.make_graphed_callables`` and with eager autograd.

PyTorch's own test cases for its make_graphed_callables (``test/test_cuda.py``:
``test_graph_make_graphed_callables`` for each autocast / cache / unused-input combination,
``..._parameterless_nograd_module`` and ``..._same_pool``), restated in our own code with the
same assertions, run on the CPU reference backend and (marked ``cuda``) on a GPU with torch's
sizes. Then what real models bring: parameter hooks, ``torch.compile``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import leangraph

CUDA = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (N, D_in, H, D_out): torch's sizes on a GPU, small ones for the CPU reference backend.
SIZES = {"cuda": (640, 4096, 2048, 1024), "cpu": (32, 64, 48, 16)}
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[CUDA, needs_cuda])]
# torch's combinations: (with_amp, cache_enabled, allow_unused_input) and whether torch's own
# test expects it to fail (the autocast cache; an unused input that requires grad).
COMBINATIONS = [
    pytest.param(False, False, True, None, id="without_amp_allow_unused_input"),
    pytest.param(True, False, True, None, id="with_amp_cache_disabled_allow_unused_input"),
    pytest.param(True, True, True, "autocast cache", id="with_amp_cache_enabled_allow_unused"),
    pytest.param(False, False, False, "do not depend on", id="without_amp_not_allow_unused"),
]


def _autocast(device: str, enabled: bool, cache_enabled: bool) -> torch.autocast:
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    return torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


def _seed(device: str) -> None:
    torch.manual_seed(5)
    if device == "cuda":
        torch.cuda.manual_seed(5)


class FirstSection(nn.Module):
    """Two linear layers with dropout, called with a dict holding an unused input."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.net_1 = nn.Sequential(nn.Linear(d_in, hidden), nn.Dropout(p=0.1))
        self.net_2 = nn.Sequential(nn.Linear(hidden, d_out), nn.Dropout(p=0.2))

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.net_2(self.net_1(inputs["x"]))


class SecondSection(FirstSection):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.net_2(self.net_1(x))


class Gather(nn.Module):
    """No parameters; returns a dict."""

    def forward(self, x: torch.Tensor) -> dict:
        index = torch.arange(x.size(0), device=x.device).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, index)}


class GatherDict(Gather):
    def forward(self, inputs: dict) -> dict:  # type: ignore[override]
        return super().forward(inputs["x"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("with_amp", "cache_enabled", "allow_unused", "refused"), COMBINATIONS)
def test_torch_case_make_graphed_callables(device, with_amp, cache_enabled, allow_unused, refused):
    n, d_in, hidden, d_out = SIZES[device]
    _seed(device)
    models = [
        nn.Sequential(
            FirstSection(d_in, hidden, hidden), SecondSection(hidden, hidden, d_out), Gather()
        ).to(device)
        for _ in range(2)
    ]
    graphed, control = models
    graphed.load_state_dict(control.state_dict())
    opt_graphed = torch.optim.SGD(graphed.parameters(), lr=0.1)
    opt_control = torch.optim.SGD(control.parameters(), lr=0.1)
    # torch's test samples every activation in fp32 and lets its copy into the static input
    # cast what autocast gives; a replay here must get the captured dtype (R5), so the
    # samples are in the dtype each section receives: autocast's after the first.
    act = _autocast(device, True, False).fast_dtype if with_amp else torch.float32
    x = torch.randn(n, d_in, device=device)
    h = torch.randn(n, hidden, device=device, dtype=act, requires_grad=True)
    h2 = torch.randn(n, d_out, device=device, dtype=act, requires_grad=True)
    unused = torch.randn(n, hidden, device=device, requires_grad=True)
    y_pred = torch.randn(n, d_out, device=device, dtype=act, requires_grad=True)
    y = torch.randn(n, d_out, device=device)
    relu, loss_fn = torch.nn.functional.relu, torch.nn.functional.mse_loss
    callables = (graphed[0], graphed[1], graphed[2], relu, loss_fn)
    samples = (({"x": x, "unused_input": unused},), (h,), (h2,), (y_pred,), (y_pred, y))
    with _autocast(device, with_amp, cache_enabled):
        if refused is not None:  # torch's own test expects these to fail
            with pytest.raises((RuntimeError, ValueError), match=refused):
                leangraph.make_graphed_callables(
                    callables, samples, allow_unused_input=allow_unused
                )
            return
        *sections, relu_graphed, loss_graphed = leangraph.make_graphed_callables(
            callables, samples, allow_unused_input=allow_unused
        )
    for index, section in enumerate(sections):
        graphed[index] = section
    inputs = [torch.rand_like(x) for _ in range(10)]
    targets = [torch.rand_like(y) for _ in range(10)]
    runs = ((graphed, opt_graphed, relu_graphed, loss_graphed), (control, opt_control, relu, loss_fn))
    for model, opt, relu_fn, loss_of in runs:
        _seed(device)  # the same dropout masks for both
        for data, target in zip(inputs, targets):
            opt.zero_grad(set_to_none=True)
            with _autocast(device, with_amp, cache_enabled):
                out = relu_fn(model({"x": data, "unused_input": unused})["output"])
                loss_of(out, target).backward()
            opt.step()
    for p, q in zip(graphed.parameters(), control.parameters()):
        torch.testing.assert_close(p, q)
    graphed.eval()
    control.eval()  # graphed in training mode: eval runs eagerly
    torch.testing.assert_close(graphed({"x": inputs[0]}), control({"x": inputs[0]}))
    leangraph.reset_all(tuple(sections) + (relu_graphed, loss_graphed))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("with_amp", "cache_enabled", "allow_unused", "refused"), COMBINATIONS)
def test_torch_case_parameterless_nograd_module(
    device, with_amp, cache_enabled, allow_unused, refused
):
    n, d_in, hidden, _ = SIZES[device]
    if refused == "do not depend on":
        refused = None  # nothing requires grad here: torch's own test runs this one
    _seed(device)
    graphed, control = (nn.Sequential(GatherDict()).to(device) for _ in range(2))
    x = torch.randn(n, d_in, device=device)
    unused = torch.randn(n, hidden, device=device)
    with _autocast(device, with_amp, cache_enabled):
        if refused is not None:
            with pytest.raises(RuntimeError, match=refused):
                leangraph.make_graphed_callables(
                    graphed[0], ({"x": x, "unused_input": unused},), allow_unused_input=allow_unused
                )
            return
        graphed[0] = leangraph.make_graphed_callables(
            graphed[0], ({"x": x, "unused_input": unused},), allow_unused_input=allow_unused
        )
    inputs = [torch.rand_like(x, requires_grad=True) for _ in range(10)]
    with pytest.warns(UserWarning, match="requires grad at replay but did not at capture"):
        for model in (graphed, control):
            _seed(device)
            for data in inputs:
                with _autocast(device, with_amp, cache_enabled):
                    model({"x": data, "unused_input": unused})["output"]
    graphed.eval()
    control.eval()
    torch.testing.assert_close(graphed({"x": inputs[0]}), control({"x": inputs[0]}))
    leangraph.reset_all(graphed[0])


@pytest.mark.parametrize("device", DEVICES)
def test_torch_case_same_pool(device):
    _seed(device)
    models = [
        nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128)).to(device)
        for _ in range(3)
    ]
    pool = torch.cuda.graph_pool_handle() if device == "cuda" else None
    graphed_models = []
    for model in models:
        x = torch.randn(64, 32, device=device)
        graphed_models.append(
            leangraph.make_graphed_callables(copy.deepcopy(model), (x,), pool=pool)
        )
    for model, graphed_model in zip(models, graphed_models):
        x = torch.randn(64, 32, device=device)
        y, yg = model(x), graphed_model(x)
        loss, loss_graphed = y.norm(), yg.norm()
        loss.backward()
        loss_graphed.backward()
        torch.testing.assert_close(y, yg)
        torch.testing.assert_close(loss, loss_graphed)
        for p, pg in zip(model.parameters(), graphed_model.parameters()):
            torch.testing.assert_close(p, pg)
            torch.testing.assert_close(p.grad, pg.grad)
            assert p.data_ptr() != pg.data_ptr()
            assert p.grad.data_ptr() != pg.grad.data_ptr()
    for graphed_model in graphed_models:
        leangraph.reset_all(graphed_model)


# ------------------------------------------------------------------------- parameter hooks


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_post_accumulate_grad_hooks_fire_once_per_accumulation_as_in_eager():
    torch.manual_seed(0)
    graphed_layer, eager_layer = Scaled(), Scaled()
    eager_layer.load_state_dict(graphed_layer.state_dict())
    fired: dict[str, list[str]] = {"graphed": [], "eager": []}
    for name, layer in (("graphed", graphed_layer), ("eager", eager_layer)):
        for pname, param in layer.named_parameters():
            param.register_post_accumulate_grad_hook(
                lambda p, name=name, pname=pname: fired[name].append(pname)
            )
    graphed = leangraph.make_graphed_callables(graphed_layer, (torch.randn(2, 4),))
    for _ in range(3):
        x = torch.randn(2, 4)
        graphed(x).sum().backward()
        eager_layer(x).sum().backward()
        # Once per parameter per backward, as eager; within one replay's backward they fire
        # in parameter order, where eager's follow its own autograd graph.
        assert sorted(fired["graphed"]) == sorted(fired["eager"]) == ["lin.bias", "lin.weight"]
        fired["graphed"].clear()
        fired["eager"].clear()
    for p, q in zip(graphed_layer.parameters(), eager_layer.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_backward_dw_fires_post_accumulate_grad_hooks_once_each():
    torch.manual_seed(0)
    layer = Scaled()
    reference = copy.deepcopy(layer)
    fired: list[tuple[str, torch.Tensor]] = []
    for name, param in layer.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: fired.append((name, p.grad.clone()))
        )
    graphed = leangraph.make_graphed_callables(
        (layer,), ((torch.randn(2, 4, requires_grad=True),),), order=[1, -1, -1.5]
    )[0]
    for step in range(2):
        x = torch.randn(2, 4, requires_grad=True)
        graphed(x).sum().backward()
        assert len(fired) == 2 * step  # input gradients only: no parameter accumulated yet
        graphed.backward_dw()
        reference(x.detach()).sum().backward()
        assert sorted(name for name, _ in fired[2 * step:]) == ["lin.bias", "lin.weight"]
        for name, grad in fired[2 * step:]:  # each hook saw the accumulated gradient
            assert torch.equal(grad, dict(reference.named_parameters())[name].grad)


def test_tensor_hooks_on_inputs_run_once_as_in_eager():
    torch.manual_seed(0)
    layer = Scaled()
    reference = copy.deepcopy(layer)
    graphed = leangraph.make_graphed_callables(layer, (torch.randn(2, 4, requires_grad=True),))
    seen = []
    x = torch.randn(2, 4, requires_grad=True)
    x.register_hook(lambda g: (seen.append(1), g * 3)[1])
    x_ref = x.detach().clone().requires_grad_()
    x_ref.register_hook(lambda g: g * 3)
    graphed(x).sum().backward()
    reference(x_ref).sum().backward()
    assert seen == [1] and torch.equal(x.grad, x_ref.grad)


# ------------------------------------------------------------------------- torch.compile


def _compiled(module: nn.Module) -> nn.Module:
    # aot_eager traces through AOTAutograd, as inductor does, without compiling kernels.
    return torch.compile(module, backend="aot_eager")


def test_compiled_module_drop_in_trains_like_eager_and_falls_back_in_eval():
    torch.manual_seed(0)
    layer = Scaled()
    reference = copy.deepcopy(layer)
    compiled = _compiled(layer)
    graphed = leangraph.make_graphed_callables(compiled, (torch.randn(2, 4, requires_grad=True),))
    assert graphed is compiled
    for _ in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        out = graphed(x)
        assert torch.equal(out, reference(x.detach()))
        out.sum().backward()
        reference(x.detach()).sum().backward()
    for p, q in zip(layer.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    graphed.eval()
    reference.eval()
    x = torch.randn(3, 4)  # another shape: only eager (the compiled forward) takes it
    torch.testing.assert_close(graphed(x), reference(x))
    leangraph.reset_all(graphed)


def test_compiled_functions_and_modules_in_an_order():
    torch.manual_seed(0)
    weight = torch.randn(4, 4, requires_grad=True)

    def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w)

    layers = (_compiled(Scaled()), torch.compile(project, backend="aot_eager"))
    samples = []
    for _ in range(2):  # chunk 1: the module, microbatches 0 and 1; chunk 2: the function
        samples.append((torch.randn(2, 4, requires_grad=True),))
    for _ in range(2):
        samples.append((torch.randn(2, 4, requires_grad=True), weight))
    graphed = leangraph.make_graphed_callables(
        layers, tuple(samples), order=[1, 2, -2, -1, 1, 2, -2, -1]
    )
    for microbatch in range(2):
        x = torch.randn(2, 4, requires_grad=True)
        hidden = graphed[microbatch](x)
        out = graphed[2 + microbatch](hidden, weight)
        torch.testing.assert_close(out, project(layers[0](x), weight))
        out.sum().backward()
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("made_at_first_trace", [False, True], ids=["made", "made_at_first_trace"])
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_around_a_graphed_module_replays_it_at_every_call(
    device, made_at_first_trace, monkeypatch
):
    """A graphed module inside a model that torch.compile compiles is a graph break: its call
    runs eagerly, with every frame it runs. Before, dynamo compiled the frames the call ran
    after its graph breaks (the CPU backend's replay of recorded ops among them: Inductor's
    kernels then computed other values than capture's, off by 1e-7). The eager wrapper is made
    at the first call dynamo traces (``made_at_first_trace``: as in a process that imports
    dynamo only after capture), and reused after."""
    from leangraph.runtime import graphed as graphed_module

    torch.manual_seed(0)
    inner = Scaled().to(device)
    reference = copy.deepcopy(inner)
    leangraph.make_graphed_callables(inner, (torch.randn(2, 4, device=device, requires_grad=True),))
    if made_at_first_trace:
        monkeypatch.setattr(graphed_module, "_UNCOMPILED_CALL", [])
    model = nn.Sequential(nn.Hardtanh(-2.0, 2.0), inner, nn.ReLU())
    eager = nn.Sequential(nn.Hardtanh(-2.0, 2.0), reference, nn.ReLU())
    traced_from: list[str] = []  # the source lines of every op dynamo hands a backend

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        for node in graph_module.graph.nodes:
            traced_from.append(node.meta.get("stack_trace") or "")
        return graph_module.forward

    compiled = torch.compile(model, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, expected = compiled(x), eager(x_eager)
        assert torch.equal(out, expected)
        out.sum().backward()
        expected.sum().backward()
        assert torch.equal(x.grad, x_eager.grad)
    for p, q in zip(inner.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    leangraph_dir = str(Path(leangraph.__file__).parent)
    assert not [t for t in traced_from if leangraph_dir in t]  # none of leangraph's frames
    assert len(graphed_module._UNCOMPILED_CALL) == 1  # made once, whichever call made it
    inner.lin.weight.data = inner.lin.weight.data.clone()  # the graphs train the old memory
    with pytest.raises(RuntimeError, match="must keep the data it was captured with"):
        compiled(torch.randn(2, 4, device=device, requires_grad=True))
    leangraph.reset_all(inner)


@CUDA
@needs_cuda
def test_inductor_compiled_layers_graph_on_cuda_drop_in_and_ordered():
    """torch.compile's default backend (Inductor's Triton kernels) inside leangraph's capture."""
    torch.manual_seed(0)
    layers = [Scaled().cuda() for _ in range(2)]
    reference = copy.deepcopy(layers)
    compiled = tuple(torch.compile(layer) for layer in layers)
    samples = tuple((torch.randn(2, 4, device="cuda", requires_grad=True),) for _ in range(4))
    graphed = leangraph.make_graphed_callables(compiled, samples, order=[1, 2, -2, -1] * 2)
    for microbatch in range(2):
        x = torch.randn(2, 4, device="cuda", requires_grad=True)
        out = graphed[2 + microbatch](graphed[microbatch](x))
        expected = reference[1](reference[0](x.detach()))
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
    for layer, ref in zip(layers, reference):
        for p, q in zip(layer.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    leangraph.reset_all(graphed)
    single = torch.compile(Scaled().cuda())
    graphed_single = leangraph.make_graphed_callables(
        single, (torch.randn(2, 4, device="cuda", requires_grad=True),)
    )
    graphed_single(torch.randn(2, 4, device="cuda", requires_grad=True)).sum().backward()
    leangraph.reset_all(graphed_single)


class _Broadcast(torch.nn.Module):
    """Returns an expanded (stride-0) view: a broadcast mean, as a mask or bias may be."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).mean(0, keepdim=True).expand(6, 8)


def _broadcast_output_trains_like_eager(device: str, **options) -> None:
    torch.manual_seed(0)
    module = _Broadcast().to(device)
    eager = copy.deepcopy(module)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(6, 8, device=device, requires_grad=True),), **options)
    for step in range(3):
        x = torch.randn(6, 8, device=device)
        out, want = graphed(x), eager(x)
        assert out.stride() == want.stride() == (0, 1) and torch.equal(out, want), step
        (out * torch.arange(6.0, device=device)[:, None]).sum().backward()
        (want * torch.arange(6.0, device=device)[:, None]).sum().backward()
    for a, b in zip(module.parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad)
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("fuse", [False, True])
def test_an_expanded_output_replays_like_eager(fuse: bool) -> None:
    _broadcast_output_trains_like_eager("cpu", fuse_grad_accumulation=fuse)


@pytest.mark.cuda
@pytest.mark.parametrize("fuse", [False, True])
def test_an_expanded_output_replays_like_eager_on_cuda(fuse: bool) -> None:
    _broadcast_output_trains_like_eager("cuda", fuse_grad_accumulation=fuse)


def _batch_norm_updates_after_capture(device: str) -> int:
    norm = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).to(device)
    graphed = leangraph.make_graphed_callables(
        norm, (torch.randn(8, 4, device=device, requires_grad=True),), num_warmup_iters=2)
    tracked = int(norm[1].num_batches_tracked)
    graphed(torch.randn(8, 4, device=device)).sum().backward()
    assert int(norm[1].num_batches_tracked) == tracked + 1  # every replay updates them
    leangraph.reset_all(graphed)
    return tracked


def test_warmup_and_capture_leave_module_buffers_as_they_were():
    """Neither the warm-up passes nor the capture (which a CUDA graph records without running;
    the CPU backend runs it) leave BatchNorm's statistics changed: the samples' values are
    nobody's data. Replays update them, as eager steps would."""
    assert _batch_norm_updates_after_capture("cpu") == 0


@pytest.mark.cuda
def test_warmup_and_capture_leave_module_buffers_as_they_were_on_cuda():
    assert _batch_norm_updates_after_capture("cuda") == 0
