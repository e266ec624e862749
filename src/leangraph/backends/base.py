"""The narrow interface between the capture engine and a graph implementation.

The engine never touches ``torch.cuda.CUDAGraph`` directly. It asks a :class:`GraphBackend`
for one :class:`GraphPair` per graphed callable and drives it through capture, replay and
reset. Each pair owns its forward and backward graph; the backend owns what the pairs share
(the memory pool and the capture stream) and tears it down explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

ForwardBody = Callable[[], Sequence[torch.Tensor]]
"""Runs the user callable on the static inputs and returns its flattened outputs."""

BackwardBody = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor | None]]
"""Given the forward's outputs (with their autograd graph) returns the gradients."""


@dataclass(frozen=True, slots=True)
class CapturedOutputs:
    """A captured forward's static outputs (overwritten by every replay) and which of them
    required grad when captured."""

    outputs: tuple[torch.Tensor, ...]
    requires_grad: tuple[bool, ...]


class GraphPair(Protocol):
    """A forward graph and the backward graph that differentiates it."""

    def capture_forward(self, body: ForwardBody) -> CapturedOutputs:
        """Record ``body`` and return its static outputs."""

    def capture_backward(
        self, body: BackwardBody, *, retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        """Record ``body`` on the captured forward's outputs; return the static gradients.

        With ``retain_graph`` the forward's saved tensors stay allocated until :meth:`reset`
        so that the backward may be replayed more than once per forward.
        """

    def capture_weight(
        self, body: BackwardBody, *, retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        """Record a second, deferred backward graph (zero-bubble weight gradients).

        Needs :meth:`capture_backward` to have run with ``retain_graph=True``.
        """

    def release_saved(self) -> None:
        """Drop the captured forward's autograd graph without recording a backward."""

    def replay_forward(self) -> None:
        """Rerun the forward, overwriting the static outputs in place."""

    def replay_backward(self) -> None:
        """Rerun the backward against the last forward replay, overwriting the gradients."""

    def replay_weight(self) -> None:
        """Rerun the weight-gradient graph against the last forward replay."""

    def reset(self) -> None:
        """Release both graphs and everything captured with them. Idempotent."""


class GraphBackend(Protocol):
    """Creates graph pairs and owns the resources they share."""

    name: str
    # Whether capturing runs the work too (the CPU trace does; CUDA capture only records).
    capture_runs_work: bool

    def warmup(self) -> AbstractContextManager[None]:
        """Context in which eager warm-up passes run."""

    def capture_session(self) -> AbstractContextManager[None]:
        """Context around a whole capture pass (synchronisation happens once, here)."""

    def new_pair(self) -> GraphPair:
        """A fresh, empty graph pair whose graphs share this backend's pool."""

    def alias(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of ``tensor``'s memory that does not keep it allocated (the owner stays)."""

    def disown(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of ``tensor``'s memory that does not keep it allocated.

        Once the last owning reference is gone the pool may hand the block to a graph
        captured later; replays still write and read it, so the view's contents are valid
        only within the window the plan guarantees.
        """

    def teardown(self) -> None:
        """Drop the shared stream and pool handle. Pairs already made keep working."""
