"""Tests of leangraph.integrations.megatron: leangraph behind Megatron-core's CUDA-graph path.

A tiny GPT (Megatron's local layer spec, bf16, Megatron's DDP with ``main_grad``) is built by
``examples/megatron_gpt.py`` and trained through Megatron's own schedule
(``get_forward_backward_func``) eagerly and with the graphs Megatron's ``TECudaGraphHelper``
captures through the adapter; losses, ``main_grad`` and parameters must be bitwise equal over
three optimizer steps. Megatron's parallel state is process-global, so every training run
happens in worker processes (this file run as a script): one for PP=1, two over gloo for
PP=2 (with and without VP=2), one on a GPU for the ``cuda`` test, and two on two GPUs over
NCCL (PP=2, VP=2) for the ``multigpu`` one. CPU runs use
``leangraph.integrations.megatron_cpu.cpu_shim()``. The adapter's own checks run in this
process on small modules (the CPU reference backend).

Skipped where megatron-core is not installed (``pip install -e ".[megatron]"``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra 'megatron')")

from helpers import free_port, rank_reports

import leangraph
from leangraph.integrations import megatron as lgm
from leangraph.schedules import interleaved_1f1b, one_f_one_b

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "megatron_gpt.py"
TIMEOUT_S = 400


def _example() -> Any:
    """examples/megatron_gpt.py as a module (loaded once per process)."""
    name = "megatron_gpt_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclass looks itself up there
        spec.loader.exec_module(module)
    return sys.modules[name]


# --------------------------------------------------------------------------------------------
# Worker side: training runs inside a process group
# --------------------------------------------------------------------------------------------

# name -> (world size, Setup keyword arguments). A "-fused" case captures with
# install(capture_options={"fuse_grad_accumulation": True}) and is compared with the eager run
# of the case without it (run once per process); "-python" also with accumulator_hooks="python"
# (the replays call Megatron DDP's hooks themselves).
CASES = {
    "pp1": (1, {"pp": 1, "microbatches": 2}),
    "pp1-fused": (1, {"pp": 1, "microbatches": 2, "fuse_grad_accumulation": True}),
    "pp1-overlap-grad-reduce": (1, {"pp": 1, "microbatches": 2, "overlap_grad_reduce": True}),
    "pp1-overlap-grad-reduce-fused": (
        1, {"pp": 1, "microbatches": 2, "overlap_grad_reduce": True,
            "fuse_grad_accumulation": True}),
    "pp1-overlap-grad-reduce-fused-python": (
        1, {"pp": 1, "microbatches": 2, "overlap_grad_reduce": True,
            "fuse_grad_accumulation": True, "accumulator_hooks": "python"}),
    # Graphs of part of each layer (config.cuda_graph_scope), the rest eager around them: no
    # graph takes the previous one's output, so the adapter captures without shared buffers.
    "pp1-attn-scope": (1, {"pp": 1, "microbatches": 2, "cuda_graph_scope": "attn"}),
    "pp1-mlp-scope": (1, {"pp": 1, "microbatches": 2, "cuda_graph_scope": "mlp"}),
    "pp2": (2, {"pp": 2, "microbatches": 4}),
    "pp2-vp2": (2, {"pp": 2, "vp": 2, "microbatches": 4}),
    "pp2-vp2-attn-scope": (2, {"pp": 2, "vp": 2, "microbatches": 4, "cuda_graph_scope": "attn"}),
    "pp2-vp2-fused": (2, {"pp": 2, "vp": 2, "microbatches": 4, "fuse_grad_accumulation": True}),
    "pp2-vp2-fused-python": (2, {"pp": 2, "vp": 2, "microbatches": 4,
                                 "fuse_grad_accumulation": True, "accumulator_hooks": "python"}),
    # Megatron's pipeline options. deallocate_pipeline_outputs: the schedule swaps each sent
    # stage output's .data for a one-element tensor, here a view of a graph's static output.
    "pp2-deallocate": (2, {"pp": 2, "microbatches": 4, "deallocate_pipeline_outputs": True}),
    "pp2-vp2-deallocate": (2, {"pp": 2, "vp": 2, "microbatches": 4,
                               "deallocate_pipeline_outputs": True}),
    # Groups of 3 microbatches per chunk, the last of 2: another order than PP's groups of 2
    # (which Megatron's schedule refuses for 5 microbatches: a last group of 1).
    "pp2-vp2-group3": (2, {"pp": 2, "vp": 2, "microbatches": 5, "microbatch_group_size": 3}),
    "pp2-vp2-overlap-p2p": (2, {"pp": 2, "vp": 2, "microbatches": 4, "overlap_p2p_comm": True}),
}
CUDA_CASES = ("pp1", "pp1-fused", "pp1-overlap-grad-reduce-fused-python")
# One GPU a rank, NCCL; with deallocate_pipeline_outputs the freed outputs are graph memory.
TWO_GPU_CASES = ("pp2-vp2", "pp2-vp2-fused", "pp2-vp2-fused-python", "pp2-vp2-deallocate")


class DdpProbe:
    """What Megatron's DDP did in one run: its backward post-hooks and bucket reductions.

    Active around building the model (DDP makes its hooks then) and training. Each hook call
    outside capture records the parameter, Megatron's ``grad_added_to_main_grad`` flag and
    whether ``.grad`` was set as the hook saw them; each ``start_grad_sync`` of a bucket
    group records whether ``register_grad_ready`` dispatched it (the overlapped reduction,
    during the backward) or ``finish_grad_sync`` did (after it).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, bool]] = []
        self.syncs: list[str] = []

    def __enter__(self) -> DdpProbe:
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
        from megatron.core.transformer.cuda_graphs import is_graph_capturing

        make_hook = DDP._make_backward_post_hook
        start, ready = _ParamAndGradBucketGroup.start_grad_sync, \
            _ParamAndGradBucketGroup.register_grad_ready
        probe, in_ready = self, [False]

        def probed_make_hook(ddp: Any, param: torch.nn.Parameter) -> Any:
            hook = make_hook(ddp, param)

            def probed(*args: Any) -> Any:
                if not is_graph_capturing():
                    probe.calls.append((id(param), bool(param.grad_added_to_main_grad),
                                        param.grad is not None))
                return hook(*args)

            return probed

        def probed_ready(group: Any, *args: Any, **kwargs: Any) -> Any:
            in_ready[0] = True
            try:
                return ready(group, *args, **kwargs)
            finally:
                in_ready[0] = False

        def probed_start(group: Any, *args: Any, **kwargs: Any) -> Any:
            probe.syncs.append("during backward" if in_ready[0] else "after backward")
            return start(group, *args, **kwargs)

        self._saved = [(DDP, "_make_backward_post_hook", make_hook),
                       (_ParamAndGradBucketGroup, "start_grad_sync", start),
                       (_ParamAndGradBucketGroup, "register_grad_ready", ready)]
        DDP._make_backward_post_hook = probed_make_hook
        _ParamAndGradBucketGroup.start_grad_sync = probed_start
        _ParamAndGradBucketGroup.register_grad_ready = probed_ready
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, value in self._saved:
            setattr(owner, name, value)

    def hook_log(self, chunks: list[Any]) -> list[tuple[int, bool, bool]]:
        """The hook calls with each parameter as its index in the chunks' parameters."""
        index = {id(p): i for i, p in enumerate(p for c in chunks for p in c.parameters())}
        return [(index[key], flag, has_grad) for key, flag, has_grad in self.calls]


