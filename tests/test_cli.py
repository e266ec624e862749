"""The `leangraph` command line: help, version, its errors, plan and demo on the CPU, progress.

Every user error must come out as one line on stderr with a non-zero status and no traceback
(``--debug`` shows the traceback), found before any work: nothing is printed on stdout then.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import leangraph
from leangraph.cli import main, progress_bar
from leangraph.cli.commands import UsageError
from leangraph.cli.demo import DemoConfig, run_demo
from leangraph.cli.phases import Phase, PhaseProgress, line_display
from leangraph.cli.workloads import BlockShape, make_blocks, plural
from leangraph.memory import format_bytes

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """main(argv) as the console script runs it: (exit status, stdout, stderr)."""
    try:
        status = main(argv)
    except SystemExit as done:
        status = int(done.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line(err: str, fragment: str, prog: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert fragment in lines[0], lines[0]


# ---------------------------------------------------------------------- help and version


@pytest.mark.parametrize("command", ["demo", "bench", "plan"])
def test_every_subcommand_has_help_with_defaults_in_plain_text(command, capsys):
    status, out, _ = run_cli([command, "--help"], capsys)
    assert status == 0
    assert f"usage: leangraph {command}" in out
    assert "``" not in out  # plain text, no RST markup
    assert "(default: " in out
    assert "--debug" in out


@pytest.mark.parametrize("command", ["demo", "bench", "plan"])
def test_every_option_says_what_it_does(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # long lines: an option's help starts on its line
    _, out, _ = run_cli([command, "--help"], capsys)  # or, after a long name, on the next
    lines = out.split("options:")[1].splitlines()[1:]
    options = [i for i, line in enumerate(lines) if line.lstrip().startswith("-")]
    assert len(options) >= 6
    for i in options:
        same_line = re.match(r"^\s+(-\w, )?--[\w-]+( \S+)?\s{2,}\S", lines[i])
        next_line = i + 1 < len(lines) and re.match(r"^\s{8,}[^\s-]", lines[i + 1])
        assert same_line or next_line, lines[i]


def test_bench_help_gives_each_device_its_default(capsys):
    _, out, _ = run_cli(["bench", "--help"], capsys)
    assert "1024 on a GPU, 64 on the CPU" in " ".join(out.split())


def test_top_level_help_is_plain_and_lists_the_commands(capsys):
    status, out, _ = run_cli(["--help"], capsys)
    assert status == 0 and "``" not in out
    assert all(f"leangraph {c}" in out for c in ("demo", "plan", "bench"))


def test_version(capsys):
    status, out, _ = run_cli(["--version"], capsys)
    assert status == 0
    assert out.strip() == f"leangraph {leangraph.__version__} (torch {torch.__version__})"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}


def _python_m_leangraph(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "leangraph", *argv], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=120, check=False)


def test_python_m_leangraph_runs_the_command_line():
    done = _python_m_leangraph("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"leangraph {leangraph.__version__} ")
    done = _python_m_leangraph("demo", "--microbatches", "3")
    assert done.returncode == 2 and done.stdout == ""
    assert_one_line(done.stderr, "--microbatches 3 must be a multiple of 2", "leangraph demo")


def test_the_console_script_answers_a_ctrl_c_during_its_imports_in_one_line(tmp_path):
    """The ``leangraph`` script's entry lies outside the package, whose import (torch's)
    takes seconds: a Ctrl-C meanwhile, here a package whose import raises it, ends in one
    line and status 130, not a traceback; once imported, the command line runs as always."""
    fake = tmp_path / "leangraph"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise KeyboardInterrupt\n")
    script = "import sys; from _leangraph_entry import main; sys.exit(main(['--version']))"
    paths = os.pathsep.join([str(tmp_path), str(ROOT / "src")])
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": paths},
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 130 and done.stdout == "", done.stderr
    assert_one_line(done.stderr, "interrupted", "leangraph")
    done = subprocess.run([sys.executable, "-c", script], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"leangraph {leangraph.__version__} ")
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^leangraph = "_leangraph_entry:main"$', pyproject, re.MULTILINE)


def test_python_m_leangraph_answers_a_ctrl_c_during_the_torch_import_in_one_line(tmp_path):
    """``python -m leangraph`` imports the package before its ``__main__`` runs: the package
    imports nothing heavy, so a Ctrl-C while torch is imported (here a torch whose import
    raises it, first on the path) ends in one line and status 130, not a traceback."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise KeyboardInterrupt\n")
    paths = os.pathsep.join([str(tmp_path), str(ROOT / "src")])
    done = subprocess.run([sys.executable, "-m", "leangraph", "--version"],
                          env={**os.environ, "PYTHONPATH": paths}, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 130 and done.stdout == "", done.stderr
    assert_one_line(done.stderr, "interrupted", "leangraph")


def test_the_package_imports_its_public_names_at_first_use():
    """``import leangraph`` imports no torch (a fresh interpreter); every name of
    ``__all__`` and every submodule is reachable as an attribute all the same."""
    script = (
        "import sys, leangraph; assert 'torch' not in sys.modules, 'torch imported'; "
        "[getattr(leangraph, name) for name in leangraph.__all__]; "
        "assert leangraph.schedules.gpipe(1) == [1, -1]; "
        "assert set(leangraph.__all__) <= set(dir(leangraph)); print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", script], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
    with pytest.raises(AttributeError, match="module 'leangraph' has no attribute 'nothing'"):
        leangraph.nothing  # noqa: B018


# ------------------------------------------------------------------------- usage errors

USAGE_ERRORS = [
    ([], "leangraph", "the following arguments are required: COMMAND"),
    (["demo", "--microbatches", "3"], "leangraph demo", "must be a multiple of 2"),
    (["demo", "--steps", "0"], "leangraph demo", "argument --steps: must be at least 1, got 0"),
    (["demo", "--steps", "two"], "leangraph demo", "expected an integer, got 'two'"),
    (["demo", "--hidden", "30"], "leangraph demo", "--hidden 30 must be a multiple of 4"),
    (["demo", "--bogus"], "leangraph demo", "unrecognized arguments: --bogus"),
    # Before the command: the top level's, whose --help is the one to read.
    (["--bogus", "plan"], "leangraph", "unrecognized arguments: --bogus (see leangraph --help)"),
    (["demo", "--device", "tpu"], "leangraph demo", "invalid choice: 'tpu'"),
    (["bench", "--methods", "foo"], "leangraph bench", "unknown method 'foo'; choose from"),
    (["bench", "--methods", ","], "leangraph bench", "no method given"),
    (["bench", "--methods", "eager,eager"], "leangraph bench", "a method is named twice"),
    (["bench", "--device", "cpu", "--methods", "torch"], "leangraph bench",
     "the torch method needs a CUDA GPU"),
    (["bench", "--device", "cpu", "--plot", "t.png"], "leangraph bench",
     "--plot: nothing to draw on the CPU"),
    (["bench", "--device", "cpu", "--bars", "b.png"], "leangraph bench",
     "--bars: nothing to draw on the CPU"),
    (["bench", "--device", "cpu", "--json", "no-such-folder/b.json"], "leangraph bench",
     "folder no-such-folder does not exist"),
    (["bench", "--device", "cpu", "--json", "."], "leangraph bench", "is a folder"),
    (["bench", "--device", "cpu", "--json", ""], "leangraph bench",
     "--json '': an empty file name"),
    (["bench", "--device", "cpu", "--rank", "4"], "leangraph bench", "--rank 4 must be below --pp 4"),
    (["bench", "--device", "cpu", "--microbatches", "6"], "leangraph bench",
     "--microbatches 6 must be a multiple of --pp 4 with --vp 2"),
    (["bench", "--device", "cpu", "--hidden", "102"], "leangraph bench",
     "--hidden 102 must be a multiple of --heads 4"),
    (["bench", "--rounds", "-1"], "leangraph bench", "argument --rounds: must be at least 0"),
    (["bench", "--device", "cpu", "--methods", "eager", "--rounds", "2"], "leangraph bench",
     "--rounds 2 captures and times the graphed methods again, and --methods eager has none"),
    (["demo", "--threads", "1000000"], "leangraph demo",
     "argument --threads: must be at most"),  # torch's thread pool would crash the process
    (["bench", "--threads", str(4 * (os.cpu_count() or 1) + 1)], "leangraph bench",
     f"must be at most {4 * (os.cpu_count() or 1)} (4 per CPU"),
    (["bench", "--device", "cpu", "--methods", "eager,whole-step"], "leangraph bench",
     "the whole-step method needs a CUDA GPU (torch.cuda.CUDAGraph)"),
    (["bench", "--device", "cpu", "--methods", "torch,whole-step"], "leangraph bench",
     "the torch and whole-step methods need a CUDA GPU"),
    (["bench", "--device", "cpu", "--launches"], "leangraph bench",
     "--launches counts CUDA kernel and graph launches"),
    (["bench", "--device", "cpu", "--replay-micro"], "leangraph bench",
     "--replay-micro times torch.cuda.make_graphed_callables' replays"),
    (["bench", "--device", "cpu", "--replay-micro", "--methods", "eager", "--launches"],
     "leangraph bench", "--methods, --launches: not used with --replay-micro"),
    (["bench", "--device", "cpu", "--replay-micro", "--grad-hooks"],
     "leangraph bench", "--grad-hooks: not used with --replay-micro"),
    (["bench", "--device", "cpu", "--replays", "10"], "leangraph bench",
     "--replays: only with --replay-micro"),
    (["bench", "--replays", "0"], "leangraph bench", "argument --replays: must be at least 1"),
    (["bench", "--device", "cpu", "--preset", "llama3-70b-pp4vp5"], "leangraph bench",
     "is too big for the CPU reference backend, and this bench runs on the CPU (--device cpu)"),
    (["bench", "--preset", "llama3-70b-pp4vp5", "--hidden", "4096", "--dtype", "fp32"],
     "leangraph bench", "--hidden, --dtype: not with --preset llama3-70b-pp4vp5, which sets"),
    (["bench", "--preset", "llama3-70b-pp4vp5-norope", "--replay-micro"], "leangraph bench",
     "--replay-micro: not with --preset llama3-70b-pp4vp5-norope"),
    # The preset sets pp and vp, whose flags it refuses: named without them.
    (["bench", "--device", "cpu", "--preset", "llama3-70b-pp4vp5", "--microbatches", "6"],
     "leangraph bench", "--microbatches 6 must be a multiple of pp 4 with vp 5 ("),
    (["bench", "--preset", "llama3-70b"], "leangraph bench", "invalid choice: 'llama3-70b'"),
    (["plan", "--dtype", "fp8"], "leangraph plan", "invalid choice: 'fp8'"),
    (["plan", "--vp", "2", "--microbatches", "2"], "leangraph plan",
     "--microbatches 2 must be a multiple of --pp 4"),
    (["plan", "--function", "no_such_module_xyz:make"], "leangraph plan",
     "no module 'no_such_module_xyz' in the working folder"),
    (["plan", "--function", "make"], "leangraph plan", "expected module:function"),
    (["plan", "--function", ""], "leangraph plan",  # not the default workload's plan
     "--function '': expected module:function"),
    (["bench", "--device", "cpu", "--json", "x" * 300 + ".json"], "leangraph bench",
     "cannot be written (File name too long)"),
    (["bench", "--device", "cpu", "--json", "out.png", "--bars", "./out.png"], "leangraph bench",
     "--json out.png, --bars ./out.png: the same file twice"),
    (["plan", "--function", "os:no_such_function"], "leangraph plan",
     "module os has no attribute 'no_such_function'"),
    (["plan", "--function", "os:sep"], "leangraph plan", "os.sep is a str, not a function"),
    (["plan", "--function", "os:O_RDONLY"], "leangraph plan",
     "os.O_RDONLY is an int, not a function"),
    # A path ending in '/' names a folder: refused before the run, not by the write at its end.
    (["bench", "--device", "cpu", "--json", "new.json/"], "leangraph bench",
     "--json new.json/: ends in '/', a folder's name; give a file name"),
    # Counts past their bounds, and integers too long to be counts (told by their length).
    (["demo", "--steps", "10001"], "leangraph demo",
     "argument --steps: must be at most 10000 (its data is made before the first step), got"),
    (["bench", "--steps", "100001"], "leangraph bench",
     "argument --steps: must be at most 100000 (more would run for days), got 100001"),
    (["bench", "--rounds", "1001"], "leangraph bench", "argument --rounds: must be at most 1000"),
    (["bench", "--replays", "1000001"], "leangraph bench",
     "argument --replays: must be at most 1000000"),
    (["demo", "--steps", "9" * 5000], "leangraph demo",
     "argument --steps: expected an integer of at most 30 digits, got one of 5000"),
    (["demo", "--hidden", "12ab" + "x" * 100], "leangraph demo",
     "argument --hidden: expected an integer, got '12ab" + "x" * 36 + "'... (104 characters)"),
    (["bench", "--device", "cpu", "--replay-micro", "--pp", "2", "--layers", "3"],
     "leangraph bench", "--pp, --layers: not used with --replay-micro"),
    (["plan", "--function", "os:getcwd"], "leangraph plan",
     "must return (callables, sample_args) or (callables, sample_args, dict"),
    (["plan", "--pp", "2", "--hidden", "8", "--function", "os:getcwd"], "leangraph plan",
     "--pp, --hidden: not used with --function"),
    # Counts far past any machine: refused at once, not hours of work or torch's overflow.
    (["plan", "--vp", "100000000000000000000"], "leangraph plan",
     "--vp 100000000000000000000 x --layers 4 x --microbatches 16 is "
     "6400000000000000000000 graphs to plan; at most 100000 (each is probed and planned"),
    (["bench", "--device", "cpu", "--microbatches", "1000000"], "leangraph bench",
     "--vp 2 x --layers 2 x --microbatches 1000000 is 4000000 graphs to capture"),
    (["demo", "--microbatches", "100000000"], "leangraph demo",
     "2 chunks x 2 blocks x --microbatches 100000000 is 400000000 graphs to capture"),
    (["plan", "--hidden", "1000000000", "--heads", "1000"], "leangraph plan",
     "fc1's weight (4 x hidden x hidden) would take 8000000000000000000 bytes; at most "
     "1125899906842624 (1 PiB) per tensor"),
    (["plan", "--sequence", "100000000000000000000"], "leangraph plan",
     "the attention scores (micro-batch x heads x sequence x sequence) would take"),
    (["demo", "--sequence", "1000000000", "--device", "cpu"], "leangraph demo",
     "the attention scores (micro-batch x heads x sequence x sequence) would take "
     "16000000000000000000 bytes"),
    (["plan", "--micro-batch", "1000000000000", "--sequence", "1", "--heads", "1",
      "--hidden", "1000000"], "leangraph plan",
     "fc1's output (micro-batch x sequence x 4 x hidden) would take 8000000000000000000 bytes"),
    # Under the cap but beyond any machine's memory: refused before anything is made, naming
    # the flags, not by torch's allocator later.
    (["demo", "--hidden", "4000000", "--device", "cpu"], "leangraph demo",
     "--hidden 4000000, --sequence 32: the weights of its 4 blocks alone would take 2793.97 "
     "TiB, more than this machine's"),
    (["bench", "--device", "cpu", "--hidden", "4000000"], "leangraph bench",
     "--hidden 4000000, --sequence 32, --micro-batch 1, --vp 2, --layers 2: the weights of its 4 "
     "blocks alone would take"),
    (["demo", "--sequence", "1000000", "--device", "cpu"], "leangraph demo",
     "--hidden 64, --sequence 1000000: the attention scores (micro-batch x heads x sequence x "
     "sequence) would take 14.55 TiB, more than this machine's"),
]


@pytest.mark.parametrize(("argv", "prog", "fragment"), USAGE_ERRORS,
                         ids=[" ".join(a) or "no-command" for a, _, _ in USAGE_ERRORS])
def test_a_usage_error_is_one_line_status_2_before_any_work(argv, prog, fragment, capsys,
                                                           tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli(argv, capsys)
    assert status == 2
    assert out == ""  # refused before any work: no header, no table
    assert_one_line(err, fragment, prog)


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without a GPU")
def test_demo_on_cuda_without_a_gpu_says_so(capsys):
    status, out, err = run_cli(["demo", "--device", "cuda"], capsys)
    assert status == 2 and out == ""
    assert_one_line(err, "--device cuda: torch sees no CUDA GPU here", "leangraph demo")


@pytest.mark.parametrize("where", ["after", "before"])
def test_debug_shows_the_traceback_instead(where, capsys):
    argv = ["demo", "--microbatches", "3"]
    argv = [*argv, "--debug"] if where == "after" else ["--debug", *argv]
    with pytest.raises(UsageError, match="must be a multiple of 2"):
        main(argv)


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """``leangraph plan | head -1``: no error line about the broken pipe."""
    process = subprocess.Popen(
        [sys.executable, "-m", "leangraph", "plan", "--pp", "1", "--vp", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=ROOT,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # before it writes: its first print finds no reader
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141, err
    assert err == ""


class _Unwritable(io.StringIO):
    """A stdout that refuses what is written to it, as a full disk or /dev/full does."""

    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error = error

    def write(self, text: str) -> int:
        raise self.error


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["--version"]], ids=" ".join)
def test_help_or_version_that_cannot_be_written_fails_in_one_line(argv, monkeypatch, capsys):
    """argparse drops a write error of --help and --version and exits 0 with nothing written:
    the command fails instead, status 1, saying why."""
    monkeypatch.setattr(sys, "stdout", _Unwritable(OSError(28, "No space left on device")))
    status, _, err = run_cli(argv, capsys)
    assert status == 1
    prog = "leangraph plan" if argv[0] == "plan" else "leangraph"
    assert_one_line(err, "cannot write the output: [Errno 28] No space left on device", prog)


def test_help_to_a_reader_gone_ends_quietly(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _Unwritable(BrokenPipeError(32, "Broken pipe")))
    monkeypatch.setattr(os, "dup2", lambda *args: None)  # keeps the test session's stdout
    status, _, err = run_cli(["--help"], capsys)
    assert status == 141 and err == ""


def test_debug_shows_the_traceback_from_a_real_process():
    done = _python_m_leangraph("plan", "--function", "os:getcwd", "--debug")
    assert done.returncode == 1  # an uncaught exception
    assert "Traceback (most recent call last)" in done.stderr
    assert "UsageError: --function os:getcwd: must return" in done.stderr


# ------------------------------------------------------------------- plan --function


def _write_module(folder: Path, name: str, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (folder / f"{name}.py").write_text(body)
    monkeypatch.chdir(folder)
    monkeypatch.delitem(sys.modules, name, raising=False)


WORKLOAD = (
    "import torch\n"
    "def make():\n"
    "    layers = tuple(torch.nn.Linear(16, 16, device='meta') for _ in range(2))\n"
    "    samples = tuple((torch.empty(4, 16, device='meta', requires_grad=True),)\n"
    "                    for _ in range(4))\n"
    "    return layers, samples, {'order': [1, 1, -1, -1]}\n"
)


def test_plan_of_a_module_function_in_the_working_folder(tmp_path, monkeypatch, capsys):
    _write_module(tmp_path, "lg_workload_here", WORKLOAD, monkeypatch)
    assert importlib.util.find_spec("lg_workload_here") is None  # not importable by itself
    path_before = list(sys.path)
    status, out, err = run_cli(["plan", "--function", "lg_workload_here:make"], capsys)
    assert status == 0, err
    assert "memory plan of lg_workload_here:make" in out and "warm-up peak, lean" in out
    assert sys.path == path_before  # the working folder was on it for the import only


@pytest.mark.parametrize(("body", "fragment"), [
    ("def make():\n    return 1 / 0\n", "it raised ZeroDivisionError: division by zero"),
    ("raise RuntimeError('broken at import')\n", "raised RuntimeError: broken at import"),
    ("import no_such_dependency_xyz\n", "importing lg_workload_bad: No module named"),
    # sys.exit is not the command's exit: status 0 would say a plan was printed.
    ("import sys\ndef make():\n    sys.exit()\n", "it called sys.exit(None)"),
    ("import sys\nsys.exit(3)\n", "importing lg_workload_bad called sys.exit(3)"),
])
def test_a_failing_function_or_module_is_one_line_status_1(body, fragment, tmp_path,
                                                          monkeypatch, capsys):
    _write_module(tmp_path, "lg_workload_bad", body, monkeypatch)
    status, out, err = run_cli(["plan", "--function", "lg_workload_bad:make"], capsys)
    assert status == 1 and out == ""
    assert_one_line(err, fragment, "leangraph plan")


def test_a_keyword_plan_memory_does_not_take_is_a_usage_error_naming_it(tmp_path, monkeypatch,
                                                                      capsys):
    body = WORKLOAD.replace("{'order'", "{'ordr'")
    _write_module(tmp_path, "lg_workload_keyword", body, monkeypatch)
    status, out, err = run_cli(["plan", "--function", "lg_workload_keyword:make"], capsys)
    assert status == 2 and out == ""
    assert_one_line(err, "--function lg_workload_keyword:make: the dict returned must hold "
                    "plan_memory keywords (sample_kwargs, order, num_layers_per_chunk, "
                    "meta_attention, fuse_grad_accumulation, overlap_grad_accumulation), got "
                    "'ordr'", "leangraph plan")


def test_a_workload_plan_memory_rejects_is_one_line_status_1(tmp_path, monkeypatch, capsys):
    body = WORKLOAD.replace("range(4)", "range(3)")  # 3 samples for 2 layers x 2 microbatches
    _write_module(tmp_path, "lg_workload_counts", body, monkeypatch)
    status, _, err = run_cli(["plan", "--function", "lg_workload_counts:make"], capsys)
    assert status == 1
    assert_one_line(err, "ValueError: ", "leangraph plan")
    assert "run again with --debug for the traceback" in err


def _plan_figure(out: str, row: str) -> str:
    """The figure of one row of a printed plan ("capture peak" -> "2.83 GiB")."""
    line = next(line for line in out.splitlines() if line.strip().startswith(row))
    return " ".join(line.split()[len(row.split()):][:2])


def test_plan_accumulation_plans_each_mode(capsys):
    small = ["--microbatches", "8", "--hidden", "64", "--heads", "4", "--sequence", "16"]
    outputs = {}
    for mode in (None, "autograd", "fused", "overlap"):
        status, out, err = run_cli(["plan", *small]
                                   + ([] if mode is None else ["--accumulation", mode]), capsys)
        assert status == 0, err
        outputs[mode] = out
    assert outputs[None] == outputs["autograd"]
    assert "accumulation buffers" not in outputs["autograd"]
    # Every parameter of the rank's 2 x 4 blocks (bf16, plan's default), none with a .grad on
    # the meta workload.
    shape = BlockShape(hidden=64, heads=4, sequence=16, dtype=torch.bfloat16)
    every = sum(p.numel() * p.element_size()
                for block in make_blocks(8, shape, "meta") for p in block.parameters())
    assert _plan_figure(outputs["fused"], "accumulation buffers") == format_bytes(every)
    assert "+ accumulation buffers" in outputs["fused"]
    autograd_peak = _plan_figure(outputs["autograd"], "capture peak")
    assert _plan_figure(outputs["fused"], "capture peak") != autograd_peak
    assert _plan_figure(outputs["overlap"], "capture peak") != autograd_peak
    assert "accumulation buffers" not in outputs["overlap"]


def test_plan_accumulation_adds_to_a_functions_keywords(tmp_path, monkeypatch, capsys):
    _write_module(tmp_path, "lg_workload_modes", WORKLOAD, monkeypatch)
    status, out, err = run_cli(["plan", "--function", "lg_workload_modes:make",
                                "--accumulation", "fused"], capsys)
    assert status == 0, err
    # Two Linear(16, 16) layers: 2 * (16 * 16 + 16) fp32 parameters.
    assert _plan_figure(out, "accumulation buffers") == "2.12 KiB"
    status, _, err = run_cli(["plan", "--accumulation", "sideways"], capsys)
    assert status == 2
    assert_one_line(err, "--accumulation: invalid choice: 'sideways'", "leangraph plan")


def test_plan_counts_one_of_a_kind_in_the_singular(capsys):
    status, out, _ = run_cli(["plan", "--pp", "1", "--vp", "1", "--microbatches", "1",
                              "--layers", "1", "--heads", "1", "--hidden", "8"], capsys)
    assert status == 0
    assert "1 chunk x 1 block, 1 microbatch, hidden 8, 1 head, sequence" in out


def test_plural_takes_an_irregular_plural():
    assert plural(1, "microbatch", "microbatches") == "1 microbatch"
    assert plural(8, "microbatch", "microbatches") == "8 microbatches"
    assert plural(2, "block") == "2 blocks"


def test_plan_prints_a_plan_without_a_gpu(capsys):
    status, out, _ = run_cli(["plan", "--microbatches", "8", "--hidden", "256", "--heads", "4",
                              "--sequence", "128"], capsys)
    assert status == 0
    assert "computed on meta tensors" in out and "warm-up peak, lean" in out
    assert "rank 0 of PP4 x VP2, 2 chunks x 4 blocks, 8 microbatches, hidden 256" in out


# ---------------------------------------------------------------------------------- demo


def test_demo_runs_on_the_cpu_and_says_so(capsys):
    status, out, err = run_cli(["demo", "--device", "cpu", "--steps", "2", "--microbatches", "2",
                                "--hidden", "32", "--sequence", "8", "--no-progress"], capsys)
    assert status == 0, err
    assert "CPU reference backend" in out and "graphed loss" in out
    assert err == ""  # --no-progress: nothing on stderr


def test_demo_progress_names_each_phase_on_stderr(capsys):
    status, _, err = run_cli(["demo", "--device", "cpu", "--steps", "2", "--microbatches", "2",
                              "--hidden", "32", "--sequence", "8"], capsys)
    assert status == 0
    # 2 microbatches x 2 chunks x 2 layers = 8 graphs: 16 graph steps to capture; warm-up
    # runs microbatch 0 of each layer (the other's sample has its layout).
    assert err.splitlines() == [
        "progress: eager reference training (2 steps)",
        "progress: probe (one forward per layer)",
        "progress: warm-up pass 1 of 3 (8 graph steps)",
        "progress: warm-up pass 2 of 3 (8 graph steps)",
        "progress: warm-up pass 3 of 3 (8 graph steps)",
        "progress: capture (16 graph steps)",
        "progress: graphed training (2 steps)",
    ]


def test_a_cpu_run_uses_one_thread_and_gives_torchs_count_back(capsys):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        status, _, _ = run_cli(["demo", "--device", "cpu", "--steps", "1", "--microbatches", "2",
                                "--hidden", "32", "--sequence", "8", "--no-progress"], capsys)
        assert status == 0 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------ progress


def test_demo_phases_are_named_with_their_totals_up_front():
    phases: list[Phase] = []
    config = DemoConfig(steps=2, num_microbatches=2, shape=BlockShape(hidden=16, sequence=4),
                        device="cpu")
    run_demo(config, progress=PhaseProgress(phases.append))
    firsts = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1].name != p.name]
    # Warm-up runs microbatch 0 of each layer (the other's sample has its layout).
    assert [(p.name, p.done, p.total) for p in firsts] == [
        ("eager reference training", 0, 2),
        ("probe (one forward per layer)", 0, None),
        ("warm-up pass 1 of 3", 0, 8),
        ("warm-up pass 2 of 3", 0, 8),
        ("warm-up pass 3 of 3", 0, 8),
        ("capture", 0, 16),
        ("graphed training", 0, 2),
    ]
    lasts = [p for i, p in enumerate(phases) if i + 1 == len(phases) or phases[i + 1].name != p.name]
    assert all(p.done == p.total for p in lasts if p.total is not None), lasts
    capture = [p for p in phases if p.name == "capture"]
    assert [p.done for p in capture] == list(range(17))
    assert capture[1].detail == "forward of graph (chunk 1, microbatch 0, layer 0)"
    assert capture[-1].count() == "16/16 graph steps"


def _capture_events(progress: PhaseProgress | list) -> None:
    torch.manual_seed(0)
    layers = (nn.Linear(8, 8), nn.Linear(8, 8))
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(4))
    callback = progress.append if isinstance(progress, list) else progress
    leangraph.reset_all(leangraph.make_graphed_callables(
        layers, samples, order=[1, 1, -1, -1], num_warmup_iters=2, progress=callback))


