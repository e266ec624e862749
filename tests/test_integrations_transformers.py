"""Tests of leangraph.integrations.transformers: a HF Llama's decoder layers, graphed.

A tiny ``LlamaForCausalLM`` with random weights (no download) trains graphed and eagerly (a
deep copy taken before capture) for several optimizer steps; the loss, every parameter's
gradient and the parameters must be bitwise equal on the CPU (leangraph's reference backend).
Drop-in: the model's own forward runs the layers graphed in place. Ordered: the layers split
into chunks replay in an interleaved 1F1B order, chunk after chunk in one process, against the
model's own forward per microbatch. The refusals are checked before any warm-up. The same
training runs on a GPU (marked ``cuda``), compared with eager within a tolerance.

Skipped as a whole where transformers is not installed (``pip install 'leangraph[hf]'``).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import leangraph  # noqa: E402 - after the skip: nothing here runs without transformers
from leangraph import StepKind  # noqa: E402
from leangraph.integrations.transformers import (  # noqa: E402
    GraphedDecoderLayers,
    LayerCall,
    decoder_layers,
    graph_causal_lm,
    graph_decoder_layers,
    record_layer_calls,
)
from leangraph.schedules import interleaved_1f1b  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_llama.py"
VOCAB, BATCH, SEQUENCE, LAYERS = 64, 2, 8, 4
STEPS, MICROBATCHES = 3, 4


def make_model(attention: str = "sdpa", device: str = "cpu", **config: Any) -> nn.Module:
    """A tiny Llama, random weights, in training mode (untied head: the embedding's and the
    head's gradients then accumulate in the same order graphed and eagerly)."""
    options: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation=attention,
    )
    options.update(config)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**options)).to(device)
    return model.train()


# Tiny configs of other decoder-only architectures (each with its own attention and MLP
# shapes); Gemma 2 alternates sliding-window and full-attention layers, Mixtral routes tokens
# to experts. Gemma 2 has no "sdpa" path in transformers 5.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "Mistral": dict(sliding_window=4),
    "Qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "Qwen3": dict(),
    "Gemma": dict(head_dim=8),
    "Gemma2": dict(head_dim=8, sliding_window=4, attn_implementation="eager"),
    "Phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "GPTNeoX": dict(hidden_dropout=0.0, attention_dropout=0.0),
    "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # Layers at transformer.h (GPT-2, GPT-J, GPT-Neo, Falcon, Bloom) and decoder.layers (OPT).
    "GPT2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "GPTJ": dict(rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "GPTNeo": dict(attention_types=[[["global", "local", "global"], 1]], window_size=4,
                   resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0,
                   attn_implementation="eager"),
    "Falcon": dict(hidden_dropout=0.0, attention_dropout=0.0),
    "Bloom": dict(hidden_dropout=0.0, attention_dropout=0.0, attn_implementation="eager"),
    "OPT": dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                layerdrop=0.0),
    # A head model that is its own base_model (prefix "language_model"), layers at .model.
    "Llama4": dict(head_dim=8, intermediate_size_mlp=64, num_local_experts=2),
}
# Where the model class is not named {name}ForCausalLM, the config not {name}Config.
MODEL_CLASSES = {"GPT2": "GPT2LMHeadModel"}
CONFIG_CLASSES = {"Llama4": "Llama4TextConfig"}


def make_architecture(name: str, dtype: torch.dtype = torch.float32, **config: Any) -> nn.Module:
    """A tiny ``{name}ForCausalLM``, random weights, in training mode, untied head."""
    options: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    options.update(ARCHITECTURES[name], **config)
    torch.manual_seed(0)
    config_class = getattr(transformers, CONFIG_CLASSES.get(name, f"{name}Config"))
    model_class = getattr(transformers, MODEL_CLASSES.get(name, f"{name}ForCausalLM"))
    if "attn_implementation" not in config and not getattr(model_class, "_supports_sdpa", True):
        # Older transformers releases (GPT-J before 5.x) have no sdpa path for some classes.
        options["attn_implementation"] = "eager"
    model = model_class(config_class(**options))
    return model.to(dtype).train()


def token_batches(count: int, device: str = "cpu", *, rows: int = BATCH) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (rows, SEQUENCE), generator=generator).to(device)
            for _ in range(count)]


@pytest.fixture
def graphed_sets() -> Iterator[list[GraphedDecoderLayers]]:
    """Captures made by a test, reset at its end whatever happened."""
    made: list[GraphedDecoderLayers] = []
    yield made
    for graphed in made:
        graphed.reset()


# --------------------------------------------------------------------------------------------
# Training loops: graphed and eager see the same batches and optimizer
# --------------------------------------------------------------------------------------------

Step = Callable[[nn.Module, list[torch.Tensor]], list[torch.Tensor]]


