"""The zero-bubble weight step: a split backward's deferred weight-gradient replay.

With an order that has ``-(c + 0.5)`` entries, a graph's backward replay computes input
gradients only and leaves its weight step pending; :meth:`WeightStep.run` (reached through
``GraphedCallable.backward_dw``) replays the weight-gradient graph and accumulates into the
parameters' ``.grad`` as autograd would.
"""

from __future__ import annotations

import torch

from ..build.record import GraphRecord

__all__ = ["WeightStep"]


class WeightStep:
    """The weight step of one graph captured with a split backward."""

    def __init__(self, record: GraphRecord) -> None:
        self._label = record.label
        self._pair = record.pair
        self._params = record.trained_params()
        self._grads = record.static_weight_grads
        self._pending: int | None = None

    def defer(self, generation: int) -> None:
        """The backward of forward replay ``generation`` ran; its weight step is now due."""
        self._pending = generation

    def check_not_due(self) -> None:
        """Refuse a forward replay while the weight step still needs the activations."""
        if self._pending is not None:
            raise RuntimeError(
                f"{self._label}: forward replayed while the weight step of replay "
                f"{self._pending} has not run; call backward_dw() first, it needs "
                "the activations this replay would overwrite"
            )

    def run(self) -> None:
        """Replay the weight-gradient graph and accumulate into each parameter's ``.grad``.

        Raises:
            RuntimeError: if no backward awaits its weight step.
        """
        if self._pending is None:
            raise RuntimeError(
                f"{self._label}: backward_dw() called with no backward awaiting its weight "
                "step; run the backward through this callable's outputs first"
            )
        if self._grads:
            self._pair.replay_weight()
        self._pending = None
        with torch.no_grad():
            for param, grad in zip(self._params, self._grads):
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad.clone()
                else:
                    param.grad.add_(grad)
