"""Argument handling shared by ``make_graphed_callables`` and ``plan_memory``.

Both take the same ``callables`` / ``sample_args`` / ``sample_kwargs`` / ``order`` forms;
this module turns them into a :class:`~leangraph.plan.Plan` and one ``(args, kwargs)`` pair
per graph, with the same errors, so the two can never disagree on what a call means.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .order import parse_order
from .plan import Plan, build_plan, build_unordered_plan

__all__ = ["Samples", "as_tuples", "common_device", "make_plan", "normalize_samples"]

Samples = list[tuple[tuple[Any, ...], dict[str, Any]]]
"""One ``(args, kwargs)`` pair per graph."""


def as_tuples(
    callables: Any, sample_args: Any, sample_kwargs: Any
) -> tuple[tuple[Any, ...], Any, Any, bool]:
    """torch's convention: a single callable (not a tuple) comes with a single sample tuple.

    Returns:
        ``(callables, sample_args, sample_kwargs, single)`` with the first three as tuples
        (``sample_kwargs`` may stay None) and ``single`` saying whether they were wrapped.
    """
    if isinstance(callables, tuple):
        return callables, sample_args, sample_kwargs, False
    kwargs = None if sample_kwargs is None else (sample_kwargs,)
    return (callables,), (sample_args,), kwargs, True


def make_plan(
    num_callables: int,
    sample_args: Any,
    order: Sequence[int] | None,
    num_layers_per_chunk: int | Sequence[int] | None,
) -> Plan:
    """The plan for these arguments (the unordered torch drop-in plan without an order).

    Raises:
        TypeError: if ``sample_args`` is not a tuple.
        ValueError: for a malformed order or counts that do not match.
    """
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
        num_samples=len(sample_args),
        num_layers_per_chunk=num_layers_per_chunk,
    )
    return build_plan(layout, steps)


def normalize_samples(sample_args: Any, sample_kwargs: Any, count: int) -> Samples:
    """One ``(args, kwargs)`` pair per graph, every leaf a tensor.

    Raises:
        TypeError: for arguments that are not tuples (kwargs not dicts) of tensor pytrees.
        ValueError: for a ``sample_kwargs`` count that does not match.
    """
    if sample_kwargs is None:
        sample_kwargs = ({},) * count
    if not isinstance(sample_kwargs, (tuple, list)) or len(sample_kwargs) != count:
        got = len(sample_kwargs) if isinstance(sample_kwargs, (tuple, list)) else sample_kwargs
        raise ValueError(f"sample_kwargs must have one dict per graph ({count}), got {got!r}")
    samples: Samples = []
    for index, (args, kwargs) in enumerate(zip(sample_args, sample_kwargs)):
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"sample_args[{index}] must be a tuple of arguments, got "
                f"{type(args).__name__} (wrap a single tensor as (tensor,))"
            )
        if not isinstance(kwargs, dict):
            raise TypeError(f"sample_kwargs[{index}] must be a dict, got {type(kwargs).__name__}")
        for leaf in pytree.tree_leaves((tuple(args), kwargs)):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"sample_args[{index}]: every argument leaf must be a tensor, got "
                    f"{type(leaf).__name__}"
                )
        samples.append((tuple(args), dict(kwargs)))
    return samples


def common_device(samples: Samples, callables: Sequence[Any]) -> torch.device:
    """The one device of every sample tensor and parameter.

    Raises:
        ValueError: naming the first two tensors on different devices.
    """
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
    samples: Samples, callables: Sequence[Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    for index, (args, kwargs) in enumerate(samples):
        for tensor in pytree.tree_leaves(args):
            yield f"sample_args[{index}]", tensor
        for tensor in pytree.tree_leaves(kwargs):
            yield f"sample_kwargs[{index}]", tensor
    for index, fn in enumerate(callables):
        if isinstance(fn, torch.nn.Module):
            for name, param in fn.named_parameters():
                yield f"callables[{index}] ({type(fn).__name__}) parameter {name!r}", param
