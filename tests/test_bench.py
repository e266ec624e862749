"""`leangraph bench` on the CPU backend: runs end to end, losses agree, JSON is complete; its
public pieces (the workload, the captures, the plots) as the benchmark scripts use them; the
whole-step graph's step and the launch counts as far as the CPU runs them, and on a GPU."""

from __future__ import annotations

import copy
import errno
import json
import os
import time
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch

import leangraph
from leangraph.cli import main
from leangraph.cli.bench import (
    FUSED,
    FUSED_NO_HOOKS,
    FUSED_PYTHON_HOOKS,
    OVERLAP,
    BenchConfig,
    BenchResult,
    BenchWorkload,
    LaunchCounts,
    MethodResult,
    RoundTimes,
    WholeStepGraph,
    capture_method,
    count_launches,
    format_table,
    fused_unavailable,
    graph_methods,
    launch_counts,
    plot_bars,
    plot_timeline,
    run_bench,
    timeline_references,
)
from leangraph.cli.phases import Phase, PhaseProgress
from leangraph.cli.workloads import BlockShape, make_blocks
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


def test_grad_hooks_fire_per_parameter_per_microbatch_in_every_method(capsys):
    """Every method calls the hooks as eager does: once per parameter per microbatch's
    backward; the table has their count per step."""
    methods = ("eager", "leangraph", OVERLAP, FUSED, FUSED_PYTHON_HOOKS)
    result = run_bench(_tiny(grad_hooks=True, methods=methods))
    params = sum(1 for _ in make_blocks(1, TINY, "cpu")[0].parameters())
    expected = params * 2 * 4  # 2 blocks on the rank, 4 microbatches
    calls = {name: m.grad_hook_calls_per_step for name, m in result.methods.items()}
    assert calls == dict.fromkeys(methods, expected)
    assert all(result.losses_agree.values())
    assert "grad hooks/step" in format_table(result)
    assert "grad hooks/step" not in format_table(run_bench(_tiny()))


def test_bench_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--device", "cpu", "--pp", "2", "--vp", "2", "--microbatches", "4",
                 "--layers", "1", "--hidden", "32", "--heads", "4", "--sequence", "16",
                 "--dtype", "fp32", "--steps", "1", "--json", str(out), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    # The CPU default: eager and the leangraph methods (torch and whole-step need CUDA).
    assert data["losses_agree"] == {"leangraph": True, "leangraph-overlap": True,
                                    "leangraph-fused": True, "leangraph-fused-python": True,
                                    "leangraph-fused-nohooks": True}
    assert set(data["methods"]) == {"eager", "leangraph", "leangraph-overlap",
                                    "leangraph-fused", "leangraph-fused-python",
                                    "leangraph-fused-nohooks"}
    assert len(data["leangraph_timeline"]) > 0
    # The CPU measures no memory: null, as every other byte figure, not a measured 0.
    assert {point["allocated_bytes"] for point in data["leangraph_timeline"]} == {None}
    assert {m["step_peak_bytes"] for m in data["methods"].values()} == {None}
    printed = capsys.readouterr().out
    assert "CPU reference backend" in printed
    assert f"wrote {out} (every figure, the config and leangraph's memory timeline)" in printed


