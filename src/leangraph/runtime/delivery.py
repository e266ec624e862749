"""Parameter gradients added on a side stream (``overlap_grad_accumulation=True``).

Autograd runs a backward node on the stream its forward ran on, and a parameter's
accumulator on the stream that was current when the accumulator was made. So a forward
replay that makes a small *delivery* node under a side stream, taking the parameters, and
hands it to the replay's node in place of them, moves the additions of the parameter
gradients into ``.grad`` to that stream: the replay's backward returns the delivery node one
placeholder gradient (one stream wait per replay), and the delivery node's backward, on the
side stream, hands the accumulators the parameter gradients. Their additions then overlap the
next layer's backward graph on the caller's stream instead of running between graphs, and
autograd makes the caller's stream wait for them when the backward pass ends, as it does for
any stream a backward pass used. The values and their order are eager's; the accumulators'
hooks run with the side stream current. On the CPU there are no streams and the same nodes
run in order, so the path is tested there too.

Memory aliasing: the gradients handed over are the backward graph's static buffers (copies
where autograd would store them), read by the side stream's additions; only the same graph's
next backward replay writes them, after the backward pass that read them has ended.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["ParamDelivery"]

# One side stream per device, made on first use: the additions need no more, and a stream
# per call would add per-stream state (the allocator's, say) with every capture.
_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


class _Owner(Protocol):
    def _deliver_param_grads(self) -> tuple[torch.Tensor | None, ...]: ...


class _Deliver(torch.autograd.Function):
    """Made under the side stream at a forward replay; its backward, run there, hands the
    replay's parameter gradients to the parameters' accumulators."""

    @staticmethod
    def forward(
        ctx: Any, owner: _Owner, placeholder: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.owner = owner
        return placeholder.detach()

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        owner, ctx.owner = ctx.owner, None
        return (None, None, *owner._deliver_param_grads())


_C_APPLY = super(torch.autograd.Function, _Deliver).apply  # as the replay's own node does


class ParamDelivery:
    """One graph's delivery of parameter gradients on the side stream of its device.

    Args:
        device: Where the graph's tensors live (CPU: no stream, the same nodes).
    """

    def __init__(self, device: torch.device) -> None:
        self._stream: Callable[[], contextlib.AbstractContextManager[Any]]
        if device.type == "cuda":
            stream = _side_stream(device)
            self._stream = lambda: torch.cuda.stream(stream)
        else:
            self._stream = contextlib.nullcontext
        # What the delivery node gives the replay's node, and the gradient it gets back: an
        # empty tensor, so nothing is computed for it.
        self._placeholder = torch.empty(0, device=device)
        self.placeholder_grad = torch.zeros(0, device=device)

    def node_input(self, owner: _Owner, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The tensor a forward replay passes its node in place of ``params``: the output of
        a delivery node made under the side stream (it requires grad if a parameter does)."""
        with self._stream():
            return _C_APPLY(owner, self._placeholder, *params)
