"""Pipeline orders of well-known schedules, and what an order keeps in flight.

Every builder here returns an *order* in the convention of :mod:`leangraph.order`
(TransformerEngine ``_order`` / Megatron-LM): one list per pipeline rank, ``+c`` the next
microbatch's forward of model chunk ``c`` (1-based), ``-c`` the backward of chunk ``c``'s oldest
outstanding forward.

* :mod:`~leangraph.schedules.megatron`: :func:`interleaved_1f1b`, :func:`one_f_one_b` (Megatron-LM)
  and :func:`gpipe`.
* :mod:`~leangraph.schedules.pipelining`: :func:`from_pipelining`, the order a
  ``torch.distributed.pipelining`` schedule class runs; what differs between torch versions is
  kept apart in ``_torch_compat``.
* :mod:`~leangraph.schedules.inspection`: :func:`validate_order` and :func:`max_in_flight` for any
  order, the latter read from the liveness plan (:mod:`leangraph.plan`).
"""

from __future__ import annotations

from .inspection import InFlight, max_in_flight, validate_order
from .megatron import gpipe, interleaved_1f1b, one_f_one_b
from .pipelining import from_pipelining

__all__ = [
    "InFlight",
    "from_pipelining",
    "gpipe",
    "interleaved_1f1b",
    "max_in_flight",
    "one_f_one_b",
    "validate_order",
]
