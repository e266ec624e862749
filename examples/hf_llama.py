"""Train a tiny Hugging Face Llama with its decoder layers graphed, and compare with eager.

Run::

    python examples/hf_llama.py                    # CPU: leangraph's reference backend
    python examples/hf_llama.py --device cuda      # CUDA graphs on one GPU
    python examples/hf_llama.py --mode ordered --attention eager

Needs ``transformers`` 5 (``pip install 'leangraph[hf]'``); the model is built from a
``LlamaConfig`` with random weights, nothing is downloaded.

Two ways, each against a deep copy of the model trained eagerly on the same batches:

* ``drop-in``: ``graph_causal_lm(model, {"input_ids": ...})`` graphs the layers in place, and
  the training loop stays the model's own (``model(input_ids, labels=...).loss.backward()``);
* ``ordered``: the layers are split into two chunks and graphed once per microbatch in an
  interleaved 1F1B order (rank 0 of a 2-rank pipeline, the other rank folded away: chunk 2
  takes chunk 1's output in this process); the eager copy runs the model's own forward per
  microbatch (gradient accumulation).

It prints each step's loss both ways and the largest difference of any loss, gradient or
parameter, tears the graphs down with ``leangraph.reset_all``, and exits 1 if the difference
exceeds ``--tolerance`` (default: 0 on the CPU, where the runs are bitwise equal).
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import leangraph
from leangraph import StepKind
from leangraph.integrations.transformers import GraphedDecoderLayers, graph_causal_lm
from leangraph.schedules import interleaved_1f1b

VOCAB, SEQUENCE, ROWS = 128, 16, 2


def build_model(attention: str, layers: int, device: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE,
        use_cache=False,  # training: a graph cannot fill a KV cache
        tie_word_embeddings=False, attn_implementation=attention,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).train()


def token_batches(steps: int, microbatches: int, device: str) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randint(VOCAB, (ROWS, SEQUENCE), generator=generator).to(device)
             for _ in range(microbatches)] for _ in range(steps)]


def model_step(model: LlamaForCausalLM, batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The model's own forward and backward, per microbatch."""
    losses = []
    for tokens in batch:
        loss = model(input_ids=tokens, labels=tokens).loss / len(batch)
        loss.backward()
        losses.append(loss.detach())
    return losses


def pipeline_step(model: LlamaForCausalLM, graphed: GraphedDecoderLayers,
                  batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The captured order, step by step: embedding before chunk 1, norm, head and loss after
    the last chunk (eager); each chunk's input is the previous chunk's output, detached."""
    assert graphed.order is not None
    last = graphed.layout.num_chunks
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    losses: dict[int, torch.Tensor] = {}
    for step in graphed.order:
        c, m = step.chunk, step.microbatch
        if step.kind is StepKind.FORWARD:
            hidden = (model.model.embed_tokens(batch[m]) if c == 1
                      else outputs[(c - 1, m)].detach().requires_grad_(True))
            inputs[(c, m)] = hidden
            outputs[(c, m)] = graphed.run_chunk(c, m, hidden)
            if c == last:
                logits = model.lm_head(model.model.norm(outputs[(c, m)]))
                loss = model.loss_function(logits=logits, labels=batch[m], vocab_size=VOCAB)
                losses[m] = loss / len(batch)
        elif c == last:
            losses[m].backward()
        else:
            outputs[(c, m)].backward(inputs.pop((c + 1, m)).grad)
    return [losses[m].detach() for m in range(len(batch))]


def train(model: LlamaForCausalLM, step: Any, batches: list[list[torch.Tensor]]
          ) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """AdamW steps; the losses of each, and every gradient of the last."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        losses.append(step(model, batch))
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return losses, grads


def largest_difference(*pairs: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]) -> float:
    return max(float((a.detach().float() - b.detach().float()).abs().max())
               for graphed, eager in pairs for a, b in zip(graphed, eager, strict=True))


def run(mode: str, args: argparse.Namespace) -> float:
    """Train graphed and eagerly in one mode; print the losses; the largest difference."""
    model = build_model(args.attention, args.layers, args.device)
    eager = copy.deepcopy(model)  # copied before capture: graphed modules cannot be copied
    microbatches = 1 if mode == "drop-in" else args.microbatches
    batches = token_batches(args.steps, microbatches, args.device)
    sample = {"input_ids": batches[0][0]}
    if mode == "drop-in":
        graphed = graph_causal_lm(model, sample)
        graphed_losses, graphed_grads = train(model, model_step, batches)
    else:
        order = interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=microbatches)
        graphed = graph_causal_lm(model, sample, order=order, num_microbatches=microbatches)
        graphed_losses, graphed_grads = train(
            model, lambda m, batch: pipeline_step(m, graphed, batch), batches)
    eager_losses, eager_grads = train(eager, model_step, batches)
    leangraph.reset_all(graphed.graphed)  # or graphed.reset(): also restores eager forwards

    print(f"{mode} ({args.attention} attention, {args.device}, {len(graphed.graphed)} graphs)")
    print("step   graphed loss     eager loss")
    for step, (g, e) in enumerate(zip(graphed_losses, eager_losses)):
        print(f"{step:4d}   {float(sum(g)):12.8f}   {float(sum(e)):12.8f}")
    difference = largest_difference(
        *zip(graphed_losses, eager_losses), (graphed_grads, eager_grads),
        (list(model.parameters()), list(eager.parameters())))
    print(f"max |graphed - eager| over losses, last gradients, parameters: {difference:.3g}")
    return difference


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf_llama.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--mode", choices=("drop-in", "ordered", "both"), default="both")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (even)")
    parser.add_argument("--microbatches", type=int, default=4, help="ordered mode (>= 2)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest difference accepted (default: 0 on cpu, 1e-4 on cuda)")
    args = parser.parse_args(argv)
    # One line for a user's error (argparse's usage and message, exit status 2), no traceback.
    ordered = args.mode != "drop-in"
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.layers < 1 or (ordered and args.layers % 2):
        parser.error(f"--layers must be >= 1, and even with --mode {args.mode} (two chunks of "
                     f"equal size), got {args.layers}")
    if ordered and (args.microbatches < 2 or args.microbatches % 2):
        parser.error(f"--microbatches must be even and >= 2 (interleaved 1F1B over 2 ranks runs "
                     f"them in groups of 2), got {args.microbatches}")
    if args.tolerance is not None and not args.tolerance >= 0:
        parser.error(f"--tolerance must be >= 0, got {args.tolerance}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no GPU", file=sys.stderr)
        return 1
    tolerance = args.tolerance if args.tolerance is not None else (
        0.0 if args.device == "cpu" else 1e-4)
    modes = ("drop-in", "ordered") if args.mode == "both" else (args.mode,)
    worst = max(run(mode, args) for mode in modes)
    verdict = "OK" if worst <= tolerance else "MISMATCH"
    print(f"{verdict}: largest difference {worst:.3g}, tolerance {tolerance:g}")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
