"""`leangraph bench` on the CPU backend: runs end to end, losses agree, JSON is complete; its
public pieces (the workload, the captures, the plots) as the benchmark scripts use them."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace

import pytest
import torch

import leangraph
from leangraph.cli import main
from leangraph.cli.bench import (
    BenchConfig,
    BenchResult,
    BenchWorkload,
    MethodResult,
    capture_method,
    format_table,
    graph_methods,
    plot_bars,
    plot_timeline,
    run_bench,
    timeline_references,
)
from leangraph.cli.phases import Phase, PhaseProgress
from leangraph.cli.workloads import BlockShape
from leangraph.report import TimelinePoint

TINY = BlockShape(hidden=32, heads=4, sequence=16, dtype=torch.float32)
MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as the command line runs the CPU bench: these tiny ops only
    contend for more, many times slower on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny(**overrides) -> BenchConfig:
    settings = dict(pp_size=2, vp_size=2, num_microbatches=4, layers_per_chunk=1, shape=TINY,
                    steps=1, methods=("eager", "leangraph"), device="cpu")
    return BenchConfig(**{**settings, **overrides})


def test_bench_runs_eager_and_leangraph_on_cpu_and_losses_agree():
    result = run_bench(_tiny(layers_per_chunk=2))
    assert result.losses_agree == {"leangraph": True}
    assert result.methods["eager"].losses == result.methods["leangraph"].losses
    assert "leangraph" in format_table(result)


def test_bench_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--device", "cpu", "--pp", "2", "--vp", "2", "--microbatches", "4",
                 "--layers", "1", "--hidden", "32", "--heads", "4", "--sequence", "16",
                 "--dtype", "fp32", "--steps", "1", "--json", str(out), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["losses_agree"] == {"leangraph": True}
    assert set(data["methods"]) == {"eager", "leangraph"}
    assert len(data["leangraph_timeline"]) > 0
    printed = capsys.readouterr().out
    assert "CPU reference backend" in printed and f"wrote {out}" in printed


def test_bench_on_the_cpu_by_default_is_small_and_finishes_in_seconds(capsys):
    start = time.perf_counter()
    assert main(["bench", "--device", "cpu", "--no-progress"]) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert "8 microbatches, hidden 64, 4 heads, sequence 32" in out and "fp32" in out
    assert "torch method is left out" in out
    rows = [line.split()[0] for line in out.splitlines() if line.split()[-1:] in (["ref"], ["ok"])]
    assert rows == ["eager", "leangraph"]
    # Seconds on an idle laptop; the bound leaves room for a busy test machine.
    assert elapsed < 60, elapsed


def test_rounds_time_each_graphed_method_afresh():
    result = run_bench(_tiny(rounds=3))
    assert set(result.rounds) == {"leangraph"}
    times = result.rounds["leangraph"]
    assert len(times.capture_seconds) == len(times.step_seconds) == 3
    assert all(t > 0 for t in times.capture_seconds + times.step_seconds)
    assert "3 rounds, median [min-max]" in format_table(result)
    assert len(result.to_json()["rounds"]["leangraph"]["capture_seconds"]) == 3


def test_bench_progress_names_every_phase_with_its_size():
    phases: list[Phase] = []
    run_bench(_tiny(rounds=1, steps=2), progress=PhaseProgress(phases.append))
    firsts = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1].name != p.name]
    # 4 microbatches x 2 chunks x 1 layer = 8 graphs: 16 graph steps a pass.
    assert [(p.name, p.total) for p in firsts] == [
        ("eager: training", 4),  # one measured for memory, one warm, two timed
        ("leangraph: warm-up pass 1 of 3", 16),
        ("leangraph: warm-up pass 2 of 3", 16),
        ("leangraph: warm-up pass 3 of 3", 16),
        ("leangraph: capture", 16),
        ("leangraph: training", 4),
        ("timing round 1 of 1: leangraph capture", None),
        ("timing round 1 of 1: leangraph training", 3),
    ]
    lasts = [p for i, p in enumerate(phases) if i + 1 == len(phases) or phases[i + 1].name != p.name]
    assert all(p.done == p.total for p in lasts if p.total is not None), lasts


def test_bench_config_refuses_what_cannot_run():
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['foo'\]"):
        _tiny(methods=("eager", "foo"))
    with pytest.raises(ValueError, match="the torch method needs a CUDA device"):
        _tiny(methods=("torch",))


def test_capture_method_refuses_unknown_names_and_torch_options():
    work = BenchWorkload(_tiny())
    with pytest.raises(ValueError, match="no graphed method 'eager'"):
        capture_method(work, "eager")
    with pytest.raises(ValueError, match="the torch method takes no options"):
        capture_method(work, "torch", check_memory=False)


def test_graph_methods_graph_a_copy_whose_steps_match_eager():
    work = BenchWorkload(_tiny())
    captured = graph_methods(work, ("leangraph",), untimed_steps=1)["leangraph"]
    assert captured.graphed is not None
    assert all(copy is not block for copy, block in zip(captured.blocks, work.blocks))
    eager = work.step(work.eager_lookup(work.blocks), work.blocks)  # steps do not update weights
    assert work.step(captured.lookup, captured.blocks) == eager
    captured.release()
    assert all(graph.is_reset for graph in captured.graphed)


# -------------------------------------------------------------------------------- plots


def _gpu_like_result(report: leangraph.MemoryReport | None) -> BenchResult:
    """A result with the figures of a GPU run (made up, plausible), for the plots."""
    start = 800 * MIB
    methods = {
        "eager": MethodResult("eager", step_peak_bytes=3452 * MIB, start_allocated_bytes=start),
        "torch": MethodResult("torch", step_peak_bytes=9710 * MIB, capture_peak_bytes=8930 * MIB,
                              held_bytes=9450 * MIB, start_allocated_bytes=start),
        "leangraph": MethodResult("leangraph", step_peak_bytes=3514 * MIB,
                                  capture_peak_bytes=3008 * MIB, held_bytes=3034 * MIB,
                                  start_allocated_bytes=start),
    }
    config = asdict(_tiny(methods=("eager", "leangraph")))
    config["shape"] = {**config["shape"], "dtype": "torch.bfloat16"}
    return BenchResult(config, methods, {"torch": True, "leangraph": True}, report=report)


def _measured_report() -> leangraph.MemoryReport:
    """A CPU report given the byte figures a CUDA call would have measured."""
    layers = tuple(torch.nn.Linear(4, 4) for _ in range(2))
    samples = tuple((torch.randn(2, 4, requires_grad=True),) for _ in range(4))
    graphed = leangraph.make_graphed_callables(layers, samples, order=[1, 1, -1, -1])
    report = leangraph.memory_report(graphed)
    leangraph.reset_all(graphed)
    points = tuple(replace(p, allocated_bytes=(900 + 100 * (i % 4)) * MIB)
                   for i, p in enumerate(report.timeline))
    replay = [TimelinePoint("replay", "F c1 m0 l0", "graph", 950 * MIB)]
    record = replace(report.record, device="cuda:0", baseline_bytes=804 * MIB,
                     warmup_peak_bytes=1250 * MIB, capture_peak_bytes=1300 * MIB)
    return replace(report, record=record, timeline=points).with_points(replay)


def test_timeline_references_put_other_peaks_on_leangraphs_scale():
    result = _gpu_like_result(None)
    assert timeline_references(result) == {
        "eager step peak (the limit)": (800 + 3452) * MIB,
        "torch warm-up+capture peak": (800 + 8930) * MIB,
    }


def test_plots_of_a_gpu_like_result_are_pngs(tmp_path):
    result = _gpu_like_result(_measured_report())
    timeline = plot_timeline(result, tmp_path / "timeline.png")
    bars = plot_bars(result, tmp_path / "bars.png")
    for path in (timeline, bars):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_of_a_cpu_run_refuse_to_draw_nothing(tmp_path):
    result = run_bench(_tiny())
    with pytest.raises(ValueError, match="measured no memory"):
        plot_timeline(result, tmp_path / "timeline.png")
    with pytest.raises(ValueError, match="no method has a memory figure"):
        plot_bars(result, tmp_path / "bars.png")
    with pytest.raises(ValueError, match="leangraph was not among its methods"):
        plot_timeline(run_bench(_tiny(methods=("eager",))), tmp_path / "timeline.png")
    assert not any(tmp_path.iterdir())
