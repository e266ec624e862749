"""Where autograd adds the parameter gradients of per-layer graphs, and what that does to a
step (GPU only): the stream of each parameter's accumulator node.

torch gives an accumulator node the stream that was current when the node was made, and a
node kept alive keeps it. If that is another stream than the one the gradient comes from,
autograd makes it wait for the gradient (an event record and a stream wait), runs the
addition there, and syncs the caller's stream with it at the end of the backward pass; torch
>= 2.9 warns about it. An addition on another stream can overlap the next layer's backward
graph on the caller's. ``torch.cuda.make_graphed_callables`` leaves its parameters'
accumulators on its capture stream (``stream_mismatch.py``); leangraph's are made at replay,
on the caller's stream, as eager's are.

For the bench's 16-microbatch workload (rank 0 of PP4/VP2, 2 chunks x 4 blocks, hidden 1024,
sequence 2048, bf16), then the launch-bound one (hidden 256, sequence 128, 8 microbatches), it
trains torch, leangraph and ``leangraph, side-stream adds``: leangraph with every parameter's
accumulator made under a side stream and held, as torch's capture leaves them. Printed: per
method the median step ms of 5 alternating rounds (the bench's timed steps each), the stream
waits and event records per step (torch.profiler, 3 steps), and whether its gradients after a
step equal leangraph's bitwise.
Usage: PYTHONPATH=src python3 benchmarks/accumulate_stream.py
"""

from __future__ import annotations

import statistics

import torch
from step_anatomy import runtime_calls

from leangraph.cli.bench import LAUNCH_BOUND, BenchConfig, BenchWorkload, Captured, capture_method

ROUNDS = 5
SIDE = "leangraph, side-stream adds"


def side_stream_accumulators(captured: Captured) -> list[object]:
    """Make every parameter's accumulator node under a side stream; the nodes, to hold."""
    side = torch.cuda.Stream()
    params = [p for block in captured.blocks for p in block.parameters()]
    with torch.cuda.stream(side):
        return [p.view_as(p).grad_fn.next_functions[0][0] for p in params]  # type: ignore[union-attr]


def grads_of(captured: Captured) -> list[torch.Tensor]:
    captured.step()
    torch.cuda.synchronize()
    return [p.grad.clone() for b in captured.blocks for p in b.parameters()]  # type: ignore[union-attr]


def run(work: BenchWorkload, title: str) -> None:
    methods: dict[str, Captured] = {
        "torch": capture_method(work, "torch"),
        "leangraph": capture_method(work, "leangraph"),
        SIDE: capture_method(work, "leangraph"),
    }
    held = side_stream_accumulators(methods[SIDE])
    reference = grads_of(methods["leangraph"])
    equal = {
        name: all(torch.equal(a, b) for a, b in zip(grads_of(c), reference))
        for name, c in methods.items()
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for round_ in range(ROUNDS):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            _, seconds = work.timed_steps(methods[name].step)
            times[name].append(seconds * 1e3)
    print(f"== {title}")
    print(f"{'method':<30} {'step ms':>9} {'stream waits':>13} {'event records':>14}  grads")
    for name, captured in methods.items():
        syncs = runtime_calls(captured.step, steps=3)  # stream waits, event records among them
        same = "= leangraph's" if equal[name] else "differ"
        print(
            f"{name:<30} {statistics.median(times[name]):9.2f} "
            f"{syncs['cudaStreamWaitEvent']:13.0f} {syncs['cudaEventRecord']:14.0f}  {same}"
        )
    print("rounds:", {name: [round(t, 2) for t in ts] for name, ts in times.items()})
    del held
    for captured in methods.values():
        captured.release()


def main() -> None:
    quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if quiet is not None:
        quiet(False)  # the mismatch is what this script measures
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()}")
    run(BenchWorkload(BenchConfig(num_microbatches=16)), "16 microbatches (compute-bound)")
    run(BenchWorkload(LAUNCH_BOUND), "launch-bound")


if __name__ == "__main__":
    main()