def drop_in_step(model: nn.Module, batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The model's own forward and backward, one batch (graphed layers replay inside)."""
    loss = model(input_ids=batch[0], labels=batch[0]).loss
    loss.backward()
    return [loss.detach()]


def eager_microbatches(model: nn.Module, batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The model's own forward and backward per microbatch (gradient accumulation)."""
    losses = []
    for tokens in batch:
        loss = model(input_ids=tokens, labels=tokens).loss / len(batch)
        loss.backward()
        losses.append(loss.detach())
    return losses


def pipeline_step(
    model: nn.Module,
    graphed: GraphedDecoderLayers,
    batch: list[torch.Tensor],
    layer_kwargs: list[dict[str, Any]] | None = None,
) -> list[torch.Tensor]:
    """One pass over the captured order, chunk c + 1 taking chunk c's output in process.

    Embedding, final norm, head and loss run eagerly around the graphed chunks, as in a
    pipeline's first and last stage. ``layer_kwargs[m]``: microbatch m's layer arguments
    (default: those recorded at capture).
    """
    assert graphed.order is not None
    last = graphed.layout.num_chunks
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    losses: dict[int, torch.Tensor] = {}
    for step in graphed.order:
        c, m = step.chunk, step.microbatch
        if step.kind is StepKind.FORWARD:
            hidden = (_embed(model, batch[m]) if c == 1
                      else outputs[(c - 1, m)].detach().requires_grad_(True))
            inputs[(c, m)] = hidden
            kwargs = None if layer_kwargs is None else layer_kwargs[m]
            outputs[(c, m)] = graphed.run_chunk(c, m, hidden, kwargs)
            if c == last:
                logits = model.lm_head(_final_norm(model)(outputs[(c, m)]))
                loss = model.loss_function(logits=logits, labels=batch[m], vocab_size=VOCAB)
                losses[m] = loss / len(batch)
        elif c == last:
            losses[m].backward()
        else:
            outputs[(c, m)].backward(inputs.pop((c + 1, m)).grad)
    return [losses[m].detach() for m in range(len(batch))]


def _embed(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The first stage's embedding, as the model's forward computes it (GPT-2 adds learned
    positions, with no dropout here)."""
    if isinstance(model, transformers.GPT2LMHeadModel):
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        return model.transformer.wte(tokens) + model.transformer.wpe(positions)
    return model.model.embed_tokens(tokens)


def _final_norm(model: nn.Module) -> nn.Module:
    if isinstance(model, transformers.GPT2LMHeadModel):
        return model.transformer.ln_f
    return model.model.norm


def train(model: nn.Module, step: Step, batches: list[list[torch.Tensor]]) -> list[Any]:
    """Train with AdamW; per optimizer step: the losses and every parameter's gradient."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    history = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        losses = step(model, batch)
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        optimizer.step()
        history.append((losses, grads))
    return history


def assert_bitwise(graphed_run: list[Any], eager_run: list[Any], graphed: nn.Module,
                   eager: nn.Module) -> None:
    for step, ((g_losses, g_grads), (e_losses, e_grads)) in enumerate(zip(graphed_run, eager_run)):
        assert all(torch.equal(a, b) for a, b in zip(g_losses, e_losses)), f"step {step} loss"
        assert len(g_grads) == len(e_grads) > 0 and any(a is not None for a in g_grads)
        for index, (a, b) in enumerate(zip(g_grads, e_grads)):
            assert (a is None) == (b is None), f"step {step}: parameter {index}'s gradient"
            assert a is None or torch.equal(a, b), f"step {step}: gradient {index} differs"
    for a, b in zip(graphed.parameters(), eager.parameters()):
        assert torch.equal(a, b)


def max_difference(graphed_run: list[Any], eager_run: list[Any]) -> float:
    pairs = [(a, b) for (gl, gg), (el, eg) in zip(graphed_run, eager_run)
             for a, b in [*zip(gl, el), *zip(gg, eg)] if a is not None]
    return max(float((a.float() - b.float()).abs().max()) for a, b in pairs)


# --------------------------------------------------------------------------------------------
# Recording the model's own layer calls
# --------------------------------------------------------------------------------------------


def test_record_layer_calls_gets_what_llama_model_passes_each_layer() -> None:
    model = make_model()
    (tokens,) = token_batches(1)
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    hooks = [layer.register_forward_pre_hook(lambda _m, a, k: seen.append((a, k)),
                                             with_kwargs=True)
             for layer in model.model.layers]
    model(input_ids=tokens)
    for hook in hooks:
        hook.remove()
    rng = torch.get_rng_state()

    calls = record_layer_calls(model, {"input_ids": tokens})

    assert torch.equal(torch.get_rng_state(), rng)
    assert len(calls) == len(seen) == LAYERS
    for call, (args, kwargs) in zip(calls, seen):
        assert set(call.kwargs) == set(kwargs)
        assert call.kwargs["use_cache"] is False
        assert call.hidden_states.requires_grad and torch.equal(call.hidden_states, args[0])
        cos, sin = call.kwargs["position_embeddings"]
        assert torch.equal(cos, kwargs["position_embeddings"][0])
        assert torch.equal(sin, kwargs["position_embeddings"][1])
        assert torch.equal(call.kwargs["position_ids"], kwargs["position_ids"])
    assert decoder_layers(model) == tuple(model.model.layers)


@pytest.mark.parametrize(("name", "where"), [("GPT2", "transformer.h"),
                                             ("OPT", "model.decoder.layers"),
                                             ("Qwen3", "model.layers"),
                                             ("Llama4", "model.layers")])
def test_decoder_layers_are_found_where_each_layout_keeps_them(name: str, where: str) -> None:
    model = make_architecture(name)
    expected = functools.reduce(getattr, where.split("."), model)
    assert decoder_layers(model) == tuple(expected)
    assert decoder_layers(model.base_model) == tuple(expected)
    assert len(record_layer_calls(model, {"input_ids": token_batches(1)[0]})) == len(expected)


def test_eager_attention_passes_a_mask_tensor_sdpa_none() -> None:
    (tokens,) = token_batches(1)
    sdpa = record_layer_calls(make_model("sdpa"), {"input_ids": tokens})
    eager = record_layer_calls(make_model("eager"), {"input_ids": tokens})
    assert sdpa[0].kwargs["attention_mask"] is None
    mask = eager[0].kwargs["attention_mask"]
    assert isinstance(mask, torch.Tensor) and mask.shape[-2:] == (SEQUENCE, SEQUENCE)


# --------------------------------------------------------------------------------------------
# Drop-in: the model's own forward replays the graphed layers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_drop_in_trains_bitwise_like_eager(attention: str, graphed_sets: list[Any]) -> None:
    model = make_model(attention)
    eager = copy.deepcopy(model)
    batches = [[tokens] for tokens in token_batches(STEPS)]
    graphed = graph_causal_lm(model, {"input_ids": batches[0][0]})
    graphed_sets.append(graphed)
    assert graphed.graphed == graphed.layers == tuple(model.model.layers)
    assert graphed.order is None and len(graphed.graphed_set.callables) == LAYERS

    assert_bitwise(train(model, drop_in_step, batches), train(eager, drop_in_step, batches),
                   model, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_drop_in_trains_other_architectures_bitwise_like_eager(
    name: str, dtype: torch.dtype, graphed_sets: list[Any]
) -> None:
    """Padding that differs per step too: each layer gets the mask its kind of attention
    needs (sliding window or full) from the model's own forward."""
    model = make_architecture(name, dtype)
    eager = copy.deepcopy(model)
    tokens = token_batches(STEPS)
    masks = padded(tokens)
    graphed_sets.append(graph_causal_lm(model, {"input_ids": tokens[0],
                                                "attention_mask": masks[0]}))

    def masked_step(net: nn.Module, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        (index,) = [i for i, t in enumerate(tokens) if t is batch[0]]
        loss = net(input_ids=batch[0], attention_mask=masks[index], labels=batch[0]).loss
        loss.backward()
        return [loss.detach()]

    batches = [[t] for t in tokens]
    assert_bitwise(train(model, masked_step, batches), train(eager, masked_step, batches),
                   model, eager)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_drop_in_under_bf16_autocast_trains_bitwise_like_eager(
    attention: str, graphed_sets: list[Any]
) -> None:
    """Captured under autocast without its cache (V2 refuses the cache), trained under the
    usual autocast (cache on: the graphs' casts are recorded, the cache only spares eager's
    repeats), labels with -100 and padding that differs per step."""
    model = make_model(attention)
    eager = copy.deepcopy(model)
    tokens = token_batches(STEPS)
    masks = padded(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            RuntimeError, match="does not support the autocast cache"):
        graph_causal_lm(model, {"input_ids": tokens[0], "attention_mask": masks[0]})
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        graphed_sets.append(graph_causal_lm(model, {"input_ids": tokens[0],
                                                    "attention_mask": masks[0]}))

    def autocast_step(net: nn.Module, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        (index,) = [i for i, t in enumerate(tokens) if t is batch[0]]
        labels = batch[0].masked_fill(masks[index] == 0, -100)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(input_ids=batch[0], attention_mask=masks[index], labels=labels).loss
        loss.backward()
        return [loss.detach()]

    batches = [[t] for t in tokens]
    assert_bitwise(train(model, autocast_step, batches), train(eager, autocast_step, batches),
                   model, eager)


def test_inputs_embeds_sample_still_trains_the_embedding(graphed_sets: list[Any]) -> None:
    """Sampled with inputs_embeds that do not require grad, the first layer's graph still
    computes its input's gradient: training on input_ids then trains the embedding as eager
    does (it got no gradient when the graph was captured for an input without one)."""
    model = make_model()
    eager = copy.deepcopy(model)
    tokens = token_batches(STEPS)
    embeds = torch.randn(BATCH, SEQUENCE, 32, generator=torch.Generator().manual_seed(3))
    graphed_sets.append(graph_causal_lm(model, {"inputs_embeds": embeds}))
    batches = [[t] for t in tokens]
    assert_bitwise(train(model, drop_in_step, batches), train(eager, drop_in_step, batches),
                   model, eager)
    assert model.model.embed_tokens.weight.grad is not None

    def embeds_step(net: nn.Module, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        loss = net(inputs_embeds=embeds + batch[0][..., None], labels=batch[0]).loss
        loss.backward()
        return [loss.detach()]

    assert_bitwise(train(model, embeds_step, batches), train(eager, embeds_step, batches),
                   model, eager)


def test_drop_in_by_hand_with_make_graphed_callables() -> None:
    """The route without the helper: recorded calls into make_graphed_callables."""
    model = make_model()
    eager = copy.deepcopy(model)
    batches = [[tokens] for tokens in token_batches(STEPS)]
    calls = record_layer_calls(model, {"input_ids": batches[0][0]})
    layers = leangraph.make_graphed_callables(
        tuple(model.model.layers),
        tuple(call.args for call in calls),
        sample_kwargs=[dict(call.kwargs) for call in calls],
    )
    assert_bitwise(train(model, drop_in_step, batches), train(eager, drop_in_step, batches),
                   model, eager)
    leangraph.reset_all(layers)


def test_drop_in_no_grad_eval_and_generate(graphed_sets: list[Any]) -> None:
    model = make_model()
    eager = copy.deepcopy(model)
    tokens, other = token_batches(2)
    graphed_sets.append(graph_causal_lm(model, {"input_ids": tokens}))
    # Training mode without gradients (a validation loss): forwards replay without backward.
    with torch.no_grad():
        assert torch.equal(model(input_ids=other).logits, eager(input_ids=other).logits)
    assert_bitwise(train(model, drop_in_step, [[tokens]]), train(eager, drop_in_step, [[tokens]]),
                   model, eager)
    # Eval mode runs the layers eagerly: another length and a KV cache work.
    model.eval()
    eager.eval()
    prompt = other[:, :3]
    assert torch.equal(model(input_ids=prompt).logits, eager(input_ids=prompt).logits)
    generated = model.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=True,
                               pad_token_id=0)
    assert torch.equal(generated, eager.generate(prompt, max_new_tokens=3, do_sample=False,
                                                 use_cache=True, pad_token_id=0))


def test_drop_in_replay_refuses_other_shapes_and_constants(graphed_sets: list[Any]) -> None:
    model = make_model()
    eager = copy.deepcopy(model)
    (tokens,) = token_batches(1)
    graphed_sets.append(graph_causal_lm(model, {"input_ids": tokens}))
    with pytest.raises(ValueError, match=r"must keep shape \(2, 8, 32\), got \(2, 9, 32\)"):
        model(input_ids=torch.cat([tokens, tokens[:, :1]], dim=1))
    # The cache argument is `cache` in transformers 5.24, `past_key_values` in 5.17.
    with pytest.raises(ValueError, match=r"kwarg '(cache|past_key_values)' must be the const"):
        model(input_ids=tokens, use_cache=True)
    # transformers 5.24 records attention weights with forward hooks it installs on the
    # attention submodules at the first such call, which a replay cannot run; earlier 5.x
    # releases passed the flag on to the layers, whose keyword the replay refuses.
    recording = ("'self_attn' has _forward_hooks recording outputs; transformers records the "
                 "outputs asked for with output_attentions, output_hidden_states")
    with pytest.raises((RuntimeError, TypeError), match=f"{recording}|keyword arguments"):
        model(input_ids=tokens, output_attentions=True)
    with pytest.raises((RuntimeError, TypeError), match=f"{recording}|keyword arguments"):
        model(input_ids=tokens, output_hidden_states=True)
    # Nothing replayed, and the hooks stay installed but do nothing: training goes on.
    assert_bitwise(train(model, drop_in_step, [[tokens]]), train(eager, drop_in_step, [[tokens]]),
                   model, eager)


def test_a_model_that_ran_with_output_attentions_before_graphing_graphs_and_trains_like_eager(
    graphed_sets: list[Any],
) -> None:
    # transformers (5.24) installs its output-capturing hooks for good at the first
    # output_attentions call, eval included; idle, they do nothing. Capture refused them as
    # module hooks (V5), so such a model could never be graphed, where a replay lets them be.
    model = make_model()
    (tokens,) = token_batches(1)
    model.eval()
    with torch.no_grad():
        model(input_ids=tokens, output_attentions=True)
    model.train()
    eager = copy.deepcopy(model)
    hooked = [name for name, m in model.named_modules() if m._forward_hooks]
    graphed_sets.append(graph_causal_lm(model, {"input_ids": tokens}))
    assert_bitwise(train(model, drop_in_step, [[tokens]] * 2),
                   train(eager, drop_in_step, [[tokens]] * 2), model, eager)
    if hooked:  # transformers 5.24; earlier 5.x passed the flag on, installing nothing
        with pytest.raises(RuntimeError, match="'self_attn' has _forward_hooks recording"):
            model(input_ids=tokens, output_attentions=True)


def test_reset_gives_the_layers_their_eager_forward_back() -> None:
    model = make_model()
    eager = copy.deepcopy(model)
    tokens, longer = token_batches(1)[0], token_batches(1, rows=3)[0]
    graphed = graph_causal_lm(model, {"input_ids": tokens})
    graphed.reset()
    graphed.reset()  # idempotent
    assert all(member.is_reset for member in graphed.graphed_set.callables)
    assert torch.equal(model(input_ids=longer).logits, eager(input_ids=longer).logits)
    copied = copy.deepcopy(model)  # eager again: copies as an eager model does
    assert torch.equal(copied(input_ids=longer).logits, eager(input_ids=longer).logits)
    # And the layers can be graphed again, for another shape.
    again = graph_causal_lm(model, {"input_ids": longer})
    assert_bitwise(train(model, drop_in_step, [[longer]]), train(eager, drop_in_step, [[longer]]),
                   model, eager)
    # Not while graphed: the recording forward would replay the graphs at their shapes.
    with pytest.raises(ValueError, match=r"decoder layers \[0, 1, 2, 3\] are graphed already"):
        graph_causal_lm(model, {"input_ids": tokens})
    leangraph.reset_all(again.graphed)
    with pytest.raises(leangraph.GraphResetError):
        model(input_ids=longer)
    with pytest.raises(ValueError, match=r"call that result's reset\(\) first"):
        graph_causal_lm(model, {"input_ids": tokens})
    again.reset()
    model(input_ids=longer)


# --------------------------------------------------------------------------------------------
# In a pipeline order
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("attention", "split"), [("sdpa", None), ("eager", [1, 3])])
def test_interleaved_order_trains_bitwise_like_the_models_forward(
    attention: str, split: list[int] | None, graphed_sets: list[Any]
) -> None:
    model = make_model(attention)
    eager = copy.deepcopy(model)
    order = interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=MICROBATCHES)
    batches = [token_batches(MICROBATCHES) for _ in range(STEPS)]
    batches = [[t.roll(step, 0) for t in batch] for step, batch in enumerate(batches)]
    graphed = graph_causal_lm(model, {"input_ids": batches[0][0]}, order=order,
                              num_microbatches=MICROBATCHES, num_layers_per_chunk=split)
    graphed_sets.append(graphed)
    assert graphed.layout.layers_per_chunk == tuple(split or (2, 2))
    assert len(graphed.graphed) == LAYERS * MICROBATCHES
    assert all(isinstance(g, leangraph.GraphedCallable) for g in graphed.graphed)

    graphed_run = train(model, lambda m, batch: pipeline_step(m, graphed, batch), batches)
    assert_bitwise(graphed_run, train(eager, eager_microbatches, batches), model, eager)


def test_gpt2_in_an_interleaved_order_trains_bitwise_like_the_models_forward(
    graphed_sets: list[Any]
) -> None:
    """GPT-2's layers (at transformer.h, called with positional Nones beside the hidden
    states) chunk by chunk in a pipeline order, against the model's own forward."""
    model = make_architecture("GPT2", num_hidden_layers=LAYERS)
    eager = copy.deepcopy(model)
    order = interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=MICROBATCHES)
    batches = [token_batches(MICROBATCHES) for _ in range(STEPS)]
    batches = [[t.roll(step, 0) for t in batch] for step, batch in enumerate(batches)]
    graphed = graph_causal_lm(model, {"input_ids": batches[0][0]}, order=order,
                              num_microbatches=MICROBATCHES)
    graphed_sets.append(graphed)
    assert len(graphed.graphed) == LAYERS * MICROBATCHES
    graphed_run = train(model, lambda m, batch: pipeline_step(m, graphed, batch), batches)
    assert_bitwise(graphed_run, train(eager, eager_microbatches, batches), model, eager)


def padded(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """Attention masks that left-pad row 0 of microbatch m by m + 1 tokens."""
    masks = []
    for m, tokens in enumerate(batch):
        mask = torch.ones_like(tokens)
        mask[0, : m + 1] = 0
        masks.append(mask)
    return masks


def eager_masked_step(masks: list[torch.Tensor]) -> Step:
    """An eager step over microbatches, each with its own attention mask: the model's own
    forward and backward per microbatch, as the pipeline's losses are scaled."""

    def step(net: nn.Module, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        losses = []
        for t, k in zip(tokens, masks):
            loss = net(input_ids=t, attention_mask=k, labels=t).loss / len(tokens)
            loss.backward()
            losses.append(loss.detach())
        return losses

    return step


def test_padded_batches_with_eager_attention(graphed_sets: list[Any]) -> None:
    """Eager attention always hands the layers a mask tensor, so padding that changes from
    batch to batch replays; in an order, run_chunk takes each microbatch's own arguments."""
    batch = token_batches(MICROBATCHES)
    masks = padded(batch)
    model = make_model("eager")
    eager = copy.deepcopy(model)
    graphed_sets.append(graph_causal_lm(model, {"input_ids": batch[0], "attention_mask": masks[0]}))

    def masked_step(net: nn.Module, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        m = len(tokens) - 1  # each step a different padding
        loss = net(input_ids=tokens[-1], attention_mask=masks[m], labels=tokens[-1]).loss
        loss.backward()
        return [loss.detach()]

    steps = [batch[: m + 1] for m in range(MICROBATCHES)]
    assert_bitwise(train(model, masked_step, steps), train(eager, masked_step, steps),
                   model, eager)

    model = make_model("eager")
    eager = copy.deepcopy(model)
    order = interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=MICROBATCHES)
    graphed = graph_causal_lm(model, {"input_ids": batch[0], "attention_mask": masks[0]},
                              order=order, num_microbatches=MICROBATCHES)
    graphed_sets.append(graphed)
    layer_kwargs = [dict(record_layer_calls(eager, {"input_ids": t, "attention_mask": k})[0].kwargs)
                    for t, k in zip(batch, masks)]
    assert not torch.equal(layer_kwargs[0]["attention_mask"], layer_kwargs[1]["attention_mask"])

    graphed_run = train(model, lambda m, b: pipeline_step(m, graphed, b, layer_kwargs), [batch])
    assert_bitwise(graphed_run, train(eager, eager_masked_step(masks), [batch]), model, eager)


def test_r27_run_chunk_takes_each_layers_own_kwargs_and_refuses_one_for_layers_called_unlike(
    graphed_sets: list[Any],
) -> None:
    """Qwen2 here gives layer 0 full attention and the others a sliding window: one mapping
    for a chunk mixing them would hand a layer the other kind's mask. One mapping per decoder
    layer (record_layer_calls' own) trains bitwise like the model's forward."""
    batch = token_batches(MICROBATCHES)
    masks = padded(batch)
    model = make_architecture("Qwen2", num_hidden_layers=4, attn_implementation="eager")
    eager = copy.deepcopy(model)
    order = interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=MICROBATCHES)
    graphed = graph_causal_lm(model, {"input_ids": batch[0], "attention_mask": masks[0]},
                              order=order, num_microbatches=MICROBATCHES)
    graphed_sets.append(graphed)
    recorded = [record_layer_calls(eager, {"input_ids": t, "attention_mask": k})
                for t, k in zip(batch, masks)]
    hidden = model.model.embed_tokens(batch[0])
    with pytest.raises(ValueError, match=(
            r"run_chunk: layer_kwargs is one mapping for the 2 layers of chunk 1, but the "
            r"model called decoder layers 0 and 1 with different 'attention_mask' at "
            r"recording .*expected one mapping per decoder layer")):
        graphed.run_chunk(1, 0, hidden, recorded[0][0].kwargs)
    with pytest.raises(ValueError, match=r"one mapping per decoder layer \(4, indexed like "
                       r"calls\), got 2"):
        graphed.run_chunk(1, 0, hidden, [call.kwargs for call in recorded[0][:2]])
    with pytest.raises(TypeError, match=r"layer_kwargs\[1\] must be a mapping of keyword "
                       r"arguments, got LayerCall"):
        graphed.run_chunk(1, 0, hidden, [recorded[0][0].kwargs, *recorded[0][1:]])
    with pytest.raises(TypeError, match="layer_kwargs must be a mapping of keyword arguments "
                       "or a sequence of one per decoder layer \\(4\\), got Tensor"):
        graphed.run_chunk(1, 0, hidden, hidden)
    # Nothing replayed: the order starts from its first step.
    layer_kwargs = [[call.kwargs for call in calls] for calls in recorded]

    graphed_run = train(model, lambda m, b: pipeline_step(m, graphed, b, layer_kwargs), [batch])
    assert_bitwise(graphed_run, train(eager, eager_masked_step(masks), [batch]), model, eager)


def test_ordered_replay_out_of_order_and_after_reset_raise(graphed_sets: list[Any]) -> None:
    model = make_model()
    order = interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=MICROBATCHES)
    tokens = token_batches(1)[0]
    graphed = graph_causal_lm(model, {"input_ids": tokens}, order=order,
                              num_microbatches=MICROBATCHES)
    graphed_sets.append(graphed)
    hidden = model.model.embed_tokens(tokens)
    with pytest.raises(ValueError, match="outside the capture's 2 chunks"):
        graphed.run_chunk(3, 0, hidden)
    with pytest.raises(RuntimeError, match="out of capture order"):
        graphed.run_chunk(1, 1, hidden)  # the order starts with microbatch 0
    graphed.reset()
    with pytest.raises(leangraph.GraphResetError):
        graphed.run_chunk(1, 0, hidden)


# --------------------------------------------------------------------------------------------
# Refusals, before any warm-up
# --------------------------------------------------------------------------------------------


class WarmupSpy:
    """A pre-warm-up hook that counts: a refusal must come before it runs."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def refuse(model: nn.Module, inputs: dict[str, Any], error: type[Exception], match: str,
           **options: Any) -> None:
    spy = WarmupSpy()
    with pytest.raises(error, match=match):
        graph_causal_lm(model, inputs, capture_options={"pre_warmup_hook": spy}, **options)
    assert spy.calls == 0
    assert not any(isinstance(vars(layer).get("forward"), leangraph.GraphedCallable)
                   for layer in model.model.layers)


def test_refuses_a_kv_cache() -> None:
    (tokens,) = token_batches(1)
    model = make_model(use_cache=True)
    refuse(model, {"input_ids": tokens}, ValueError,
           "decoder layer 0 .* use_cache=True.*use_cache=False")
    refuse(make_model(), {"input_ids": tokens, "use_cache": True}, ValueError,
           "LlamaForCausalLM is called with use_cache=True")
    calls = record_layer_calls(model, {"input_ids": tokens, "use_cache": False})
    cached = LayerCall(calls[0].args, {**calls[0].kwargs, "use_cache": False,
                                       "cache": transformers.DynamicCache(config=model.config)})
    with pytest.raises(TypeError, match=r"'cache' is a DynamicCache.*KV cache"):
        graph_decoder_layers(decoder_layers(model)[:1], cached)


def test_refuses_other_attention_implementations() -> None:
    model = make_model()
    model.config._attn_implementation = "flex_attention"
    refuse(model, {"input_ids": token_batches(1)[0]}, ValueError,
           "attention implementation 'flex_attention' is not supported")


def test_refuses_gradient_checkpointing() -> None:
    model = make_model()
    # transformers 5 renamed gradient_checkpointing_enable (kept as a deprecated alias).
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable()
    refuse(model, {"input_ids": token_batches(1)[0]}, ValueError, "gradient checkpointing")
    calls = record_layer_calls(make_model(), {"input_ids": token_batches(1)[0]})
    with pytest.raises(ValueError, match=r"decoder layer 0 .*gradient checkpointing"):
        graph_decoder_layers(decoder_layers(model), calls)


def test_refuses_dropout_in_training_but_not_in_eval() -> None:
    (tokens,) = token_batches(1)
    model = make_model(attention_dropout=0.1)
    refuse(model, {"input_ids": tokens}, ValueError, "attention_dropout=0.1")
    layers = decoder_layers(make_model())
    layers[0].mlp.act_fn = nn.Sequential(nn.SiLU(), nn.Dropout(0.2))
    calls = record_layer_calls(make_model(), {"input_ids": tokens})
    with pytest.raises(ValueError, match=r"nn.Dropout\(p=0.2\)"):
        graph_decoder_layers(layers, calls)
    graph_causal_lm(model.eval(), {"input_ids": tokens}).reset()


def test_refuses_outputs_recorded_by_hooks() -> None:
    (tokens,) = token_batches(1)
    refuse(make_model(output_hidden_states=True), {"input_ids": tokens}, ValueError,
           "config.output_hidden_states")
    # Refused before the recording forward: HF would install its output hooks for good, and
    # make_graphed_callables refuses modules with hooks. So the model can be graphed after.
    model = make_model("eager")
    refuse(model, {"input_ids": tokens, "output_attentions": True}, ValueError,
           "LlamaForCausalLM is called with output_attentions=True")
    graph_causal_lm(model, {"input_ids": tokens}).reset()
    # A mixture of experts' router logits (its auxiliary loss) are recorded by hooks too.
    refuse(make_architecture("Mixtral", output_router_logits=True), {"input_ids": tokens},
           ValueError, "config.output_router_logits is set")
    mixtral = make_architecture("Mixtral")
    refuse(mixtral, {"input_ids": tokens, "output_router_logits": True}, ValueError,
           "MixtralForCausalLM is called with output_router_logits=True")
    graph_causal_lm(mixtral, {"input_ids": tokens}).reset()


def test_refuses_arguments_that_do_not_fit() -> None:
    model = make_model()
    tokens = token_batches(1)[0]
    order = interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=MICROBATCHES)
    refuse(model, {"input_ids": tokens}, ValueError, "num_microbatches .* is required",
           order=order)
    refuse(model, {"input_ids": tokens}, ValueError, "does not fit 4 layers and "
           "num_microbatches=3", order=order, num_microbatches=3)
    refuse(model, {"input_ids": tokens}, ValueError, "go with an order", num_microbatches=2)
    with pytest.raises(ValueError, match="capture_options may not set order"):
        graph_causal_lm(model, {"input_ids": tokens}, capture_options={"order": order})
    with pytest.raises(TypeError, match="sample_inputs must be a mapping"):
        graph_causal_lm(model, tokens)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"no decoder layers \(an nn.ModuleList\) at "
                       r"base_model\.layers, base_model\.h, base_model\.decoder\.layers"):
        graph_causal_lm(nn.Linear(2, 2), {"input": tokens})
    calls = record_layer_calls(model, {"input_ids": tokens})
    with pytest.raises(ValueError, match="calls has 4 entries but there are 2 layers"):
        graph_decoder_layers(decoder_layers(model)[:2], calls)
    with pytest.raises(TypeError, match="must start with the hidden states"):
        graph_decoder_layers(decoder_layers(model)[:1], LayerCall((), calls[0].kwargs))


def test_refuses_arguments_of_the_wrong_type_naming_them(graphed_sets: list[Any]) -> None:
    tokens = token_batches(1)[0]
    with pytest.raises(TypeError, match="graph_causal_lm: model must be an nn.Module .*, got str"):
        graph_causal_lm("llama", {"input_ids": tokens})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="record_layer_calls: model must be an nn.Module"):
        record_layer_calls(None, {"input_ids": tokens})  # type: ignore[arg-type]
    model = make_model()
    with pytest.raises(TypeError, match="calls must be a LayerCall or a sequence of them, .*got "
                       "NoneType"):
        graph_decoder_layers(decoder_layers(model), None)  # type: ignore[arg-type]
    order = interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=MICROBATCHES)
    graphed = graph_causal_lm(model, {"input_ids": tokens}, order=order,
                              num_microbatches=MICROBATCHES)
    graphed_sets.append(graphed)
    hidden = torch.randn(BATCH, SEQUENCE, 32, requires_grad=True)
    for chunk, microbatch, name, got in [("1", 0, "chunk", "str '1'"), (1.0, 0, "chunk", "float"),
                                         (True, 0, "chunk", "bool"),
                                         (1, 0.0, "microbatch", "float")]:
        with pytest.raises(TypeError, match=f"run_chunk: {name} must be an int .*, got {got}"):
            graphed.run_chunk(chunk, microbatch, hidden)  # type: ignore[arg-type]


class PlainLayer(nn.Module):
    """A decoder layer's calling convention without transformers: hidden states in, a tuple
    out."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (hidden + self.linear(hidden),)


def test_a_call_whose_kwargs_is_not_a_mapping_is_refused_naming_it() -> None:
    """LayerCall.kwargs is a mapping ({} for none): None (or a list of pairs) is refused by
    name and type before any warm-up, not met as an AttributeError inside the checks."""
    hidden = torch.randn(2, 3, 8, requires_grad=True)
    layers = [PlainLayer(), PlainLayer()]
    pairs: Any = [("use_cache", False)]
    for calls, named, got in [
        (LayerCall((hidden,), None), "calls", "NoneType"),  # type: ignore[arg-type]
        ([LayerCall((hidden,), {}), LayerCall((hidden,), pairs)], "calls[1]", "list"),
    ]:
        spy = WarmupSpy()
        with pytest.raises(TypeError) as info:
            graph_decoder_layers(layers, calls, capture_options={"pre_warmup_hook": spy})
        assert str(info.value) == (
            f"{named}.kwargs must be a mapping of the layer's keyword arguments (pass {{}} for "
            f"none), got {got}")
        assert spy.calls == 0
        assert not any(isinstance(vars(layer).get("forward"), leangraph.GraphedCallable)
                       for layer in layers)
    graph_decoder_layers(layers, LayerCall((hidden,), {})).reset()  # {}: no keyword arguments


def test_v31_refuses_dropout_the_forward_draws_itself_and_every_dropout_module() -> None:
    """Rates handed to nn.functional.dropout (Starcoder2's residual_dropout), random router
    noise (Mixtral's jitter) and dropout modules of any kind, in any training submodule."""
    (tokens,) = token_batches(1)
    starcoder = transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False, residual_dropout=0.1,
        attention_dropout=0.0, embedding_dropout=0.0)).train()
    refuse(starcoder, {"input_ids": tokens}, ValueError,
           r"decoder layer 0 \(Starcoder2DecoderLayer\) trains with residual_dropout=0.1 in "
           r"submodule 'self_attn'; .* set it to 0 \(or graph in eval mode\)")
    mixtral = make_architecture("Mixtral", router_jitter_noise=0.05)
    refuse(mixtral, {"input_ids": tokens}, ValueError, "jitter_noise=0.05 in submodule 'mlp")
    layers = decoder_layers(make_model())
    layers[1].mlp.act_fn = nn.Sequential(nn.SiLU(), nn.AlphaDropout(0.3))
    calls = record_layer_calls(make_model(), {"input_ids": tokens})
    with pytest.raises(ValueError, match=r"decoder layer 1 \(LlamaDecoderLayer\) trains with "
                       r"nn.AlphaDropout\(p=0.3\) in submodule 'mlp.act_fn.1'"):
        graph_decoder_layers(layers, calls)
    # In eval mode nothing is drawn: graphed, and reset.
    graph_causal_lm(starcoder.eval(), {"input_ids": tokens}).reset()
    layers[1].mlp.act_fn.eval()
    graph_decoder_layers(layers, calls).reset()


def test_v32_refuses_capture_options_that_are_no_mapping_and_no_microbatches() -> None:
    model = make_model()
    tokens = token_batches(1)[0]
    order = interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=MICROBATCHES)
    refuse(model, {"input_ids": tokens}, ValueError,
           r"num_microbatches \(an integer >= 1\) is required with an order, got 0",
           order=order, num_microbatches=0)
    with pytest.raises(TypeError, match=r"capture_options must be a mapping of "
                       r"leangraph.make_graphed_callables options .* or None, got list"):
        graph_causal_lm(model, {"input_ids": tokens}, capture_options=[("backend", "cpu")])
    # A misspelt option is named before the recording forward, with the closest one.
    seen: list[Any] = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *args: seen.append(args))
    with pytest.raises(TypeError, match="has no option 'num_warmup_iter'; did you mean "
                       "'num_warmup_iters'"):
        graph_causal_lm(model, {"input_ids": tokens}, capture_options={"num_warmup_iter": 1})
    hook.remove()
    assert seen == []


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_llama_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_trains_bitwise_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_example().main(["--steps", "2", "--microbatches", "2"]) == 0
    printed = capsys.readouterr().out
    assert "drop-in (sdpa attention, cpu, 4 graphs)" in printed
    assert "ordered (sdpa attention, cpu, 8 graphs)" in printed
    assert "OK: largest difference 0, tolerance 0" in printed



