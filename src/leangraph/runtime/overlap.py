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
captured later reuse the memory, so a later backward graph could write a buffer an addition on
the side stream is still reading. Two rules order them. Capture keeps a backward's
parameter-gradient buffers owned until the next backward is recorded (``build/capture.py``),
so the next backward graph never writes them; and before every backward replay the caller's
stream waits for the side stream's work as it stood at the previous backward replay (one event
per call, :class:`AdditionFence`), which covers every addition launched before that replay,
those of the graph two backwards back included. Where the previous backward replay was not the
one captured just before (a step passed over, a repeat), it waits for all the side stream's
work instead. The additions of one backward still overlap the whole next backward graph; a
backward pass's end orders the rest (autograd makes the caller's stream wait for the side
stream). ``benchmarks/overlap_race.py --hook-sleep`` makes each addition late enough to show a
race where one is left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..backends.cuda import stream_per_device
from ..build.accumulation import accumulator_node

__all__ = ["AdditionFence", "BackwardNeighbours", "side_stream_accumulators"]

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


class BackwardNeighbours:
    """Whether each backward replay follows the backward captured just before it.

    Args:
        backwards: The graphs with a backward, in the order their backwards were captured.
    """

    def __init__(self, backwards: Sequence[int]) -> None:
        # Each graph's capture-order predecessor; the first's is the last (the next pass).
        self._before = {g: backwards[i - 1] for i, g in enumerate(backwards)}
        self._last: int | None = None  # the graph of the latest backward replay

    def follows_its_predecessor(self, graph: int) -> bool:
        """Whether the latest backward replay (if any) was the one captured just before
        ``graph``'s: not so after a step passed over, or a backward repeated."""
        return self._last is None or self._last == self._before.get(graph)

    def ran(self, graph: int) -> None:
        """``graph``'s backward is replaying now."""
        self._last = graph


class AdditionFence:
    """Orders one ``overlap_grad_accumulation`` call's backward graphs after the side-stream
    additions whose blocks they may write (CUDA).

    Args:
        backwards: The graphs with a backward, in the order their backwards were captured
            (and replay).
        device: The GPU of the call.
    """

    def __init__(self, backwards: Sequence[int], device: torch.device) -> None:
        self._neighbours = BackwardNeighbours(backwards)
        self._side = stream_per_device(_STREAMS, device)
        # The side stream's work as it stood at the latest backward replay. One event is
        # enough: a stream wait takes the event as last recorded when the wait is enqueued.
        self._event = torch.cuda.Event()

    def before_backward(self, graph: int) -> None:
        """Make the current stream wait before the backward replay of ``graph``, then note where
        the side stream stands now for the next one. After the backward captured just before,
        what came before that one's replay is enough (it covers every graph whose blocks this
        one may write); else all the side stream's work. (A never-recorded event is no wait.)"""
        caller = torch.cuda.current_stream(self._side.device)
        if self._neighbours.follows_its_predecessor(graph):
            caller.wait_event(self._event)
        else:
            caller.wait_stream(self._side)
        self._event.record(self._side)
        self._neighbours.ran(graph)
