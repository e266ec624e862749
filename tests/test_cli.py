"""The `leangraph` command line: every subcommand has --help, demo and plan run on the CPU."""

from __future__ import annotations

import pytest

from leangraph.cli import main, progress_bar


@pytest.mark.parametrize("command", ["demo", "bench", "plan"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert f"usage: leangraph {command}" in capsys.readouterr().out


def test_demo_runs_on_the_cpu_and_says_so(capsys):
    assert main(["demo", "--device", "cpu", "--steps", "2", "--microbatches", "2",
                 "--hidden", "32", "--sequence", "8"]) == 0
    out = capsys.readouterr().out
    assert "CPU reference backend" in out and "graphed loss" in out


def test_plan_prints_a_plan_without_a_gpu(capsys):
    assert main(["plan", "--microbatches", "8", "--hidden", "256", "--heads", "4",
                 "--sequence", "128"]) == 0
    out = capsys.readouterr().out
    assert "computed on meta tensors" in out and "warm-up peak, lean" in out


def test_plan_of_a_module_function(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_workload.py").write_text(
        "import torch\n"
        "def make():\n"
        "    layers = tuple(torch.nn.Linear(16, 16, device='meta') for _ in range(2))\n"
        "    samples = tuple((torch.empty(4, 16, device='meta', requires_grad=True),)\n"
        "                    for _ in range(4))\n"
        "    return layers, samples, {'order': [1, 1, -1, -1]}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--function", "my_workload:make"]) == 0
    assert "memory plan of my_workload:make" in capsys.readouterr().out


def test_progress_bar_is_off_without_a_terminal():
    with progress_bar(True) as callback:  # pytest's stderr is not a terminal
        assert callback is None


def test_progress_bar_follows_events_on_a_terminal(monkeypatch):
    import sys

    from leangraph.progress import ProgressEvent

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with progress_bar(True) as callback:
        assert callback is not None
        for done in range(1, 4):
            callback(ProgressEvent("capture", done, 3, None, f"graph {done}"))  # type: ignore[arg-type]