@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--mode", "ordered", "--layers", "3"], "--layers must be >= 1, and even with --mode "
     "ordered (two chunks of equal size), got 3"),
    (["--microbatches", "3"], "--microbatches must be even and >= 2 (interleaved 1F1B over 2 "
     "ranks runs them in groups of 2), got 3"),
    (["--tolerance", "-1"], "--tolerance must be >= 0, got -1.0"),
])
def test_example_answers_bad_arguments_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before anything is built: argparse's usage and one line, no traceback (it raised an
    IndexError or leangraph's order error from deep inside before)."""
    with pytest.raises(SystemExit) as info:
        load_example().main(argv)
    assert info.value.code == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.splitlines()[-1] == f"hf_llama.py: error: {message}"
    assert "Traceback" not in printed.err

# --------------------------------------------------------------------------------------------
# On a GPU
# --------------------------------------------------------------------------------------------


CUDA_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
CUDA_DTYPES = pytest.mark.parametrize("dtype", list(CUDA_TOLERANCE), ids=["fp32", "bf16"])


@pytest.mark.cuda
@CUDA_DTYPES
def test_cuda_drop_in_matches_eager(dtype: torch.dtype) -> None:
    """CUDA kernels (atomics in the embedding's backward) need not repeat bit for bit, even
    eagerly, so the GPU runs compare within a tolerance; they are often equal."""
    difference = _cuda_drop_in_difference(make_model(device="cuda").to(dtype))
    assert difference <= CUDA_TOLERANCE[dtype], f"drop-in differs from eager by {difference}"