class DeallocateProbe:
    """The stage outputs Megatron's schedule freed (``deallocate_output_tensor`` under
    ``config.deallocate_pipeline_outputs``; one-element tensors, the losses, left out): how
    many, and how many of them were outputs of a graph's replay (their storage graph-owned)."""

    def __init__(self) -> None:
        self.freed = self.graph_owned = 0
        self._replayed: set[int] = set()  # the storages of the replays' outputs

    def __enter__(self) -> DeallocateProbe:
        from megatron.core.pipeline_parallel import schedules

        probe = self
        deallocate, replay = schedules.deallocate_output_tensor, lgm.MegatronGraphedLayer.__call__

        def probed(out: Any, deallocate_pipeline_outputs: bool = False) -> None:
            if deallocate_pipeline_outputs and out is not None and out.numel() > 1:
                probe.freed += 1
                probe.graph_owned += out.untyped_storage().data_ptr() in probe._replayed
            deallocate(out, deallocate_pipeline_outputs)

        def replayed(layer: Any, *args: Any, **kwargs: Any) -> Any:
            outputs = replay(layer, *args, **kwargs)
            probe._replayed.update(o.untyped_storage().data_ptr() for o in outputs
                                   if isinstance(o, torch.Tensor))
            return outputs

        self._saved = [(schedules, "deallocate_output_tensor", deallocate),
                       (lgm.MegatronGraphedLayer, "__call__", replay)]
        schedules.deallocate_output_tensor = probed
        lgm.MegatronGraphedLayer.__call__ = replayed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, value in self._saved:
            setattr(owner, name, value)


class OrderSpy:
    """The ``_order`` Megatron's helper passed to the adapter (the adapter's own function,
    which ``install()``'s patch calls, wrapped)."""

    def __init__(self) -> None:
        self.orders: list[list[float]] = []

    def __enter__(self) -> OrderSpy:
        self._original = original = lgm.make_graphed_callables

        def spied(*args: Any, **kwargs: Any) -> Any:
            self.orders.append(list(kwargs.get("_order") or []))
            return original(*args, **kwargs)

        lgm.make_graphed_callables = spied
        return self

    def __exit__(self, *exc: object) -> None:
        lgm.make_graphed_callables = self._original


class CudaPeak:
    """On CUDA, the allocator's peak above what was allocated on entry (MiB); None on the CPU."""

    def __init__(self, device: str) -> None:
        self._cuda = device == "cuda"
        self.mib: float | None = None

    def __enter__(self) -> CudaPeak:
        if self._cuda:
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cuda:
            torch.cuda.synchronize()
            self.mib = (torch.cuda.max_memory_allocated() - self._base) / 2**20


def _eager_run(example: Any, setup: Any) -> tuple[list[dict], list[Any], list[str], float | None,
                                                 int]:
    """Train eagerly: the history (one step more than the graphed run's: the step it takes
    eagerly once its graphs are gone), Megatron's hook calls and bucket reductions in the
    graphed run's steps, on CUDA the steps' peak above the built model (MiB), and the stage
    outputs the schedule freed in those steps."""
    with DdpProbe() as probe:
        config, chunks = example.build_model(setup, graphed=False)
        with CudaPeak(setup.device) as peak, DeallocateProbe() as freed:
            history = example.train_steps(setup, config, chunks)
        calls, syncs = len(probe.calls), len(probe.syncs)
        history += example.train_steps(replace(setup, steps=1), config, chunks)
    return history, probe.hook_log(chunks)[:calls], probe.syncs[:syncs], peak.mib, freed.freed


