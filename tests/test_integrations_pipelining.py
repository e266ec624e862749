"""Tests of leangraph.integrations.pipelining: graphed stages under torch's own schedules.

Every schedule class of this torch that ``from_pipelining`` supports trains on two ranks over
gloo (the CPU reference backend), graphed and eagerly (a deep copy of the same stages, plain
``PipelineStage`` objects), through torch's ``schedule.step()``; losses, the merged output of
``step()``, gradients and parameters must be bitwise equal over several optimizer steps, and so
must ``schedule.eval()`` where torch's eager runtime runs it. Importing torch dominates the
cost, so one pair of processes (this file, run as a script) runs every case, and
``examples/pipelining_torch.py``'s training too; the tests read what each rank reported.
Marked ``multigpu``, a pair on two GPUs over NCCL runs an interleaved and two zero-bubble
schedules, unfused and fused.

Errors, eval and teardown are checked in this process on a pipeline of one rank (a gloo group
of one; torch's runtime drives all stages on that rank); the same bitwise check runs there on
the CPU and, marked ``cuda``, on a GPU.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import rank_worker, two_ranks
from models import Block
from torch import nn
from torch.distributed import pipelining

import leangraph
from leangraph.integrations.pipelining import (
    GraphedPipeline,
    StageModules,
    graph_pipeline_stages,
    stage_placement,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pipelining_torch.py"
WIDTH, IN_FEATURES, OUT_FEATURES, ROWS = 8, 3, 2, 2  # ROWS: rows per microbatch
STEPS = 3
TIMEOUT_S = 300
# torch's V-shaped schedules place rank r's two stages at r and 2 * pp_size - 1 - r.
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@dataclass(frozen=True)
class Case:
    """One training run: a schedule class, how many stages and layers, whether glue runs.

    With ``glue`` the first stage has an eager ``pre`` (a Linear from the inputs) and the last
    an eager ``post`` (a Linear head); without, the last stage's output is a graph's output
    itself, which torch keeps past its backward.
    """

    schedule: str
    stages_per_rank: int
    layers: int
    glue: bool
    microbatches: int = 4
    # With fuse_grad_accumulation: its accumulator_hooks (None: not fused).
    fused_hooks: bool | str | None = None
    # The first stage's layers: "train" (Blocks), "batchnorm" (Blocks with a batch norm,
    # whose running statistics must count what eager's count) or "frozen" (its first layer
    # trains nothing: without glue its output needs no gradient, so its graph gets neither a
    # backward nor a weight step).
    first_stage: str = "train"

    @property
    def id(self) -> str:
        fused = "" if self.fused_hooks is None else f"-fused-{self.fused_hooks}".lower()
        first = "" if self.first_stage == "train" else f"-{self.first_stage}"
        return f"{self.schedule}-{'glue' if self.glue else 'bare'}{fused}{first}"

    @property
    def capture_options(self) -> dict[str, Any]:
        if self.fused_hooks is None:
            return {}
        return {"fuse_grad_accumulation": True, "accumulator_hooks": self.fused_hooks}

    @property
    def schedule_class(self) -> type:
        return getattr(pipelining, self.schedule)


# Every schedule class from_pipelining supports (tests/test_schedules.py); zero-bubble ones
# split backwards, which leangraph graphs one layer per stage.
CASES = [
    Case("ScheduleGPipe", 1, 2, glue=False),
    Case("Schedule1F1B", 1, 2, glue=True),
    Case("ScheduleInterleaved1F1B", 2, 2, glue=False),
    Case("ScheduleLoopedBFS", 2, 2, glue=True),
    Case("ScheduleInterleavedZeroBubble", 2, 1, glue=False),
    Case("ScheduleZBVZeroBubble", 2, 1, glue=True),
    Case("ScheduleDualPipeV", 2, 1, glue=False),
    # A frozen first layer on the model inputs: no backward for its graphs, and a chained next
    # layer whose input needs no gradient (zero-bubble ones: test_zero_bubble_trains_...).
    Case("Schedule1F1B", 1, 2, glue=False, first_stage="frozen"),
    Case("ScheduleInterleaved1F1B", 2, 2, glue=True, first_stage="batchnorm"),
]


def _present(case: Case) -> Any:
    if hasattr(pipelining, case.schedule):
        return pytest.param(case, id=case.id)
    return pytest.param(case, id=case.id, marks=pytest.mark.skip(
        reason=f"this torch has no {case.schedule}"))


# --------------------------------------------------------------------------------------------
# One training run, on any rank (shared by the two-rank workers and the in-process tests)
# --------------------------------------------------------------------------------------------


def stage_indices(case: Case, pp_size: int, rank: int) -> list[int]:
    """Where torch's schedule places rank ``rank``'s stages (stated here independently)."""
    if case.schedule in V_SCHEDULES:
        return [k * pp_size + (rank if k % 2 == 0 else pp_size - 1 - rank)
                for k in range(case.stages_per_rank)]
    return [rank + k * pp_size for k in range(case.stages_per_rank)]


def build_model(case: Case, pp_size: int, device: str) -> list[StageModules]:
    """Every stage of the model, the same on every rank (one seed, built in stage order)."""
    torch.manual_seed(0)
    num_stages = pp_size * case.stages_per_rank
    stages = []
    for s in range(num_stages):
        pre = nn.Linear(IN_FEATURES, WIDTH) if case.glue and s == 0 else None
        post = nn.Linear(WIDTH, OUT_FEATURES) if case.glue and s == num_stages - 1 else None
        layers = [Block(WIDTH) for _ in range(case.layers)]
        if s == 0 and case.first_stage == "batchnorm":
            layers = [NormedBlock(WIDTH) for _ in range(case.layers)]
        if s == 0 and case.first_stage == "frozen":
            layers[0].requires_grad_(False)
        stages.append(StageModules(
            [layer.to(device) for layer in layers],
            None if pre is None else pre.to(device),
            None if post is None else post.to(device)))
    return stages


class NormedBlock(nn.Module):
    """A Block behind a batch norm, whose running statistics each training forward updates.

    Only the first stage has them: torch's metadata inference on the first ``step()`` runs
    every later stage's module on uninitialized tensors (``torch.empty``), eager or graphed.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width)
        self.block = Block(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.norm(x))


