"""One graph under construction: eager warm-up on its samples, then capture into its pair.

A :class:`GraphBuilder` is private to the build stage. Warm-up and capture drive it in the
plan's order; :meth:`GraphBuilder.record` then freezes what capture made into a
:class:`~leangraph.build.record.GraphRecord` and the builder is dropped.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..backends.base import GraphBackend, GraphPair
from ..buffers import BufferKey, same_buffer, same_layout
from ..hooks import CaptureHooks
from ..order import GraphId, StepKind
from ..probe import GraphFacts, OutputView, output_repeats, output_template, output_views
from ..runtime.signature import CallSignature
from .accumulation import (
    TENSOR_HOOKS,
    AccumulationTarget,
    FusedGradients,
    HookDelivery,
    add_into,
    hook_relay,
    python_hooks,
)
from .record import GraphRecord, ModuleBinding, ModuleState, ParameterSharing

__all__ = ["GraphBuilder", "GraphSource"]


@dataclass(frozen=True)
class GraphSource:
    """What one graph is built from, all known before warm-up.

    ``samples`` are the sample call's tensor leaves (detached, ``requires_grad`` kept);
    ``split_backward`` says whether the plan defers weight gradients to their own step.
    """

    index: int
    label: str
    graph_id: GraphId | None
    fn: Callable[..., Any]
    samples: tuple[torch.Tensor, ...]
    signature: CallSignature
    params: tuple[torch.nn.Parameter, ...]
    param_names: tuple[str, ...]
    facts: GraphFacts
    hooks: CaptureHooks
    sharing: ParameterSharing
    module: ModuleBinding | None
    modules: ModuleState | None
    allow_unused_input: bool
    retain_graph: bool
    split_backward: bool


class GraphBuilder:
    """Warm-up and capture of one graph; see the module docstring."""

    def __init__(self, source: GraphSource, pair: GraphPair) -> None:
        self.source = source
        self.pair = pair
        self._static_inputs: tuple[torch.Tensor, ...] = ()
        self._chained_from: tuple[str | None, ...] = ()
        self._static_outputs: tuple[torch.Tensor, ...] = ()
        self._output_requires_grad: tuple[bool, ...] = ()
        self._static_grad_outputs: tuple[torch.Tensor | None, ...] = ()
        self._static_grads: tuple[torch.Tensor | None, ...] = ()
        self._static_weight_grads: tuple[torch.Tensor | None, ...] = ()
        self._released = False
        self._accumulate: tuple[AccumulationTarget, ...] = ()
        self._delivery = HookDelivery.AUTOGRAD
        # Input 0's gradient buffer, kept owned after this graph's backward capture so that
        # the previous layer's backward reads it as its seed (no copy at replay).
        self._lent_grad: torch.Tensor | None = None
        self._lent = False  # whether it ever was: the previous layer's seed until it ran
        self._seed_from: str | None = None  # the graph whose lent buffer output 0's seed is
        # How many trailing entries of _static_grads (the parameters' gradients) stay owned
        # after release until the next backward is captured (overlap: see capture.py).
        self._held_param_grads = 0
        self._eager_order: list[int] = []  # trained parameters, as eager's backward reaches them

    @property
    def label(self) -> str:
        return self.source.label

    @property
    def static_outputs(self) -> tuple[torch.Tensor, ...]:
        """The captured static outputs (what a chained next layer reads)."""
        return self._static_outputs

    # ------------------------------------------------------------------------ running

    def _with_forward_hooks(
        self, leaves: Sequence[torch.Tensor], run: Callable[[], tuple[torch.Tensor, ...]]
    ) -> tuple[torch.Tensor, ...]:
        """``run()`` between the callable's forward_pre and forward capture-time hooks."""
        hooks = self.source.hooks
        if not (hooks.forward_pre or hooks.forward):
            return run()  # once per step of every pass: skip rebuilding the arguments
        args, kwargs = self.source.signature.unflatten(leaves)
        hooks.run("forward_pre", args, kwargs)
        outputs = run()
        facts = self.source.facts
        output = pytree.tree_unflatten(facts.output_template.fill(outputs), facts.output_tree)
        hooks.run("forward", args, kwargs, output)
        return outputs

    def _input_targets(self, leaves: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in leaves if t.requires_grad)

    def _param_targets(self) -> tuple[torch.Tensor, ...]:
        source = self.source
        return tuple(p for p, trains in zip(source.params, source.facts.trains) if trains)

    def _differentiable(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # The probe refused outputs differentiating anything but inputs and parameters.
        return tuple(o for o in outputs if o.requires_grad)

    # ------------------------------------------------------------------------ warm-up

    def warmup_forward(self) -> tuple[torch.Tensor, ...] | None:
        """One eager forward on the samples; returns the outputs awaiting a backward, or None."""
        samples = self.source.samples
        outputs = self._with_forward_hooks(samples, lambda: _run_callable(self.source, samples))
        return self._differentiable(outputs) or None

    def warmup_backward(self, outputs: tuple[torch.Tensor, ...], kind: StepKind) -> None:
        """One eager backward (full, input-gradient or weight-gradient part) on ``outputs``."""
        split = self.source.split_backward
        if kind is StepKind.BACKWARD and split:
            targets, retain = self._input_targets(self.source.samples), True
        elif kind is StepKind.WEIGHT:
            targets, retain = self._param_targets(), False
        else:
            targets = self._input_targets(self.source.samples) + self._param_targets()
            retain = False
        self.source.hooks.run("backward_pre")
        if targets:
            grads = torch.autograd.grad(
                outputs,
                targets,
                retain_graph=retain,
                allow_unused=True,
                grad_outputs=[torch.zeros_like(o) for o in outputs],
            )
            if not split:
                _check_unused(self.source, grads)
        self.source.hooks.run("backward")

    # ------------------------------------------------------------------------ capture

    def capture_forward(
        self,
        static_inputs: Sequence[torch.Tensor],
        seeds: Sequence[torch.Tensor | None],
        chained_from: Sequence[str | None],
    ) -> None:
        """Record the forward graph on the static inputs and gradient seeds the buffer plan
        gave this graph (``chained_from[i]``: the graph whose output buffer input ``i`` is)."""
        self._static_inputs = tuple(static_inputs)
        self._static_grad_outputs = tuple(seeds)
        self._chained_from = tuple(chained_from)
        with torch.no_grad():
            for static, sample in zip(self._static_inputs, self.source.samples):
                if not same_buffer(static, sample):
                    # Values do not matter on CUDA; they keep CPU runs exact. Through .data, whose
                    # version counter is its own: a chained input is the previous layer's output,
                    # which that layer's backward may have saved (a ReLU's), and a versioned
                    # write would make its backward capture refuse it as modified in place.
                    static.data.copy_(sample)
        captured: list[Any] = []

        def capture() -> tuple[torch.Tensor, ...]:
            captured.append(
                self.pair.capture_forward(lambda: _run_callable(self.source, self._static_inputs))
            )
            return captured[0].outputs

        self._with_forward_hooks(self._static_inputs, capture)
        self._static_outputs = captured[0].outputs
        self._output_requires_grad = captured[0].requires_grad
        if not self._static_grad_outputs and any(self._output_requires_grad):
            self._static_grad_outputs = tuple(
                torch.empty_like(o) if rg else None
                for o, rg in zip(self._static_outputs, self._output_requires_grad)
            )

    def fuse_into(self, targets: tuple[AccumulationTarget, ...], *, delivery: HookDelivery) -> None:
        """Add the trained parameters' gradients into ``targets`` inside the backward graph
        (in-graph accumulation; set before capture); ``delivery``: how replays fire the
        hooks on the parameters' accumulators."""
        self._accumulate = targets
        self._delivery = delivery

    def _grad_body(
        self, targets: Callable[[], tuple[torch.Tensor, ...]], retain: bool, *, params: bool
    ) -> Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor | None]]:
        """A backward body for ``targets()``, the trained parameters last when ``params``. A
        backend records what it runs; a parameter frozen after capture still gets its
        gradient computed at replay, and autograd drops it."""
        seeds = [g for g in self._static_grad_outputs if g is not None]
        accumulate = self._accumulate if params else ()
        return _backward_body(
            self._differentiable, targets, seeds, accumulate, self._eager_order, retain
        )

    def capture_backward(
        self,
        backend: GraphBackend,
        *,
        release: bool,
        chained: Sequence[bool],
        lender: GraphBuilder | None = None,
        hold_param_grads: bool = False,
    ) -> None:
        """Record the backward graph (input gradients only when the backward is split).

        With ``release`` (and no weight step to come), stop owning what dies here: the plan
        has no further use for this graph's outputs, its gradient buffers or (for chained
        inputs) the previous layer's output, so they are kept only as non-owning views and
        the pool hands their blocks to graphs captured later. Input 0's gradient buffer is
        the exception when input 0 is chained: it stays owned until the previous layer,
        whose output it is the gradient of, has recorded its backward reading it as its
        seed. ``lender`` is the next layer (whose input 0 is this graph's output 0), once it
        recorded its backward: its lent buffer becomes this graph's seed of output 0, so the
        gradient autograd hands this backward at replay is that seed already. With
        ``hold_param_grads`` the parameters' gradient buffers stay owned too, until
        :meth:`release_held_param_grads`.
        """
        try:
            self._record_backward(
                backend,
                release=release,
                chained=chained,
                lender=lender,
                hold_param_grads=hold_param_grads,
            )
        finally:
            if lender is not None:  # recorded, or failed: the lent block may go to the pool
                lender.return_lent_grad(backend)

    def _record_backward(
        self,
        backend: GraphBackend,
        *,
        release: bool,
        chained: Sequence[bool],
        lender: GraphBuilder | None,
        hold_param_grads: bool,
    ) -> None:
        if not any(self._output_requires_grad):
            return
        hooks = self.source.hooks
        hooks.run("backward_pre")
        if self.source.split_backward:  # the weight step still needs the saved activations
            if self._input_targets(self._static_inputs):  # none: there is no graph to record
                body = self._grad_body(
                    lambda: self._input_targets(self._static_inputs), True, params=False
                )
                self._static_grads = self.pair.capture_backward(body, retain_graph=True)
            hooks.run("backward")
            return
        retain = self.source.retain_graph
        if lender is not None and lender._lent_grad is not None:
            self._borrow_seed(lender.label, lender._lent_grad)
        body = self._grad_body(
            lambda: self._input_targets(self._static_inputs) + self._param_targets(),
            retain,
            params=True,
        )
        self._static_grads = self.pair.capture_backward(body, retain_graph=retain)
        hooks.run("backward")
        _check_unused(self.source, self._static_grads)
        if release:
            if chained and chained[0] and not retain and self._lends_input_grad():
                self._lent_grad = self._static_grads[0]
                self._lent = True
            if hold_param_grads:
                self._held_param_grads = len(self._param_targets())
            self._release_buffers(backend, chained)

    def release_held_param_grads(self, backend: GraphBackend) -> None:
        """Stop owning the parameters' gradient buffers that the backward's release kept."""
        held, self._held_param_grads = self._held_param_grads, 0
        if held:
            start = len(self._static_grads) - held
            self._static_grads = self._static_grads[:start] + tuple(
                None if g is None else backend.disown(g) for g in self._static_grads[start:]
            )

    def _lends_input_grad(self) -> bool:
        """Whether input 0's gradient is the first one the backward graph writes (it is when
        input 0 requires grad as captured), so it can be the previous layer's seed."""
        specs = self.source.signature.specs
        return bool(
            specs
            and specs[0].requires_grad
            and self._static_grads
            and self._static_grads[0] is not None
        )

    def _borrow_seed(self, lender: str, lent: torch.Tensor) -> None:
        """Read output 0's gradient from ``lent`` (the next layer's input gradient buffer)
        instead of the planned seed, when it has the seed's layout."""
        seed = self._static_grad_outputs[0] if self._static_grad_outputs else None
        if seed is None or not same_layout(lent, seed):
            return
        self._static_grad_outputs = (lent, *self._static_grad_outputs[1:])
        self._seed_from = lender

    def return_lent_grad(self, backend: GraphBackend) -> None:
        """The previous layer recorded its backward: stop owning input 0's gradient buffer."""
        if self._lent_grad is None:
            return
        self._lent_grad = None
        grad = self._static_grads[0]
        assert grad is not None  # lent only when it exists
        self._static_grads = (backend.disown(grad), *self._static_grads[1:])

    def capture_weight(
        self, backend: GraphBackend, *, release: bool, chained: Sequence[bool]
    ) -> None:
        """Record the deferred weight-gradient graph of a split backward."""
        if not any(self._output_requires_grad):
            return
        retain = self.source.retain_graph
        hooks = self.source.hooks
        hooks.run("backward_pre")
        if self._param_targets():
            body = self._grad_body(self._param_targets, retain, params=True)
            self._static_weight_grads = self.pair.capture_weight(body, retain_graph=retain)
        elif not retain:  # nothing to record: just let the activations go
            self.pair.release_saved()
        hooks.run("backward")
        _check_unused(self.source, self._static_grads + self._static_weight_grads)
        if release:
            self._release_buffers(backend, chained)

    def _release_buffers(self, backend: GraphBackend, chained: Sequence[bool]) -> None:
        self._released = True
        self._static_outputs = tuple(backend.disown(o) for o in self._static_outputs)
        held_from = len(self._static_grads) - self._held_param_grads
        self._static_grads = tuple(
            g
            if g is None or (i == 0 and self._lent_grad is not None) or i >= held_from
            else backend.disown(g)
            for i, g in enumerate(self._static_grads)
        )
        if self._seed_from is not None:  # the lender owns it until return_lent_grad
            seed = self._static_grad_outputs[0]
            assert seed is not None
            self._static_grad_outputs = (backend.alias(seed), *self._static_grad_outputs[1:])
        self._static_weight_grads = tuple(
            None if g is None else backend.disown(g) for g in self._static_weight_grads
        )
        self._static_inputs = tuple(
            backend.alias(t).requires_grad_(t.requires_grad) if link else t
            for t, link in zip(self._static_inputs, chained)
        )

    # ------------------------------------------------------------------------ hand-off

    def record(self) -> GraphRecord:
        """Freeze what capture made (call once, after the capture pass)."""
        source = self.source
        return GraphRecord(
            index=source.index,
            label=source.label,
            graph_id=source.graph_id,
            pair=self.pair,
            signature=source.signature,
            static_inputs=self._static_inputs,
            chained_from=self._chained_from or (None,) * len(self._static_inputs),
            static_outputs=self._static_outputs,
            output_tree=source.facts.output_tree,
            output_template=source.facts.output_template,
            output_repeats=source.facts.repeats,
            output_views=source.facts.views,
            output_requires_grad=self._output_requires_grad,
            saved_outputs=source.facts.saved_outputs,
            saved_params=source.facts.saved_params,
            saved_inputs=source.facts.saved_inputs,
            saved_buffers=source.facts.saved_buffers,
            output_reach=source.facts.reach,
            static_grad_outputs=self._static_grad_outputs,
            seed_from=self._seed_from,
            static_grads=self._static_grads,
            static_weight_grads=self._static_weight_grads,
            params=source.params,
            param_names=source.param_names,
            param_trains=source.facts.trains,
            reads_requires_grad=source.facts.reads_requires_grad,
            released=self._released,
            split_backward=source.split_backward,
            retain_graph=source.retain_graph,
            sharing=source.sharing,
            module=source.module,
            modules=source.modules,
            input_grad_lent=self._lent,
            fused=_fused_gradients(self._accumulate, self._eager_order, self._delivery),
        )

    def abandon(self) -> None:
        """Release the pair after a failed build."""
        self.pair.reset()