def _graphed_run(example: Any, setup: Any) -> tuple[list[dict], dict[str, Any], Any]:
    """Train with Megatron's helper capturing through the adapter; what it captured, and what
    Megatron's DDP did."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    with DdpProbe() as probe:
        config, chunks = example.build_model(setup, graphed=True)
        with lgm.install(capture_options=setup.capture_options):
            helper = TECudaGraphHelper(chunks, config, example.SEQ, example.BATCH)
            with CudaPeak(setup.device) as capture_peak, OrderSpy() as spy:
                helper.create_cudagraphs()
            layers = [layer for chunk in helper.callables_per_chunk for layer in chunk]
            graphs = [graph for layer in layers for graph in layer.cuda_graphs]
            with DeallocateProbe() as freed:
                history = example.train_steps(setup, config, chunks)
            helper.delete_cuda_graphs()
            calls, syncs = len(probe.calls), len(probe.syncs)
        # Eagerly on (Megatron's layers run eagerly without graphs): Megatron's hooks must
        # add the gradients again, none left skipped by a flag the graphs set.
        history += example.train_steps(replace(setup, steps=1), config, chunks)
    params = [p for chunk in chunks for p in chunk.parameters()]
    graphed = {id(p) for layer in layers for p in layer.parameters()}
    in_layer = [id(p) in graphed for p in params]
    facts = {
        "layers": len(layers),
        "graphs": len(graphs),
        "kinds": sorted({type(graph).__name__ for graph in graphs}),
        "all_reset": all(graph.graphed.is_reset for graph in graphs),
        "uninstalled": not lgm.installed(),
        "layer_params": sum(in_layer),
        # Megatron's protocol after training: the flag per layer / other parameter (clear:
        # set by a replay only until its backward pass ends); .grad left set anywhere (each
        # hook clears it).
        "flags_after": {
            kind: sorted({bool(p.grad_added_to_main_grad)
                          for p, inside in zip(params, in_layer) if inside == want})
            for kind, want in (("layer", True), ("other", False))
        },
        "grads_left": sum(p.grad is not None for p in params),
        "capture_peak_mib": capture_peak.mib,  # warm-up + capture, above the built model
        "orders": spy.orders,  # one capture: the helper's order for this rank
        # Stage outputs the schedule freed, and of them outputs of a graph's replay.
        "freed": [freed.freed, freed.graph_owned],
    }
    return history, facts, (probe.hook_log(chunks)[:calls], probe.syncs[:syncs], in_layer)


def _compare(eager: list[dict], graphed: list[dict]) -> tuple[dict[str, int], list[str]]:
    counts = {"losses": 0, "grads": 0, "params": 0}
    mismatches = []
    for step, (e, g) in enumerate(zip(eager, graphed)):
        for kind in counts:
            if len(e[kind]) != len(g[kind]):
                mismatches.append(f"step {step}: {kind} counts differ")
            for index, (a, b) in enumerate(zip(e[kind], g[kind])):
                counts[kind] += 1
                if not torch.equal(a, b):
                    diff = (a.double() - b.double()).abs().max().item()
                    mismatches.append(f"step {step}: {kind}[{index}] differs by {diff:.3g}")
    return counts, mismatches


def _hook_facts(eager: list[Any], graphed: list[Any], in_layer: list[bool]) -> dict[str, Any]:
    """How Megatron's hook calls in the graphed run compare with eager's."""
    order, eager_order = [call[0] for call in graphed], [call[0] for call in eager]

    def among(calls: list[int], inside: bool) -> list[int]:
        return [i for i in calls if in_layer[i] == inside]

    # Whether the hook added .grad into main_grad itself (else the graph had, and said so).
    added: dict[str, set[bool]] = {"layer": set(), "other": set()}
    for index, flag, has_grad in graphed:
        added["layer" if in_layer[index] else "other"].add(has_grad and not flag)
    return {
        "hook_calls": [len(eager), len(graphed)],
        "same_hook_calls": sorted(order) == sorted(eager_order),
        # The order among the graphed layers' parameters, and among the others, as eager's.
        "same_order": [among(order, inside) == among(eager_order, inside)
                       for inside in (True, False)],
        "hooks_per_param": sorted({order.count(i) for i in range(len(in_layer))}),
        "hook_saw_grad": sorted({has_grad for _, _, has_grad in graphed}),
        "hook_added": {kind: sorted(values) for kind, values in added.items()},
    }


_EAGER: dict[Any, tuple[list[dict], list[Any], list[str], float | None, int]] = {}


def _reset_error(example: Any, setup: Any) -> str:
    """Reset one graph, then train: the replay must raise GraphResetError."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    config, chunks = example.build_model(setup, graphed=True)
    with lgm.install():
        helper = TECudaGraphHelper(chunks, config, example.SEQ, example.BATCH)
        helper.create_cudagraphs()
        helper.callables_per_chunk[0][0].cuda_graphs[0].reset()
        try:
            example.train_steps(setup, config, chunks)
        except leangraph.GraphResetError as exc:
            return f"GraphResetError: {exc}"
        finally:
            helper.delete_cuda_graphs()
    return "no error"


def _megatron_refusals(example: Any, setup: Any) -> dict[str, Any]:
    """Misuse through Megatron's own helper and schedule (PP=1): what each raised, whether
    warm-up ran, and Megatron's capture flag after it; and a failed capture's eager fallback
    (its history, to compare with eager training). Each scenario reports what it raised
    unexpectedly under ``"<scenario>-error"``, and leaves Megatron's state clean for the
    next."""
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    out: dict[str, Any] = {}
    warmed: list[bool] = []
    spy = {"pre_warmup_hook": lambda: warmed.append(True)}

    def capture(chunks: list[Any], config: Any, key: str) -> Any:
        warmed.clear()
        helper = TECudaGraphHelper(chunks, config, example.SEQ, example.BATCH)
        try:
            helper.create_cudagraphs()
            out[key] = "accepted"
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
        out[f"{key}-warmed"] = bool(warmed)
        out[f"{key}-capturing-after"] = cuda_graphs.is_graph_capturing()
        return helper

    def second_helper() -> None:  # while the first one's graphs live (V4)
        config, chunks = example.build_model(setup, graphed=True)
        with lgm.install(capture_options=spy):
            first = capture(chunks, config, "second-helper-first")
            example.train_steps(replace(setup, steps=1), config, chunks)
            capture(chunks, config, "second-helper")
            trained = example.train_steps(replace(setup, steps=1), config, chunks)
            out["second-helper-then-trains"] = len(trained)  # the first's graphs
            first.delete_cuda_graphs()

    def hooks_false() -> None:  # Megatron DDP's hooks are on the accumulators (V24)
        hooked = replace(setup, overlap_grad_reduce=True)
        config, chunks = example.build_model(hooked, graphed=True)
        with lgm.install(capture_options={**spy, "fuse_grad_accumulation": True,
                                          "accumulator_hooks": False}):
            capture(chunks, config, "hooks-false")

    def forward_only() -> None:  # in training mode with grad on (L4), then under no_grad
        config, chunks = example.build_model(setup, graphed=True)
        with lgm.install():
            helper = capture(chunks, config, "forward-only-capture")
            schedule = example.get_forward_backward_func()

            def run() -> Any:
                return schedule(forward_step_func=example.forward_step,
                                data_iterator=iter(example.microbatches(setup, 100)),
                                model=chunks[0], num_microbatches=setup.microbatches,
                                seq_length=example.SEQ, micro_batch_size=example.BATCH,
                                forward_only=True)

            try:
                run()
                out["forward-only"] = "accepted"
            except RuntimeError as exc:
                out["forward-only"] = f"{type(exc).__name__}: {exc}"
            with torch.no_grad():
                out["forward-only-no-grad"] = len(run())
            helper.delete_cuda_graphs()

    def variable_lengths() -> None:  # a graph replays one sequence length (V37)
        lengths = replace(setup, variable_seq_lengths=True)
        config, chunks = example.build_model(lengths, graphed=True)
        with lgm.install(capture_options=spy):
            capture(chunks, config, "variable-seq-lengths")

    def failed() -> None:  # a capture failing inside the helper, then eager training
        def boom() -> None:
            raise KeyError("boom")

        config, chunks = example.build_model(setup, graphed=True)
        with lgm.install(capture_options={"pre_warmup_hook": boom}):
            capture(chunks, config, "failed")
        out["failed-then-eager"] = example.train_steps(setup, config, chunks)

    for name, scenario in (("second-helper", second_helper), ("hooks-false", hooks_false),
                           ("forward-only", forward_only),
                           ("variable-seq-lengths", variable_lengths), ("failed", failed)):
        try:
            scenario()
        except Exception:
            out[f"{name}-error"] = traceback.format_exc()
        finally:
            if cuda_graphs.is_graph_capturing():  # left on by a failure the test reports
                cuda_graphs._set_capture_end()
    return out


