"""Diagnose capture failures across engine options on a small transformer stack (GPU)."""
import itertools
import sys
import traceback

import torch

import leangraph
from leangraph.schedules import interleaved_1f1b
from leangraph.workloads import BlockShape, make_blocks, sample_hidden


def attempt(dtype, check, share, same_sample, attn):
    shape = BlockShape(hidden=256, heads=4, sequence=128, dtype=dtype)
    blocks = make_blocks(4, shape, "cuda")
    order = interleaved_1f1b(4, 2, 0, 4)
    one = sample_hidden(shape, "cuda")
    samples = tuple((one if same_sample else sample_hidden(shape, "cuda"),) for _ in range(16))
    ctx = torch.nn.attention.sdpa_kernel([attn]) if attn is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    try:
        with ctx:
            g = leangraph.make_graphed_callables(tuple(blocks), samples, order=order,
                                                 check_memory=check, share_buffers=share)
        leangraph.reset_all(g)
        return "ok"
    except Exception as exc:  # noqa: BLE001
        return f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"


from torch.nn.attention import SDPBackend
for dtype, check, share, same, attn in itertools.product(
        [torch.bfloat16, torch.float32], [False, True], [False, True], [False, True],
        [None, SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
         SDPBackend.CUDNN_ATTENTION]):
    if dtype == torch.float32 and attn in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        continue
    print(f"{str(dtype):15} check={check!s:5} share={share!s:5} same_sample={same!s:5} "
          f"attn={attn}: {attempt(dtype, check, share, same, attn)}", flush=True)