class _Leaf:
    """Stands for an output leaf where :func:`_structure` writes a structure out."""

    def __repr__(self) -> str:
        return "leaf"


def _fused_gradients(
    accumulate: Sequence[AccumulationTarget], eager_order: Sequence[int], delivery: HookDelivery
) -> FusedGradients | None:
    """The in-graph accumulation's record: the targets, and a relay reaching the parameters
    the backward reached (``eager_order``, indices into ``accumulate``), in that order (or
    their Python hooks, to call in it). Made after the capture pass, graph by graph, so a
    later layer's relay is newer (its hooks first, as in eager)."""
    if not accumulate:
        return None
    reached = list(dict.fromkeys(eager_order))
    # A parameter the outputs do not depend on (allow_unused_input) gets no gradient in
    # eager, so its .grad stays None: it is no target at replay either.
    targets = tuple(accumulate[i] for i in sorted(reached))
    params = [accumulate[i].param for i in reached]
    if not params:
        return FusedGradients(targets, None, delivery)
    names = [accumulate[i].name for i in reached]
    if delivery is HookDelivery.NONE:
        return FusedGradients(targets, None, delivery, unrun_hooks=python_hooks(names, params))
    if delivery is HookDelivery.PYTHON:
        return FusedGradients(targets, None, delivery, python_hooks(names, params))
    return FusedGradients(targets, hook_relay(params), delivery)