def _freeze_error(example: Any, setup: Any) -> str:
    """Freeze a linear layer's weight after capture, then train: Megatron's
    ``ColumnParallelLinear`` reads ``weight.requires_grad`` in its forward (and would take
    ``linear_with_frozen_weight``, leaving the bias without a gradient), so the replay must
    refuse rather than train along the captured path."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    config, chunks = example.build_model(setup, graphed=True)
    with lgm.install():
        helper = TECudaGraphHelper(chunks, config, example.SEQ, example.BATCH)
        helper.create_cudagraphs()
        layer = helper.callables_per_chunk[0][0]
        layer.self_attention.linear_qkv.weight.requires_grad_(False)
        try:
            example.train_steps(setup, config, chunks)
        except RuntimeError as exc:
            return f"RuntimeError: {exc}"
        finally:
            helper.delete_cuda_graphs()
    return "no error"


def run_case(name: str, device: str) -> dict[str, Any]:
    example = _example()
    setup = example.Setup(**CASES[name][1], device=device)
    # Eager depends on none of these options.
    unfused = replace(setup, fuse_grad_accumulation=False, accumulator_hooks=True,
                      cuda_graph_scope=None)
    if unfused not in _EAGER:
        _EAGER[unfused] = _eager_run(example, unfused)
    eager, eager_hooks, eager_syncs, eager_peak, eager_freed = _EAGER[unfused]
    graphed, facts, (hooks, syncs, in_layer) = _graphed_run(example, setup)
    counts, mismatches = _compare(eager, graphed)
    return {"counts": counts, "mismatches": mismatches, **facts, "eager_step_peak_mib": eager_peak,
            "eager_freed": eager_freed,
            **_hook_facts(eager_hooks, hooks, in_layer), "syncs": [eager_syncs, syncs],
            "setup": asdict(setup)}


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from leangraph.integrations.megatron_cpu import cpu_shim

    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(args.rank)  # one GPU a rank
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
    )
    example = _example()
    results: dict[str, Any] = {}
    out = Path(args.out) / f"rank{args.rank}.json"
    try:
        shim = cpu_shim() if args.device == "cpu" else _no_shim()
        with shim:
            for name, (world, kwargs) in CASES.items():
                on_gpu = CUDA_CASES + TWO_GPU_CASES
                if world != args.world or (args.device == "cuda" and name not in on_gpu):
                    continue
                example.initialize(example.Setup(**kwargs, device=args.device), args.rank, args.world)
                results[name] = run_case(name, args.device)
                if name == "pp1" and args.device == "cpu":
                    results["reset"] = _reset_error(example, example.Setup(**kwargs))
                    refusals = _megatron_refusals(example, example.Setup(**kwargs))
                    eager = _EAGER[example.Setup(**kwargs)][0][:3]
                    fallback = refusals.pop("failed-then-eager", "not run")
                    counts, mismatches = ((None, fallback) if isinstance(fallback, str)
                                          else _compare(eager, fallback))
                    results["refusals"] = {**refusals, "failed-then-eager": mismatches,
                                           "failed-then-eager-counts": counts}
                    results["freeze"] = _freeze_error(example, example.Setup(**kwargs))
                if name in ("pp1", "pp2-vp2") and args.device == "cpu":
                    results[f"example-{name}"] = bool(example.run(example.Setup(**kwargs)))
                example.finalize()
    except BaseException:
        results["error"] = traceback.format_exc()
        out.write_text(json.dumps(results))
        os._exit(1)  # a peer may wait on this rank forever
    out.write_text(json.dumps(results))
    dist.destroy_process_group()


def _no_shim() -> Any:
    import contextlib

    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# Test side
# --------------------------------------------------------------------------------------------


def _launch(world: int, device: str, out: Path) -> list[dict[str, Any]]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    commands = [[sys.executable, __file__, "--rank", str(rank), "--world", str(world), "--port",
                 str(port), "--out", str(out), "--device", device] for rank in range(world)]
    return rank_reports(commands, out, env=env, cwd=ROOT, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(1, "cpu", tmp_path_factory.mktemp("megatron1"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(2, "cpu", tmp_path_factory.mktemp("megatron2"))


def check_case(name: str, reports: list[dict[str, Any]]) -> None:
    """Every rank trained bitwise like eager, through graphs the adapter made, with
    Megatron's DDP hooks and bucket reductions running as in eager."""
    world, kwargs = CASES[name]
    fused = kwargs.get("fuse_grad_accumulation", False)
    microbatches_captured = kwargs["microbatches"] if kwargs["pp"] > 1 else 1
    losses = freed = 0
    for rank, report in enumerate(reports):
        result = report[name]
        assert result["mismatches"] == [], f"rank {rank}: {result['mismatches']}"
        assert result["orders"] == [expected_order(kwargs, rank)], result["orders"]
        # Freed in the graphed steps as eagerly, each an output of a graph's replay.
        assert result["freed"] == [result["eager_freed"]] * 2, result
        freed += result["eager_freed"]
        assert result["counts"]["params"] > 0 and result["counts"]["grads"] > 0, result
        assert result["kinds"] == ["MegatronGraphedLayer"], result
        assert result["graphs"] == result["layers"] * microbatches_captured > 0, result
        assert result["all_reset"] and result["uninstalled"], result
        losses += result["counts"]["losses"]
        check_hooks(result, kwargs, fused)
    # Only the last stage reports losses: one per microbatch and step (3 graphed, 1 eager).
    assert losses == 4 * kwargs["microbatches"], reports
    # Every stage but the last frees its outputs once sent: one per microbatch, chunk, step.
    vp = kwargs.get("vp") or 1
    sending = kwargs["pp"] * vp - 1 if kwargs.get("deallocate_pipeline_outputs") else 0
    assert freed == 3 * kwargs["microbatches"] * sending, reports


