"""Where the bytes held after capture go, by allocation site (GPU only).

Captures two Block(256) layers in plain 1F1B with 4 and with 16 microbatches, as
tests/test_cuda.py's flatness test does, and prints the live blocks of each run grouped by the
Python line that allocated them, so a buffer that grows with the microbatch count shows up by
name. Also measures what torch itself keeps per CUDA graph (trivial graphs sharing one pool).
"""

from __future__ import annotations

import collections
import gc
import sys

import torch

sys.path.insert(0, "tests")
import leangraph  # noqa: E402
from models import Block  # noqa: E402


def per_graph_bookkeeping(count: int = 32) -> float:
    x = torch.zeros(1024, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graphs = []
    for _ in range(count):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            x.add_(1)
        graphs.append(graph)
    torch.cuda.synchronize()
    return (torch.cuda.memory_allocated() - before) / count


def live_blocks_by_site() -> collections.Counter:
    sites: collections.Counter = collections.Counter()
    for segment in torch.cuda.memory_snapshot():
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f for f in block.get("frames", []) if "leangraph" in f["filename"]
                      or "tests/" in f["filename"]]
            where = " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}"
                               for f in frames[:3]) or "(no python frame)"
            sites[(block["size"], where)] += 1
    return sites


def held(microbatches: int) -> collections.Counter:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    blocks = tuple(Block(256).cuda() for _ in range(2))
    samples = tuple((torch.randn(16, 256, device="cuda", requires_grad=True),)
                    for _ in range(2 * microbatches))
    order = [1] + [e for _ in range(microbatches - 1) for e in (1, -1)] + [-1]
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    graphed = leangraph.make_graphed_callables(blocks, samples, order=order)
    del samples
    torch.cuda.synchronize()
    print(f"{microbatches} microbatches: held {torch.cuda.memory_allocated() - base} bytes")
    sites = live_blocks_by_site()
    torch.cuda.memory._record_memory_history(enabled=None)
    leangraph.reset_all(graphed)
    return sites


if __name__ == "__main__":
    print(f"torch keeps {per_graph_bookkeeping():.0f} bytes per trivial CUDA graph")
    held(4)  # untimed: per-process set-up (cuBLAS workspaces, handles)
    small, large = held(4), held(16)
    print("live blocks whose count differs (size, site): count at 4 -> count at 16")
    for key in sorted(set(small) | set(large)):
        if small[key] != large[key]:
            print(f"  {key[0]:>8} {key[1]}: {small[key]} -> {large[key]}")
