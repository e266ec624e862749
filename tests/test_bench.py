"""`leangraph bench` on the CPU backend: runs end to end, losses agree, JSON is complete."""

from __future__ import annotations

import json

import torch

from leangraph.cli.bench import BenchConfig, format_table, run_bench
from leangraph.cli import main
from leangraph.cli.workloads import BlockShape

TINY = BlockShape(hidden=32, heads=4, sequence=16, dtype=torch.float32)


def test_bench_runs_eager_and_leangraph_on_cpu_and_losses_agree():
    config = BenchConfig(pp_size=2, vp_size=2, num_microbatches=4, layers_per_chunk=2,
                         shape=TINY, steps=1, methods=("eager", "leangraph"), device="cpu")
    result = run_bench(config)
    assert result.losses_agree == {"leangraph": True}
    assert result.methods["eager"].losses == result.methods["leangraph"].losses
    assert "leangraph" in format_table(result)


def test_bench_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--device", "cpu", "--pp", "2", "--vp", "2", "--microbatches", "4",
                 "--layers", "1", "--hidden", "32", "--heads", "4", "--sequence", "16",
                 "--dtype", "fp32", "--steps", "1", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["losses_agree"] == {"leangraph": True}
    assert set(data["methods"]) == {"eager", "leangraph"}
    assert len(data["leangraph_timeline"]) > 0
    assert "CPU reference backend" in capsys.readouterr().out


def test_rounds_time_each_graphed_method_afresh():
    config = BenchConfig(pp_size=2, vp_size=2, num_microbatches=4, layers_per_chunk=1,
                         shape=TINY, steps=1, methods=("eager", "leangraph"), device="cpu",
                         rounds=3)
    result = run_bench(config)
    assert set(result.rounds) == {"leangraph"}
    times = result.rounds["leangraph"]
    assert len(times.capture_seconds) == len(times.step_seconds) == 3
    assert all(t > 0 for t in times.capture_seconds + times.step_seconds)
    assert "3 rounds, median [min-max]" in format_table(result)
    assert len(result.to_json()["rounds"]["leangraph"]["capture_seconds"]) == 3
