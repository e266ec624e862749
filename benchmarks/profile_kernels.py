"""GPU time per training step by kernel (GPU only): torch's and leangraph's graphs and the
whole-step graph of the 16-microbatch benchmark workload, two steps each under
``torch.profiler`` (the bench's own ``profile_steps``).

Prints each method's total self device time per step (graph kernels count twice: under the
replay and by kernel), its launches per step (the bench's ``launch_counts``, as
``leangraph bench --launches`` prints them) and its 22 largest entries. Equal totals
mean the graphs do the same GPU work, so a step-time difference is idle time between launches.
Then, side by side, the entries whose time per step differs most between leangraph-fused-nohooks
and the whole-step graph: where the per-layer step's extra GPU time goes.
Usage: PYTHONPATH=src python3 benchmarks/profile_kernels.py
"""

from __future__ import annotations

from leangraph.cli.bench import (
    FUSED_NO_HOOKS,
    LIMIT,
    BenchConfig,
    BenchWorkload,
    graph_methods,
    launch_counts,
    profile_steps,
    self_device_us,
)

STEPS = 2


def main() -> None:
    work = BenchWorkload(BenchConfig(num_microbatches=16))
    per_kernel: dict[str, dict[str, float]] = {}
    for name, captured in graph_methods(work, untimed_steps=2).items():
        prof = profile_steps(captured.step, STEPS)
        events = [e for e in prof.key_averages() if self_device_us(e) > 0]
        per_kernel[name] = {e.key: self_device_us(e) / STEPS / 1e3 for e in events}
        total = sum(self_device_us(e) for e in events)
        launches = launch_counts(prof.events(), STEPS)
        print(f"== {name}: self device time per step {total / STEPS / 1e3:.2f} ms")
        print(
            f"graph launches/step {launches.graph_launches:.0f}, kernels outside graphs/step "
            f"{launches.kernel_launches:.0f}, kernels on the GPU/step {launches.gpu_kernels:.0f}"
        )
        for event in sorted(events, key=self_device_us, reverse=True)[:22]:
            print(
                f"{event.key[:70]:<70} calls/step {event.count / STEPS:>6.0f}  "
                f"ms/step {self_device_us(event) / STEPS / 1e3:8.3f}"
            )
        captured.release()
    print_differences(per_kernel.get(FUSED_NO_HOOKS, {}), per_kernel.get(LIMIT, {}))


def print_differences(per_layer: dict[str, float], whole: dict[str, float], rows: int = 25) -> None:
    """The entries (ms per step) whose time differs most between the two methods."""
    keys = sorted(
        set(per_layer) | set(whole),
        key=lambda k: abs(per_layer.get(k, 0.0) - whole.get(k, 0.0)),
        reverse=True,
    )
    print(f"== {FUSED_NO_HOOKS} against {LIMIT}, ms per step (largest differences first)")
    for key in keys[:rows]:
        a, b = per_layer.get(key, 0.0), whole.get(key, 0.0)
        print(f"{key[:70]:<70} {a:8.3f} {b:8.3f} {a - b:+8.3f}")


if __name__ == "__main__":
    main()
