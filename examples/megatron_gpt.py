"""A tiny Megatron-core GPT trained with leangraph's graphs behind Megatron's CUDA-graph path.

Megatron builds the graphs itself (``config.cuda_graph_impl = "transformer_engine"``,
``TECudaGraphHelper``); ``leangraph.integrations.megatron.install()`` makes leangraph the
implementation it calls. The model trains through Megatron's own schedule
(``get_forward_backward_func``), DDP (``main_grad``, its gradient hooks) and bf16, and the
same model trained eagerly must match it bitwise: losses, gradients and parameters.

    python examples/megatron_gpt.py                                       # PP=1, CPU
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --pp 2 --vp 2   # PP=2/VP=2, gloo
    python examples/megatron_gpt.py --device cuda                         # PP=1, one GPU
    python examples/megatron_gpt.py --fuse        # gradients added into main_grad in-graph

On the CPU, ``leangraph.integrations.megatron_cpu.cpu_shim()`` patches the few places where
Megatron assumes a GPU, and leangraph's CPU reference backend stands in for CUDA graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    init_num_microbatches_calculator,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.cuda_graphs import TECudaGraphHelper
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from leangraph.integrations.megatron import install
from leangraph.integrations.megatron_cpu import cpu_shim

SEQ, BATCH, VOCAB, HIDDEN = 8, 2, 64, 16  # BATCH: sequences per microbatch


@dataclass(frozen=True)
class Setup:
    """One training run's sizes: pipeline and virtual-pipeline sizes, microbatches, steps."""

    pp: int = 1
    vp: int | None = None
    microbatches: int = 2
    layers_per_chunk: int = 2
    steps: int = 3
    overlap_grad_reduce: bool = False
    fuse_grad_accumulation: bool = False
    # With fuse_grad_accumulation: how DDP's gradient-ready hooks fire (True: autograd's
    # accumulators; "python": the replays call them, Megatron-core's hooks being Python).
    accumulator_hooks: bool | str = True
    # Megatron's config.cuda_graph_scope: None graphs whole layers; "attn" or "mlp" only that
    # part of each layer, Megatron running the rest eagerly around the graph.
    cuda_graph_scope: str | None = None
    # Megatron's pipeline options: free each stage output's data once sent
    # (config.deallocate_pipeline_outputs); the microbatches run per model chunk before the
    # interleaved schedule switches chunks (config.microbatch_group_size_per_vp_stage, None:
    # Megatron's default, the pipeline size); sends and receives overlapped with compute
    # (config.overlap_p2p_comm, interleaved only); shapes sent before each tensor
    # (config.variable_seq_lengths).
    deallocate_pipeline_outputs: bool = False
    microbatch_group_size: int | None = None
    overlap_p2p_comm: bool = False
    variable_seq_lengths: bool = False
    device: str = "cpu"

    @property
    def chunks(self) -> int:
        return self.vp or 1

    @property
    def capture_options(self) -> dict[str, Any]:
        """What :func:`install` passes on to every capture."""
        if not self.fuse_grad_accumulation:
            return {}
        return {"fuse_grad_accumulation": True, "accumulator_hooks": self.accumulator_hooks}


def initialize(setup: Setup, rank: int, world: int) -> None:
    """Megatron's parallel state and microbatch calculator (the process group exists)."""
    parallel_state.initialize_model_parallel(
        1, setup.pp, virtual_pipeline_model_parallel_size=setup.vp
    )
    init_num_microbatches_calculator(
        rank, None, setup.microbatches * BATCH * (world // setup.pp), BATCH, world // setup.pp
    )
    if setup.device == "cuda":
        # Megatron's attention forks its CUDA generator tracker, which needs its seeds (on
        # the CPU the shim stands in for the tracker); graph-safe, so that its states can be
        # registered with the CUDA graphs (the adapter does) and switched inside a capture.
        tensor_parallel.model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True)


def finalize() -> None:
    destroy_num_microbatches_calculator()
    parallel_state.destroy_model_parallel()


def build_model(setup: Setup, *, graphed: bool) -> tuple[TransformerConfig, list[Any]]:
    """The rank's model chunks (bf16, Megatron's DDP), the same weights on every call."""
    config = TransformerConfig(
        num_layers=setup.layers_per_chunk * setup.chunks * setup.pp,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        ffn_hidden_size=2 * HIDDEN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=setup.pp,
        virtual_pipeline_model_parallel_size=setup.vp,
        cuda_graph_impl="transformer_engine" if graphed else "none",
        cuda_graph_scope=(setup.cuda_graph_scope if graphed else None) or "full",
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=setup.deallocate_pipeline_outputs,
        microbatch_group_size_per_vp_stage=setup.microbatch_group_size,
        overlap_p2p_comm=setup.overlap_p2p_comm,
        variable_seq_lengths=setup.variable_seq_lengths,
        # Megatron's config refuses variable_seq_lengths with its default MoE dispatcher,
        # MoE or not.
        moe_token_dispatcher_type="alltoall" if setup.variable_seq_lengths else "allgather",
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=setup.overlap_grad_reduce
    )
    modules = []
    for chunk in range(setup.chunks):
        torch.manual_seed(1000 + chunk)
        vp_stage = chunk if setup.vp else None
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            VOCAB,
            SEQ,
            pre_process=parallel_state.is_pipeline_first_stage(False, vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(False, vp_stage),
            vp_stage=vp_stage,
        ).to(setup.device)
        modules.append(Float16Module(config, model))
    with ddp_stream(setup.device):
        chunks = [DistributedDataParallel(config, ddp_config, m) for m in modules]
    config.no_sync_func = [c.no_sync for c in chunks] if setup.vp else chunks[0].no_sync
    if setup.overlap_grad_reduce:
        config.grad_sync_func = [c.start_grad_sync for c in chunks]
        if not setup.vp:
            config.grad_sync_func = chunks[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    return config, chunks


@contextlib.contextmanager
def ddp_stream(device: str) -> Iterator[None]:
    """Build Megatron's DDP on a side stream, as Megatron-LM's ``get_model`` does.

    DDP keeps every parameter's gradient accumulator node (``grad_accs``), and torch (2.10
    and later) runs a node on the stream current when it was made, syncing the gradient's
    producer with it. Made on the default (legacy) stream, the capture of a backward would
    have to make that stream wait on the capturing one, which CUDA refuses ("operation would
    make the legacy stream depend on a capturing blocking stream"); made on a side stream,
    that stream joins the capture and is joined back at the end of the backward.
    """
    if device != "cuda":
        yield
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)  # the buffers DDP made are used after


