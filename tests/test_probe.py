"""The probe: one forward per distinct callable and signature, facts for every later stage."""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch
from helpers import Opaque, raises, sample
from models import Block

import leangraph
from leangraph._call import validate_call
from leangraph.buffers import BufferKey
from leangraph.probe import probe

mgc = leangraph.make_graphed_callables


def _facts(callables, samples, order=None, **kwargs):
    return probe(validate_call(callables, samples, None, order, None), **kwargs)


def test_facts_say_what_each_graph_returns_needs_and_trains():
    block = Block(8)
    block.norm.weight.requires_grad_(False)
    frozen = lambda x: (x * 2).detach()  # noqa: E731
    samples = ((torch.randn(4, 8, requires_grad=True),), (torch.randn(4, 8),))
    trained, plain = _facts((block, frozen), samples)
    key = BufferKey((4, 8), torch.float32, torch.device("cpu"), True)
    assert trained.inputs == (key,) and trained.outputs == (key,) and trained.has_backward
    names = [name for name, _ in block.named_parameters()]
    assert dict(zip(names, trained.trains)) == {
        name: name != "norm.weight" for name in names
    }
    assert plain.outputs == (BufferKey((4, 8), torch.float32, torch.device("cpu"), False),)
    assert not plain.has_backward and plain.trains == ()
    assert plain.output_tree.is_leaf()


def test_facts_name_the_inputs_outputs_and_parameters_the_backward_reads():
    """A linear layer saves its input (for the weight's gradient) and its weight (for the
    input's); ``x + b`` saves neither; tanh saves its output. These are what a replay's
    version check guards (R24, R28)."""
    linear = torch.nn.Linear(4, 4)

    def shift(x, b):
        return x + b, x

    samples = ((torch.randn(2, 4, requires_grad=True),),
               (torch.randn(2, 4, requires_grad=True), torch.randn(4, requires_grad=True)),
               (torch.randn(2, 4, requires_grad=True),))
    facts = _facts((linear, shift, torch.tanh), samples)
    assert [(f.saved_inputs, f.saved_outputs, f.saved_params) for f in facts] == [
        ((0,), (), (0,)), ((), (), ()), ((), (0,), ())]


