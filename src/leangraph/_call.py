"""One validated record of a call: callables, samples, device and plan, checked once.

``make_graphed_callables`` and ``plan_memory`` take the same ``callables`` / ``sample_args`` /
``sample_kwargs`` / ``order`` forms. :func:`validate_call` turns them into one frozen
:class:`Call`, which every later stage (probe, memory plan, buffers, build) reads, so no two
stages can disagree on what a call means and every error message exists here once.
:func:`check_capturable` adds what capture alone requires (module hooks, autocast, distinct
modules); :class:`CaptureOptions` holds the options of ``make_graphed_callables``, checked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .build.accumulation import TENSOR_HOOKS, HookDelivery
from .leaves import is_constant, not_dense, tensor_subclass
from .order import OrderEntry, parse_order
from .plan import Plan, build_plan, build_unordered_plan

__all__ = [
    "Call",
    "CaptureOptions",
    "Sample",
    "check_callables_form",
    "check_capturable",
    "check_options",
    "validate_call",
]

Sample = tuple[tuple[Any, ...], dict[str, Any]]
"""One graph's sample call: ``(args, kwargs)``."""


@dataclass(frozen=True)
class Call:
    """The validated arguments of one call.

    Attributes:
        callables: The callables (or modules), as a tuple.
        samples: One ``(args, kwargs)`` pair per graph, by graph index.
        plan: The liveness plan of the order (or of torch's drop-in order).
        device: The one device of every sample tensor and parameter.
        single: Whether a single callable was passed (not a tuple).
        alike: Per graph, the first graph that runs the same callable on samples of the same
            layout (pytree structure, and per leaf the tensor's type, shape, strides, dtype,
            device and ``requires_grad``, or the constant): the two run the same kernels, so
            the probe measures only the first, and warm-up runs only the first (the plan's
            warm-up is over these graphs).
        grad_enabled: Whether grad mode was on at the call: under ``torch.no_grad()`` the
            outputs need no gradient and the graphs get no backward (forward graphs only).
    """

    callables: tuple[Any, ...]
    samples: tuple[Sample, ...]
    plan: Plan
    device: torch.device
    single: bool
    alike: tuple[int, ...]
    grad_enabled: bool = True

    def callable_index(self, graph: int) -> int:
        """Position in ``callables`` of the callable graph ``graph`` runs."""
        return self.plan.layout.callable_of_graph(graph)

    def callable_of(self, graph: int) -> Any:
        """The callable (or module) graph ``graph`` runs."""
        return self.callables[self.callable_index(graph)]

    def label(self, graph: int) -> str:
        """How errors name graph ``graph``: by position in the order, or by callable."""
        if self.plan.ordered:
            return f"graph ({self.plan.layout.graph_id(graph)})"
        fn = self.callable_of(graph)
        name = (
            type(fn).__name__
            if isinstance(fn, torch.nn.Module)
            else getattr(fn, "__qualname__", type(fn).__name__)
        )
        return f"callable {self.callable_index(graph)} ({name})"

    def chainable(self) -> tuple[bool, ...]:
        """Per graph, whether its first input leaf is positional argument 0 itself (a
        tensor), so that the previous layer's output can be passed for it."""
        return tuple(bool(args) and isinstance(args[0], torch.Tensor) for args, _ in self.samples)


def check_callables_form(callables: Any, convention: str) -> None:
    """Refuse ``callables`` that is a list, or an empty tuple (V19): the convention (one
    callable, or a tuple) is ``convention``'s, named in the message."""
    if isinstance(callables, list):
        raise TypeError(
            "callables must be a callable or a tuple of callables, got a list; pass "
            f"tuple(callables) ({convention} takes a tuple too)"
        )
    if isinstance(callables, tuple) and not callables:
        raise ValueError("callables is empty; pass at least one callable to graph")


