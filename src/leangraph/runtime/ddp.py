"""torch's ``DistributedDataParallel`` around replays: which DDP a replay runs inside, and what
it expects of the backward (R17, R29).

DDP's reducer hooks the parameters' accumulator nodes from C++, where no replay can see them.
With ``find_unused_parameters=False`` (its default) it expects every parameter it manages to
become ready in each backward that synchronizes: eager DDP raises at the next forward when
one did not (a layer returns ``(y, aux)``, the loss uses ``y``, and some parameters reach only
``aux``). A replay's autograd node has an edge to every parameter it trains (or to the relay
of their accumulators), so autograd runs those accumulators with no gradient, the reducer
marks them ready, and DDP would silently all-reduce zeros for them where eager raises. The
forward replay notes the DDP whose forward runs it (:func:`strict_ddp`, weakly, in the
replay's autograd node), and a backward replay that leaves one of that DDP's parameters
without a gradient refuses before anything runs (:func:`refuse_unreached_in_ddp`).
"""

from __future__ import annotations

import weakref
from collections.abc import Set

from torch.nn.parallel import DistributedDataParallel

from ..build.record import GraphRecord
from .grads import trained_elsewhere_in_pass
from .pending import PendingBackwards

__all__ = ["active_torch_ddp", "refuse_unreached_in_ddp", "strict_ddp"]


def active_torch_ddp() -> DistributedDataParallel | None:
    """The torch DDP module whose forward is running, or None (torch sets it for dynamo)."""
    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def strict_ddp() -> weakref.ref[DistributedDataParallel] | None:
    """At a forward replay: the torch DDP module whose forward runs it (weakly), where that DDP
    expects every parameter it manages to get a gradient in the backward of this forward:
    ``find_unused_parameters=False`` (its default), no ``static_graph`` (which learns the
    unused parameters at its first step) and gradients synchronized (not under ``no_sync()``:
    there the reducer waits for no parameter). Else None."""
    ddp = active_torch_ddp()
    if (
        ddp is None
        or ddp.find_unused_parameters
        or getattr(ddp, "static_graph", False)
        or not ddp.require_backward_grad_sync
        or getattr(ddp, "_delay_all_reduce_all_params", False)
    ):
        return None
    return weakref.ref(ddp)


def refuse_unreached_in_ddp(
    label: str,
    record: GraphRecord,
    unreached: Set[int],
    pending: PendingBackwards,
    ddp: weakref.ref[DistributedDataParallel],
) -> None:
    """Before a backward replay that leaves the trained parameters in ``unreached`` (ids)
    without a gradient, whose forward replay ran inside ``ddp`` (:func:`strict_ddp`'s): refuse
    where autograd runs their accumulators all the same and DDP manages one of them that no
    other graph may hand a gradient in this pass (:func:`trained_elsewhere_in_pass`). Not
    where no accumulator of theirs runs, as in eager: a split backward (its weight step
    leaves them out) and in-graph accumulation without the relay (``accumulator_hooks``
    ``"python"`` or ``False``, refused inside DDP at the forward anyway).

    Raises:
        RuntimeError: naming the callable and the parameters.
    """
    if record.split_backward or (record.fused is not None and record.fused.relay is None):
        return
    module = ddp()
    if module is None:
        return
    elsewhere = trained_elsewhere_in_pass(record, pending)
    ignored = module.parameters_to_ignore
    managed = {id(p) for name, p in module.module.named_parameters() if name not in ignored}
    names = [
        name
        for name, param in zip(record.param_names, record.params)
        if id(param) in unreached
        and id(param) not in elsewhere
        and id(param) in managed
        and param.requires_grad  # frozen since: no accumulator runs, as in eager
    ]
    if names:
        raise RuntimeError(_unreached_message(label, names))


def _unreached_message(label: str, names: list[str]) -> str:
    quoted = ", ".join(repr(n) for n in names)
    one = len(names) == 1
    subject = f"parameter {quoted} gets" if one else f"parameters {quoted} get"
    them, accumulators = ("it", "its accumulator") if one else ("them", "their accumulators")
    return (
        f"{label} {subject} no gradient in this backward (no output that got a gradient "
        f"reaches {them}: the loss leaves an output out), but the forward replay ran inside "
        "torch's DistributedDataParallel with find_unused_parameters=False, which expects "
        "every parameter it manages to get one. Eager DDP raises at the next forward "
        f"(parameters that did not receive grad); here autograd would still run {accumulators} "
        "(the replay's node has an edge to every parameter) and DDP would silently all-reduce "
        f"zeros for {them}. Use every output in the loss, or construct DDP with "
        "find_unused_parameters=True, as eager DDP requires"
    )