def modules_of(spec: StageModules) -> list[nn.Module]:
    return [m for m in (spec.pre, *spec.layers, spec.post) if m is not None]


def batch(case: Case, step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    rows = ROWS * case.microbatches
    x = torch.randn(rows, IN_FEATURES if case.glue else WIDTH, generator=gen)
    y = torch.randn(rows, OUT_FEATURES if case.glue else WIDTH, generator=gen)
    return x.to(device), y.to(device)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def graph(case: Case, specs: list[StageModules], indices: list[int], device: str,
          pp_size: int) -> GraphedPipeline:
    samples = [torch.randn(ROWS, IN_FEATURES if i == 0 and case.glue else WIDTH, device=device)
               for i in indices]
    return graph_pipeline_stages(specs, case.schedule_class, samples,
                                 num_microbatches=case.microbatches, pp_size=pp_size)


def eager_schedule(case: Case, specs: list[StageModules], indices: list[int], pp_size: int,
                   device: str) -> Any:
    stages = [pipelining.PipelineStage(nn.Sequential(*modules_of(spec)), index,
                                       pp_size * case.stages_per_rank, torch.device(device))
              for spec, index in zip(specs, indices)]
    stage_arg = stages if case.stages_per_rank > 1 else stages[0]
    return case.schedule_class(stage_arg, case.microbatches, loss_fn=mse)


def train(case: Case, schedule: Any, specs: list[StageModules], device: str) -> list[dict]:
    """``STEPS`` optimizer steps through ``schedule``: what each step produced, then eval."""
    params = [p for spec in specs for m in modules_of(spec) for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    history = []
    for step in range(STEPS):
        x, y = batch(case, step, device)
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        output = schedule.step(x, target=y, losses=losses)
        history.append({
            "output": None if output is None else [output.detach().clone()],
            "losses": [loss.detach().clone() for loss in losses],
            "grads": [None if p.grad is None else p.grad.clone() for p in params],
            "buffers": [b.clone() for spec in specs for m in modules_of(spec)
                        for b in m.buffers()],
        })
        optimizer.step()
        history[-1]["params"] = [p.detach().clone() for p in params]
    return history


def evaluate(case: Case, schedule: Any, device: str) -> list[torch.Tensor] | None:
    """``schedule.eval()`` under no_grad (eager fallback for graphed stages)."""
    x, y = batch(case, STEPS, device)
    with torch.no_grad():
        output = schedule.eval(x, target=y)
    return None if output is None else [output.detach().clone()]


def eval_runs_in_torch(case: Case, pp_size: int) -> bool:
    """Whether torch's runtime runs ``eval()`` for this placement (eager or graphed alike).

    torch 2.13 cannot eval two adjacent stages on one rank (it passes their gradients locally
    in eval as well: "can't steal_bwd_input if this stage doesn't have backward"), so eval is
    compared where no rank holds adjacent stages, and then on every rank (it communicates).
    """
    return all(b - a > 1
               for rank in range(pp_size)
               for a, b in zip(stage_indices(case, pp_size, rank),
                               stage_indices(case, pp_size, rank)[1:]))


def compare(eager: list[dict], graphed: list[dict]) -> tuple[dict[str, int], list[str]]:
    """Count the tensors compared bitwise, by kind; and describe each difference."""
    counts = {"output": 0, "losses": 0, "grads": 0, "params": 0, "buffers": 0}
    mismatches = []
    for step, (e, g) in enumerate(zip(eager, graphed)):
        for kind in counts:
            if (e.get(kind) is None) != (g.get(kind) is None):
                mismatches.append(f"step {step}: {kind} present in only one run")
                continue
            pairs = list(zip(e.get(kind) or [], g.get(kind) or []))
            if len(e.get(kind) or []) != len(g.get(kind) or []):
                mismatches.append(f"step {step}: {kind} counts differ")
            for index, (a, b) in enumerate(pairs):
                if a is None or b is None:  # a parameter without a gradient
                    if (a is None) != (b is None):
                        mismatches.append(f"step {step}: {kind}[{index}] is None in one run")
                    continue
                counts[kind] += 1
                if not torch.equal(a, b):
                    diff = (a.double() - b.double()).abs().max().item()
                    mismatches.append(f"step {step}: {kind}[{index}] differs by {diff:.3g}")
    return counts, mismatches


def run_case(case: Case, pp_size: int, rank: int, device: str = "cpu") -> dict[str, Any]:
    """Train eager and graphed copies of the rank's stages; what was compared and differed."""
    indices = stage_indices(case, pp_size, rank)
    model = build_model(case, pp_size, device)
    specs = [model[i] for i in indices]
    eager_specs = copy.deepcopy(specs)
    graphed = graph(case, specs, indices, device, pp_size)
    eager = eager_schedule(case, eager_specs, indices, pp_size, device)
    schedule = graphed.schedule(mse)
    counts, mismatches = compare(train(case, eager, eager_specs, device),
                                 train(case, schedule, specs, device))
    counts["eval"] = 0
    if eval_runs_in_torch(case, pp_size):
        eval_counts, eval_mismatches = compare(
            [{"output": evaluate(case, eager, device)}],
            [{"output": evaluate(case, schedule, device)}])
        counts["eval"] = eval_counts["output"]
        mismatches += [f"eval: {m}" for m in eval_mismatches]
    placed = list(graphed.stage_indices) == indices
    graphed.reset()
    return {"counts": counts, "mismatches": mismatches, "placed": placed,
            "last_stage": pp_size * case.stages_per_rank - 1 in indices,
            "first_stage": 0 in indices}


def check_case(case: Case, results: list[dict[str, Any]]) -> None:
    """Every rank matched eager bitwise, and everything that must be compared was."""
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], f"rank {rank}: {result['mismatches']}"
        assert result["placed"], f"rank {rank}: stages placed elsewhere than torch places them"
        assert result["counts"]["grads"] > 0 and result["counts"]["params"] > 0, result
        if case.first_stage == "batchnorm" and result["first_stage"]:
            assert result["counts"]["buffers"] >= STEPS * 3 * case.layers, result
    last = [r for r in results if r["last_stage"]]
    assert len(last) == 1, results
    assert last[0]["counts"]["output"] == STEPS, last[0]
    assert last[0]["counts"]["losses"] == STEPS * case.microbatches, last[0]


# --------------------------------------------------------------------------------------------
# Two ranks over gloo: one pair of processes for every case
# --------------------------------------------------------------------------------------------


def _all_cases(rank: int, device: str) -> dict[str, Any]:
    """Every case on ``rank`` of two: on the CPU, also the refused placement and the example;
    on CUDA (``rank``'s GPU, NCCL between them), the training cases and their fused variants."""
    results: dict[str, Any] = {}
    if device == "cuda":
        for case in TWO_GPU_CASES:
            if hasattr(pipelining, case.schedule):
                results[case.id] = run_case(case, pp_size=2, rank=rank, device=f"cuda:{rank}")
        return results
    for case in CASES:
        if hasattr(pipelining, case.schedule):
            results[case.id] = run_case(case, pp_size=2, rank=rank)
    results["placement_error"] = _placement_error(rank)
    results["example"] = _example(rank)
    return results


def _placement_error(rank: int) -> str:
    """Graph ScheduleZBVZeroBubble's stages where a looped schedule would put them: its
    schedule() must refuse (torch places V stages itself); no step runs, nothing is sent."""
    case = Case("ScheduleZBVZeroBubble", 2, 1, glue=False)
    wrong = [rank, rank + 2]
    model = build_model(case, 2, "cpu")
    samples = [torch.randn(ROWS, WIDTH) for _ in wrong]
    graphed = graph_pipeline_stages([model[i] for i in wrong], case.schedule_class, samples,
                                    num_microbatches=case.microbatches, stage_indices=wrong)
    try:
        graphed.schedule(mse)
    except ValueError as exc:
        return str(exc)
    finally:
        graphed.reset()
    return "no error"


def _example(rank: int) -> bool:
    """examples/pipelining_torch.py's training and checks on this rank (its launcher aside)."""
    spec = importlib.util.spec_from_file_location("pipelining_torch_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return bool(example.run(example.parse_args([]), rank, 2, torch.device("cpu")))


@pytest.fixture(scope="module")
def two_ranks_cpu(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' reports (the workers run once for the whole module)."""
    return two_ranks(__file__, tmp_path_factory.mktemp("pipelining"), timeout=TIMEOUT_S)


@pytest.mark.parametrize("case", [_present(case) for case in CASES])
def test_two_ranks_train_bitwise_like_eager(case: Case, two_ranks_cpu: list[dict[str, Any]]) -> None:
    check_case(case, [report[case.id] for report in two_ranks_cpu])


def test_two_ranks_schedule_refuses_stages_placed_elsewhere(two_ranks_cpu) -> None:
    if not hasattr(pipelining, "ScheduleZBVZeroBubble"):
        pytest.skip("this torch has no ScheduleZBVZeroBubble")
    assert "ScheduleZBVZeroBubble places stage 2 on rank 1, but rank 0 captured it" in (
        two_ranks_cpu[0]["placement_error"])
    assert "places stage 3 on rank 0, but rank 1 captured it" in (
        two_ranks_cpu[1]["placement_error"])


def test_two_ranks_run_the_example_bitwise_like_eager(two_ranks_cpu) -> None:
    assert [report["example"] for report in two_ranks_cpu] == [True, True]


# Two GPUs over NCCL (issue 17): torch's own step() with an interleaved and a zero-bubble
# schedule, unfused and fused in both hook modes.
TWO_GPU_CASES = [Case(schedule, 2, layers, glue=glue, fused_hooks=hooks)
                 for schedule, layers, glue in (("ScheduleInterleaved1F1B", 2, True),
                                                ("ScheduleInterleavedZeroBubble", 1, False),
                                                ("ScheduleZBVZeroBubble", 1, True))
                 for hooks in (None, True, "python")]


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return two_ranks(__file__, tmp_path_factory.mktemp("pipelining-nccl"), timeout=TIMEOUT_S,
                     device="cuda")


@pytest.mark.multigpu
@pytest.mark.parametrize("case", [_present(case) for case in TWO_GPU_CASES])
def test_two_gpus_train_bitwise_like_eager(case: Case, two_gpus: list[dict[str, Any]]) -> None:
    check_case(case, [report[case.id] for report in two_gpus])


# --------------------------------------------------------------------------------------------
# One rank in this process: errors, eval, teardown; the bitwise check on CPU and CUDA
# --------------------------------------------------------------------------------------------


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A process group of one (torch's runtime runs every stage on this rank, and still sends
    between them): gloo for CPU tensors, and NCCL for CUDA ones where there is a GPU."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# Fused too: torch's runtime runs the backwards, and in-graph accumulation must train as eager.
ONE_RANK_CASES = [Case("ScheduleInterleaved1F1B", 2, 2, glue=True),
                  Case("ScheduleZBVZeroBubble", 2, 1, glue=False),
                  Case("ScheduleGPipe", 1, 2, glue=False, first_stage="batchnorm"),
                  Case("ScheduleInterleaved1F1B", 2, 2, glue=False, first_stage="frozen"),
                  *(Case(schedule, 2, layers, glue=False, fused_hooks=hooks)
                    for schedule, layers in (("ScheduleInterleaved1F1B", 2),
                                             ("ScheduleZBVZeroBubble", 1))
                    for hooks in (True, "python"))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("case", [_present(case) for case in ONE_RANK_CASES])
def test_one_rank_trains_bitwise_like_eager(case: Case, device: str, one_rank: None) -> None:
    check_case(case, [run_case(case, pp_size=1, rank=0, device=device)])


def autograd_reference(case: Case, pp_size: int) -> list[list[torch.Tensor | None]]:
    """The whole model trained by plain autograd, microbatch by microbatch (each loss divided
    by the microbatch count, as torch's schedules scale the gradients): every parameter's
    gradient at each step."""
    modules = [m for spec in build_model(case, pp_size, "cpu") for m in modules_of(spec)]
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    history = []
    for step in range(STEPS):
        x, y = batch(case, step, "cpu")
        optimizer.zero_grad(set_to_none=True)
        for rows, target in zip(x.split(ROWS), y.split(ROWS)):
            for module in modules:
                rows = module(rows)
            (mse(rows, target) / case.microbatches).backward()
        history.append([None if p.grad is None else p.grad.clone() for p in params])
        optimizer.step()
    return history


@pytest.mark.parametrize("schedule", ["ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"])
def test_zero_bubble_trains_a_stage_on_inputs_without_gradients_like_autograd(
        schedule: str, one_rank: None) -> None:
    # The first stage's only layer is frozen, so neither its graphs' outputs nor the second
    # stage's inputs need a gradient: the first stage's graphs get no backward and no weight
    # step (its weight step replayed backward_dw() and raised), and the second stage still
    # trains. torch's eager stages do not compare here: their weight step finds its
    # parameters through the stage inputs' autograd graph and, with none, leaves them without
    # gradients; plain autograd is the reference.
    if not hasattr(pipelining, schedule):
        pytest.skip(f"this torch has no {schedule}")
    case = Case(schedule, 2, 1, glue=False, first_stage="frozen")
    specs = build_model(case, 1, "cpu")
    graphed = graph(case, specs, [0, 1], "cpu", 1)
    history = train(case, graphed.schedule(mse), specs, "cpu")
    graphed.reset()
    for step, (got, want) in enumerate(zip(history, autograd_reference(case, 1))):
        assert [g is None for g in got["grads"]] == [w is None for w in want], step
        assert sum(g is not None for g in want) == 6, step  # the second stage's Block
        assert all(g is None or torch.equal(g, w) for g, w in zip(got["grads"], want)), step


def _interleaved(microbatches: int = 2) -> tuple[GraphedPipeline, list[StageModules]]:
    case = Case("ScheduleInterleaved1F1B", 2, 1, glue=False, microbatches=microbatches)
    specs = build_model(case, 1, "cpu")
    eager = copy.deepcopy(specs)
    return graph(case, specs, [0, 1], "cpu", 1), eager


def test_result_holds_the_stages_and_the_capture(one_rank: None) -> None:
    graphed, _ = _interleaved()
    assert all(isinstance(s, pipelining.PipelineStage) for s in graphed.stages)
    assert [s.stage_index for s in graphed.stages] == [0, 1] == list(graphed.stage_indices)
    assert leangraph.GraphedSet.of(graphed.graphed) is graphed.graphed_set
    assert graphed.graphed[0].graphed_set is graphed.graphed_set
    assert len(graphed.graphed) == graphed.layout.num_graphs == 4
    assert [str(step) for step in graphed.order[:3]] == ["F c1 m0", "F c2 m0", "B c2 m0"]
    graphed.reset()
    assert all(g.is_reset for g in graphed.graphed)


def test_a_schedule_the_order_does_not_have_is_refused_naming_the_step(one_rank: None) -> None:
    graphed, _ = _interleaved()
    looped = pipelining.ScheduleLoopedBFS(list(graphed.stages), 2, loss_fn=mse)
    with pytest.raises(leangraph.LeangraphError, match=(
            r"ran the forward of chunk 1 \(stage 0\), microbatch 1 on rank 0, but at step 1 the "
            r"order leangraph captured from ScheduleInterleaved1F1B expects the forward of chunk "
            r"2 \(stage 1\), microbatch 0")):
        looped.step(torch.randn(2 * ROWS, WIDTH), target=torch.randn(2 * ROWS, WIDTH))
    # The next step starts the order over: the captured schedule still trains.
    losses: list[torch.Tensor] = []
    graphed.schedule(mse).step(torch.randn(2 * ROWS, WIDTH), target=torch.randn(2 * ROWS, WIDTH),
                               losses=losses)
    assert len(losses) == 2 and all(torch.isfinite(loss) for loss in losses)
    graphed.reset()


def test_schedule_refuses_another_microbatch_count_naming_the_captured_one(
    one_rank: None,
) -> None:
    """torch's own TypeError ("got multiple values for argument 'n_microbatches'") said
    nothing of the count being fixed at capture."""
    graphed, _ = _interleaved(microbatches=2)
    with pytest.raises(ValueError, match=r"schedule: n_microbatches is fixed at capture \(2"):
        graphed.schedule(mse, n_microbatches=3)
    graphed.schedule(mse)  # as captured
    graphed.reset()


def test_more_microbatches_than_captured_are_refused(one_rank: None) -> None:
    graphed, _ = _interleaved(microbatches=2)
    more = pipelining.ScheduleInterleaved1F1B(list(graphed.stages), 4, loss_fn=mse)
    with pytest.raises(leangraph.LeangraphError, match=(
            r"ran the forward of chunk 1 \(stage 0\), microbatch 2 on rank 0, but at step \d+ "
            r"the order .* expects the backward of chunk 1 \(stage 0\), microbatch 1")):
        more.step(torch.randn(4 * ROWS, WIDTH), target=torch.randn(4 * ROWS, WIDTH))
    graphed.reset()


def _gpipe() -> tuple[GraphedPipeline, Any, Case]:
    case = Case("ScheduleGPipe", 1, 2, glue=True)
    specs = build_model(case, 1, "cpu")
    eager_specs = copy.deepcopy(specs)
    graphed = graph(case, specs, [0], "cpu", 1)
    return graphed, eager_schedule(case, eager_specs, [0], 1, "cpu"), case


def test_eval_and_no_grad_run_eagerly_even_after_reset(one_rank: None) -> None:
    graphed, eager, case = _gpipe()
    schedule = graphed.schedule(mse)
    x, y = batch(case, 0, "cpu")
    schedule.step(x, target=y)  # the first step's metadata inference runs eagerly
    eager.step(x, target=y)
    graphed.reset()
    # eval (has_backward off, receive buffers without requires_grad) never replays a graph:
    # after reset it still runs, eagerly, and equals eager.
    for context in (torch.no_grad, torch.enable_grad):
        with context():
            assert torch.equal(schedule.eval(x, target=y), eager.eval(x, target=y))
    with pytest.raises(RuntimeError, match="failed to run forward") as info:
        schedule.step(x, target=y)
    assert isinstance(info.value.__cause__, leangraph.GraphResetError)


@pytest.mark.parametrize("which", ["every module", "one module inside a layer"])
def test_layers_in_another_training_mode_run_eagerly(which: str, one_rank: None) -> None:
    graphed, _, case = _gpipe()
    schedule = graphed.schedule(mse)
    graphed.reset()  # any replay would now raise GraphResetError
    stage = graphed.stages[0].submod
    inner = list(stage.layers[0].modules())[-1]  # a Linear inside the first layer
    for module in stage.modules() if which == "every module" else [inner]:
        module.eval()
    x, y = batch(case, 0, "cpu")
    losses: list[torch.Tensor] = []
    schedule.step(x, target=y, losses=losses)
    assert len(losses) == case.microbatches


def test_zero_bubble_needs_one_layer_per_stage(one_rank: None) -> None:
    case = Case("ScheduleZBVZeroBubble", 2, 2, glue=False)
    with pytest.raises(ValueError, match="needs exactly one layer per chunk"):
        graph(case, build_model(case, 1, "cpu"), [0, 1], "cpu", 1)


def _args(**changes: Any) -> dict[str, Any]:
    case = Case("ScheduleGPipe", 1, 1, glue=False)
    arguments: dict[str, Any] = {
        "stages": [[Block(WIDTH)]], "schedule_class": pipelining.ScheduleGPipe,
        "sample_args": [torch.randn(ROWS, WIDTH)], "num_microbatches": case.microbatches}
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize(("changes", "error", "message"), [
    ({"stages": []}, ValueError, "stages is empty"),
    ({"stages": Block(WIDTH)}, TypeError, "one entry per local stage"),
    ({"stages": [Block(WIDTH)]}, TypeError, r"stages\[0\] must be StageModules"),
    ({"sample_args": []}, ValueError, "sample_args has 0 entries but there are 1 stages"),
    ({"pp_size": 2}, ValueError, "pp_size=2 but the pipeline's process group has pp_size 1"),
    ({"rank": 1}, ValueError, "rank=1 but the pipeline's process group has rank 0"),
    ({"stage_indices": [1]}, ValueError, r"out of range for 1 stages"),
    ({"capture_options": {"order": [1, -1]}}, ValueError, "capture_options may not set order"),
    ({"stages": [[Block(WIDTH)], [Block(WIDTH)]], "sample_args": [torch.randn(ROWS, WIDTH)] * 2},
     ValueError, "ScheduleGPipe runs one stage per rank; got stages_per_rank=2"),
])
def test_argument_errors(changes: dict[str, Any], error: type, message: str,
                         one_rank: None) -> None:
    with pytest.raises(error, match=message):
        graph_pipeline_stages(**_args(**changes))


def test_v33_graph_pipeline_stages_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=(
            r"graph_pipeline_stages needs torch.distributed's default process group .*got none: "
            r"call torch.distributed.init_process_group\(\) on every rank first")):
        graph_pipeline_stages(**_args())


@pytest.mark.parametrize(("changes", "error", "message"), [
    ({"schedule_class": "ScheduleGPipe"}, TypeError,
     r"graph_pipeline_stages: schedule_class must be a torch.distributed.pipelining schedule "
     r"class \(a subclass of PipelineScheduleSingle or PipelineScheduleMulti, e.g. "
     r"ScheduleInterleaved1F1B\), got str 'ScheduleGPipe'"),
    ({"schedule_class": nn.Linear}, TypeError, "schedule class .*, got class Linear"),
    ({"stage_indices": 0}, TypeError,
     "graph_pipeline_stages: stage_indices must be a sequence of ints, one global stage index "
     "per entry of stages, got int 0"),
    ({"stage_indices": "0"}, TypeError, "stage_indices must be a sequence of ints, .*got str '0'"),
    ({"stage_indices": [0.0]}, TypeError, r"stage_indices must be .*got list \[0.0\]"),
    ({"device": "meta"}, ValueError,
     r"graph_pipeline_stages: device=meta but sample_args\[0\] input 0 is on cpu; the stages "
     "receive activations on device and the graphs take them on the samples' device"),
])
def test_v33_graph_pipeline_stages_refuses_arguments_of_another_kind(
        changes: dict[str, Any], error: type, message: str, one_rank: None) -> None:
    with pytest.raises(error, match=message):
        graph_pipeline_stages(**_args(**changes))


@pytest.mark.parametrize("schedule_class", ["ScheduleGPipe", int])
def test_v33_stage_placement_refuses_what_is_not_a_schedule_class(schedule_class: Any) -> None:
    with pytest.raises(TypeError, match=(
            "stage_placement: schedule_class must be a torch.distributed.pipelining schedule "
            f"class .*, got {'str' if isinstance(schedule_class, str) else 'class'} ")):
        stage_placement(schedule_class, 2, 0)


@pytest.mark.parametrize("layers", [Block(WIDTH), nn.Sequential(Block(WIDTH)), "ab"])
def test_v33_stage_modules_layers_must_be_a_sequence_of_layers(layers: Any) -> None:
    with pytest.raises(TypeError, match=(
            r"StageModules layers must be a sequence of layers \(a list, tuple or "
            rf"nn.ModuleList\), got {type(layers).__name__}; pass \[module\] to graph a module "
            "as one layer")):
        StageModules(layers)
    assert len(StageModules(nn.ModuleList([Block(WIDTH)])).layers) == 1


@pytest.mark.parametrize(("options", "error", "message"), [
    ([("num_warmup_iters", 2)], TypeError,
     r"capture_options must be a mapping of leangraph.make_graphed_callables options "
     r"\(e.g. \{'num_warmup_iters': 2\}\) or None, got list"),
    ({"num_warmup_iter": 2}, TypeError,
     "capture_options: leangraph.make_graphed_callables has no option 'num_warmup_iter'; did "
     "you mean 'num_warmup_iters'?"),
    ({"fuse_grad_accumulation": 1}, TypeError, "fuse_grad_accumulation must be a bool, got int 1"),
])
def test_v34_capture_options_are_checked_before_anything_runs(
        options: Any, error: type, message: str, one_rank: None) -> None:
    sampled: list[int] = []
    layer = Block(WIDTH)
    layer.register_forward_hook(lambda *_: sampled.append(1))
    with pytest.raises(error, match=message):
        graph_pipeline_stages(**_args(stages=[[layer]], capture_options=options))
    assert sampled == []  # refused before the sampling pass ran the layer


@pytest.mark.parametrize("case", [_present(case) for case in CASES])
@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_stage_placement_follows_the_schedule(case: Case, pp_size: int) -> None:
    for rank in range(pp_size):
        placed = stage_placement(case.schedule_class, pp_size, rank, case.stages_per_rank)
        assert placed == tuple(stage_indices(case, pp_size, rank))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: stage_placement(pipelining.ScheduleGPipe, 2, 2), "rank 2 out of range for pp_size 2"),
    (lambda: stage_placement(pipelining.ScheduleGPipe, 0, 0), "pp_size must be an integer >= 1"),
    (lambda: stage_placement(pipelining.ScheduleGPipe, 2, 0, 0), "stages_per_rank must be"),
])
def test_stage_placement_errors(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(("build", "message"), [
    (lambda: StageModules([]), "at least one layer"),
    (lambda: StageModules([torch.relu]), "layer 0 must be an nn.Module"),
    (lambda: StageModules([Block(WIDTH)], pre=torch.relu), "pre must be an nn.Module or None"),
])
def test_stage_modules_errors(build, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        build()


if __name__ == "__main__":
    rank_worker(_all_cases, "one rank of the two-rank pipelining tests")