def expected_order(kwargs: dict[str, Any], rank: int) -> list[int]:
    """The order Megatron's helper passes for one rank: leangraph's own schedule for the
    same settings (one microbatch without pipelining: the helper captures one), which
    Megatron's schedule must then replay (leangraph checks every replay against it)."""
    pp, vp = kwargs["pp"], kwargs.get("vp") or 1
    if pp == 1:
        return one_f_one_b(1, 0, 1)
    return interleaved_1f1b(pp, vp, rank, kwargs["microbatches"],
                            kwargs.get("microbatch_group_size"))


def check_hooks(result: dict[str, Any], kwargs: dict[str, Any], fused: bool) -> None:
    """Megatron's backward post-hook ran once per parameter per microbatch, with a ``.grad``
    (its ``overlap_grad_reduce`` assertion). Fused, it ran in eager's order among the
    layers' parameters and among the others (the relay runs a graph's accumulators after
    the eager part of the backward, so not interleaved as in eager), skipped the add for the
    layers' parameters (``grad_added_to_main_grad``: the graph added into ``main_grad``) and
    did it for the rest. The buckets reduced as in eager, during the backward with
    ``overlap_grad_reduce`` (else ``finish_grad_sync`` would assert)."""
    calls = result["hook_calls"]
    assert calls[0] == calls[1] > 0 and result["same_hook_calls"], result
    if fused:  # the relay (or the replay) runs each graph's hooks in eager's order
        assert result["same_order"] == [True, True], result
    assert result["hooks_per_param"] == [3 * kwargs["microbatches"]], result
    assert result["hook_saw_grad"] == [True], result
    assert result["layer_params"] > 0, result
    other = [True] if result["flags_after"]["other"] else []  # a stage may have only layers
    assert result["hook_added"] == {"layer": [not fused], "other": other}, result
    assert result["flags_after"] == {"layer": [False], "other": [False] if other else []}, result
    assert result["grads_left"] == 0, result
    eager_syncs, syncs = result["syncs"]
    assert syncs == eager_syncs and syncs, result
    if kwargs.get("overlap_grad_reduce"):  # after the first step, dispatched by the hooks
        assert "during backward" in syncs, result


@pytest.mark.parametrize("name", [n for n, (world, _) in CASES.items() if world == 1])
def test_pp1_trains_bitwise_like_eager(name: str, one_rank: list[dict[str, Any]]) -> None:
    check_case(name, one_rank)


@pytest.mark.parametrize("name", [n for n, (world, _) in CASES.items() if world == 2])
def test_two_ranks_train_bitwise_like_eager(name: str, two_ranks: list[dict[str, Any]]) -> None:
    check_case(name, two_ranks)


def test_a_reset_graph_refuses_to_replay(one_rank: list[dict[str, Any]]) -> None:
    assert one_rank[0]["reset"].startswith("GraphResetError"), one_rank[0]["reset"]


def test_v4_a_second_helper_capturing_layers_with_live_graphs_is_refused(
    one_rank: list[dict[str, Any]],
) -> None:
    """The layers would replay the first helper's graphs inside the new capture."""
    report = one_rank[0]["refusals"]
    assert report["second-helper-first"] == "accepted", report
    assert report["second-helper"] == (
        "ValueError: leangraph's Megatron adapter: layer 0 (TransformerLayer 1) already has "
        "leangraph graphs that are not reset (1 of the 1 in layer.cuda_graphs); its __call__ "
        "replays them, so this capture would record their replays instead of the layer. Call "
        "the first TECudaGraphHelper's delete_cuda_graphs() (it resets them and empties "
        "layer.cuda_graphs) before capturing again"
    ), report
    assert report["second-helper-warmed"] is False, report
    assert report["second-helper-capturing-after"] is False, report
    assert report["second-helper-then-trains"] == 1, report


def test_v24_accumulator_hooks_false_under_megatron_ddp_is_refused_before_warm_up(
    one_rank: list[dict[str, Any]],
) -> None:
    report = one_rank[0]["refusals"]
    assert report["hooks-false"].startswith(
        "ValueError: graph (chunk 1, microbatch 0, layer 0) parameter "
        "'layer.input_layernorm.weight' is managed by Megatron-core's DistributedDataParallel "
        "(it has grad_added_to_main_grad), whose gradient-ready hooks are registered on the "
        "parameters' accumulators; accumulator_hooks=False would never run them"
    ), report
    assert report["hooks-false"].endswith(
        "Capture with accumulator_hooks=True or 'python'"), report
    assert report["hooks-false-warmed"] is False, report
    assert report["hooks-false-capturing-after"] is False, report


