"""The replay microbenchmark: its config's refusals, the replay it times (on the CPU backend,
leangraph's graphed layer trains as eager over repeated replays), its output; on a GPU, both
methods side by side."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from leangraph.cli.replay_micro import (
    ReplayMicroConfig,
    ReplayMicroResult,
    format_replay_micro,
    graphed_layer,
    run_replay_micro,
    time_replays,
)
from leangraph.cli.workloads import BlockShape, make_blocks, sample_hidden

TINY = BlockShape(hidden=32, heads=4, sequence=16, dtype=torch.float32)


def test_config_refuses_the_cpu_and_empty_rounds():
    with pytest.raises(ValueError, match="needs a CUDA device .* got 'cpu'"):
        ReplayMicroConfig(device="cpu")
    with pytest.raises(ValueError, match="replays must be at least 1, got 0"):
        ReplayMicroConfig(replays=0)
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        ReplayMicroConfig(rounds=0)
    with pytest.raises(ValueError, match="warmup_replays must be at least 0, got -1"):
        ReplayMicroConfig(warmup_replays=-1)


def test_graphed_layer_refuses_an_unknown_method():
    block = make_blocks(1, TINY, "cpu")[0]
    with pytest.raises(ValueError, match="no replay method 'eager'; choose from torch, leangraph, leangraph-overlap, leangraph-fused"):
        graphed_layer("eager", block, sample_hidden(TINY, "cpu"))


@pytest.mark.parametrize("method", ["leangraph", "leangraph-fused"])
def test_timed_replays_of_leangraphs_layer_accumulate_eagers_gradients(method):
    """What a round times: forward+backward replays, one after the other, gradients adding
    up in ``.grad`` as over a step's microbatches (CPU reference backend)."""
    block = make_blocks(1, TINY, "cpu")[0]
    eager = copy.deepcopy(block)
    layer = graphed_layer(method, block, sample_hidden(TINY, "cpu"))
    x = sample_hidden(TINY, "cpu")
    grad = torch.randn_like(x)
    synced = []
    host, wall = time_replays(lambda: layer(x).backward(grad), 3, lambda: synced.append(1))
    assert synced == [1, 1] and 0 < host <= wall
    x_eager = x.detach().clone().requires_grad_(True)
    for _ in range(3):
        eager(x_eager).backward(grad)
    for ours, theirs in zip(block.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    torch.testing.assert_close(x.grad, x_eager.grad)


def _result() -> ReplayMicroResult:
    return ReplayMicroResult({"replays": 200}, host_us={"torch": [310.0, 300.0, 320.0],
                                                       "leangraph": [250.0, 260.0, 240.0]},
                             wall_us={"torch": [312.0, 301.0, 322.0],
                                      "leangraph": [252.0, 262.0, 243.0]})


def test_output_gives_both_methods_and_their_ratio():
    lines = format_replay_micro(_result()).splitlines()
    assert lines[0].split() == ["method", "host", "µs/replay", "wall", "µs/replay"]
    assert lines[2].split() == ["torch", "310.0", "[300.0-320.0]", "312.0", "[301.0-322.0]"]
    assert lines[3].split()[:3] == ["leangraph", "250.0", "[240.0-260.0]"]
    assert lines[-1] == "leangraph / torch, host medians: 0.81x"
    data = json.loads(json.dumps(_result().to_json()))
    assert data["median_host_us"] == {"torch": 310.0, "leangraph": 250.0}
    assert data["leangraph_over_torch_host"] == pytest.approx(250 / 310)


@pytest.mark.cuda
def test_replay_micro_times_both_methods_on_cuda():
    result = run_replay_micro(ReplayMicroConfig(shape=TINY, replays=5, rounds=3,
                                                warmup_replays=2))
    for figures in (result.host_us, result.wall_us):
        assert set(figures) == {"torch", "leangraph", "leangraph-overlap", "leangraph-fused",
                                "leangraph-fused-python", "leangraph-fused-nohooks"}
        assert all(len(v) == 3 and min(v) > 0 for v in figures.values())
    assert result.ratio() > 0
    assert "leangraph / torch" in format_replay_micro(result)
    assert "leangraph-fused / torch" in format_replay_micro(result)