def test_without_expectations_events_name_their_own_phase():
    phases: list[Phase] = []
    _capture_events(PhaseProgress(phases.append))
    names = list(dict.fromkeys(p.name for p in phases))
    assert names == ["warm-up pass 1", "warm-up pass 2", "capture"]
    # Each counted in its own steps: a warm-up pass runs microbatch 0 (the samples are alike).
    assert [p.count() for p in phases if p.name == "warm-up pass 1"][-1] == "4/4 graph steps"
    assert phases[-1].count() == "8/8 graph steps"


def test_line_display_writes_one_line_per_phase():
    stream = io.StringIO()
    progress = PhaseProgress(line_display(stream))
    progress.expect_capture(warmup_passes=2, memory_check=True, prefix="x: ")
    _capture_events(progress)
    assert stream.getvalue().splitlines() == [
        "progress: x: memory check (one forward per layer)",
        "progress: x: warm-up pass 1 of 2 (4 graph steps)",
        "progress: x: warm-up pass 2 of 2 (4 graph steps)",
        "progress: x: capture (8 graph steps)",
    ]


def test_a_phase_of_one_counts_it_in_the_singular():
    stream = io.StringIO()
    progress = PhaseProgress(line_display(stream))
    progress.begin("eager reference training", 1, "steps")
    progress.begin("graphed training", 2, "steps")
    progress.begin("capture", 1, "graph steps")
    assert stream.getvalue().splitlines() == [
        "progress: eager reference training (1 step)",
        "progress: graphed training (2 steps)",
        "progress: capture (1 graph step)",
    ]
    assert Phase("capture", 0, 1, "graph steps").count() == "0/1 graph step"