def validate_call(
    callables: Any,
    sample_args: Any,
    sample_kwargs: Any,
    order: Sequence[OrderEntry] | None,
    num_layers_per_chunk: int | Sequence[int] | None,
) -> Call:
    """Check the shared argument forms and return the :class:`Call` they describe.

    torch's convention holds: a single callable (not a tuple) comes with a single sample
    tuple (and a single kwargs dict).

    Raises:
        TypeError: for callables that are not callable, sample arguments that are not tuples
            of tensor pytrees, kwargs that are not dicts.
        ValueError: for a malformed order, counts that do not match, tensors on several
            devices.
    """
    check_callables_form(callables, "torch.cuda.make_graphed_callables")
    single = not isinstance(callables, tuple)
    if single:
        _check_single_sample(sample_args, sample_kwargs)
        callables = (callables,)
        sample_args = (sample_args,)
        sample_kwargs = None if sample_kwargs is None else (sample_kwargs,)
    for index, fn in enumerate(callables):
        if not callable(fn):
            raise TypeError(f"callables[{index}] is a {type(fn).__name__}, which is not callable")
    plan = _make_plan(len(callables), sample_args, order, num_layers_per_chunk, single=single)
    samples = _normalize_samples(sample_args, sample_kwargs, plan.layout.num_graphs)
    device = _common_device(samples, callables)
    alike = _first_alike(plan, callables, samples)
    return Call(
        tuple(callables),
        samples,
        plan.warming(set(alike)),
        device,
        single,
        alike,
        grad_enabled=torch.is_grad_enabled(),
    )


def _check_single_sample(sample_args: Any, sample_kwargs: Any) -> None:
    """A single callable's ``sample_args`` is its one tuple of arguments (and
    ``sample_kwargs`` its one dict): named as such, not as the ``sample_args[0]`` leangraph
    wraps them into.

    Raises:
        TypeError: for a ``sample_args`` that is not a tuple (or list), a ``sample_kwargs``
            that is not a dict or None.
    """
    if not isinstance(sample_args, (tuple, list)):
        raise TypeError(
            "sample_args of a single callable must be its tuple of arguments, got "
            f"{type(sample_args).__name__} (wrap a single tensor as (tensor,))"
        )
    if sample_kwargs is not None and not isinstance(sample_kwargs, dict):
        raise TypeError(
            "sample_kwargs of a single callable must be its dict of keyword arguments or None, "
            f"got {type(sample_kwargs).__name__}"
        )


def _make_plan(
    num_callables: int,
    sample_args: Any,
    order: Sequence[OrderEntry] | None,
    num_layers_per_chunk: int | Sequence[int] | None,
    *,
    single: bool = False,
) -> Plan:
    if not isinstance(sample_args, (tuple, list)):
        raise TypeError(f"sample_args must be a tuple, got {type(sample_args).__name__}")
    if order is None:
        if num_layers_per_chunk is not None:
            raise ValueError("num_layers_per_chunk needs an order")
        if len(sample_args) != num_callables:
            raise ValueError(
                f"sample_args has {len(sample_args)} entries for {num_callables} callables; "
                "without an order each callable needs exactly one"
            )
        return build_unordered_plan(num_callables)
    layout, steps = parse_order(
        order,
        num_callables=num_callables,
        num_samples=None if single else len(sample_args),
        num_layers_per_chunk=num_layers_per_chunk,
    )
    if single and layout.num_graphs != 1:
        # sample_args is the one callable's own tuple of arguments, wrapped as one entry:
        # "has 1 entries" would count what the caller did not write.
        raise ValueError(
            f"a single callable (not a tuple) has one tuple of sample arguments, so one graph, "
            f"but the order runs {layout.num_microbatches} microbatches; pass callables as a "
            f"tuple, (callable,), and sample_args as one tuple of arguments per microbatch"
        )
    return build_plan(layout, steps)