def _cuda_drop_in_difference(model: nn.Module) -> float:
    """Drop-in training of ``model`` (on the GPU) graphed and eagerly: the largest
    difference in losses, gradients and parameters."""
    eager = copy.deepcopy(model)
    batches = [[tokens] for tokens in token_batches(STEPS, "cuda")]
    graphed = graph_causal_lm(model, {"input_ids": batches[0][0]})
    assert graphed.graphed_set.record.device.startswith("cuda")
    difference = max_difference(train(model, drop_in_step, batches),
                                train(eager, drop_in_step, batches))
    graphed.reset()
    return difference


@pytest.mark.cuda
@CUDA_DTYPES
def test_cuda_interleaved_order_matches_eager(dtype: torch.dtype) -> None:
    model = make_model(device="cuda").to(dtype)
    eager = copy.deepcopy(model)
    order = interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=MICROBATCHES)
    batches = [token_batches(MICROBATCHES, "cuda") for _ in range(STEPS)]
    graphed = graph_causal_lm(model, {"input_ids": batches[0][0]}, order=order,
                              num_microbatches=MICROBATCHES)
    graphed_run = train(model, lambda m, batch: pipeline_step(m, graphed, batch), batches)
    difference = max_difference(graphed_run, train(eager, eager_microbatches, batches))
    leangraph.reset_all(graphed.graphed)
    assert difference <= CUDA_TOLERANCE[dtype], f"ordered differs from eager by {difference}"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["GPT2", "GPTJ", "OPT"])
def test_cuda_drop_in_of_other_layer_layouts_matches_eager(name: str) -> None:
    """Layers at transformer.h (GPT-2, GPT-J) and decoder.layers (OPT), bf16, on the GPU.
    (Falcon's multi-query attention splits its heads with list indices, a host-to-device
    copy that no CUDA capture takes, torch's own included.)"""
    difference = _cuda_drop_in_difference(make_architecture(name, torch.bfloat16).cuda())
    assert difference <= CUDA_TOLERANCE[torch.bfloat16], f"{name} differs by {difference}"


@pytest.mark.cuda
def test_cuda_example() -> None:
    assert load_example().main(["--device", "cuda", "--steps", "2"]) == 0
