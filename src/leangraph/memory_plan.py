"""Memory planning: how many bytes warm-up and capture of a pipeline order hold, step by step.

:func:`plan_memory` takes the arguments of :func:`leangraph.make_graphed_callables`, measures
one forward of every distinct callable (what autograd saves for backward, what it returns, what
its backward produces) and walks the liveness plan of :mod:`leangraph.plan` with the engine's
memory model:

* **Warm-up** runs the order eagerly on the sample tensors. At each step the forwards whose
  backward has not run yet hold their saved activations and their outputs; a backward step
  transiently adds its gradients (grad-inputs + parameter grads) and the zero grad-outputs it
  seeds the backward with. Nothing else is allocated (the samples are the caller's).
* **Static buffers** (allocated before capture, outside the pool) come from the engine's own
  buffer plan, :func:`leangraph.buffers.plan_buffers`: graphs whose lifetimes
  ``[forward, backward]`` never overlap share input slots of the same shape, dtype, device
  and ``requires_grad``; a layer's first input is the previous layer's output (chained, no
  slot); gradient seeds (static grad-outputs) are needed once per key.
* **Capture** follows the same sequence into one pool. A graph's saved activations and its
  outputs stay in the pool until its backward is recorded, after which later captures reuse
  them; its gradients are released right after its backward. The capture peak is the static
  buffers plus the in-flight forwards plus the backward's gradients; what is held after
  capture is the static buffers plus the pool's high-water mark of in-flight forwards (the
  gradients are taken to fit in blocks the backward frees; add ``peak_transient_bytes`` for an
  upper bound).

It works on the ``meta`` device (nothing is allocated: sizes come from tensor metadata), so a
70B-parameter model can be planned on a laptop, and on CPU or CUDA (measured the same way,
never from allocator statistics). On ``meta``, ``scaled_dot_product_attention`` has no kernel
choice and would run its math fallback (saving the ``s x s`` probabilities); it is measured
instead as the fused flash kernel of the modelled device (``meta_attention``), with the
outputs of torch's own meta kernel (on torch 2.4, which has no meta kernel for CUDA's flash
attention, with the outputs torch 2.5 gives). Modelling the CPU, it follows CPU's own kernel
choice: where that is the math path (say grouped-query attention before CPU's flash kernel
took it), the math path is measured, as a CPU run would.

Parameters and buffers are known only for ``nn.Module`` callables: tensors a plain function
closes over (a weight, say) count as activations when autograd saves them.

Not modelled: forward temporaries that are not saved for backward (they live only inside one
step), tensors a custom ``autograd.Function`` stores on ``ctx`` directly rather than through
``save_for_backward``, allocator fragmentation and rounding, the caller's sample tensors, and
``share_buffers=False``.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .arguments import Samples, as_tuples, common_device, make_plan, normalize_samples
from .buffers import BufferKey, plan_buffers
from .order import Layout, StepKind
from .plan import GraphStep, Plan

__all__ = [
    "LayerMemory",
    "MemoryPlan",
    "StepMemory",
    "format_bytes",
    "key_bytes",
    "plan_memory",
]

SampleArgs = tuple[Any, ...]
_META_ATTENTION = ("cuda", "cpu", "math")


# ---------------------------------------------------------------------------- records


def key_bytes(key: BufferKey) -> int:
    """Bytes of one contiguous buffer of ``key``."""
    return math.prod(key.shape) * _element_size(key.dtype)


@dataclass(frozen=True, slots=True)
class LayerMemory:
    """One measured forward/backward of a callable on one sample signature.

    Byte counts are of distinct storages (a view keeps its whole storage alive, so a saved view
    costs its storage, and several views of one storage cost it once).

    Attributes:
        activation_bytes: Saved for backward, excluding parameters, buffers and the inputs.
        saved_input_bytes: Inputs that are saved for backward (static inputs or the previous
            layer's output; the Korthikanti formula counts them as the layer's activations).
        output_bytes: Outputs that await a backward (differentiable ones).
        in_flight_bytes: What one forward holds until its backward, in warm-up and in the
            capture pool: activations and outputs (a saved output counted once).
        grad_input_bytes: Gradients of inputs that require grad.
        param_grad_bytes: Gradients of parameters that require grad.
        inputs: Buffer key of every tensor leaf of the sample arguments.
        outputs: Buffer key of every tensor output (``requires_grad``: it needs a gradient).
    """

    activation_bytes: int
    saved_input_bytes: int
    output_bytes: int
    in_flight_bytes: int
    grad_input_bytes: int
    param_grad_bytes: int
    inputs: tuple[BufferKey, ...]
    outputs: tuple[BufferKey, ...]

    @property
    def transient_bytes(self) -> int:
        """What a backward allocates on top of what is held: grad-inputs + parameter grads."""
        return self.grad_input_bytes + self.param_grad_bytes


@dataclass(frozen=True, slots=True)
class StepMemory:
    """Live bytes during one step of warm-up or capture.

    Attributes:
        phase: ``"warm-up"`` or ``"capture"``.
        index: Position of the step within its phase.
        step: The plan step, e.g. ``"F c1 m0 l2"``.
        in_flight: Graphs whose forward ran and whose backward has not finished.
        live_bytes: Highest live bytes during the step (a backward's transient included).
    """

    phase: str
    index: int
    step: str
    in_flight: int
    live_bytes: int

    def where(self) -> str:
        """E.g. ``"capture step 183 (B c1 m0 l3)"``."""
        return f"{self.phase} step {self.index} ({self.step})"


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes that warm-up and capture of one ``make_graphed_callables`` call hold.

    Attributes:
        ordered: Whether an order was given (else the torch drop-in plan).
        layout: Chunks, layers and microbatches of the graphs.
        layers: One measurement per callable (``callables[i]`` -> ``layers[i]``), on its
            microbatch-0 sample.
        activation_bytes_per_graph: ``activation_bytes`` of each graph, by graph index.
        static_input_bytes: Shared static input slots (chained inputs need none).
        grad_output_bytes: Gradient seeds (static grad-outputs), one per key.
        static_bytes: The two above.
        warmup_peak_bytes: Lean warm-up peak: in-flight forwards + a backward's gradients and
            its zero grad-outputs.
        naive_warmup_peak_bytes: Warm-up peak if every warm-up output and saved activation
            were kept for the whole pass (a tool that frees warm-up outputs only at the end).
        capture_peak_bytes: Capture peak: static buffers + in-flight forwards + transient.
        pool_bytes: High-water mark of in-flight forwards (activations and outputs) in the
            capture pool.
        held_bytes: Held after capture: ``static_bytes + pool_bytes``.
        peak_transient_bytes: Largest backward transient (grad-inputs + parameter grads).
        max_in_flight: Most graphs in flight at once during capture.
        warmup_peak_step, capture_peak_step, naive_peak_step: Where each peak falls.
        peak_step: Where the larger of the warm-up and capture peaks falls.
        steps: Every warm-up step, then every capture step.
    """

    ordered: bool
    layout: Layout
    layers: tuple[LayerMemory, ...]
    activation_bytes_per_graph: tuple[int, ...]
    static_input_bytes: int
    grad_output_bytes: int
    warmup_peak_bytes: int
    naive_warmup_peak_bytes: int
    capture_peak_bytes: int
    pool_bytes: int
    peak_transient_bytes: int
    max_in_flight: int
    warmup_peak_step: str
    naive_peak_step: str
    capture_peak_step: str
    steps: tuple[StepMemory, ...]

    @property
    def static_bytes(self) -> int:
        """Static input slots and gradient seeds together."""
        return self.static_input_bytes + self.grad_output_bytes

    @property
    def held_bytes(self) -> int:
        """What the graphs hold after capture: the pool's high-water mark + static buffers."""
        return self.pool_bytes + self.static_bytes

    @property
    def peak_step(self) -> str:
        """Where the larger of the warm-up and capture peaks falls."""
        if self.capture_peak_bytes >= self.warmup_peak_bytes:
            return self.capture_peak_step
        return self.warmup_peak_step

    def describe(self) -> str:
        """A human-readable table of the per-callable measurements and the plan's figures."""
        return "\n".join(_describe_header(self) + _describe_layers(self) + _describe_plan(self))


# ---------------------------------------------------------------------------- entry point


def plan_memory(
    callables: Callable[..., Any] | tuple[Callable[..., Any], ...],
    sample_args: SampleArgs | tuple[SampleArgs, ...],
    *,
    sample_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    order: Sequence[int] | None = None,
    num_layers_per_chunk: int | Sequence[int] | None = None,
    meta_attention: str = "cuda",
) -> MemoryPlan:
    """Plan the memory of ``make_graphed_callables`` with the same arguments, without capturing.

    Every distinct callable (the same object counts once) is run forward once per distinct
    sample signature under ``torch.autograd.graph.saved_tensors_hooks``; nothing runs backward
    (gradient sizes come from tensor metadata). Then the plan's warm-up and capture sequences
    are walked step by step (see the module docstring for the model).

    Args:
        callables: A callable or ``nn.Module``, or a tuple of them (the layers, chunk by chunk).
        sample_args: One tuple of sample arguments per graph (one tuple for a single callable),
            laid out as for ``make_graphed_callables``. Meta tensors allocate nothing.
        sample_kwargs: One dict of keyword sample arguments per graph (a dict for a single
            callable), or None.
        order: The pipeline order; None for the torch drop-in plan (each callable's forward
            and backward back to back in warm-up; all forwards then all backwards in capture).
        num_layers_per_chunk: Layers of each chunk with ``order`` (default: an equal split).
        meta_attention: Which kernel ``scaled_dot_product_attention`` on meta tensors without
            an ``attn_mask`` stands for: ``"cuda"`` (CUDA's flash kernel: saves q, k, v, the
            output, its fp32 log-sum-exp and the RNG seed and offset), ``"cpu"`` (what CPU's
            SDPA runs on such tensors, which is what a CPU run measures: its flash kernel,
            which saves the same without the RNG state, or its math path where CPU's kernel
            choice picks that) or ``"math"`` (PyTorch's own meta fallback, the unfused math
            path that saves the ``s x s`` attention probabilities).

    Returns:
        The :class:`MemoryPlan`.

    Raises:
        TypeError: for callables that are not callable, sample arguments that are not tuples
            of tensor pytrees, or outputs that are not tensors.
        ValueError: for a malformed order, mismatched counts, tensors on several devices or an
            unknown ``meta_attention``.
    """
    if meta_attention not in _META_ATTENTION:
        raise ValueError(f"meta_attention must be one of {_META_ATTENTION}, got {meta_attention!r}")
    fns, samples = _normalize(callables, sample_args, sample_kwargs)
    plan = make_plan(len(fns), samples, order, num_layers_per_chunk)
    common_device(samples, fns)
    graphs = _measure_graphs(plan, fns, samples, meta_attention)
    return _walk_plan(plan, graphs, *_static_bytes(plan, graphs, samples))


def format_bytes(count: float) -> str:
    """``count`` bytes in the largest binary unit that keeps it >= 1, e.g. ``"1.50 GiB"``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


# ---------------------------------------------------------------------------- validation


def _normalize(
    callables: Any, sample_args: Any, sample_kwargs: Any
) -> tuple[tuple[Any, ...], Samples]:
    """The callables as a tuple and one ``(args, kwargs)`` pair per graph, leaves checked."""
    callables, sample_args, sample_kwargs, _ = as_tuples(callables, sample_args, sample_kwargs)
    for index, fn in enumerate(callables):
        if not callable(fn):
            raise TypeError(f"callables[{index}] is a {type(fn).__name__}, which is not callable")
    if not isinstance(sample_args, (tuple, list)):
        raise TypeError(f"sample_args must be a tuple, got {type(sample_args).__name__}")
    return callables, normalize_samples(sample_args, sample_kwargs, len(sample_args))


# ---------------------------------------------------------------------------- measurement


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """A key identifying ``tensor``'s storage while it is alive, and the storage's bytes."""
    try:
        storage = tensor.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (NotImplementedError, RuntimeError):  # tensors without a plain storage
        return id(tensor), _nbytes(tensor)


def _bytes(storages: dict[int, int], keys: Iterable[int]) -> int:
    return sum(storages[k] for k in set(keys))


def _signature(fn: Any, sample: tuple[Any, Any]) -> tuple[Any, ...]:
    """What makes two graphs' measurements equal: the callable and the samples' metadata."""
    leaves, tree = pytree.tree_flatten(sample)
    meta = tuple((tuple(t.shape), t.dtype, str(t.device), t.requires_grad) for t in leaves)
    return id(fn), str(tree), meta


def _measure_graphs(
    plan: Plan, fns: tuple[Any, ...], samples: list[tuple[Any, Any]], meta_attention: str
) -> list[LayerMemory]:
    """One measurement per graph, shared between graphs of the same callable and signature."""
    cache: dict[tuple[Any, ...], LayerMemory] = {}
    result = []
    layout = plan.layout
    for graph in range(layout.num_graphs):
        graph_id = layout.graph_id(graph)
        fn = fns[layout.callable_index(graph_id.chunk, graph_id.layer)]
        key = _signature(fn, samples[graph])
        if key not in cache:
            cache[key] = _measure(fn, samples[graph], meta_attention, graph)
        result.append(cache[key])
    return result


def _per_callable(layout: Layout, graphs: Sequence[LayerMemory]) -> tuple[LayerMemory, ...]:
    """Each callable's measurement on its first graph (microbatch 0)."""
    first: dict[int, LayerMemory] = {}
    for graph in reversed(range(layout.num_graphs)):
        graph_id = layout.graph_id(graph)
        first[layout.callable_index(graph_id.chunk, graph_id.layer)] = graphs[graph]
    return tuple(first[index] for index in range(layout.num_callables))


class _Packed:
    """What the pack hook hands autograd instead of a saved tensor.

    Packing the tensor itself would tie a saved *output* and its own ``grad_fn`` into a
    reference cycle (output -> node -> output), which keeps the whole graph of the forward,
    and its device memory, alive until the cycle collector runs. The holder is emptied once
    the measurement is done, which breaks every such cycle.
    """

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor


@contextlib.contextmanager
def _run_forward(
    fn: Any, inputs: list[torch.Tensor], tree: pytree.TreeSpec, meta_attention: str
) -> Iterator[tuple[list[Any], list[torch.Tensor]]]:
    """Run ``fn`` once; yields its output leaves and the tensors autograd still saves.

    Saved tensors are tracked by weak reference: those of graph branches that died during the
    forward (results the callable dropped) are freed, so they neither count nor alias the
    storage keys of tensors allocated after them.
    """
    packed: list[weakref.ref[_Packed]] = []

    def pack(tensor: torch.Tensor) -> _Packed:
        holder = _Packed(tensor)
        packed.append(weakref.ref(holder))
        return holder

    def unpack(holder: _Packed) -> torch.Tensor:
        assert holder.tensor is not None, "the measurement's graph is never differentiated"
        return holder.tensor

    args, kwargs = pytree.tree_unflatten(inputs, tree)
    with (
        torch.enable_grad(),
        _MetaAttention(meta_attention),
        torch.autograd.graph.saved_tensors_hooks(pack, unpack),
    ):
        outputs = pytree.tree_leaves(fn(*args, **kwargs))
    holders = [h for h in (ref() for ref in packed) if h is not None]
    try:
        yield outputs, [h.tensor for h in holders if h.tensor is not None]
    finally:
        for holder in holders:
            holder.tensor = None


def _measure(fn: Any, sample: tuple[Any, Any], meta_attention: str, graph: int) -> LayerMemory:
    """Measure one forward of ``fn`` on ``sample``; see :class:`LayerMemory`."""
    leaves, tree = pytree.tree_flatten(sample)
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in leaves]
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    buffers = list(fn.buffers()) if isinstance(fn, torch.nn.Module) else []
    with _run_forward(fn, inputs, tree, meta_attention) as (outputs, saved_tensors):
        for index, out in enumerate(outputs):
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"graph {graph}: output {index} must be a tensor, got {type(out).__name__}"
                )
        storages = dict(_storage(t) for t in saved_tensors + inputs + params + buffers + outputs)
        saved = {_storage(t)[0] for t in saved_tensors}
        fixed = {_storage(t)[0] for t in params + buffers}
        input_keys = {_storage(t)[0] for t in inputs} - fixed
        kept_keys = {_storage(t)[0] for t in outputs if t.requires_grad} - fixed - input_keys
        activations = saved - fixed - input_keys
        return LayerMemory(
            activation_bytes=_bytes(storages, activations),
            saved_input_bytes=_bytes(storages, saved & input_keys),
            output_bytes=_bytes(storages, kept_keys),
            # Without a differentiable output there is no backward: nothing outlives the forward.
            in_flight_bytes=_bytes(storages, activations | kept_keys) if kept_keys else 0,
            grad_input_bytes=sum(_nbytes(t) for t in inputs if t.requires_grad),
            param_grad_bytes=sum(_nbytes(p) for p in params if p.requires_grad),
            inputs=tuple(BufferKey.of(t) for t in inputs),
            outputs=tuple(BufferKey.of(t) for t in outputs),
        )


