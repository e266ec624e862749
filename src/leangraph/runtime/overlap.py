"""Parameter gradients added on a side stream (``overlap_grad_accumulation=True``).

Autograd runs a parameter's accumulator node on the stream that was current when the node was
made, and a node something holds stays as it was made. Made fresh at every step, as eager
makes them, the nodes run on the caller's stream, and the additions of a step's parameter
gradients run between the graphs. A graphed callable that makes its parameters' accumulators
under a side stream and holds them has autograd add its replays' parameter gradients there:
autograd makes the side stream wait for each gradient (an event record and a stream wait per
parameter per backward replay, host time), the additions overlap the next layer's backward
graph on the caller's stream, and when the backward pass ends autograd makes the caller's
stream wait for the side stream, as for any stream a backward pass used. The values and the
hooks are the default path's; the hooks run with the side stream current.
``torch.cuda.make_graphed_callables`` leaves its accumulators on its capture stream, so its
graphs get this overlap without asking (``benchmarks/accumulate_stream.py``), and torch >= 2.9
warns about it once (``The AccumulateGrad node's stream does not match ...``); so does this.

Memory aliasing: the gradients the side stream adds are the backward graph's static buffers
(or copies). With ``share_buffers=True`` those go back to the pool once the graph's backward
is captured, and graphs captured later reuse the memory: the next layer's backward graph may
write the buffer an addition on the side stream is still reading, and no event orders the
two. ``benchmarks/overlap_race.py`` probes for it; the same probe as
``--width 4096 --rows 64 --layers 6 --steps 6`` (run from a scratch copy of the script, at
commit 3ad99ce) found nothing on the H200, which does not rule it out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..backends.cuda import stream_per_device
from ..build.accumulation import accumulator_node

__all__ = ["side_stream_accumulators"]

_STREAMS: dict[int, torch.cuda.Stream] = {}  # the side stream of each device


def side_stream_accumulators(
    params: Sequence[torch.nn.Parameter], device: torch.device
) -> tuple[object, ...]:
    """The accumulator nodes of ``params``, made under the side stream of ``device`` where
    nothing holds one yet (one something holds, DDP's say, keeps its stream), for the caller
    to hold. On the CPU, where there are no streams, the nodes as they are."""
    stream = (
        torch.cuda.stream(stream_per_device(_STREAMS, device))
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    with torch.enable_grad(), stream:
        return tuple(accumulator_node(p) for p in params)