def test_l4_a_forward_only_schedule_in_training_mode_says_to_use_no_grad(
    one_rank: list[dict[str, Any]],
) -> None:
    report = one_rank[0]["refusals"]
    assert report["forward-only-capture"] == "accepted", report
    assert report["forward-only"].startswith(
        "RuntimeError: graph (chunk 1, microbatch 0, layer 0): forward replayed while the "
        "outputs of its previous replay"), report
    assert report["forward-only"].endswith(
        "drop those outputs and everything computed from them. Megatron's schedule runs with "
        "forward_only=True here, in training mode with grad enabled, so the layers replay "
        "their training graphs and no backward comes: use torch.no_grad() or model.eval() "
        "for forward-only passes"), report
    assert report["forward-only-no-grad"] == 2, report  # one loss per microbatch


def test_v37_variable_seq_lengths_is_refused_before_warm_up(
    one_rank: list[dict[str, Any]],
) -> None:
    """Megatron's helper samples one sequence length; with lengths that vary, the replay of
    another length would be refused mid-step, where the other pipeline ranks wait."""
    report = one_rank[0]["refusals"]
    assert report["variable-seq-lengths"] == (
        "ValueError: leangraph's Megatron adapter: layer 0 (TransformerLayer 1) is captured "
        "with config.variable_seq_lengths=True, but its graphs replay the sampled sequence "
        "length only (8 tokens, dim 0 of hidden_states); a microbatch of another length "
        "would be refused only at its replay, mid-step (in a pipeline, while the other ranks "
        "wait on it). Pad every microbatch to seq_length and set variable_seq_lengths=False "
        "(with fixed lengths it only sends the shapes), or leave these layers eager"), report
    assert report["variable-seq-lengths-warmed"] is False, report
    assert report["variable-seq-lengths-capturing-after"] is False, report


def test_a_failed_capture_puts_megatrons_capture_flag_back(
    one_rank: list[dict[str, Any]],
) -> None:
    """Eager training after it (the layers have no graphs) is eager's, bitwise: with the
    flag left on, the layers would run their capture path and DDP's hooks return early."""
    report = one_rank[0]["refusals"]
    assert report["failed"].startswith("KeyError: 'boom'"), report
    assert report["failed-capturing-after"] is False, report
    assert report["failed-then-eager"] == [], report
    assert report["failed-then-eager-counts"]["grads"] > 0, report


def test_freezing_a_weight_megatron_reads_the_flag_of_is_refused(
    one_rank: list[dict[str, Any]],
) -> None:
    error = one_rank[0]["freeze"]
    assert error.startswith("RuntimeError: graph (chunk 1, microbatch 0, layer 0) parameter "
                            "'layer.self_attention.linear_qkv.weight' must require grad as at "
                            "capture"), error
    assert "reads the parameter's requires_grad" in error, error


def test_the_example_trains_bitwise_like_eager(one_rank, two_ranks) -> None:
    assert one_rank[0]["example-pp1"] is True
    assert [report["example-pp2-vp2"] for report in two_ranks] == [True, True]


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]] | str:
    """The GPU rank's reports, or why it failed (raised in the test, not the fixture)."""
    try:
        return _launch(1, "cuda", tmp_path_factory.mktemp("megatron-cuda"))
    except pytest.fail.Exception as failure:
        return str(failure)


@pytest.mark.cuda
@pytest.mark.parametrize("name", CUDA_CASES)
def test_pp1_on_one_gpu_trains_bitwise_like_eager(name: str, one_gpu: list[dict] | str) -> None:
    """DDP is built on a side stream, as Megatron-LM does (examples/megatron_gpt.py,
    ``ddp_stream``), before the helper captures; Megatron's CUDA RNG tracker is graph-safe
    and the adapter registers its states with every graph (its attention forks the tracker
    inside the capture)."""
    if isinstance(one_gpu, str):
        pytest.fail(one_gpu)
    check_case(name, one_gpu)


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(2, "cuda", tmp_path_factory.mktemp("megatron-nccl"))


@pytest.mark.multigpu
@pytest.mark.parametrize("name", TWO_GPU_CASES)
def test_pp2_vp2_on_two_gpus_trains_bitwise_like_eager(
    name: str, two_gpus: list[dict[str, Any]], record_property: Any
) -> None:
    """Pipeline size 2, virtual pipeline 2, one GPU a rank over NCCL (issue 17). Each rank's
    warm-up + capture peak and its own eager steps' peak, above the built model, are in the
    test's properties (``--junitxml``) and in its output."""
    check_case(name, two_gpus)
    for rank, report in enumerate(two_gpus):
        capture, eager = report[name]["capture_peak_mib"], report[name]["eager_step_peak_mib"]
        assert capture is not None and eager is not None and eager > 0, report[name]
        record_property(f"rank{rank}_capture_peak_mib", capture)
        record_property(f"rank{rank}_eager_step_peak_mib", eager)
        print(f"{name} rank {rank}: warm-up + capture peak {capture:.1f} MiB, eager step "
              f"peak {eager:.1f} MiB (above the built model)")


# --------------------------------------------------------------------------------------------
# In this process: install, versions, the adapter's checks (small modules, CPU backend)
# --------------------------------------------------------------------------------------------


def test_install_patches_and_uninstall_restores() -> None:
    from megatron.core.transformer import cuda_graphs, transformer_layer

    before = (cuda_graphs.HAVE_TE_GRAPHS, cuda_graphs.is_te_min_version,
              transformer_layer.TransformerLayer._get_te_cuda_graph_replay_args,
              hasattr(cuda_graphs, "make_graphed_callables"))
    patches = lgm.install()
    try:
        assert lgm.installed()
        assert patches.names == tuple(patch.name for patch in lgm.PATCHES)
        assert cuda_graphs.HAVE_TE_GRAPHS is True
        assert cuda_graphs.is_te_min_version is lgm.te_min_version
        with pytest.raises(RuntimeError, match="already installed"):
            lgm.install()
    finally:
        patches.uninstall()
    patches.uninstall()  # idempotent
    assert not lgm.installed()
    assert before == (cuda_graphs.HAVE_TE_GRAPHS, cuda_graphs.is_te_min_version,
                      transformer_layer.TransformerLayer._get_te_cuda_graph_replay_args,
                      hasattr(cuda_graphs, "make_graphed_callables"))