def _normalize_samples(sample_args: Any, sample_kwargs: Any, count: int) -> tuple[Sample, ...]:
    if sample_kwargs is None:
        sample_kwargs = ({},) * count
    if not isinstance(sample_kwargs, (tuple, list)) or len(sample_kwargs) != count:
        got = len(sample_kwargs) if isinstance(sample_kwargs, (tuple, list)) else sample_kwargs
        raise ValueError(f"sample_kwargs must have one dict per graph ({count}), got {got!r}")
    samples: list[Sample] = []
    for index, (args, kwargs) in enumerate(zip(sample_args, sample_kwargs)):
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"sample_args[{index}] must be a tuple of arguments, got "
                f"{type(args).__name__} (wrap a single tensor as (tensor,))"
            )
        if not isinstance(kwargs, dict):
            raise TypeError(f"sample_kwargs[{index}] must be a dict, got {type(kwargs).__name__}")
        key = next((key for key in kwargs if not isinstance(key, str)), None)
        if key is not None:
            raise TypeError(
                f"sample_kwargs[{index}] must map keyword names (str) to arguments, got the key "
                f"{key!r} ({type(key).__name__}): a call's keywords are strings"
            )
        _check_leaves(index, tuple(args), kwargs)
        samples.append((tuple(args), dict(kwargs)))
    return tuple(samples)


def _first_alike(
    plan: Plan, callables: Sequence[Any], samples: Sequence[Sample]
) -> tuple[int, ...]:
    """Per graph, the first graph with its callable and sample layout (``Call.alike``)."""
    first: dict[tuple[Any, ...], int] = {}
    alike = []
    for graph, sample in enumerate(samples):
        fn = callables[plan.layout.callable_of_graph(graph)]
        alike.append(first.setdefault((id(fn), *_sample_layout(sample)), graph))
    return tuple(alike)


def _sample_layout(sample: Sample) -> tuple[Any, ...]:
    """What the kernels a callable runs on ``sample`` can depend on, values aside."""
    leaves, tree = pytree.tree_flatten(sample)
    return str(tree), tuple(
        (
            type(leaf),
            tuple(leaf.shape),
            leaf.stride() if leaf.layout is torch.strided else leaf.layout,
            leaf.dtype,
            leaf.device,
            leaf.requires_grad,
        )
        if isinstance(leaf, torch.Tensor)
        else (type(leaf), repr(leaf))
        for leaf in leaves
    )


