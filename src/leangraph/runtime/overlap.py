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
(or copies). With ``share_buffers=True`` those go back to the pool after capture, and graphs
captured later reuse the memory, so a later backward graph could write a buffer an addition
on the side stream is still reading. Two rules order them. Capture keeps a backward's
parameter-gradient buffers owned until the next backward is recorded (``build/capture.py``),
so the next backward graph never writes them; and before every backward replay the caller's
stream waits for the side stream's work as it stood at the previous backward replay (one
event per device, :func:`wait_for_earlier_additions`), which covers every addition launched
before that replay, those of the graph two backwards back included. The additions of one
backward still overlap the whole next backward graph; a backward pass's end orders the rest
(autograd makes the caller's stream wait for the side stream). ``benchmarks/overlap_race.py
--hook-sleep`` makes each addition late enough to show a race where one is left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..backends.cuda import stream_per_device
from ..build.accumulation import accumulator_node

__all__ = ["side_stream_accumulators", "wait_for_earlier_additions"]

_STREAMS: dict[int, torch.cuda.Stream] = {}  # the side stream of each device
# Per device: the side stream's work as it stood at the latest backward replay. One event is
# enough: a stream wait takes the event as last recorded when the wait is enqueued.
_ADDITIONS_BEFORE: dict[int, torch.cuda.Event] = {}


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


def wait_for_earlier_additions(device: torch.device) -> None:
    """At a backward replay of an ``overlap_grad_accumulation`` call on ``device`` (CUDA):
    make the current stream wait for the side stream's additions launched before the
    previous backward replay, then note where the side stream stands now for the next one.
    A never-recorded event is no wait (the first replay)."""
    side = stream_per_device(_STREAMS, device)
    index = side.device.index
    assert index is not None  # a CUDA stream's device always has one
    event = _ADDITIONS_BEFORE.get(index)
    if event is None:
        event = _ADDITIONS_BEFORE[index] = torch.cuda.Event()
    torch.cuda.current_stream(side.device).wait_event(event)
    event.record(side)
