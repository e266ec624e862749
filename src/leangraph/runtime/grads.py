"""Gradient routing: what a backward replay hands autograd, view or copy, per gradient.

A backward graph writes its gradients into static buffers that later replays overwrite.
Autograd may *store* some of them (a leaf input's ``.grad``, or a parameter's ``.grad`` while
it is None) or hold them while it waits for other branches; those get copies, the rest views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..build.record import GraphRecord
from .pending import PendingBackwards

__all__ = ["GradRouting"]


class GradRouting:
    """The gradients of one graph's backward replay, in ``_Replay.apply``'s argument order.

    A gradient autograd may store (a leaf input's ``.grad``, or a parameter whose ``.grad`` is
    still None, which autograd would take over) is copied, so no stored gradient aliases a
    buffer that a later replay overwrites. A parameter that already has a ``.grad`` gets a
    view: autograd adds it in place right away, unless another graph training the same
    parameter still has to run in this backward pass (several microbatches, or tied weights,
    differentiated together): autograd then waits for that graph's gradient too, whose replay
    may overwrite this buffer first, so it gets a copy. A gradient flowing to an earlier
    autograd node is a view, consumed by that node before any other replay.
    """

    def __init__(self, record: GraphRecord, pending: PendingBackwards) -> None:
        self._static_grads = record.static_grads
        self._input_requires_grad = tuple(s.requires_grad for s in record.signature.specs)
        # With in-graph accumulation the parameters' gradients stay in the graphs' buffers;
        # a split backward's come at the weight step.
        delivers = record.fused is None and not record.split_backward
        self._params = record.params if delivers else ()
        self._param_trains = record.param_trains
        self._peers = record.sharing.peers
        # Shared parameters matter only where this replay hands their gradients to autograd.
        self._shared_param_ids = record.sharing.shared_param_ids if delivers else frozenset()
        self._pending = pending

    def scatter(self, clone_inputs: Sequence[bool]) -> tuple[torch.Tensor | None, ...]:
        """One gradient per tensor passed to the replay (inputs, then parameters);
        ``clone_inputs[i]`` says whether input ``i`` is a leaf autograd stores into."""
        grads = iter(self._static_grads)
        result: list[torch.Tensor | None] = []
        copy_at: list[int] = []
        for requires_grad, clone in zip(self._input_requires_grad, clone_inputs):
            grad = next(grads) if requires_grad else None
            if grad is not None and clone:
                copy_at.append(len(result))
            result.append(grad)
        awaited = bool(self._shared_param_ids) and self._pending.reached_now(self._peers)
        for param, trains in zip(self._params, self._param_trains):
            grad = next(grads, None) if trains else None
            if grad is not None and (
                param.grad is None or (awaited and id(param) in self._shared_param_ids)
            ):
                copy_at.append(len(result))
            result.append(grad)
        views = [None if g is None else g.detach() for g in result]
        if copy_at:
            for index, copy in zip(copy_at, copies([result[i] for i in copy_at])):
                views[index] = copy
        return tuple(views)


def copies(tensors: list[Any]) -> list[torch.Tensor]:
    """Fresh copies of ``tensors``; on CUDA in a few fused kernels instead of one per tensor
    (a layer's first backward of a step copies every parameter's gradient). Multiplying by
    one is exact for every value, signed zeros and infinities included."""
    if len(tensors) == 1:
        return [tensors[0].clone()]
    return list(torch._foreach_mul(tensors, 1.0))