def _check_leaves(index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Every leaf is a dense tensor autograd can track, or a constant the graph can capture
    (see ``leaves``)."""
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            if not_dense(leaf) is not None or leaf.is_inference():
                _refuse_sample_tensor(_leaf_path(index, path), leaf)
            subclass = tensor_subclass(leaf)
            if subclass is not None:
                raise TypeError(
                    f"{_leaf_path(index, path)}: a sample tensor must be a torch.Tensor, got a "
                    f"{subclass}; a graph replays the kernels capture recorded on plain static "
                    "buffers and returns plain tensors, where eager would follow the subclass. "
                    "Pass tensor.as_subclass(torch.Tensor) and apply the subclass outside the "
                    "graphed callable"
                )
            continue
        if is_constant(leaf):
            continue
        raise TypeError(
            f"{_leaf_path(index, path)}: an argument leaf must be a tensor or a constant (None, "
            f"bool, int, float, str, dtype, device, enum), got {type(leaf).__name__}; graphs "
            "replay tensors, and capture other leaves as constants compared at every replay"
        )


def _leaf_path(index: int, path: tuple[Any, ...]) -> str:
    """``sample_args[1][0]``, ``sample_kwargs[1]['mask']``: how errors name a sample leaf."""
    group, *rest = path
    where = "sample_args" if group == pytree.SequenceKey(0) else "sample_kwargs"
    return f"{where}[{index}]{''.join(str(key) for key in rest)}"


def _refuse_sample_tensor(where: str, tensor: torch.Tensor) -> None:
    """Refuse a sample tensor that is not dense with storage (a graph's static input is one,
    which every replay copies into) or is an inference tensor (warm-up and capture
    differentiate through it)."""
    kind = not_dense(tensor)
    if kind is not None:
        raise TypeError(
            f"{where}: a sample tensor must be a dense (strided) tensor with storage, got a "
            f"{kind}; a graph's static input is dense and every replay copies its argument "
            "into it. Convert it outside the graphed callable (to_dense(), dequantize(), "
            "to_padded_tensor()) and graph the dense computation"
        )
    raise ValueError(
        f"{where} is an inference tensor (made under torch.inference_mode()), which autograd "
        "cannot track, and warm-up and capture differentiate through the samples; make the "
        "samples, and call make_graphed_callables, outside inference_mode (under "
        "torch.no_grad() for forward-only graphs, which replay under inference_mode too)"
    )


def _common_device(samples: Sequence[Sample], callables: Sequence[Any]) -> torch.device:
    first: tuple[torch.device, str] | None = None
    for where, tensor in _device_owners(samples, callables):
        if first is None:
            first = (tensor.device, where)
        elif tensor.device != first[0]:
            raise ValueError(
                f"sample tensors and parameters must share one device: {first[1]} is on "
                f"{first[0]}, but {where} is on {tensor.device}"
            )
    return first[0] if first is not None else torch.device("cpu")


def _device_owners(
    samples: Sequence[Sample], callables: Sequence[Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    for index, sample in enumerate(samples):
        for path, tensor in pytree.tree_flatten_with_path(sample)[0]:
            if isinstance(tensor, torch.Tensor):
                yield _leaf_path(index, path), tensor
    for index, fn in enumerate(callables):
        if isinstance(fn, torch.nn.Module):
            for name, param in fn.named_parameters():
                yield f"callables[{index}] ({type(fn).__name__}) parameter {name!r}", param


# ---------------------------------------------------------------------------- capture only


# The options that are flags: anything but a bool (the string 'False', None) is refused.
_BOOL_OPTIONS = (
    "allow_unused_input",
    "retain_graph_in_backward",
    "share_buffers",
    "debug_outputs",
    "check_memory",
    "fuse_grad_accumulation",
    "overlap_grad_accumulation",
)


def check_callable_or_none(name: str, value: object) -> None:
    """Refuse an option that must be a callable or None, naming it.

    Raises:
        TypeError: for anything else.
    """
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class CaptureOptions:
    """The options of ``make_graphed_callables`` that warm-up, capture and replay read."""

    num_warmup_iters: int
    allow_unused_input: bool
    retain_graph_in_backward: bool
    share_buffers: bool
    debug_outputs: bool
    check_memory: bool
    pre_warmup_hook: Callable[[], None] | None = None
    post_warmup_hook: Callable[[], None] | None = None
    fuse_grad_accumulation: bool = False
    accumulator_hooks: bool | str = True
    overlap_grad_accumulation: bool = False

    def __post_init__(self) -> None:
        count = self.num_warmup_iters
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"num_warmup_iters must be an int >= 0, got {count!r}")
        for name in _BOOL_OPTIONS:
            check_flag(name, getattr(self, name))
        for name in ("pre_warmup_hook", "post_warmup_hook"):
            check_callable_or_none(name, getattr(self, name))
        hooks = self.accumulator_hooks
        if not isinstance(hooks, (bool, str)):
            raise TypeError(
                "accumulator_hooks must be True, False or 'python', got "
                f"{type(hooks).__name__} {hooks!r}"
            )
        if isinstance(hooks, str) and hooks != HookDelivery.PYTHON.value:
            raise ValueError(f"accumulator_hooks must be True, False or 'python', got {hooks!r}")
        check_accumulation_modes(self.fuse_grad_accumulation, self.overlap_grad_accumulation)
        if hooks is not True and not self.fuse_grad_accumulation:
            raise ValueError(
                f"accumulator_hooks={hooks!r} needs fuse_grad_accumulation=True: without it "
                "autograd accumulates every parameter gradient itself, and its accumulators "
                "run their hooks; got fuse_grad_accumulation=False"
            )

    @property
    def hook_delivery(self) -> HookDelivery:
        """How the hooks on fused graphs' parameters' accumulators fire."""
        return HookDelivery(self.accumulator_hooks)


def check_flag(name: str, value: object) -> None:
    """Refuse an option that must be a bool (the string 'False', None, 0), naming it.

    Raises:
        TypeError: for anything but a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_accumulation_modes(fuse: bool, overlap: bool) -> None:
    """Refuse ``fuse_grad_accumulation`` and ``overlap_grad_accumulation`` together (both
    known to be bools).

    Raises:
        ValueError: when both are True.
    """
    if overlap and fuse:
        raise ValueError(
            "overlap_grad_accumulation=True moves autograd's additions of parameter "
            "gradients to a side stream, and fuse_grad_accumulation=True leaves autograd "
            "none (the backward graphs add them): choose one"
        )


def check_options(call: Call, options: CaptureOptions) -> None:
    """What the options require of a valid call, checked before any work.

    Raises:
        ValueError: for ``overlap_grad_accumulation`` with an order that has weight steps.
    """
    check_overlap_order(call, options.overlap_grad_accumulation)


def check_overlap_order(call: Call, overlap: bool) -> None:
    """Refuse ``overlap_grad_accumulation`` with an order that has weight steps.

    Raises:
        ValueError: for that.
    """
    if overlap and call.plan.split_backward:
        raise ValueError(
            "overlap_grad_accumulation=True needs an order without weight steps (-(c + 0.5)): "
            "there the parameter gradients come at backward_dw(), on the caller's stream"
        )


# The hooks a module call runs, per module and (``_global`` prefixed) for every module.
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def global_module_hooks() -> tuple[dict[int, Any], ...]:
    """torch's dicts of global module hooks, one per kind of :data:`MODULE_HOOKS` (filled
    and emptied in place by ``register_module_*_hook`` and their handles)."""
    return tuple(getattr(torch.nn.modules.module, f"_global{kind}", {}) for kind in MODULE_HOOKS)


def inert_hook(hook: object) -> bool:
    """Whether ``hook`` does nothing now, known by where it comes from: transformers installs
    its output-capturing hooks for good at the first ``output_attentions`` or
    ``output_hidden_states`` call, and they act only while its collector records. Capture
    and replay both let them be while they do nothing (a model that once ran eagerly with
    ``output_attentions=True`` stays graphable), and refuse them while they record."""
    if getattr(hook, "__module__", None) != _TRANSFORMERS_CAPTURING:
        return False
    collector = getattr(sys.modules.get(_TRANSFORMERS_CAPTURING), "_active_collector", None)
    get = getattr(collector, "get", None)
    return get is not None and not get()


_TRANSFORMERS_CAPTURING = "transformers.utils.output_capturing"

RECORDING_OUTPUTS_HINT = (
    "transformers records the outputs asked for with output_attentions, output_hidden_states "
    "or output_router_logits (in the call or the config) with these hooks, and a replay "
    "cannot run them: call the model without those outputs, or run the eager layers"
)


def transformers_recording(hooks: Mapping[Any, Any]) -> bool:
    """Whether every hook in ``hooks`` that acts is one of transformers' output-capturing
    hooks, recording now (the model was called asking for hooked outputs)."""
    acting = [hook for hook in hooks.values() if not inert_hook(hook)]
    return bool(acting) and all(
        getattr(hook, "__module__", None) == _TRANSFORMERS_CAPTURING for hook in acting
    )


def _active_hooks(hooks: Mapping[Any, Any] | None) -> bool:
    """Whether a module's (or torch's global) dict of hooks holds one that acts."""
    return hooks is not None and not all(map(inert_hook, hooks.values()))


def check_capturable(call: Call, already_graphed: Callable[[Any], bool]) -> None:
    """What capture alone requires of a valid call, checked before any work.

    ``already_graphed(obj)`` says whether ``obj`` is a graphed callable, or a module whose
    ``forward`` is one.

    Raises:
        RuntimeError: for autocast with its cache enabled, inference mode, or a CUDA stream
            capturing a graph.
        ValueError: for modules with hooks, buffers that require grad, an already graphed
            module or submodule, a TorchScript module or submodule, a graphed callable, or
            (without an order) the same module given twice.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "make_graphed_callables must not run under torch.inference_mode(): the static "
            "buffers and outputs it allocates would be inference tensors, which a replay "
            "outside inference_mode cannot write into; call it outside inference_mode, "
            "under torch.no_grad() for forward-only graphs (which replay under "
            "inference_mode too)"
        )
    if _stream_capturing():
        raise RuntimeError(
            "make_graphed_callables must not run while a CUDA stream captures (inside "
            "torch.cuda.graph or between CUDAGraph.capture_begin and capture_end): its warm-up "
            "runs the callables eagerly and its captures need a stream of their own, so CUDA "
            "would invalidate the outer capture; call it before or after that capture"
        )
    enabled = any(torch.is_autocast_enabled(d) for d in ("cuda", "cpu"))
    if enabled and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            "make_graphed_callables does not support the autocast cache: the cache would keep "
            "capture-time casts alive; use torch.autocast(..., cache_enabled=False)"
        )
    for index, fn, submodule in _graphed_parts(call, already_graphed):
        if not isinstance(fn, torch.nn.Module):
            raise ValueError(
                f"callables[{index}] is a graphed callable (a result of "
                f"make_graphed_callables): {_NESTED}; graph the eager callable it replays"
            )
        if submodule is None:
            raise ValueError(
                f"callables[{index}] ({type(fn).__name__}) was already graphed (reset or not, "
                "its forward stays the graphed callable); capture a fresh module: copy "
                "modules before graphing them"
            )
        raise ValueError(
            f"callables[{index}] ({type(fn).__name__}): submodule {submodule!r} was graphed "
            f"by make_graphed_callables (its forward is a graphed callable): {_NESTED}. "
            "Graph the outer module from eager submodules (copy it before graphing the "
            "submodule), or graph the submodule alone"
        )
    for index, fn in enumerate(call.callables):
        if isinstance(fn, torch.nn.Module):
            _check_module(index, fn)
    if not call.plan.ordered:
        _check_distinct_modules(call.callables)


def _stream_capturing() -> bool:
    """Whether the current CUDA stream captures a graph (never where CUDA was not started)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _fsdp_module_class() -> type | None:
    """FSDP2's module class (``fully_shard`` turns modules into subclasses of it), if its
    module is imported: a module was sharded only if it is."""
    for path in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        found = getattr(sys.modules.get(path), "FSDPModule", None)
        if isinstance(found, type):
            return found
    return None


_NESTED = (
    "a capture around it would record its replays, which read and write its static buffers "
    "without its checks, so calling it directly or resetting it would silently change the "
    "new graphs' results"
)


def check_plannable(call: Call, already_graphed: Callable[[Any], bool]) -> None:
    """What planning requires of a valid call: callables that are not graphed already.

    ``already_graphed(obj)`` says whether ``obj`` is a graphed callable, or a module whose
    ``forward`` is one.

    Raises:
        ValueError: for a graphed callable, or a module that was graphed or holds a graphed
            submodule: its forward replays graphs, which save nothing for autograd, so the
            probe would measure the replay, not the callable it stands for.
    """
    for index, fn, submodule in _graphed_parts(call, already_graphed):
        if not isinstance(fn, torch.nn.Module):
            what = f"callables[{index}] is a graphed callable (a result of make_graphed_callables)"
            remedy = "plan the eager callable it replays"
        elif submodule is None:
            what = (
                f"callables[{index}] ({type(fn).__name__}) was graphed by "
                "make_graphed_callables (reset or not, its forward is the graphed callable)"
            )
            remedy = "plan a copy of the module made before graphing it"
        else:
            what = (
                f"callables[{index}] ({type(fn).__name__}): submodule {submodule!r} was graphed "
                "by make_graphed_callables (its forward is a graphed callable)"
            )
            remedy = "plan a copy of the module made before graphing the submodule"
        raise ValueError(
            f"plan_memory: {what}; its forward replays graphs, whose autograd node saves "
            "nothing, so the plan would measure the replay, not the forward it stands for "
            f"(a reset one raises); {remedy}"
        )


def _graphed_parts(
    call: Call, already_graphed: Callable[[Any], bool]
) -> Iterator[tuple[int, Any, str | None]]:
    """``(index, callable, submodule)`` for each callable that is graphed (``submodule``
    None) or, for a module, each of its submodules that is (``submodule`` its name)."""
    for index, fn in enumerate(call.callables):
        if already_graphed(fn):
            yield index, fn, None
        elif isinstance(fn, torch.nn.Module):
            for name, module in fn.named_modules():
                if name and already_graphed(module):
                    yield index, fn, name


def _check_module(index: int, fn: torch.nn.Module) -> None:
    global_hooks = [
        kind for kind, hooks in zip(MODULE_HOOKS, global_module_hooks()) if _active_hooks(hooks)
    ]
    if global_hooks:
        raise ValueError(
            f"callables[{index}] ({type(fn).__name__}): global module hooks are registered "
            f"({', '.join(f'_global{kind}' for kind in global_hooks)}); graphs cannot replay "
            "them; remove them (torch.nn.modules.module.register_module_*_hook) before capture"
        )
    fsdp = _fsdp_module_class()
    for name, module in fn.named_modules():
        where = f"submodule {name!r}" if name else "the module"
        if isinstance(module, torch.jit.ScriptModule):
            raise ValueError(
                f"callables[{index}] ({type(fn).__name__}): {where} is a TorchScript module "
                f"({type(module).__name__}, from torch.jit.script or torch.jit.trace), whose "
                "parameters, buffers and submodules live in C++ behind wrappers that are not "
                "the dicts a replay checks them in; expected an eager nn.Module: graph the "
                "module before scripting or tracing it"
            )
        if fsdp is not None and isinstance(module, fsdp):
            raise ValueError(
                f"callables[{index}] ({type(fn).__name__}): {where} is sharded by FSDP2's "
                "fully_shard, whose hooks all-gather and free its parameters around every "
                "forward and backward; graphs cannot replay them, and FSDP2 does not compose "
                "with graphed layers (docs/composition.md)"
            )
        hooks = [kind for kind in MODULE_HOOKS if _active_hooks(getattr(module, kind, None))]
        if hooks:
            raise ValueError(
                f"callables[{index}] ({type(fn).__name__}): {where} has {', '.join(hooks)}, "
                "which graphs cannot replay; remove them before capture"
            )
    for name, param in fn.named_parameters():
        if TENSOR_HOOKS(param):
            raise ValueError(
                f"callables[{index}] ({type(fn).__name__}): parameter {name!r} has a tensor hook "
                "(register_hook); the captured backward would run it and autograd would run it "
                "again when it accumulates the gradient, so it would act twice. Remove it "
                "before capture (register_post_accumulate_grad_hook hooks are fine)"
            )
    for name, buffer in fn.named_buffers():
        if buffer.requires_grad:
            raise ValueError(
                f"callables[{index}] ({type(fn).__name__}): buffer {name!r} requires grad; "
                "graphed modules' buffers must not require grad"
            )


def _check_distinct_modules(callables: tuple[Any, ...]) -> None:
    first: dict[int, int] = {}
    for index, fn in enumerate(callables):
        if isinstance(fn, torch.nn.Module):
            if id(fn) in first:
                raise ValueError(
                    f"callables[{index}] is the same module as callables[{first[id(fn)]}]; "
                    "without an order each module is graphed once (its forward is replaced)"
                )
            first[id(fn)] = index
