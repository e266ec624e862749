"""``examples/pipeline.py`` end to end: two processes, interleaved 1F1B, p2p between them.

The example trains a 2-rank x 2-chunk pipeline eagerly and graphed and exits non-zero on any
mismatch. The timeout turns a hang (a p2p deadlock, or graphs outliving the process group at
teardown) into a failure instead of a stuck test run.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pipeline.py"
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_example(device: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()),
        str(EXAMPLE), "--device", device, *extra,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(command)} hung for {TIMEOUT_S} s (deadlock or teardown hang)\n"
                    f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")


def _check(result: subprocess.CompletedProcess[str], steps: int) -> None:
    log = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, log
    for rank in (0, 1):
        assert re.search(rf"^rank {rank}: OK \(", result.stdout, re.MULTILINE), log
    assert "FAILED" not in result.stdout, log
    # The last stage's rank prints the per-step loss table: whole model, eager, graphed.
    rows = re.findall(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", result.stdout, re.MULTILINE)
    assert [int(row[0]) for row in rows] == list(range(steps)), log
    for _, whole, eager, graphed in rows:
        assert whole == eager == graphed, log


# reset: reset_all before destroy_process_group, as the docs prescribe; alive: the graphs
# outlive the process group until interpreter exit (pytorch#115388's hang, Megatron-Bridge#3595).
TEARDOWNS = ["reset", "alive"]


@pytest.mark.parametrize("teardown", TEARDOWNS)
def test_pipeline_example_two_cpu_processes(teardown: str) -> None:
    _check(_run_example("cpu", "--steps", "3", "--microbatches", "4", "--teardown", teardown),
           steps=3)


@pytest.mark.multigpu
@pytest.mark.parametrize("teardown", TEARDOWNS)
def test_pipeline_example_two_gpus_nccl(teardown: str) -> None:
    _check(_run_example("cuda", "--steps", "3", "--microbatches", "4", "--teardown", teardown),
           steps=3)