class _FlagReader(torch.nn.Module):
    """Reads its own weight's requires_grad (as Megatron-core's linear layers do), and an
    input's, which is no parameter's."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.weight = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        w = self.weight if self.weight.requires_grad and x.requires_grad else self.weight * 1
        return self.inner(x) @ w


def test_facts_name_the_parameters_whose_requires_grad_the_forward_reads():
    reader = _FlagReader()
    (facts,) = _facts((reader,), ((torch.randn(2, 4, requires_grad=True),),))
    names = [name for name, _ in reader.named_parameters()]
    assert [names[i] for i in facts.reads_requires_grad] == ["weight"]


@pytest.mark.parametrize("make", [
    lambda: torch.nn.Linear(4, 4),
    lambda: Block(4),
    lambda: torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
    lambda: torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.GRU(4, 4, batch_first=True)),
])
def test_torch_layers_read_no_parameters_requires_grad_in_python(make):
    """Autograd and ``Function.apply`` read the flag in C++; nothing in these layers' Python
    does, so freezing their parameters after capture stays allowed."""
    module = make()
    (facts,) = _facts((module,), ((torch.randn(2, 3, 4, requires_grad=True),),))
    assert facts.reads_requires_grad == ()


class _Trunk(torch.nn.Module):
    """A trunk and several heads on it: each head's output reaches the trunk and itself."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(4, 4)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(heads))

    def forward(self, x, z):
        y = self.trunk(x)
        return (y, *(head(y) for head in self.heads), z * 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_reach_names_every_input_and_parameter_each_output_gradient_reaches(device):
    """Per output, the positions (inputs, then parameters) its gradient reaches. On CUDA an
    early walk ended short: autograd nodes' Python objects were freed as it went and their
    ids taken by the next ones, so a head's output seemed not to reach the trunk."""
    module = _Trunk(heads=5).to(device)
    inputs = tuple(torch.randn(3, 4, device=device, requires_grad=True) for _ in range(2))
    (facts,) = _facts(module, inputs)
    trunk = {0, 2, 3}  # x, trunk.weight, trunk.bias
    heads = [trunk | {4 + 2 * h, 5 + 2 * h} for h in range(5)]
    assert facts.reach == (frozenset(trunk), *map(frozenset, heads), frozenset({1}))


def test_one_forward_per_callable_and_signature():
    calls = []

    def double(x):
        calls.append(tuple(x.shape))
        return x * 2

    samples = tuple((torch.randn(n, 3, requires_grad=True),) for n in (2, 2, 5, 2))
    facts = _facts(double, samples[0])
    assert len(facts) == 1 and calls == [(2, 3)]
    calls.clear()
    facts = _facts((double,), (samples[2],))
    assert calls == [(5, 3)] and facts[0].inputs[0].shape == (5, 3)
    # Four microbatches of one layer, two signatures among them: two forwards, and graphs
    # of one signature share their facts.
    calls.clear()
    facts = _facts((double,), samples, order=[1, 1, 1, 1, -1, -1, -1, -1])
    assert calls == [(2, 3), (5, 3)]
    assert facts[0] is facts[1] is facts[3] and facts[2] is not facts[0]
    assert [f.inputs[0].shape for f in facts] == [(2, 3), (2, 3), (5, 3), (2, 3)]


def test_distinct_callables_are_probed_apart_even_on_one_signature():
    calls = []

    def double(x):
        calls.append("double")
        return x * 2

    def negate(x):
        calls.append("negate")
        return -x

    x = torch.randn(2, 3, requires_grad=True)
    facts = _facts((double, negate, double), ((x,), (x,), (x,)), order=[1, 2, 3, -3, -2, -1])
    assert calls == ["double", "negate"] and facts[0] is facts[2]


def test_probe_leaves_rng_parameters_grads_and_buffers_alone():
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(8)
    dropout = torch.nn.Dropout(0.5)
    model = torch.nn.Sequential(norm, dropout)
    before = {name: b.clone() for name, b in norm.named_buffers()}
    params = [p.detach().clone() for p in model.parameters()]
    sample = torch.randn(4, 8, requires_grad=True)
    rng = torch.get_rng_state()
    _facts(model, (sample,))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(b, before[name]) for name, b in norm.named_buffers())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(p.grad is None for p in model.parameters())


def test_probe_runs_the_callables_inside_the_given_context():
    log = []

    @contextlib.contextmanager
    def where():
        log.append("enter")
        yield
        log.append("exit")

    def scaled(x):
        log.append("forward")
        return x * 2

    _facts(scaled, (torch.randn(3, requires_grad=True),), where=where())
    assert log == ["enter", "forward", "exit"]


def test_an_output_that_is_not_a_tensor_is_refused_naming_the_callable():
    with pytest.raises(TypeError, match=r"callable 0 \(.*<lambda>\): output 1 must be a tensor"):
        _facts(lambda x: (x, object()), (torch.randn(3),))


def test_w3_outputs_must_be_tensors_or_constants():
    with raises(
        TypeError,
        "callable 0 (test_w3_outputs_must_be_tensors_or_constants.<locals>.<lambda>): "
        "output 1 must be a tensor or a constant",
        "got Opaque",
    ):
        mgc((lambda x: (x * 2, Opaque()),), ((sample(),),))
    with raises(TypeError, "outputs hold no tensor; a graph must return at least one"):
        mgc((lambda x: (None, 3),), ((sample(),),))


class _WritesIntoCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.keys = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        keys = self.keys(x)
        cache[:, :4].copy_(keys.detach())  # a KV-cache update: eager writes the caller's tensor
        return keys


