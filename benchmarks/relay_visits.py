"""What a parameter's accumulator costs a backward replay when it gets no gradient (the relay
of ``fuse_grad_accumulation=True`` with accumulator hooks), on the CPU and on CUDA.

One autograd node per layer stands for a layer's backward replay; it takes ``x`` and either
(A) the layer's parameters, returning no gradient for them, so the engine runs each
parameter's accumulator after it (leangraph's relay), (B) an empty stand-in, and runs the
accumulators from a backward nested in its own (``fire_relay``, the delivery leangraph uses
for zero-bubble weight steps), (C) the stand-in only (no accumulator runs: the floor), or
(D) the stand-in, and calls the parameters' Python hooks itself from its backward, as
``accumulator_hooks="python"`` does (its checks included: whether the backward pass runs
an accumulator itself, and each node's dicts of hooks). Built with torch alone, the nodes
are those leangraph's replays make. Per accumulator: (A - C), (B - C) and (D - C) /
parameters, each with and without a Python post-accumulate-grad hook on every parameter
(the hooks must fire once per parameter per backward, which is checked). (A - C) is
autograd's own cost: the floor of ``fuse_grad_accumulation=True`` with accumulator hooks
above ``accumulator_hooks=False``; (D - C) what ``"python"`` costs instead.
Usage: PYTHONPATH=src python3 benchmarks/relay_visits.py [cpu|cuda ...]
"""

from __future__ import annotations

import operator
import statistics
import sys
import time

import torch

PARAMS = 12  # one launch-bound block's parameters
LAYERS = 8  # nodes chained per backward, as a chunk's layers are
STEPS = 400


class _Deliver(torch.autograd.Function):
    """A root whose backward hands its inputs no gradient: their accumulators run, adding
    nothing (what leangraph's relay is, delivered on its own)."""

    @staticmethod
    def forward(ctx, *inputs):  # type: ignore[override]
        ctx.count = len(inputs)
        return torch.zeros((), device=inputs[0].device)

    @staticmethod
    def backward(ctx, _):  # type: ignore[override]
        return (None,) * ctx.count


def fire_relay(params: list[torch.nn.Parameter]) -> None:
    """Run ``params``' accumulators from a backward of their own (nested where called from
    a backward)."""
    with torch.enable_grad():
        root = _Deliver.apply(*params)
    torch.autograd.backward(root)


def _hook_dict(register) -> dict:
    """A node's dict of Python hooks of one kind (made by a first registration)."""
    handle = register(lambda *_: None)
    hooks = handle.hooks_dict_ref()
    handle.remove()
    return hooks


_POST_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


class _PythonHooks:
    """What a replay with ``accumulator_hooks="python"`` does for its parameters' hooks."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
        self.pre = [_hook_dict(n.register_prehook) for n in self.nodes]
        self.post = [_hook_dict(n.register_hook) for n in self.nodes]

    def __call__(self) -> None:
        assert not any(map(torch._C._will_engine_execute_node, self.nodes))
        if not (any(self.pre) or any(self.post) or any(map(_POST_HOOKS, self.params))):
            return
        for param, pre, post in zip(self.params, self.pre, self.post):
            for hook in tuple(pre.values()) if pre else ():
                hook((None,))
            hooks = param._post_accumulate_grad_hooks
            for hook in tuple(hooks.values()) if hooks else ():
                hook(param)
            for hook in tuple(post.values()) if post else ():
                hook((), (None,))


class _Layer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, work, x, *params):  # type: ignore[override]
        ctx.work, ctx.count = work, len(params)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.work is not None:
            ctx.work()
        return (None, grad) + (None,) * ctx.count


def _time(device: str, variant: str, hooked: bool) -> float:
    layers = [
        [torch.nn.Parameter(torch.randn(64, device=device)) for _ in range(PARAMS)]
        for _ in range(LAYERS)
    ]
    fired = [0]
    for params in layers:
        for p in params if hooked else ():
            p.register_post_accumulate_grad_hook(lambda _: fired.__setitem__(0, fired[0] + 1))
    stand_in = torch.empty(0, device=device, requires_grad=True)
    x = torch.randn(64, device=device, requires_grad=True)
    direct = [_PythonHooks(params) for params in layers]
    times = []
    for _ in range(STEPS):
        fired[0] = 0
        start = time.perf_counter()
        out = x
        for params, calls in zip(layers, direct):
            if variant == "A":
                out = _Layer.apply(None, out, *params)
            elif variant == "B":
                out = _Layer.apply(lambda params=params: fire_relay(params), out, stand_in)
            elif variant == "D":
                out = _Layer.apply(calls, out, stand_in)
            else:
                out = _Layer.apply(None, out, stand_in)
        out.sum().backward()
        times.append(time.perf_counter() - start)
        expected = 0 if variant == "C" or not hooked else PARAMS * LAYERS
        assert fired[0] == expected, (variant, fired[0])
    return statistics.median(times[STEPS // 4 :]) * 1e6


def main(devices: list[str]) -> None:
    for device in devices:
        for hooked in (False, True):
            rounds: dict[str, list[float]] = {v: [] for v in "ABCD"}
            for _ in range(5):
                for variant in "ABCD":
                    rounds[variant].append(_time(device, variant, hooked))
            med = {v: statistics.median(r) for v, r in rounds.items()}
            per = PARAMS * LAYERS
            hooks = "a Python post-accumulate hook each" if hooked else "no hooks"
            print(
                f"{device}, {hooks}: a backward of {LAYERS} nodes x {PARAMS} parameters, "
                f"medians of 5 rounds: A {med['A']:.1f} us, B {med['B']:.1f} us, "
                f"C {med['C']:.1f} us, D {med['D']:.1f} us; per accumulator "
                f"A {(med['A'] - med['C']) / per:.2f} us, B {(med['B'] - med['C']) / per:.2f} "
                f"us, D {(med['D'] - med['C']) / per:.2f} us"
            )


if __name__ == "__main__":
    main(sys.argv[1:] or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]))
