"""Tensor leaves and the constants between them, in arguments and outputs.

A graph replays kernels, so only tensors can change between replays; every other leaf of a
call's arguments (``use_cache=False``, ``attention_mask=None``, an int, a string, ``None``
inside a tuple) or of its outputs (Megatron-core's ``(hidden, None)``) is a constant captured
with the graph. A :class:`LeafTemplate` remembers the constants by position so the tensors
can be taken out (the static buffers) and put back (the call and the returned outputs).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .runtime.guard import GuardedOutput

__all__ = [
    "CONSTANT_TYPES",
    "TENSOR",
    "LeafTemplate",
    "is_constant",
    "leaf_names",
    "not_dense",
    "same_constant",
    "tensor_subclass",
]

CONSTANT_TYPES: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
    type(Ellipsis),
    slice,
)
"""The non-tensor leaves a graph can hold as constants: immutable values compared by value."""


def is_constant(value: object) -> bool:
    """Whether ``value`` is a leaf a graph can capture as a constant."""
    return isinstance(value, CONSTANT_TYPES)


def same_constant(a: object, b: object) -> bool:
    """Whether two constants are the same: same type and equal (``1`` is not ``True``);
    floats and complex numbers by their exact value (:func:`_same_float`)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and isinstance(b, float):
        return _same_float(a, b)
    if isinstance(a, complex) and isinstance(b, complex):
        return _same_float(a.real, b.real) and _same_float(a.imag, b.imag)
    try:
        return bool(a == b)
    except Exception:  # a value whose comparison fails is not the same constant
        return False


def _same_float(a: float, b: float) -> bool:
    """``==`` but exact: ``-0.0`` is not ``0.0`` (``x / eps`` gives -inf for one, +inf for
    the other) and NaN is NaN (a graph captured with a NaN fill replays with NaN again)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def not_dense(tensor: torch.Tensor) -> str | None:
    """What kind of tensor ``tensor`` is if it is not a dense one with storage (sparse,
    mkldnn, nested, quantized), else None: a graph's static inputs are dense buffers that
    every replay copies its arguments into."""
    if tensor.is_nested:
        return f"nested tensor ({tensor.layout})"
    if tensor.layout is not torch.strided:
        return f"{tensor.layout} tensor"
    if tensor.is_quantized:
        return f"quantized tensor ({tensor.dtype})"
    return None


# The function behind torch.Tensor's classmethod __torch_function__: a subclass keeping it
# only keeps its type through ops.
_DEFAULT_FUNCTION = vars(torch.Tensor)["__torch_function__"].__func__


def tensor_subclass(tensor: torch.Tensor) -> str | None:
    """What ``tensor`` is if it is a tensor subclass that eager would compute with otherwise
    than with a plain tensor, else None.

    A subclass that overrides ``__torch_function__`` or ``__torch_dispatch__`` (a DTensor, a
    float8 tensor, one that wraps its ops) changes what eager runs, and even the default
    ``__torch_function__`` makes eager's results that subclass. A graph replays the kernels
    capture recorded on its plain static buffers and returns plain tensors, so neither holds.
    A subclass with both disabled (``nn.Parameter``'s) computes as a plain tensor, and so do
    the outputs of graphs captured with ``debug_outputs=True``, which check their guard first.
    """
    cls = type(tensor)
    if cls is torch.Tensor or cls is GuardedOutput:
        return None  # debug_outputs' outputs compute as plain tensors once their guard passes
    function = cls.__torch_function__
    disabled = function is torch._C._disabled_torch_function_impl
    dispatches = cls.__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl
    if disabled and not dispatches:
        return None
    own_function = not disabled and getattr(function, "__func__", None) is not _DEFAULT_FUNCTION
    overrides = [
        hook
        for hook, overridden in (
            ("__torch_function__", own_function),
            ("__torch_dispatch__", dispatches),
        )
        if overridden
    ]
    how = f"overrides {' and '.join(overrides)}" if overrides else "keeps its type through ops"
    return f"{cls.__qualname__} (a torch.Tensor subclass that {how})"


class _TensorSlot:
    """Where a template holds a tensor."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<tensor>"


TENSOR = _TensorSlot()


@dataclass(frozen=True)
class LeafTemplate:
    """The leaves of one call or output, constants in place and a slot for each tensor."""

    leaves: tuple[Any, ...]

    @classmethod
    def of(cls, leaves: Sequence[Any]) -> LeafTemplate:
        """The template of ``leaves`` (tensors become slots)."""
        return cls(tuple(TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves))

    @property
    def all_tensors(self) -> bool:
        """Whether every leaf is a tensor (no constants)."""
        return all(leaf is TENSOR for leaf in self.leaves)

    @property
    def num_tensors(self) -> int:
        return sum(1 for leaf in self.leaves if leaf is TENSOR)

    def fill(self, tensors: Sequence[Any]) -> list[Any]:
        """All leaves, the tensors put into their slots in order."""
        if self.all_tensors:
            return list(tensors)
        given = iter(tensors)
        return [next(given) if leaf is TENSOR else leaf for leaf in self.leaves]

    def constants(self) -> list[tuple[int, Any]]:
        """``(position, value)`` of every constant."""
        return [(i, leaf) for i, leaf in enumerate(self.leaves) if leaf is not TENSOR]


def leaf_names(tree: Any) -> list[str]:
    """Readable names for the leaves of a call's ``(args, kwargs)``, e.g. ``input 0``,
    ``input 1[2]``, ``kwarg 'use_cache'``."""
    names = []
    for path, _ in pytree.tree_flatten_with_path(tree)[0]:
        group, head, *rest = path
        suffix = "".join(str(k) for k in rest)
        if isinstance(group, pytree.SequenceKey) and group.idx == 0:  # positional arguments
            assert isinstance(head, pytree.SequenceKey)
            names.append(f"input {head.idx}{suffix}")
        else:
            assert isinstance(head, pytree.MappingKey)
            names.append(f"kwarg {head.key!r}{suffix}")
    return names