@pytest.mark.parametrize("as_keyword", [False, True])
def test_w11_a_callable_writing_into_an_input_is_refused_before_warm_up(as_keyword):
    module = _WritesIntoCache()
    x, cache = torch.randn(2, 4, requires_grad=True), torch.zeros(2, 8)
    warmed: list[str] = []
    sample = ((x,), {"cache": cache}) if as_keyword else ((x, cache), {})
    with pytest.raises(ValueError, match=(r"callable 0 \(_WritesIntoCache\) writes into "
                                          + ("kwarg 'cache'" if as_keyword else "input 1")
                                          + " in place, but a graphed replay writes into its "
                                            "static copy")):
        leangraph.make_graphed_callables(
            module, sample[0], sample_kwargs=sample[1] or None,
            pre_warmup_hook=lambda: warmed.append("warm-up"))
    assert warmed == []


def _write_like_a_custom_kernel(x: torch.Tensor) -> torch.Tensor:
    """Zeroes ``x``'s memory behind autograd's back, as a kernel handed its pointer does."""
    ctypes.memset(x.data_ptr(), 0, x.numel() * x.element_size())
    return x * 2


_UNSEEN_WRITES = {
    "through-data": lambda x: x.data.add_(1) * 2,
    "data-reassigned": lambda x: (setattr(x, "data", x.data * 3), x * 2)[1],
    "a-view-through-data": lambda x: x[:, 1:].data.mul_(0.5).sum() + x,
    "custom-kernel": _write_like_a_custom_kernel,
}


@pytest.mark.parametrize(("write", "device"), [
    *((write, "cpu") for write in _UNSEEN_WRITES),
    # (The stand-in custom kernel writes host memory: CPU only.)
    *(pytest.param(write, "cuda", marks=pytest.mark.cuda)
      for write in _UNSEEN_WRITES if write != "custom-kernel"),
])
def test_w11_a_write_the_version_counter_does_not_see_is_refused_too(write, device):
    """Writes into an input that bump no version counter (through ``.data``, re-pointing it,
    a custom kernel writing the memory it is handed) change the caller's tensor in eager and
    only a static copy in a replay: refused before warm-up, saying how it was seen."""
    x = torch.randn(2, 4, device=device, requires_grad=True)
    warmed: list[str] = []
    with pytest.raises(ValueError, match=(
            r"callable 0 \(\S+\) writes into input 0 in place \(a write autograd's "
            r"version counter does not see: through \.data, or by a custom kernel")):
        leangraph.make_graphed_callables((_UNSEEN_WRITES[write],), ((x,),),
                                         pre_warmup_hook=lambda: warmed.append("warm-up"))
    assert warmed == []


def test_a_callable_reading_its_inputs_only_passes_the_write_check():
    module = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    graphed = leangraph.make_graphed_callables(module, (x,))
    graphed(torch.randn(2, 4)).sum().backward()
    leangraph.reset_all(graphed)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_capture_leaves_dynamo_unimported():
    """A first capture on CUDA costs no dynamo import (a second or more on a slow host, which
    torch's make_graphed_callables does not pay): the probe's opt-out and the replay's eager
    wrapper for torch.compile wait until dynamo is there. The graphed layer then still breaks
    a compiled model's graph (test_parity.py)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, leangraph; m = torch.nn.Linear(8, 8).cuda(); "
        "x = torch.randn(4, 8, device='cuda', requires_grad=True); "
        "g = leangraph.make_graphed_callables(m, (x,)); g(x).sum().backward(); "
        "torch.cuda.synchronize(); print('torch._dynamo' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False"], result.stdout + result.stderr


def test_importing_leangraph_leaves_dynamo_unimported():
    """``import leangraph`` costs what torch costs: the probe's dynamo opt-out is applied at
    the first probe, not at import (where it imported torch._dynamo, a second)."""
    import subprocess
    import sys

    code = (
        "import sys, torch; before = 'torch._dynamo' in sys.modules; import leangraph; "
        "print(before, 'torch._dynamo' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    before, after = result.stdout.split()
    assert after == before, result.stdout