def microbatches(setup: Setup, step: int) -> list[tuple[torch.Tensor, ...]]:
    """Step ``step``'s microbatches: tokens, labels, causal mask, positions."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(VOCAB, (setup.microbatches, BATCH, SEQ + 1), generator=generator)
    mask = ~torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).expand(BATCH, 1, SEQ, SEQ)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return [
        tuple(t.to(setup.device) for t in (tokens[m, :, :-1], tokens[m, :, 1:], mask, positions))
        for m in range(setup.microbatches)
    ]


def forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
    """Megatron's forward step: the model's per-token loss and how to reduce it."""
    tokens, labels, mask, positions = next(data)
    output = model(tokens, positions, mask, labels=labels)

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def train_steps(setup: Setup, config: Any, chunks: list[Any]) -> list[dict[str, list[Any]]]:
    """``setup.steps`` optimizer steps (SGD on ``main_grad``) through Megatron's schedule."""
    schedule = get_forward_backward_func()
    history = []
    for step in range(setup.steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        data = microbatches(setup, step)
        losses = schedule(
            forward_step_func=forward_step,
            data_iterator=[iter(data) for _ in chunks] if setup.vp else iter(data),
            model=chunks if setup.vp else chunks[0],
            num_microbatches=setup.microbatches,
            seq_length=SEQ,
            micro_batch_size=BATCH,
        )
        params = [p for chunk in chunks for p in chunk.parameters()]
        grads = [p.main_grad.clone() for p in params]
        with torch.no_grad():
            for param in params:
                param.add_(param.main_grad.to(param.dtype), alpha=-0.1)
        history.append({
            "losses": [entry["loss"].cpu() for entry in losses],
            "grads": [g.cpu() for g in grads],
            "params": [p.detach().cpu().clone() for p in params],
        })
    return history


def train(setup: Setup, *, graphed: bool) -> list[dict[str, list[Any]]]:
    """Train a fresh model eagerly, or with leangraph's graphs captured by Megatron."""
    config, chunks = build_model(setup, graphed=graphed)
    if not graphed:
        return train_steps(setup, config, chunks)
    with install(capture_options=setup.capture_options):
        helper = TECudaGraphHelper(chunks, config, SEQ, BATCH)
        helper.create_cudagraphs()  # leangraph captures, in Megatron's pipeline order
        try:
            return train_steps(setup, config, chunks)
        finally:
            helper.delete_cuda_graphs()  # calls reset() on every graph


def run(setup: Setup) -> bool:
    """Train eagerly and graphed; print and return whether every tensor matched bitwise."""
    eager, graphed = train(setup, graphed=False), train(setup, graphed=True)
    same = all(
        torch.equal(a, b)
        for e, g in zip(eager, graphed)
        for kind in ("losses", "grads", "params")
        for a, b in zip(e[kind], g[kind])
    )
    losses = [round(float(sum(h["losses"])), 4) for h in graphed if h["losses"]]
    where = f"rank {dist.get_rank()}" + (f", losses per step {losses}" if losses else "")
    print(f"{where}: graphed == eager bitwise (losses, main_grads, parameters): {same}")
    return same


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--pp", type=int, default=1, help="pipeline size (= processes)")
    parser.add_argument("--vp", type=int, default=None, help="virtual pipeline size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--fuse", action="store_true",
                        help="fuse_grad_accumulation: backward graphs add into main_grad")
    parser.add_argument("--python-hooks", action="store_true",
                        help="with --fuse, accumulator_hooks='python': the replays call DDP's "
                        "gradient-ready hooks themselves")
    args = parser.parse_args(argv)
    if args.python_hooks and not args.fuse:
        parser.error("--python-hooks needs --fuse")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup = Setup(pp=args.pp, vp=args.vp, microbatches=2 * args.pp, steps=args.steps,
                  fuse_grad_accumulation=args.fuse,
                  accumulator_hooks="python" if args.python_hooks else True, device=args.device)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if args.device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as store:
        init = "env://" if "MASTER_ADDR" in os.environ else f"file://{store}/pg"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        shim = cpu_shim() if args.device == "cpu" else contextlib.nullcontext()
        try:
            with shim:
                initialize(setup, rank, world)
                ok = run(setup)
                finalize()
        finally:
            dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