def _structure(spec: pytree.TreeSpec) -> str:
    """``(leaf,)``, ``[leaf, leaf]``, ``{'a': leaf}``: an output structure as written (a
    TreeSpec's own text spans lines and names no container literally)."""
    try:
        return repr(pytree.tree_unflatten([_Leaf()] * spec.num_leaves, spec))
    except Exception:  # a registered type that cannot be built from placeholders
        return " ".join(str(spec).split())


def _run_callable(source: GraphSource, leaves: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run the callable on ``leaves``; its outputs must look as the probe saw them.

    The CPU backend's refusals find the callable's own frames below this one by its name
    (``backends._cpu_refusals.CALLABLE_ENTRY``): rename both together."""
    args, kwargs = source.signature.unflatten(leaves)
    output_leaves, tree = pytree.tree_flatten(source.fn(*args, **kwargs))
    expected = source.facts
    if tree != expected.output_tree:
        raise RuntimeError(
            f"{source.label}: outputs changed structure between runs: the probe's forward "
            f"returned {_structure(expected.output_tree)}, this run {_structure(tree)}; a "
            "graph replays one output structure, so the callable must return the same one "
            "on every call"
        )
    template = output_template(source.label, output_leaves)
    if template != expected.output_template:
        raise RuntimeError(
            f"{source.label}: outputs changed their constants or which leaves are tensors "
            f"between runs: {list(expected.output_template.leaves)} then "
            f"{list(template.leaves)}"
        )
    outputs = [leaf for leaf in output_leaves if isinstance(leaf, torch.Tensor)]
    keys = tuple(BufferKey.of(o, keep_layout=True) for o in outputs)
    if keys != expected.outputs:
        raise RuntimeError(
            f"{source.label}: outputs changed shape, dtype, device, layout or requires_grad "
            f"between runs: {_describe(expected.outputs)} then {_describe(keys)}; graphs need "
            "outputs that do not depend on the data"
        )
    repeats = output_repeats(outputs)
    if repeats != expected.repeats:
        # A replay returns one tensor where the probe's forward returned one several times.
        raise RuntimeError(
            f"{source.label}: outputs changed which of them are the same tensor between "
            f"runs: {_repeated(expected.repeats)} then {_repeated(repeats)}; a graph "
            "replays one aliasing of its outputs, so the callable must return the same "
            "tensor in the same places on every call"
        )
    module = source.fn if isinstance(source.fn, torch.nn.Module) else None
    foreign = [*leaves, *module.parameters(), *module.buffers()] if module else leaves
    views = output_views(outputs, foreign)
    if views != expected.views:
        raise RuntimeError(
            f"{source.label}: outputs changed which of them are views of another between "
            f"runs: {_viewing(expected.views)} then {_viewing(views)}; a graph replays one "
            "aliasing of its outputs, so the callable must return views of the same outputs "
            "on every call"
        )
    return tuple(outputs)


def _viewing(views: Sequence[OutputView]) -> str:
    pairs = [f"output {v.position} views output {v.base}" for v in views]
    return ", ".join(pairs) or "no output a view of another"


def _repeated(repeats: Sequence[int]) -> str:
    pairs = [f"output {i} is output {j}" for i, j in enumerate(repeats) if i != j]
    return ", ".join(pairs) or "every output a tensor of its own"


def _check_unused(source: GraphSource, grads: Sequence[torch.Tensor | None]) -> None:
    """Refuse inputs and trained parameters that got no gradient (unless allowed)."""
    if source.allow_unused_input or all(g is not None for g in grads):
        return
    names = [s.name for s in source.signature.specs if s.requires_grad]
    names += [
        f"parameter {name!r}"
        for name, trains in zip(source.param_names, source.facts.trains)
        if trains
    ]
    unused = [name for name, g in zip(names, grads) if g is None]
    raise ValueError(
        f"{source.label}: outputs do not depend on {', '.join(unused)}, which "
        "require grad; pass allow_unused_input=True to allow it"
    )


def _backward_body(
    differentiable: Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]],
    targets: Callable[[], tuple[torch.Tensor, ...]],
    seeds: Sequence[torch.Tensor],
    accumulate: Sequence[AccumulationTarget],
    eager_order: list[int],
    retain: bool,
) -> Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor | None]]:
    """A backward body: the gradients of ``differentiable(outputs)`` seeded with ``seeds``,
    w.r.t. ``targets()`` (looked up when the body runs, at capture). With ``accumulate``
    (in-graph accumulation; the trained parameters are the last targets) their gradients are
    added into those targets inside the graph, and the order in which the backward reaches
    the parameters (eager's order for their hooks) is appended to ``eager_order``."""

    def body(outputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        wanted = targets()
        live = [t for t in wanted if t.requires_grad]
        if not live:
            return (None,) * len(wanted)
        with _noting_reached(accumulate, eager_order):
            grads = iter(
                torch.autograd.grad(
                    differentiable(outputs),
                    live,
                    grad_outputs=seeds,
                    allow_unused=True,
                    retain_graph=retain,
                )
            )
        result = tuple(next(grads) if t.requires_grad else None for t in wanted)
        if accumulate:
            param_grads = result[len(result) - len(accumulate) :]
            reached = [(t, g) for t, g in zip(accumulate, param_grads) if g is not None]
            add_into([t for t, _ in reached], [g for _, g in reached])
        return result

    return body


@contextlib.contextmanager
def _noting_reached(accumulate: Sequence[AccumulationTarget], order: list[int]) -> Iterator[None]:
    """Appends to ``order`` the index in ``accumulate`` of each parameter the backward reaches,
    as it reaches it, through a tensor hook on each. torch keeps a tensor's hooks in a dict it
    makes at the first ``register_hook`` and leaves attached, empty, once the last handle is
    removed: a parameter that had none gets None back, so capture leaves no state on it."""
    had_none = [target.param for target in accumulate if TENSOR_HOOKS(target.param) is None]
    watching = [
        target.param.register_hook(functools.partial(_note_reached, order, i))
        for i, target in enumerate(accumulate)
    ]
    try:
        yield
    finally:
        for handle in watching:
            handle.remove()
        for param in had_none:
            if not TENSOR_HOOKS(param):  # no hook came meanwhile
                param._backward_hooks = None  # detaches torch's emptied hook dict as well


def _note_reached(order: list[int], index: int, _: torch.Tensor) -> None:
    order.append(index)


def _describe(keys: Sequence[BufferKey]) -> str:
    return ", ".join(
        f"{tuple(k.shape)} {k.dtype}{'' if k.stride is None else f' strides {k.stride}'}"
        f"{' requires_grad' if k.requires_grad else ''}"
        for k in keys
    )