def test_the_json_without_leangraph_has_no_timeline_and_says_so(tmp_path, capsys):
    from leangraph.cli.commands import main

    out = tmp_path / "eager.json"
    code = main(["bench", "--device", "cpu", "--methods", "eager", "--microbatches", "4",
                 "--layers", "1", "--hidden", "16", "--sequence", "8", "--steps", "1",
                 "--json", str(out), "--no-progress"])
    assert code == 0
    assert "leangraph_timeline" not in json.loads(out.read_text())
    assert f"wrote {out} (every figure and the config)\n" in capsys.readouterr().out


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_json_file_the_system_cannot_write_at_the_end_is_one_line_naming_the_flag(capsys):
    """The folder is checked before any work; a write refused at the end (a full disk:
    /dev/full opens but takes no bytes) is a failed run, in one line naming ``--json``."""
    shape = ["--hidden", "32", "--heads", "4", "--sequence", "16", "--dtype", "fp32"]
    code = main(["bench", "--device", "cpu", *shape, "--layers", "1", "--steps", "1", "--json",
                 "/dev/full",
                 "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["leangraph bench: error: --json /dev/full: cannot be written "
                   f"({os.strerror(errno.ENOSPC)})"]


def test_bench_on_the_cpu_by_default_is_small_and_finishes_in_seconds(capsys):
    start = time.perf_counter()
    assert main(["bench", "--device", "cpu", "--no-progress"]) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert "8 microbatches, hidden 64, 4 heads, sequence 32" in out and "fp32" in out
    assert "so the torch and whole-step methods are left out" in out
    rows = [line.split()[0] for line in out.splitlines() if line.split()[-1:] in (["ref"], ["ok"])]
    assert rows == ["eager", "leangraph"] + (
        [OVERLAP, FUSED, FUSED_PYTHON_HOOKS, FUSED_NO_HOOKS] if fused_unavailable() is None
        else [])
    # Seconds on an idle laptop; the bound leaves room for a busy test machine.
    assert elapsed < 60, elapsed


def test_without_eager_no_row_claims_to_be_the_loss_reference(capsys):
    assert main(["bench", "--device", "cpu", "--no-progress", "--methods", "leangraph"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] == ["leangraph"]}
    assert rows["leangraph"][-1] == "-", rows


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
    # 4 microbatches x 2 chunks x 1 layer = 8 graphs: 16 graph steps to capture; warm-up runs
    # microbatch 0 of each layer (the others' samples have its layout).
    assert [(p.name, p.total) for p in firsts] == [
        ("eager: training", 4),  # one measured for memory, one warm, two timed
        ("leangraph: probe (one forward per layer)", None),
        ("leangraph: warm-up pass 1 of 3", 4),
        ("leangraph: warm-up pass 2 of 3", 4),
        ("leangraph: warm-up pass 3 of 3", 4),
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
    with pytest.raises(ValueError, match=r"the whole-step method needs a CUDA device \(torch.cuda.CUDAGraph\)"):
        _tiny(methods=("eager", "whole-step"))
    with pytest.raises(ValueError, match="launch counts need a CUDA device"):
        _tiny(launch_steps=3)
    with pytest.raises(ValueError, match="launch_steps must be at least 0, got -1"):
        _tiny(launch_steps=-1)


def test_capture_method_refuses_unknown_names_and_torch_options():
    work = BenchWorkload(_tiny())
    with pytest.raises(ValueError, match="no graphed method 'eager'"):
        capture_method(work, "eager")
    with pytest.raises(ValueError, match="the torch method takes no options"):
        capture_method(work, "torch", check_memory=False)
    with pytest.raises(ValueError, match="the whole-step method takes no options, got progress"):
        capture_method(work, "whole-step", progress=lambda event: None)


def test_graph_methods_graph_a_copy_whose_steps_match_eager():
    work = BenchWorkload(_tiny())
    captured = graph_methods(work, ("leangraph",), untimed_steps=1)["leangraph"]
    assert captured.graphed is not None
    assert all(copy is not block for copy, block in zip(captured.blocks, work.blocks))
    eager = work.step(work.eager_lookup(work.blocks), work.blocks)  # steps do not update weights
    assert captured.step() == eager
    captured.release()
    assert all(graph.is_reset for graph in captured.graphed)


def test_workload_steps_are_its_order_parsed_once_and_lookups_read_one_table():
    from leangraph.cli.local_pipeline import order_steps, run_order

    work = BenchWorkload(_tiny())
    count = work.config.num_microbatches
    assert work.steps == order_steps(work.order, work.layers_per_chunk, count)
    lookup = work.eager_lookup(work.blocks)
    last = work.layers_per_chunk[-1] - 1
    assert lookup(1, 0, 0) is work.blocks[work.layout.callable_index(1, 0)]
    assert lookup(2, count - 1, last) is work.blocks[work.layout.callable_index(2, last)]
    with pytest.raises(KeyError):
        lookup(3, 0, 0)  # a chunk outside the layout is no layer of another chunk
    # The pre-parsed step trains exactly as run_order parsing the order itself.
    blocks = work.copy_blocks()
    losses = [float(loss) for loss in work.train_step(lookup, work.blocks)]
    mse = torch.nn.functional.mse_loss
    parsed = run_order(
        work.order,
        work.layers_per_chunk,
        lambda c, m, l: blocks[work.layout.callable_index(c, l)],
        work.inputs,
        lambda out, m: mse(out.float(), work.targets[m].float()),
    )
    assert [float(loss) for loss in parsed.losses] == losses
    for block, copy_ in zip(work.blocks, blocks):
        for p, q in zip(block.parameters(), copy_.parameters()):
            assert torch.equal(p.grad, q.grad)
    # Fewer inputs than the config's microbatches: parsed for their count, and refused by
    # what the caller passed (not the sample_args a capture would count).
    message = rf"the order runs {count} microbatches, but inputs holds 1 \(one per microbatch\)"
    with pytest.raises(ValueError, match=message):
        work.train_step(lookup, work.blocks, work.inputs[:1], work.targets[:1])
    with pytest.raises(ValueError, match=message):
        run_order(work.order, work.layers_per_chunk, lookup, work.inputs[:1], lambda out, m: out)


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


# ------------------------------------------------------------------- the whole-step graph


def _grads(blocks) -> list[torch.Tensor]:
    return [p.grad.clone() for block in blocks for p in block.parameters()]


def _eager_step(work: BenchWorkload) -> tuple[list[float], list[torch.Tensor]]:
    blocks = copy.deepcopy(work.blocks)
    return work.step(work.eager_lookup(blocks), blocks), _grads(blocks)


def test_whole_step_runs_eagers_step_on_its_static_inputs():
    """The step the graph captures is eager's step: the same losses and gradients, from
    zero every time (the second run does not add to the first's gradients)."""
    work = BenchWorkload(_tiny(layers_per_chunk=2))
    losses, grads = _eager_step(work)
    whole = WholeStepGraph(work, copy.deepcopy(work.blocks))
    for _ in range(2):
        assert [float(loss) for loss in whole.run()] == losses
        for ours, eager in zip(_grads(whole.blocks), grads, strict=True):
            torch.testing.assert_close(ours, eager, rtol=0, atol=0)
    assert all(static is not x for static, x in zip(whole.inputs, work.inputs))


def test_whole_step_accumulates_each_gradient_in_one_buffer():
    """What capture relies on: within a step, every microbatch's gradient of a parameter lands
    in the tensor its first backward created, so a replay rewrites the same ``.grad``."""
    work = BenchWorkload(_tiny())
    whole = WholeStepGraph(work, copy.deepcopy(work.blocks))
    seen: dict[int, set[int]] = {}
    params = [p for block in whole.blocks for p in block.parameters()]
    for param in params:
        param.register_post_accumulate_grad_hook(
            lambda p: seen.setdefault(id(p), set()).add(p.grad.data_ptr()))
    whole.run()
    assert set(seen) == {id(p) for p in params}
    assert all(len(pointers) == 1 for pointers in seen.values()), seen


def test_whole_step_capture_needs_cuda_and_step_needs_a_capture():
    work = BenchWorkload(_tiny())
    whole = WholeStepGraph(work, copy.deepcopy(work.blocks))
    with pytest.raises(RuntimeError, match="the whole-step graph is not captured"):
        whole.step()
    with pytest.raises(RuntimeError, match="needs CUDA tensors .* the workload is on cpu"):
        whole.capture()


# ------------------------------------------------------------------ table, JSON, launches


def _launches(graphs: float, kernels: float, in_graphs: float) -> LaunchCounts:
    return LaunchCounts(steps=3, graph_launches=graphs, kernel_launches=kernels,
                        gpu_kernels=kernels + in_graphs, gpu_kernels_in_graphs=in_graphs)


def _limit_result() -> BenchResult:
    """A result of all four methods with made-up times and launch counts."""
    result = _gpu_like_result(None)
    times = {"eager": 0.1033, "torch": 0.0287, "leangraph": 0.0258, "whole-step": 0.0085}
    launches = {"eager": _launches(0, 2600, 0), "torch": _launches(128, 800, 1800),
                "leangraph": _launches(128, 800.5, 1800), "whole-step": _launches(1, 0, 2600)}
    result.methods["whole-step"] = MethodResult("whole-step", step_peak_bytes=3600 * MIB)
    for name, m in result.methods.items():
        m.step_seconds, m.launches = times[name], launches[name]
    result.losses_agree["whole-step"] = True
    result.rounds = {name: RoundTimes([0.5, 0.4], [t, 2 * t]) for name, t in times.items()
                     if name != "eager"}
    return result


def test_table_gives_step_times_against_the_limit_and_launches_per_step():
    table = format_table(_limit_result()).splitlines()
    titles = ["step ms", "x limit", "graph launches/step", "kernels outside graphs/step", "loss"]
    where = [table[0].index(title) for title in titles]
    assert where == sorted(where) and table[0].endswith("loss")
    rows = {line.split()[0]: line.split() for line in table[2:6]}
    assert rows["torch"][-4:] == ["3.38x", "128", "800", "ok"]
    assert rows["leangraph"][-4:] == ["3.04x", "128", "800.5", "ok"]
    assert rows["whole-step"][-4:] == ["1.00x", "1", "0", "ok"]
    assert rows["eager"][-4:] == ["12.15x", "0", "2600", "ref"]
    rounds = table[table.index("2 rounds, median [min-max] (x limit: of the medians):") + 2:]
    assert rounds[0].split()[0] == "torch" and rounds[0].split()[-1] == "3.38x"


def test_table_without_the_limit_or_launches_keeps_its_columns():
    result = _gpu_like_result(None)
    header = format_table(result).splitlines()[0]
    assert "x limit" not in header and "launches" not in header
    assert header.split()[-1] == "loss"


def test_json_carries_the_limit_ratios_and_launch_counts():
    data = json.loads(json.dumps(_limit_result().to_json()))
    ratios = data["step_ratios_to_whole_step"]
    assert ratios["whole-step"] == 1.0 and ratios["torch"] == pytest.approx(0.0287 / 0.0085)
    # medians of the rounds: leangraph [25.8, 51.6] ms, whole-step [8.5, 17] ms
    assert data["round_step_ratios_to_whole_step"]["leangraph"] == pytest.approx(38.7 / 12.75)
    assert data["methods"]["torch"]["launches"] == {
        "steps": 3, "graph_launches": 128, "kernel_launches": 800, "gpu_kernels": 2600,
        "gpu_kernels_in_graphs": 1800}
    assert "step_ratios_to_whole_step" not in _gpu_like_result(None).to_json()


def _event(name: str, correlation: int, on_gpu: bool = False) -> SimpleNamespace:
    """The three fields of a torch.profiler event that the launch count reads."""
    device = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, id=correlation, device_type=device)


def test_launch_counts_tell_graph_launches_from_kernels_outside_graphs():
    events = []
    for step in range(2):
        base = 100 * step
        events += [
            _event("aten::add_", base), _event("cudaLaunchKernel", base + 1),
            _event("void at::native::vectorized_elementwise_kernel", base + 1, on_gpu=True),
            _event("cudaLaunchKernelExC_v11060", base + 2), _event("gemm", base + 2, on_gpu=True),
            _event("cudaGraphLaunch_v10000", base + 3),
            *(_event(f"graph kernel {k}", base + 3, on_gpu=True) for k in range(5)),
            _event("cudaMemcpyAsync", base + 4),
            _event("Memcpy DtoD (Device -> Device)", base + 4, on_gpu=True),
            _event("Memset (Device)", base + 5, on_gpu=True),
        ]
    counts = launch_counts(events, steps=2)
    assert counts == LaunchCounts(steps=2, graph_launches=1, kernel_launches=2, gpu_kernels=7,
                                  gpu_kernels_in_graphs=5)
    assert counts.gpu_kernels_outside_graphs == 2


def test_a_launch_count_that_disagrees_with_the_gpu_is_noted_under_the_table():
    result = _limit_result()
    assert not [line for line in format_table(result).splitlines() if line.startswith("note")]
    result.methods["torch"].launches = _launches(128, 800, 1800)
    result.methods["torch"].launches = replace(result.methods["torch"].launches, gpu_kernels=2700)
    notes = [line for line in format_table(result).splitlines() if line.startswith("note")]
    assert notes == ["note: torch: 800 kernel launch calls per step, but the GPU ran 900 kernels "
                     "outside graphs"]


def test_count_launches_needs_a_step():
    with pytest.raises(ValueError, match="at least one step, got 0"):
        count_launches(lambda: None, 0)


# ----------------------------------------------------------------------------- on a GPU

CUDA_TINY = dict(device="cuda", methods=("eager", "torch", "leangraph", "whole-step"))


@pytest.mark.cuda
def test_whole_step_graph_trains_as_eager_on_cuda():
    work = BenchWorkload(_tiny(layers_per_chunk=2, **CUDA_TINY))
    losses, grads = _eager_step(work)
    captured = capture_method(work, "whole-step")
    for _ in range(2):  # every replay starts from zero gradients
        torch.testing.assert_close(captured.step(), losses)
        for ours, eager in zip(_grads(captured.blocks), grads, strict=True):
            torch.testing.assert_close(ours, eager)
    captured.release()
    assert all(p.grad is None for block in captured.blocks for p in block.parameters())
    with pytest.raises(RuntimeError, match="not captured"):
        captured.step()


@pytest.mark.cuda
def test_bench_on_cuda_counts_launches_and_compares_with_the_limit():
    result = run_bench(_tiny(launch_steps=2, rounds=1, **CUDA_TINY))
    assert result.losses_agree == {"torch": True, "leangraph": True, "whole-step": True}
    launches = {name: m.launches for name, m in result.methods.items()}
    graphs = 2 * 4 * 1  # chunks x microbatches x layers: one forward, one backward each
    assert launches["whole-step"].graph_launches == 1
    assert launches["whole-step"].kernel_launches == 0
    assert launches["torch"].graph_launches == launches["leangraph"].graph_launches == 2 * graphs
    assert launches["eager"].graph_launches == 0 and launches["eager"].kernel_launches > 0
    for name, counts in launches.items():
        assert counts.kernel_launches == counts.gpu_kernels_outside_graphs, name
    assert result.limit_ratio("whole-step") == 1.0
    assert result.limit_ratio("eager") > 1.0
    assert set(result.rounds) == {"torch", "leangraph", "whole-step"}
    for name in ("torch", "leangraph", "whole-step"):
        assert result.methods[name].held_bytes is not None
    table = format_table(result)
    assert "x limit" in table and "kernels outside graphs/step" in table


def test_grad_hooks_leave_out_the_method_that_runs_no_accumulator(capsys):
    """accumulator_hooks=False refuses a parameter whose accumulator node has a hook (it
    would never fire), so the bench does not run that method with --grad-hooks: named, it is
    a usage error; among the default methods, it is left out with a note."""
    with pytest.raises(ValueError, match="the leangraph-fused-nohooks method cannot run with "
                       "gradient-ready hooks"):
        _tiny(grad_hooks=True, methods=("eager", FUSED_NO_HOOKS))
    tiny = ["--device", "cpu", "--pp", "2", "--vp", "2", "--microbatches", "4", "--layers",
            "1", "--hidden", "16", "--heads", "2", "--sequence", "8", "--steps", "1",
            "--no-progress", "--grad-hooks"]
    assert main(["bench", *tiny, "--methods", f"eager,{FUSED_NO_HOOKS}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--grad-hooks: the leangraph-fused-nohooks method" in err
    assert main(["bench", *tiny]) == 0
    out = capsys.readouterr().out
    assert "the leangraph-fused-nohooks method runs no accumulator hook, so it is left out" in out
    workload = out.split("workload:")[1].splitlines()[0]
    assert FUSED_PYTHON_HOOKS in workload and FUSED_NO_HOOKS not in workload
