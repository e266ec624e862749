"""Capture a small transformer stack under every combination of engine options (GPU only).

Used to find which option made backward capture fail with "operation would make the legacy
stream depend on a capturing blocking stream": it was a memory check that ran the real modules
on the default stream before warm-up (it now runs them on the warm-up stream). Prints one line
per case; ``--first-call BACKEND`` runs only the first capture of a fresh process.
"""

from __future__ import annotations

import contextlib
import itertools
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import leangraph
from leangraph.schedules import interleaved_1f1b
from leangraph.workloads import BlockShape, make_blocks, sample_hidden

BACKENDS = [None, SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.CUDNN_ATTENTION]


def attempt(dtype: torch.dtype, check: bool, share: bool, same_sample: bool,
            attention: SDPBackend | None) -> str:
    shape = BlockShape(hidden=256, heads=4, sequence=128, dtype=dtype)
    blocks = make_blocks(4, shape, "cuda")
    one = sample_hidden(shape, "cuda")
    samples = tuple((one if same_sample else sample_hidden(shape, "cuda"),) for _ in range(16))
    kernel = sdpa_kernel([attention]) if attention is not None else contextlib.nullcontext()
    try:
        with kernel:
            graphed = leangraph.make_graphed_callables(
                tuple(blocks), samples, order=interleaved_1f1b(4, 2, 0, 4),
                check_memory=check, share_buffers=share)
        leangraph.reset_all(graphed)
        return "ok"
    except Exception as exc:  # noqa: BLE001 - a diagnostic: report and go on
        return f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"


def main() -> None:
    for dtype, check, share, same, attention in itertools.product(
            [torch.bfloat16, torch.float32], [False, True], [False, True], [False, True],
            BACKENDS):
        if dtype == torch.float32 and attention in (SDPBackend.FLASH_ATTENTION,
                                                    SDPBackend.CUDNN_ATTENTION):
            continue
        result = attempt(dtype, check, share, same, attention)
        print(f"{str(dtype):15} check={check!s:5} share={share!s:5} same_sample={same!s:5} "
              f"attention={attention}: {result}", flush=True)


def first_call(attention: str) -> None:
    """The first capture of a fresh process, with the memory check on (it runs the modules
    once before warm-up): ``python3 scripts/diag_capture.py --first-call FLASH_ATTENTION``."""
    backend = None if attention == "default" else getattr(SDPBackend, attention)
    print(f"first call, check=True, attention={backend}: "
          f"{attempt(torch.bfloat16, True, True, False, backend)}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--first-call":
        first_call(sys.argv[2])
    else:
        main()