def test_install_refuses_an_unsupported_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.15.2")
    with pytest.raises(RuntimeError, match=r"supports megatron-core 0\.16\.x, got 0\.15\.2"):
        lgm.install()
    assert not lgm.installed()


def test_install_refuses_options_it_sets() -> None:
    with pytest.raises(ValueError, match="capture_options may not set order"):
        lgm.install(capture_options={"order": [1, -1]})


@pytest.mark.parametrize(("name", "value", "source"), [
    ("share_buffers", False, "_reuse_graph_input_output_buffers, which the helper passes as True"),
    ("num_warmup_iters", 1, "the helper's num_warmup_iters, computed from Megatron's "
                            "config.cuda_graph_warmup_steps"),
    ("allow_unused_input", False, "the helper's allow_unused_input, True"),
    ("retain_graph_in_backward", True, "Megatron's config.cuda_graph_retain_backward_graph"),
    ("sample_kwargs", {}, "Megatron's static inputs, the layers' get_layer_static_inputs"),
])
def test_v29_install_refuses_options_the_adapter_sets_naming_where_it_takes_them(
    name: str, value: Any, source: str,
) -> None:
    message = (f"capture_options may not set {name}: leangraph's Megatron adapter sets these "
               f"itself ({name} from {source})")
    with pytest.raises(ValueError) as info:
        lgm.install(capture_options={name: value})
    assert str(info.value) == message
    assert not lgm.installed()
    with pytest.raises(ValueError) as info:  # the adapter itself, called directly
        _capture(Layer(), capture_options={name: value})
    assert str(info.value) == message


def test_v29_install_refuses_an_unknown_option_naming_the_closest() -> None:
    with pytest.raises(TypeError) as info:
        lgm.install(capture_options={"fuse_grad_accumulaton": True})
    assert str(info.value) == (
        "capture_options: leangraph.make_graphed_callables has no option "
        "'fuse_grad_accumulaton'; did you mean 'fuse_grad_accumulation'?")
    with pytest.raises(TypeError, match=r"has no option 'zzz'; expected one of accumulator_hooks, "
                                        r"backend, capture_time_hooks, check_memory"):
        lgm.install(capture_options={"zzz": 1})
    with pytest.raises(TypeError, match="has no option 'debug_output'; did you mean "
                                        "'debug_outputs'"):
        _capture(Layer(), capture_options={"debug_output": True})
    assert not lgm.installed()


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"fuse_grad_accumulation": 1}, TypeError, "fuse_grad_accumulation must be a bool, got int 1"),
    ({"check_memory": "False"}, TypeError, "check_memory must be a bool, got str 'False'"),
    ({"accumulator_hooks": "Python"}, ValueError,
     "accumulator_hooks must be True, False or 'python', got 'Python'"),
    ({"accumulator_hooks": "python"}, ValueError,
     "accumulator_hooks='python' needs fuse_grad_accumulation=True"),
    ({"overlap_grad_accumulation": True, "fuse_grad_accumulation": True}, ValueError,
     "overlap_grad_accumulation=True moves autograd's additions"),
    ({"backend": "tpu"}, ValueError, "backend must be 'cuda', 'cpu' or None, got 'tpu'"),
    ({"generator_states": [1]}, ValueError,
     "generator_states[0] must be a CUDA torch.Generator"),
    ({"generator_states": torch.Generator()}, TypeError,
     "generator_states must be a list or tuple of CUDA generators, got Generator"),
    ({"progress": 3}, TypeError, "progress must be callable or None, got int 3"),
    ({"pre_warmup_hook": 3}, TypeError, "pre_warmup_hook must be callable or None, got int 3"),
])
def test_v26_install_checks_option_values_at_once(
    options: dict[str, Any], error: type[Exception], message: str,
) -> None:
    """leangraph's own checks of the values (V16, V23-V26), run at install()."""
    with pytest.raises(error) as info:
        lgm.install(capture_options=options)
    assert str(info.value).startswith(message), info.value
    assert not lgm.installed()


def test_warm_up_hooks_and_pool_may_come_from_capture_options() -> None:
    """The helper passes none of them; given both ways they are refused."""
    calls: list[str] = []
    graphed = _capture(Layer(), capture_options={"pre_warmup_hook": lambda: calls.append("pre"),
                                                 "post_warmup_hook": lambda: calls.append("post")})
    assert calls == ["pre", "post"]
    graphed.reset()
    with pytest.raises(ValueError, match="pre_warmup_hook is given both as the adapter's "
                                         "argument and in capture_options; expected one"):
        _capture(Layer(), pre_warmup_hook=lambda: None,
                 capture_options={"pre_warmup_hook": lambda: None})


def test_te_min_version_answers_for_the_adapters_features() -> None:
    for version in ("1.10.0", "2.6.0", "2.7.0", "2.7.0.dev0", "2.10.0"):
        assert lgm.te_min_version(version), version
    assert not lgm.te_min_version("2.11.0")
    assert not lgm.te_min_version("2.10.0", check_equality=False)


class Layer(nn.Module):
    """A layer with Megatron's call shape: hidden states and keyword arguments."""

    def __init__(self, params_dtype: torch.dtype = torch.float32, fp8: str | None = None,
                 variable_seq_lengths: bool = False):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.config = type("Config", (), {"params_dtype": params_dtype, "fp8": fp8,
                                          "variable_seq_lengths": variable_seq_lengths})()

    def forward(self, hidden_states, attention_mask=None, context=None):
        out = self.linear(hidden_states)
        return (out.masked_fill(attention_mask, 0.0) if attention_mask is not None else out,)


def _capture(layer: nn.Module, **options: Any) -> Any:
    hidden = torch.randn(2, 4, requires_grad=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    return lgm.make_graphed_callables((layer,), ((hidden,),), sample_kwargs=[{"attention_mask":
                                      mask}], _order=[1, -1], **options)[0]


def test_graphed_layer_replays_with_megatrons_call_convention() -> None:
    layer = Layer()
    graphed = _capture(layer, allow_unused_input=True)
    x = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[True, False, False, False]] * 2)
    (out,) = graphed(x, attention_mask=mask, context=None, rotary_pos_emb=None,
                     is_first_microbatch=True)
    (expected,) = layer(x, attention_mask=mask)
    assert torch.equal(out, expected)
    out.sum().backward()
    assert x.grad is not None and layer.linear.weight.grad is not None
    assert graphed.graphed_set is graphed.graphed.graphed_set
    graphed.reset()
    with pytest.raises(leangraph.GraphResetError):
        graphed(x, attention_mask=mask)