class _MetaAttention(TorchFunctionMode):
    """Measures ``scaled_dot_product_attention`` on meta tensors as a fused flash kernel."""

    def __init__(self, like: str) -> None:
        super().__init__()
        self._like = like

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self._like != "math":
            fused = _flash_attention(self._like, *args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _flash_attention(
    like: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """The flash kernel's output on meta tensors, or None where the kernel does not apply."""
    if query.device.type != "meta" or attn_mask is not None:
        return None
    if key.shape[-3] != query.shape[-3] and not enable_gqa:
        return None  # let PyTorch raise its own error
    if like == "cuda":
        with _cuda_flash_meta_kernel():
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
    if not _cpu_runs_flash(query, key, value, dropout_p, is_causal, scale, enable_gqa):
        return None  # a CPU run takes the math path, which is PyTorch's meta fallback too
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )[0]


def _cpu_runs_flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> bool:
    """Whether CPU's SDPA would pick its flash kernel for tensors like these (no mask).

    Asks CPU's own kernel choice, which changes between torch versions (torch 2.5 and 2.6
    run grouped-query attention on the math path) and with ``torch.nn.attention.sdpa_kernel``.
    """
    gqa: dict[str, Any] = {"enable_gqa": True} if enable_gqa else {}  # torch 2.4 has none
    choice = torch._fused_sdp_choice(
        _cpu_stand_in(query),
        _cpu_stand_in(key),
        _cpu_stand_in(value),
        None,
        dropout_p,
        is_causal,
        scale=scale,
        **gqa,
    )
    return choice == SDPBackend.FLASH_ATTENTION.value


def _cpu_stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``tensor``'s sizes, dtype and last stride, all that CPU's kernel
    choice reads, over one row of memory (stride 0 elsewhere), whatever the sizes."""
    strides = [0] * tensor.dim()
    if strides:
        strides[-1] = tensor.stride(-1)
    return torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype)


_CUDA_FLASH = "aten::_scaled_dot_product_flash_attention"


def _cuda_flash_meta_kernel() -> contextlib.AbstractContextManager[Any]:
    """Torch's own meta kernel of CUDA's flash attention, or ours where torch has none."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(_CUDA_FLASH, "Meta"):
        return contextlib.nullcontext()
    return _CudaFlashMetaKernel()


class _CudaFlashMetaKernel(TorchDispatchMode):
    """CUDA's flash attention on meta tensors, for torch 2.4, which has no meta kernel for it.

    Autograd runs above this mode, so it saves what it saves for the real kernel; the outputs
    are those of torch 2.4's own FakeTensor kernel and torch 2.5's meta kernel: the output laid
    out as the query, its fp32 log-sum-exp, and the RNG seed and offset as int64 scalars.
    """

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is not torch.ops.aten._scaled_dot_product_flash_attention.default:
            return func(*args, **(kwargs or {}))
        query, key = args[0], args[1]
        batch, heads, query_length = query.shape[:3]
        output = torch.empty_like(query.transpose(1, 2)).transpose(1, 2)
        logsumexp = torch.empty(batch, heads, query_length, dtype=torch.float, device="meta")
        seed, offset = (torch.empty((), dtype=torch.long, device="meta") for _ in range(2))
        debug_mask = torch.empty(0, dtype=query.dtype, device="meta")  # never asked for
        return output, logsumexp, None, None, query_length, key.shape[2], seed, offset, debug_mask


# ---------------------------------------------------------------------------- walking the plan


def _walk_plan(
    plan: Plan, graphs: Sequence[LayerMemory], static_in: int, grad_out: int
) -> MemoryPlan:
    """Walk warm-up (lean and keep-all) and capture over the per-graph measurements."""
    held = [m.in_flight_bytes for m in graphs]
    transient = _Transients.of(graphs, plan.split_backward, seeds=False)
    seeded = _Transients.of(graphs, plan.split_backward, seeds=True)  # warm-up's zero seeds
    warmup = _walk("warm-up", plan.warmup, 0, held, seeded)
    naive = _walk("warm-up", plan.warmup, 0, held, seeded, keep_all=True)
    capture = _walk("capture", plan.capture, static_in + grad_out, held, transient)
    return MemoryPlan(
        ordered=plan.ordered,
        layout=plan.layout,
        layers=_per_callable(plan.layout, graphs),
        activation_bytes_per_graph=tuple(m.activation_bytes for m in graphs),
        static_input_bytes=static_in,
        grad_output_bytes=grad_out,
        warmup_peak_bytes=warmup.peak.live_bytes,
        naive_warmup_peak_bytes=naive.peak.live_bytes,
        capture_peak_bytes=capture.peak.live_bytes,
        pool_bytes=capture.high_water,
        peak_transient_bytes=max((*transient.backward, *transient.weight), default=0),
        max_in_flight=max((s.in_flight for s in capture.steps), default=0),
        warmup_peak_step=warmup.peak.where(),
        naive_peak_step=naive.peak.where(),
        capture_peak_step=capture.peak.where(),
        steps=warmup.steps + capture.steps,
    )


def _static_bytes(
    plan: Plan, graphs: Sequence[LayerMemory], samples: Sequence[tuple[Any, Any]]
) -> tuple[int, int]:
    """Bytes of the input slots and gradient seeds the engine's buffer plan allocates."""
    chainable = [bool(args) and isinstance(args[0], torch.Tensor) for args, _ in samples]
    buffers = plan_buffers(
        plan, [m.inputs for m in graphs], [m.outputs for m in graphs], chainable=chainable
    )
    return (
        sum(key_bytes(k) for k in buffers.slot_keys),
        sum(key_bytes(k) for k in buffers.seed_keys),
    )


@dataclass(frozen=True, slots=True)
class _Transients:
    """What each graph's backward and weight steps allocate on top of what is held.

    A full backward allocates input and parameter gradients; a split one allocates the input
    gradients at ``-c`` and the parameter gradients at the deferred ``-(c + 0.5)``.
    """

    backward: tuple[int, ...]
    weight: tuple[int, ...]

    @classmethod
    def of(cls, graphs: Sequence[LayerMemory], split: bool, *, seeds: bool) -> _Transients:
        seed = [m.output_bytes if seeds else 0 for m in graphs]
        if not split:
            return cls(
                tuple(m.transient_bytes + s for m, s in zip(graphs, seed)), (0,) * len(graphs)
            )
        return cls(
            tuple(m.grad_input_bytes + s for m, s in zip(graphs, seed)),
            tuple(m.param_grad_bytes + s for m, s in zip(graphs, seed)),
        )

    def at(self, step: GraphStep) -> int:
        if step.kind is StepKind.BACKWARD:
            return self.backward[step.graph]
        if step.kind is StepKind.WEIGHT:
            return self.weight[step.graph]
        return 0


@dataclass(frozen=True, slots=True)
class _Walk:
    steps: tuple[StepMemory, ...]
    peak: StepMemory
    high_water: int  # most in-flight bytes, transients excluded


def _walk(
    phase: str,
    steps: Sequence[GraphStep],
    static: int,
    held: Sequence[int],
    transient: _Transients,
    *,
    keep_all: bool = False,
) -> _Walk:
    """Live bytes at each step: ``static`` + what in-flight graphs hold + a backward's transient.

    ``held[g]`` is what graph ``g`` holds from its forward (``born``) until its backward
    (``dies``); with ``keep_all`` nothing dies (the keep-everything baseline).
    """
    in_flight: set[int] = set()
    total = high_water = 0
    records = []
    for index, step in enumerate(steps):
        for graph in step.born:
            in_flight.add(graph)
            total += held[graph]
        high_water = max(high_water, total)
        extra = transient.at(step)
        records.append(StepMemory(phase, index, str(step), len(in_flight), static + total + extra))
        for graph in () if keep_all else step.dies:
            in_flight.discard(graph)
            total -= held[graph]
    if not records:
        raise ValueError("the plan has no steps")
    peak = max(records, key=lambda r: r.live_bytes)
    return _Walk(tuple(records), peak, high_water)


# ---------------------------------------------------------------------------- describe


def _describe_header(plan: MemoryPlan) -> list[str]:
    layout = plan.layout
    kind = "ordered" if plan.ordered else "unordered (torch drop-in)"
    return [
        f"leangraph memory plan, {kind}: {layout.num_chunks} chunk(s) of "
        f"{list(layout.layers_per_chunk)} layer(s) x {layout.num_microbatches} microbatch(es) "
        f"= {layout.num_graphs} graphs",
        "",
    ]


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    start = prev = indices[0]
    following: list[int | None] = [*indices[1:], None]
    for index in following:
        if index is not None and index == prev + 1:
            prev = index
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if index is not None:
            start = prev = index
    return ", ".join(parts)


def _describe_layers(plan: MemoryPlan) -> list[str]:
    groups: dict[LayerMemory, list[int]] = {}
    for index, layer in enumerate(plan.layers):
        groups.setdefault(layer, []).append(index)
    header = ("callables", "activations", "saved inputs", "outputs", "grad-inputs", "param grads")
    rows = [header] + [
        (
            _ranges(indices),
            format_bytes(m.activation_bytes),
            format_bytes(m.saved_input_bytes),
            format_bytes(m.output_bytes),
            format_bytes(m.grad_input_bytes),
            format_bytes(m.param_grad_bytes),
        )
        for m, indices in groups.items()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["per callable (one forward):"]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  " + "  ".join(cells))
    return [*lines, ""]


def _describe_plan(plan: MemoryPlan) -> list[str]:
    rows = [
        ("static input slots", plan.static_input_bytes, "shared; chained inputs need none"),
        ("static grad-output seeds", plan.grad_output_bytes, "one per shape"),
        ("warm-up peak, keep-all", plan.naive_warmup_peak_bytes, plan.naive_peak_step),
        ("warm-up peak, lean", plan.warmup_peak_bytes, plan.warmup_peak_step),
        ("capture peak", plan.capture_peak_bytes, plan.capture_peak_step),
        ("capture pool high-water", plan.pool_bytes, ""),
        ("held after capture", plan.held_bytes, "pool high-water + static buffers"),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [
        f"  {name.ljust(width)}  {format_bytes(value):>11}  {note}".rstrip()
        for name, value, note in rows
    ]
    lines.append(
        f"  most graphs in flight: {plan.max_in_flight}; largest backward transient "
        f"{format_bytes(plan.peak_transient_bytes)}"
    )
    return ["plan:", *lines]
