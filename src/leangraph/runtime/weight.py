"""The zero-bubble weight step: a split backward's deferred weight-gradient replay.

With an order that has ``-(c + 0.5)`` entries, a graph's backward replay computes input
gradients only and leaves its weight step pending; :meth:`WeightStep.run` (reached through
``GraphedCallable.backward_dw``) replays the weight-gradient graph and hands the gradients to
autograd, which accumulates them into the parameters' ``.grad`` and runs their
post-accumulate-grad hooks as in eager's weight step.
"""

from __future__ import annotations

import torch

from ..build.accumulation import TENSOR_HOOKS, deliver_gradients, fire_relay
from ..build.record import GraphRecord
from .accumulation import InGraphAccumulation
from .grads import keep_apart

__all__ = ["WeightStep"]


class WeightStep:
    """The weight step of one graph captured with a split backward."""

    def __init__(self, record: GraphRecord, fused: InGraphAccumulation | None) -> None:
        self._label = record.label
        self._fused = fused
        self._pair = record.pair
        self._params = record.trained_params()
        self._grads = record.static_weight_grads
        self._pending: int | None = None
        # The ids of the parameters no output with a gradient reached in that backward.
        self._unreached: frozenset[int] = frozenset()

    def defer(self, generation: int, unreached: frozenset[int] = frozenset()) -> None:
        """The backward of forward replay ``generation`` ran; its weight step is now due.
        ``unreached``: the ids of the parameters no output with a gradient reached in it,
        which the weight step leaves without a gradient, as eager's does."""
        self._pending = generation
        self._unreached = unreached

    def check_not_due(self) -> None:
        """Refuse a forward replay while the weight step still needs the activations."""
        if self._pending is not None:
            raise RuntimeError(
                f"{self._label}: forward replayed while the weight step of replay "
                f"{self._pending} has not run; call backward_dw() first, it needs "
                "the activations this replay would overwrite"
            )

    def require_due(self) -> None:
        """Raise ``RuntimeError`` if no backward awaits its weight step."""
        if self._pending is None:
            raise RuntimeError(
                f"{self._label}: backward_dw() called with no backward awaiting its weight "
                "step; run the backward through this callable's outputs first"
            )

    def check(self) -> bool:
        """Refuse, before anything changes (the replay order included), a weight step the
        graph cannot run as captured; return whether :meth:`run` must attach gradient
        targets first (``attach``).

        Raises:
            RuntimeError: if no backward awaits its weight step; with in-graph accumulation,
                for a parameter the graph can no longer add into (R14, R15).
        """
        self.require_due()
        return self._fused is not None and self._fused.check_targets()

    def run(self, *, attach: bool) -> None:
        """Replay the weight-gradient graph and accumulate into each parameter's ``.grad``
        (after :meth:`check`, whose result ``attach`` is), leaving the parameters its
        backward's outputs with a gradient did not reach without one."""
        fused, unreached = self._fused, self._unreached
        if attach:
            assert fused is not None  # only in-graph accumulation attaches targets
            fused.before_replay(unreached)
        if self._grads:
            self._pair.replay_weight()
        self._pending = None
        if fused is not None:
            # The graph added the gradients; the accumulators only run their hooks. They run
            # with grad mode off, as in the relay's backward (and in eager's).
            fused.after_replay(unreached)
            with torch.no_grad():
                fused.call_hooks(unreached)
            if fused.relay is not None:
                fire_relay(fused.relay, skip=unreached)  # eager's runs none of theirs
            fused.megatron_hooks_ran()  # outside a backward pass: the hooks ran above
            return
        pairs = [
            (p, g)
            for p, g in zip(self._params, self._grads)
            if g is not None and id(p) not in unreached
        ]
        if not pairs:
            return
        # Hand the gradients to autograd, which accumulates them as it does in eager's weight
        # step: .grad set (to a copy: the buffer is overwritten by the next replay) when None,
        # else added in place, and each parameter's post-accumulate-grad hooks run once. A
        # tensor hook on the parameter sees what is handed and may keep it (or a view): a copy
        # too. The rest are lent, and moved onto copies where a hook on an accumulator kept
        # one, as a backward replay's are (grads.py).
        lent = [g.clone() if p.grad is None or TENSOR_HOOKS(p) else g.detach() for p, g in pairs]
        deliver_gradients([p for p, _ in pairs], lent)
        keep_apart(lent)