def test_r2_hidden_states_as_a_keyword_is_refused_naming_megatrons_convention() -> None:
    graphed = _capture(Layer(), allow_unused_input=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    with pytest.raises(TypeError) as info:
        graphed(hidden_states=torch.randn(2, 4, requires_grad=True), attention_mask=mask)
    assert str(info.value) == (
        "graph (chunk 1, microbatch 0, layer 0): hidden_states must be passed positionally, "
        "as Megatron's layer passes it to its graphs (layer.cuda_graphs[m](hidden_states, "
        "attention_mask=..., ...)), got it as a keyword argument")
    graphed.reset()


def test_v4_a_layer_that_still_holds_graphs_is_refused_before_warm_up() -> None:
    """As Megatron's layers hold them in ``layer.cuda_graphs``, which their ``__call__``
    replays whenever it is not empty."""
    layer = Layer()
    layer.cuda_graphs = [_capture(layer, allow_unused_input=True)]
    warmed: list[bool] = []
    with pytest.raises(ValueError) as info:
        _capture(layer, allow_unused_input=True, pre_warmup_hook=lambda: warmed.append(True))
    assert str(info.value).startswith(
        "leangraph's Megatron adapter: layer 0 (Layer) already has leangraph graphs that are "
        "not reset (1 of the 1 in layer.cuda_graphs); its __call__ replays them")
    assert warmed == []
    layer.cuda_graphs[0].reset()
    with pytest.raises(ValueError, match=r"layer 0 \(Layer\) still holds 1 graphs in "
                                         r"layer.cuda_graphs \(reset, or not leangraph's\)"):
        _capture(layer, allow_unused_input=True)
    layer.cuda_graphs = []
    _capture(layer, allow_unused_input=True).reset()


def test_l4_outside_a_forward_only_schedule_gets_no_megatron_hint() -> None:
    graphed = _capture(Layer(), allow_unused_input=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    kept = graphed(torch.randn(2, 4, requires_grad=True), attention_mask=mask)
    with pytest.raises(RuntimeError, match="still await their backward") as info:
        graphed(torch.randn(2, 4, requires_grad=True), attention_mask=mask)
    assert "forward_only" not in str(info.value)
    del kept
    graphed.reset()


def test_graphed_layer_refuses_a_tensor_it_did_not_capture() -> None:
    graphed = _capture(Layer(), allow_unused_input=True)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="keyword argument 'context' was not captured"):
        graphed(x, attention_mask=torch.zeros(2, 4, dtype=torch.bool), context=x)
    graphed.reset()


def test_fp8_is_refused_before_warm_up() -> None:
    with pytest.raises(ValueError, match=r"config\.fp8='hybrid'; fp8/fp4 scaling state"):
        _capture(Layer(fp8="hybrid"))
    with pytest.raises(ValueError, match="fp8_enabled=True"):
        _capture(Layer(), fp8_enabled=(True,))


def test_v37_variable_seq_lengths_is_refused_by_the_adapter_itself() -> None:
    warmed: list[bool] = []
    with pytest.raises(ValueError) as info:
        _capture(Layer(variable_seq_lengths=True), pre_warmup_hook=lambda: warmed.append(True))
    assert str(info.value).startswith(
        "leangraph's Megatron adapter: layer 0 (Layer) is captured with "
        "config.variable_seq_lengths=True, but its graphs replay the sampled sequence length "
        "only (2 tokens, dim 0 of hidden_states); a microbatch of another length"), info.value
    assert warmed == []
    _capture(Layer(variable_seq_lengths=False), allow_unused_input=True).reset()


def test_hidden_states_of_another_dtype_than_the_layer_are_refused() -> None:
    with pytest.raises(ValueError, match=r"dtype torch\.float32 but the layer trains in "
                                         r"torch\.bfloat16"):
        _capture(Layer(params_dtype=torch.bfloat16))


def test_v19_a_list_or_no_callables_is_refused_as_the_core_api_refuses_it() -> None:
    """TE's convention (Megatron's helper passes a tuple) wraps anything but a tuple as one
    callable; a list is named as a list, as leangraph.make_graphed_callables names it, not
    as ``callables[0]``, and an empty tuple as empty, before any warm-up."""
    hidden = torch.randn(2, 4, requires_grad=True)
    warmed: list[bool] = []
    hook = {"pre_warmup_hook": lambda: warmed.append(True)}
    for callables in ([], [Layer()]):
        with pytest.raises(TypeError) as info:
            lgm.make_graphed_callables(callables, ((hidden,),), **hook)
        assert str(info.value).startswith(
            "callables must be a callable or a tuple of callables, got a list; pass "
            "tuple(callables)"), info.value
        with pytest.raises(TypeError, match="got a list; pass tuple"):  # the core's words
            leangraph.make_graphed_callables(callables, ((hidden,),))
    with pytest.raises(ValueError) as info:
        lgm.make_graphed_callables((), (), **hook)
    assert str(info.value) == "callables is empty; pass at least one callable to graph"
    assert warmed == []
    single = lgm.make_graphed_callables(Layer(), (hidden,), allow_unused_input=True)
    assert isinstance(single, lgm.MegatronGraphedLayer)  # one callable: one graph, unwrapped
    single.reset()


def test_backward_dw_runs_the_weight_step_of_a_split_order() -> None:
    layer = Layer()
    hidden = torch.randn(2, 4, requires_grad=True)
    graphed = lgm.make_graphed_callables((layer,), ((hidden,),), _order=[1, -1, -1.5])[0]
    x = torch.randn(2, 4, requires_grad=True)
    graphed(x)[0].sum().backward()
    assert x.grad is not None and layer.linear.weight.grad is None
    graphed.backward_dw()
    assert layer.linear.weight.grad is not None
    graphed.reset()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    _worker(parser.parse_args())