def test_expect_capture_ignores_the_old_steps_per_pass_with_a_warning():
    stream = io.StringIO()
    progress = PhaseProgress(line_display(stream))
    with pytest.warns(DeprecationWarning, match="steps_per_pass=.* is ignored"):
        progress.expect_capture(warmup_passes=2, steps_per_pass=8, memory_check=False)
    _capture_events(progress)
    assert stream.getvalue().splitlines()[1] == "progress: warm-up pass 1 of 2 (4 graph steps)"


def test_progress_bar_is_off_without_a_terminal():
    with progress_bar(True) as callback:  # pytest's stderr is not a terminal
        assert callback is None


def test_progress_bar_follows_events_on_a_terminal(monkeypatch):
    pytest.importorskip("rich")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with progress_bar(True) as bar:
        assert isinstance(bar, PhaseProgress)
        bar.expect_capture(warmup_passes=2, memory_check=False)
        _capture_events(bar)


# --------------------------------------------------------------------------------- docs


def _documented_errors() -> list[tuple[list[str], str]]:
    """The ``$ leangraph ...`` lines of docs/quickstart.md and the line printed after each."""
    lines = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8").splitlines()
    return [(lines[i].split()[2:], lines[i + 1]) for i in range(len(lines) - 1)
            if lines[i].startswith("$ leangraph ")]


def test_the_quickstart_shows_the_errors_the_cli_prints(capsys):
    examples = _documented_errors()
    assert len(examples) >= 2
    for argv, expected in examples:
        _, _, err = run_cli(argv, capsys)
        assert err.strip() == expected, argv


def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(capsys):
    from leangraph.cli.commands import main

    assert main(["bench", "--no-progress", "--steps", "1", "--json", "/proc/leangraph.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--json /proc/leangraph.json: cannot be written" in err


def test_an_output_path_ending_in_a_slash_is_refused_though_a_file_has_its_name(tmp_path,
                                                                                monkeypatch,
                                                                                capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exist.json").write_text("kept")
    status, out, err = run_cli(["bench", "--device", "cpu", "--json", "exist.json/"], capsys)
    assert status == 2 and out == ""
    assert_one_line(err, "--json exist.json/: ends in '/', a folder's name", "leangraph bench")
    assert (tmp_path / "exist.json").read_text() == "kept"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes (POSIX)")
def test_a_named_pipe_with_no_reader_is_refused_at_once_not_waited_on(tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "pipe")
    status, out, err = run_cli(["bench", "--device", "cpu", "--json", "pipe"], capsys)
    assert status == 2 and out == ""
    assert_one_line(err, "--json pipe: cannot be written (", "leangraph bench")


def test_output_checks_follow_a_symbolic_link_and_leave_it_as_it_was(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    status, _, err = run_cli(["bench", "--device", "cpu", "--json", "loop"], capsys)
    assert status == 2
    assert_one_line(err, "--json loop: cannot be written (", "leangraph bench")  # a loop

    (tmp_path / "dangling").symlink_to(tmp_path / "gone" / "b.json")
    status, _, err = run_cli(["bench", "--device", "cpu", "--json", "dangling"], capsys)
    assert status == 2
    assert_one_line(err, f"--json dangling: folder {tmp_path / 'gone'} does not exist",
                    "leangraph bench")

    (tmp_path / "link").symlink_to(tmp_path / "b.json")  # a link to a file still to write
    status, _, err = run_cli(["bench", "--device", "cpu", "--json", "link", "--plot", "t.png"],
                             capsys)
    assert status == 2 and "--plot: nothing to draw on the CPU" in err  # after the checks
    assert (tmp_path / "link").is_symlink() and not (tmp_path / "b.json").exists()


def test_plan_builds_its_blocks_on_meta_tensors():
    from leangraph.cli.workloads import BlockShape, make_blocks

    (block,) = make_blocks(1, BlockShape(hidden=8192, heads=64, sequence=16), "meta")
    assert {p.device.type for p in block.parameters()} == {"meta"}


def test_demo_fails_when_a_graphed_loss_is_nan(monkeypatch, capsys):
    """A NaN compares False with any tolerance: it must fail the check, not pass it."""
    from leangraph.cli import commands
    from leangraph.cli.demo import DemoResult

    def nan_run(config, progress=None):
        return DemoResult("cpu", [1, -1], eager_losses=[1.0, 0.9],
                          graphed_losses=[1.0, float("nan")])

    monkeypatch.setattr(commands, "run_demo", nan_run)
    status, out, err = run_cli(["demo", "--device", "cpu", "--no-progress"], capsys)
    assert status == 1, out
    assert_one_line(err, "graphed and eager losses differ", "leangraph demo")


def test_a_closed_stderr_runs_without_progress():
    """``leangraph demo 2>&-``: Python's sys.stderr is None; the run must still finish."""
    done = subprocess.run(
        [sys.executable, "-m", "leangraph", "demo", "--device", "cpu", "--steps", "1",
         "--microbatches", "2", "--hidden", "8", "--sequence", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_env(), cwd=ROOT, text=True,
        timeout=120, check=False, preexec_fn=lambda: os.close(2),
    )
    assert done.returncode == 0, done.stdout
    assert "graphed loss" in done.stdout and "progress:" not in done.stdout
