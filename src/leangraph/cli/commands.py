"""The ``leangraph`` command line: ``demo``, ``bench`` and ``plan``.

Every argument is checked before any work starts. A user error is one line on stderr (what
was wrong and what to do) with exit status 2; a run that fails is one line with status 1; a
Python traceback only with ``--debug``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

import leangraph
from leangraph.memory import format_bytes
from leangraph.schedules import interleaved_1f1b

from .bench import (
    CUDA_METHODS,
    FUSED,
    FUSED_NO_HOOKS,
    FUSED_PYTHON_HOOKS,
    GRAD_HOOKS_WITHOUT_ACCUMULATORS,
    GRAPHED_METHODS,
    LEANGRAPH_METHODS,
    METHODS,
    OPT_IN_METHODS,
    OVERLAP,
    BenchConfig,
    BenchResult,
    format_table,
    fused_unavailable,
    method_unavailable,
    plot_bars,
    plot_timeline,
    run_bench,
)
from .demo import DemoConfig, DemoResult, run_demo
from .phases import phase_display, progress_bar
from .presets import PRESETS, BenchPreset
from .replay_micro import ReplayMicroConfig, format_replay_micro, run_replay_micro
from .workloads import BlockShape, make_blocks, plural, sample_hidden

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

__all__ = ["CommandError", "UsageError", "build_parser", "main", "progress_bar"]

MIB = 1024 * 1024
LAUNCH_STEPS = 3
"""Steps ``bench --launches`` profiles per method: launches repeat exactly from step to step."""

DESCRIPTION = """\
leangraph: memory-lean CUDA-graph capture for pipeline-parallel PyTorch training.

  leangraph demo    capture a small transformer stack, train it eagerly and graphed, compare
  leangraph plan    print the memory plan of a pipeline rank (meta tensors: no GPU needed)
  leangraph bench   eager vs torch.cuda.make_graphed_callables vs leangraph on one rank,
                    against the whole step as one CUDA graph (the limit)

Without a GPU, demo and bench run on leangraph's CPU reference backend (no memory figures)."""

EPILOG = """\
A wrong argument is reported in one line with exit status 2, a failed run with status 1;
--debug shows the Python traceback instead. leangraph COMMAND --help lists each command's
options and their defaults."""


class CommandError(Exception):
    """An error the command line reports as one line on stderr, with exit ``status``."""

    status = 1


class UsageError(CommandError):
    """A wrong or inapplicable argument (exit status 2), found before any work starts."""

    status = 2


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, plus ``(default: X)`` for every option with a fixed default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        fixed = not any(action.default is unset for unset in (None, False, argparse.SUPPRESS))
        if fixed and action.option_strings and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


class _TableHelpFormatter(_HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The top-level help: its description (a table of the commands) kept as written."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (what was wrong, where to look), status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        """argparse's, but output that cannot be written (``--help`` or ``--version`` into a
        full disk) fails the command in one line, status 1, where argparse drops the error
        and exits 0 with nothing written; a reader gone ends quietly, as a run's does."""
        if not message:
            return
        out = file or sys.stderr
        try:
            out.write(message)
            flush = getattr(out, "flush", None)  # where written into a buffer, fail here
            if flush is not None:
                flush()
        except BrokenPipeError:
            raise SystemExit(_reader_gone()) from None
        except OSError as exc:
            if out is sys.stderr:  # nowhere left to say it
                return
            sys.stderr.write(f"{self.prog}: error: cannot write the output: {exc}\n")
            raise SystemExit(1) from None


# ------------------------------------------------------------------------------ arguments


def _count(minimum: int, maximum: tuple[int, str] | None = None) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` and, with ``maximum`` (the
    bound, and why), at most that."""

    def parse(text: str) -> int:
        digits = text.strip().lstrip("+-")
        if len(digits) > _MAX_DIGITS and digits.isdigit():  # int() refuses, or it is huge
            raise argparse.ArgumentTypeError(
                f"expected an integer of at most {_MAX_DIGITS} digits, got one of {len(digits)}"
            )
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {_shown(text)}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum[0]:
            bound, why = maximum
            raise argparse.ArgumentTypeError(f"must be at most {bound} ({why}), got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


_MAX_DIGITS = 30
"""Integer flags take at most this many digits: every count far smaller is refused by a bound
of its own, so a longer one is a slip, told by its length rather than echoed (Python's
``int`` refuses more than 4300 digits, as not an integer at all)."""


def _shown(text: str, limit: int = 40) -> str:
    """``text`` as an error echoes it: quoted, cut to ``limit`` characters."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


MAX_STEPS = 100_000
"""The most training steps a command runs per method (more would run for days)."""

MAX_DEMO_STEPS = 10_000
"""The most steps of ``demo``, which makes every step's data before its first step."""

MAX_ROUNDS = 1_000
"""The most rounds of ``bench --rounds`` (each captures and times every graphed method)."""

MAX_REPLAYS = 1_000_000
"""The most replays per method and round of ``bench --replay-micro``."""


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class Workload:
    """One pipeline rank of transformer blocks, as ``plan`` and ``bench`` describe it: rank
    ``rank`` of a ``pp`` x ``vp`` interleaved 1F1B pipeline, ``layers`` blocks per chunk."""

    pp: int = 4
    vp: int = 2
    rank: int = 0
    microbatches: int = 16
    layers: int = 4
    hidden: int = 1024
    heads: int = 16
    sequence: int = 2048
    micro_batch: int = 1
    dtype: str = "bf16"

    def describe(self) -> str:
        """``rank 0 of PP4 x VP2, 2 chunks x 4 blocks, hidden 1024, ...``."""
        chunks = f"{plural(self.vp, 'chunk')} x {plural(self.layers, 'block')}"
        return (
            f"rank {self.rank} of PP{self.pp} x VP{self.vp}, {chunks}, "
            f"{plural(self.microbatches, 'microbatch', 'microbatches')}, hidden "
            f"{self.hidden}, {plural(self.heads, 'head')}, sequence {self.sequence}, "
            f"micro-batch {self.micro_batch}, {self.dtype}"
        )


GPU_WORKLOAD = Workload()
"""``plan``'s workload, and ``bench``'s on a GPU (the workload of docs/benchmarks.md)."""
CPU_WORKLOAD = Workload(microbatches=8, layers=2, hidden=64, heads=4, sequence=32, dtype="fp32")
"""``bench``'s workload on the CPU backend: the same schedule, small enough for seconds."""

_WORKLOAD_HELP = {
    "pp": "pipeline-parallel size: the number of ranks",
    "vp": "virtual pipeline size: model chunks per rank",
    "rank": "the pipeline rank whose order runs",
    "microbatches": "microbatches per training step; a multiple of --pp when --vp > 1",
    "layers": "transformer blocks per chunk",
    "hidden": "hidden size; a multiple of --heads",
    "heads": "attention heads",
    "sequence": "tokens per microbatch",
    "micro_batch": "sequences per microbatch",
    "dtype": "parameter and activation dtype",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_workload_options(
    parser: argparse.ArgumentParser, defaults: Workload, cpu: Workload | None = None
) -> None:
    """The flags of a :class:`Workload`. They default to None, so that a command can tell a
    flag given from one left out; the help says the default (per device with ``cpu``)."""
    for item in fields(Workload):
        default, on_cpu = getattr(defaults, item.name), getattr(cpu or defaults, item.name)
        shown = f"{default}" if default == on_cpu else f"{default} on a GPU, {on_cpu} on the CPU"
        help_text = f"{_WORKLOAD_HELP[item.name]} (default: {shown})"
        if item.name == "dtype":
            parser.add_argument("--dtype", choices=sorted(_DTYPES), help=help_text)
        else:
            minimum = 0 if item.name == "rank" else 1
            parser.add_argument(_flag(item.name), type=_count(minimum), metavar="N", help=help_text)


def _workload_given(args: argparse.Namespace) -> list[str]:
    """The workload flags given on the command line."""
    return [_flag(f.name) for f in fields(Workload) if getattr(args, f.name) is not None]


def _workload(
    args: argparse.Namespace,
    defaults: Workload,
    *,
    captured: bool = True,
    fixed: Sequence[str] = (),
) -> Workload:
    """The workload of ``args``, checked: ``defaults`` where a flag was left out; ``fixed``:
    the fields no flag may set (a preset's), which errors name without a flag; ``captured``:
    the command captures its graphs (``plan`` only plans them)."""
    given = {f.name: getattr(args, f.name) for f in fields(Workload)}
    work = replace(defaults, **{k: v for k, v in given.items() if v is not None})
    if work.rank >= work.pp:
        raise UsageError(
            f"--rank {work.rank} must be below --pp {work.pp} (ranks 0 to {work.pp - 1})"
        )
    if work.hidden % work.heads:
        raise UsageError(f"--hidden {work.hidden} must be a multiple of --heads {work.heads}")

    def named(field: str) -> str:
        value = getattr(work, field)
        return f"{field} {value}" if field in fixed else f"{_flag(field)} {value}"

    if work.vp > 1 and work.microbatches % work.pp:
        raise UsageError(
            f"{named('microbatches')} must be a multiple of {named('pp')} with {named('vp')} "
            "(Megatron-LM's interleaved 1F1B runs microbatches in groups of pp)"
        )
    _refuse_too_many_graphs(
        work.vp * work.layers * work.microbatches,
        f"{named('vp')} x {named('layers')} x {named('microbatches')}",
        captured=captured,
    )
    _refuse_oversized(_shape(work))
    _order_of(work)  # any rule the schedule has beyond these
    return work


MAX_GRAPHS = 100_000
"""The most graphs (chunks x blocks x microbatches) a command captures or plans."""

MAX_TENSOR_BYTES = 2**50
"""The largest tensor a workload may make, 1 PiB: more than any machine holds, and not far
below sizes whose byte counts overflow torch's 64-bit size arithmetic."""


def _refuse_too_many_graphs(graphs: int, product: str, *, captured: bool = True) -> None:
    """Refuse more than :data:`MAX_GRAPHS` graphs; ``product`` says what multiplies to them,
    ``captured`` whether the command captures them or only plans them."""
    if graphs > MAX_GRAPHS:
        verb, steps = (
            ("capture", "probed, planned and captured")
            if captured
            else ("plan", "probed and planned")
        )
        raise UsageError(
            f"{product} is {graphs} graphs to {verb}; at most {MAX_GRAPHS} (each is {steps} in "
            "turn: far more would run for hours)"
        )


def _refuse_oversized(shape: BlockShape) -> None:
    """Refuse a block whose largest tensor would exceed :data:`MAX_TENSOR_BYTES`, naming the
    flags it comes from (torch would fail on it with an overflow, or run out of memory)."""
    name, size = _largest_tensor(shape)
    if size > MAX_TENSOR_BYTES:
        raise UsageError(
            f"{name} would take {size} bytes; at most {MAX_TENSOR_BYTES} (1 PiB) per tensor"
        )


def _largest_tensor(shape: BlockShape) -> tuple[str, int]:
    """What the block's largest tensor is, and its bytes."""
    h, mb, seq = shape.hidden, shape.micro_batch, shape.sequence
    tensors = {
        "fc1's weight (4 x hidden x hidden)": 4 * h * h,
        "fc1's output (micro-batch x sequence x 4 x hidden)": mb * seq * 4 * h,
        "the attention scores (micro-batch x heads x sequence x sequence)": (
            mb * shape.heads * seq * seq
        ),
    }
    name, elements = max(tensors.items(), key=lambda item: item[1])
    return name, elements * shape.dtype.itemsize


def _refuse_beyond_memory(shape: BlockShape, blocks: int, device: str, sizes: str) -> None:
    """Refuse, before anything is made, a workload that cannot run on ``device`` whatever
    else it holds: whose ``blocks`` blocks' weights (one copy; a run holds several, and
    gradients) or largest tensor exceed the device's whole memory, where torch's allocator
    would fail later without naming a flag. ``sizes``: the flags that size it, as given."""
    total = _device_memory(device)
    if total is None:
        return
    per_block = sum(p.numel() for p in make_blocks(1, shape, "meta")[0].parameters())
    weights = blocks * per_block * shape.dtype.itemsize
    name, largest = _largest_tensor(shape)
    what, size = (
        (f"the weights of its {plural(blocks, 'block')} alone", weights)
        if weights >= largest
        else (name, largest)
    )
    if size > total:
        raise UsageError(
            f"{sizes}: {what} would take {format_bytes(size)}, more than this machine's "
            f"{format_bytes(total)} "
            f"of {'GPU' if device == 'cuda' else 'CPU'} memory; make the workload smaller"
        )


def _device_memory(device: str) -> int | None:
    """The whole memory of ``device`` (the current GPU's, or the machine's RAM) in bytes;
    None where the platform does not say."""
    if device == "cuda":
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # not a POSIX system that tells
        return None


def _order_of(work: Workload) -> list[int]:
    try:
        return interleaved_1f1b(work.pp, work.vp, work.rank, work.microbatches)
    except ValueError as exc:
        raise UsageError(f"no interleaved 1F1B order for this workload: {exc}") from exc


def _shape(work: Workload) -> BlockShape:
    return BlockShape(
        hidden=work.hidden,
        heads=work.heads,
        sequence=work.sequence,
        micro_batch=work.micro_batch,
        dtype=_DTYPES[work.dtype],
    )


def _device(requested: str | None) -> str:
    """``requested``, checked against this machine; None: cuda when torch sees a GPU."""
    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False); "
            "use --device cpu, or leave --device out to use a GPU only when there is one"
        )
    return requested


@contextlib.contextmanager
def _intra_op_threads(requested: int | None, device: str) -> Iterator[None]:
    """torch's intra-op thread count for the run, restored after it (``main`` may run inside
    a longer process, such as a test session)."""
    count = requested if requested is not None else (1 if device == "cpu" else None)
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _output_file(path: str | None, flag: str) -> None:
    """Refuse an output path whose folder does not exist, before any work."""
    if path is None:
        return
    if not path.strip():
        raise UsageError(f"{flag} {path!r}: an empty file name; give a file name")
    if path.endswith(("/", os.sep)):  # Path() drops the slash, the open at the end would not
        raise UsageError(f"{flag} {path}: ends in '/', a folder's name; give a file name")
    try:  # a name the system refuses (too long, say) fails these checks as the open would
        _check_output_file(Path(path), path, flag)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot be written ({exc.strerror})") from None
    except RuntimeError as exc:  # Path.resolve's symlink loop before Python 3.13
        raise UsageError(f"{flag} {path}: cannot be written ({exc})") from None


def _check_output_file(target: Path, path: str, flag: str) -> None:
    if target.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    resolved = target.resolve()  # where a symbolic link leads: the file the run writes
    folder = resolved.parent
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist; create it first"
        named = f"{target.parent}" if folder == target.parent.resolve() else f"{folder}"
        raise UsageError(f"{flag} {path}: folder {named} {what}")
    existed = resolved.exists()
    # Opened for writing as the run will open it, so that a run is not lost at its end; without
    # blocking, so that a named pipe with no reader is refused (ENXIO) rather than waited on.
    os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666))
    if not existed:  # the file the open made, not a link to it
        resolved.unlink(missing_ok=True)


def _distinct_outputs(outputs: Sequence[tuple[str, str | None]]) -> None:
    """Refuse two output flags naming one file: the later write would replace the earlier."""
    seen: dict[Path, str] = {}
    for flag, path in outputs:
        if path is None:
            continue
        key = Path(path).resolve()
        if key in seen:
            first = seen[key]
            raise UsageError(
                f"{first}, {flag} {path}: the same file twice (the second would overwrite the "
                "first); give each its own file"
            )
        seen[key] = f"{flag} {path}"


def _needs_matplotlib(flag: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            f"{flag} draws with matplotlib, which is not installed: pip install 'leangraph[plot]'"
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return line + (" [...]" if "\n" in text else "")


# ----------------------------------------------------------------------------------- demo


def _demo(args: argparse.Namespace) -> int:
    device = _device(args.device)
    base = DemoConfig()
    if args.hidden % base.shape.heads:
        raise UsageError(
            f"--hidden {args.hidden} must be a multiple of {base.shape.heads} (the demo's "
            "attention heads)"
        )
    if args.microbatches % base.pp_size:
        raise UsageError(
            f"--microbatches {args.microbatches} must be a multiple of {base.pp_size}: the demo "
            f"runs rank 0 of a {base.pp_size}-rank pipeline with {base.vp_size} chunks per rank, "
            "whose interleaved 1F1B order takes microbatches in groups of the rank count"
        )
    config = replace(
        base,
        steps=args.steps,
        num_microbatches=args.microbatches,
        shape=BlockShape(hidden=args.hidden, sequence=args.sequence),
        device=device,
    )
    _refuse_too_many_graphs(
        config.vp_size * config.layers_per_chunk * config.num_microbatches,
        f"{config.vp_size} chunks x {config.layers_per_chunk} blocks x --microbatches "
        f"{config.num_microbatches}",
    )
    _refuse_oversized(config.shape)
    _refuse_beyond_memory(
        config.shape,
        config.vp_size * config.layers_per_chunk,
        device,
        f"--hidden {args.hidden}, --sequence {args.sequence}",
    )
    _order_of(Workload(pp=config.pp_size, vp=config.vp_size, microbatches=config.num_microbatches))
    with _intra_op_threads(args.threads, device), phase_display(not args.no_progress) as progress:
        result = run_demo(config, progress=progress)
    _print_demo(config, result, "--device cpu" if args.device == "cpu" else "No GPU found")
    diffs = [abs(e - g) for e, g in zip(result.eager_losses, result.graphed_losses)]
    worst = max(diffs, key=lambda d: math.inf if math.isnan(d) else d)  # NaN: the worst
    tolerance = 1e-5 * max(1.0, max(result.eager_losses))
    if not worst <= tolerance:  # a NaN loss fails too
        raise CommandError(
            f"graphed and eager losses differ by up to {worst:.2e}, above the tolerance "
            f"{tolerance:.2e}"
        )
    return 0


def _print_demo(config: DemoConfig, result: DemoResult, why_cpu: str) -> None:
    if result.device == "cpu":
        print(
            f"{why_cpu}: running on leangraph's CPU reference backend (graph semantics "
            "emulated on the CPU)."
        )
    print(
        f"device: {result.device}; interleaved 1F1B order of rank {config.rank} "
        f"(pp={config.pp_size}, vp={config.vp_size}, {config.num_microbatches} microbatches):"
    )
    print(f"  {result.order}")
    print(f"{'step':>4}  {'eager loss':>12}  {'graphed loss':>12}  {'|diff|':>9}")
    for step, (e, g) in enumerate(zip(result.eager_losses, result.graphed_losses)):
        print(f"{step:>4}  {e:>12.6f}  {g:>12.6f}  {abs(e - g):>9.2e}")
    if result.memory:
        m = result.memory
        print(
            f"memory: before capture {m['before_capture'] / MIB:.1f} MiB, peak during "
            f"warm-up+capture {m['peak_capture'] / MIB:.1f} MiB, held after capture "
            f"{m['after_capture'] / MIB:.1f} MiB allocated / {m['reserved'] / MIB:.1f} MiB "
            "reserved"
        )
    else:
        print("memory: not measured on the CPU backend")


# ---------------------------------------------------------------------------------- bench


def _default_methods(defaults: Sequence[str], device: str) -> tuple[tuple[str, ...], list[str]]:
    """The methods of ``defaults`` that can run here, and a note per kind left out."""
    notes = []
    on_cuda = [m for m in defaults if m in CUDA_METHODS]
    if on_cuda and device == "cpu":
        uses = " and ".join(CUDA_METHODS[m] for m in on_cuda)
        notes.append(f"{uses} need CUDA, so the {' and '.join(on_cuda)} methods are left out")
    for name in OPT_IN_METHODS:
        why = fused_unavailable(name)
        if name in defaults and why is not None:
            notes.append(f"the {name} method {why}, so it is left out")
    kept = tuple(m for m in defaults if method_unavailable(m, device) is None)
    return kept, notes


def _bench_methods(
    text: str | None, device: str, why_cpu: str, defaults: Sequence[str] = METHODS
) -> tuple[tuple[str, ...], list[str]]:
    """The methods to run (``defaults`` without ``--methods``), and a note on each kind of
    default method left out because it cannot run here."""
    if text is None:
        return _default_methods(defaults, device)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METHODS]
    if unknown or not names:
        wrong = f"unknown method {unknown[0]!r}" if unknown else "no method given"
        raise UsageError(f"--methods: {wrong}; choose from {','.join(METHODS)} (comma-separated)")
    if len(set(names)) < len(names):
        raise UsageError(f"--methods {text}: a method is named twice; name each once")
    on_cuda = [name for name in names if name in CUDA_METHODS]
    if on_cuda and device == "cpu":
        them = " and ".join(on_cuda)
        uses = ", ".join(CUDA_METHODS[name] for name in on_cuda)
        raise UsageError(
            f"--methods {text}: the {them} method{'s need' if len(on_cuda) > 1 else ' needs'} "
            f"a CUDA GPU ({uses}) and this bench runs on the CPU ({why_cpu}); leave {them} out "
            "of --methods or run on a GPU"
        )
    for name in OPT_IN_METHODS:
        why = fused_unavailable(name)
        if name in names and why is not None:
            raise UsageError(
                f"--methods {text}: the {name} method {why}; leave it out of --methods"
            )
    return tuple(name for name in METHODS if name in names), []


def _check_bench_outputs(args: argparse.Namespace, device: str, methods: Sequence[str]) -> None:
    outputs = (("--json", args.json), ("--plot", args.plot), ("--bars", args.bars))
    for flag, path in outputs:
        _output_file(path, flag)
    _distinct_outputs(outputs)
    for flag, path in (("--plot", args.plot), ("--bars", args.bars)):
        if path is None:
            continue
        if device == "cpu":
            raise UsageError(
                f"{flag}: nothing to draw on the CPU: its reference backend measures no memory; "
                f"run on a GPU or drop {flag}"
            )
        _needs_matplotlib(flag)
    if args.rounds and not any(name in GRAPHED_METHODS for name in methods):
        raise UsageError(
            f"--rounds {args.rounds} captures and times the graphed methods again, and "
            f"--methods {','.join(methods)} has none; add one ({','.join(GRAPHED_METHODS)}) or "
            "drop --rounds"
        )
    if args.plot is not None and "leangraph" not in methods:
        raise UsageError("--plot draws leangraph's memory timeline: add leangraph to --methods")
    if args.launches and device == "cpu":
        raise UsageError(
            "--launches counts CUDA kernel and graph launches (torch.profiler's CUDA activity): "
            "nothing to count on the CPU; run on a GPU or drop --launches"
        )


def _bench(args: argparse.Namespace) -> int:
    device = _device(args.device)
    why_cpu = "--device cpu" if args.device == "cpu" else "no GPU found"
    if args.preset is not None:
        config, described, notes = _preset_config(args, device, why_cpu)
    else:
        work = _workload(args, CPU_WORKLOAD if device == "cpu" else GPU_WORKLOAD)
        micro = args.replay_micro or args.replays is not None
        _refuse_beyond_memory(
            _shape(work),
            1 if micro else work.vp * work.layers,
            device,
            f"--hidden {work.hidden}, --sequence {work.sequence}, --micro-batch "
            f"{work.micro_batch}" + ("" if micro else f", --vp {work.vp}, --layers {work.layers}"),
        )
        if micro:
            return _replay_micro(args, device, why_cpu, work)
        methods, notes = _bench_methods(args.methods, device, why_cpu)
        _check_bench_outputs(args, device, methods)
        config = BenchConfig(
            pp_size=work.pp,
            vp_size=work.vp,
            rank=work.rank,
            num_microbatches=work.microbatches,
            layers_per_chunk=work.layers,
            steps=args.steps if args.steps is not None else (3 if device == "cpu" else 5),
            methods=methods,
            device=device,
            shape=_shape(work),
            rounds=args.rounds,
            launch_steps=LAUNCH_STEPS if args.launches else 0,
        )
        described = work.describe()
    if args.grad_hooks:
        if FUSED_NO_HOOKS in config.methods:
            if args.methods is not None:
                raise UsageError(
                    f"--grad-hooks: {GRAD_HOOKS_WITHOUT_ACCUMULATORS}; drop one of them"
                )
            kept = tuple(m for m in config.methods if m != FUSED_NO_HOOKS)
            config = replace(config, methods=kept)
            notes.append(f"the {FUSED_NO_HOOKS} method runs no accumulator hook, so it is left out")
        config = replace(config, grad_hooks=True)
    if device == "cpu":
        print(
            f"{why_cpu[0].upper()}{why_cpu[1:]}: leangraph's CPU reference backend, times "
            f"only (it measures no memory), {plural(args.threads or 1, 'intra-op thread')}"
            f"{''.join('; ' + note for note in notes)}."
        )
    else:
        print("".join(f"Note: {note[0].upper()}{note[1:]}.\n" for note in notes), end="")
    hooked = "; a gradient-ready hook on every parameter" if config.grad_hooks else ""
    print(
        f"workload: {described}; {', '.join(config.methods)}; {plural(config.steps, 'timed step')} "
        f"each{hooked}"
    )
    with _intra_op_threads(args.threads, device), phase_display(not args.no_progress) as progress:
        result = run_bench(config, progress=progress)
    print(format_table(result))
    _write_bench_outputs(args, result)
    wrong = [name for name in LEANGRAPH_METHODS if not result.losses_agree.get(name, True)]
    if wrong:
        raise CommandError(
            f"{' and '.join(wrong)}: losses differ from eager's (the loss column says DIFF)"
        )
    return 0


_PRESET_FIXED = ("pp", "vp", "rank", "layers", "hidden", "heads", "micro_batch", "dtype")
"""The workload flags a preset sets; ``--sequence`` and ``--microbatches`` may change it."""


def _preset_config(
    args: argparse.Namespace, device: str, why_cpu: str
) -> tuple[BenchConfig, str, list[str]]:
    """``bench --preset``: the flags checked against the preset, its config, its one-line
    description and the notes on default methods left out."""
    preset = PRESETS[args.preset]
    fixed = [_flag(name) for name in _PRESET_FIXED if getattr(args, name) is not None]
    if args.replay_micro or args.replays is not None:
        fixed.append("--replay-micro" if args.replay_micro else "--replays")
    if fixed:
        them = "them" if len(fixed) > 1 else "it"
        raise UsageError(
            f"{', '.join(fixed)}: not with --preset {preset.name}, which sets the workload "
            f"(only --sequence and --microbatches change its size); drop {them} or drop --preset"
        )
    work = _workload(args, _preset_workload(preset), fixed=_PRESET_FIXED)
    if device == "cpu":
        raise UsageError(
            f"--preset {preset.name}: {preset.title} ({preset.weight_bytes() / 1024**3:.0f} GiB "
            "of weights, as much of gradients, and tens of GiB of activations per step) is too "
            f"big for the CPU reference backend, and this bench runs on the CPU ({why_cpu}); run "
            "on a GPU"
        )
    methods, notes = _bench_methods(args.methods, device, why_cpu, preset.methods)
    _check_bench_outputs(args, device, methods)
    config = preset.config(
        device=device,
        sequence=work.sequence,
        num_microbatches=work.microbatches,
        steps=args.steps,
        methods=methods,
        rounds=args.rounds,
        launch_steps=LAUNCH_STEPS if args.launches else 0,
    )
    return config, preset.describe(sequence=work.sequence, microbatches=work.microbatches), notes


def _preset_workload(preset: BenchPreset) -> Workload:
    """The preset as the command line's workload, for its checks of the flags it may take."""
    return Workload(
        pp=preset.pp_size,
        vp=preset.vp_size,
        rank=preset.rank,
        microbatches=preset.num_microbatches,
        layers=preset.layers_per_chunk,
        hidden=preset.shape.hidden,
        heads=preset.shape.heads,
        sequence=preset.shape.sequence,
        micro_batch=preset.shape.micro_batch,
    )


def _given(name: str) -> Callable[[argparse.Namespace], bool]:
    """Whether the workload flag of field ``name`` was given (such flags default to None)."""
    return lambda args: getattr(args, name) is not None


_NOT_WITH_REPLAY_MICRO = (
    ("--methods", lambda a: a.methods is not None),
    ("--steps", lambda a: a.steps is not None),
    ("--rounds", lambda a: a.rounds != 0),
    ("--launches", lambda a: a.launches),
    ("--grad-hooks", lambda a: a.grad_hooks),
    ("--plot", lambda a: a.plot is not None),
    ("--bars", lambda a: a.bars is not None),
    *((_flag(name), _given(name)) for name in ("pp", "vp", "rank", "microbatches", "layers")),
)
"""The bench's flags that the replay microbenchmark has no use for, and how to tell one given."""


def _replay_micro(args: argparse.Namespace, device: str, why_cpu: str, work: Workload) -> int:
    """``bench --replay-micro``: checked, run, printed (and written with ``--json``)."""
    if not args.replay_micro:
        raise UsageError(
            "--replays: only with --replay-micro (replays per round); add --replay-micro or "
            "drop --replays"
        )
    given = [flag for flag, is_given in _NOT_WITH_REPLAY_MICRO if is_given(args)]
    if given:
        raise UsageError(
            f"{', '.join(given)}: not used with --replay-micro (it times one graphed layer's "
            "replays, no training steps); drop them or drop --replay-micro"
        )
    if device == "cpu":
        raise UsageError(
            "--replay-micro times torch.cuda.make_graphed_callables' replays against "
            f"leangraph's, which needs a CUDA GPU, and this bench runs on the CPU ({why_cpu}); "
            "run on a GPU"
        )
    _output_file(args.json, "--json")
    replays = {} if args.replays is None else {"replays": args.replays}
    config = ReplayMicroConfig(shape=_shape(work), device=device, **replays)
    print(
        f"replay microbenchmark: one block of hidden {work.hidden}, {work.heads} heads, "
        f"sequence {work.sequence}, micro-batch {work.micro_batch}, {work.dtype}; "
        f"{config.rounds} rounds of {config.replays} forward+backward replays per method"
    )
    with _intra_op_threads(args.threads, device):
        result = run_replay_micro(config)
    print(format_replay_micro(result))
    if args.json:
        _write_json(args.json, result.to_json())
        print(f"wrote {args.json} (every round's figures and the config)")
    return 0


def _write_json(path: str, data: object) -> None:
    """Write ``data`` to the ``--json`` file; a write the system refuses at the end of a run
    (a full disk, say: the folder was checked before any work) is a one-line error naming
    the flag."""
    try:
        with open(path, "w") as handle:
            json.dump(data, handle, indent=2)
    except OSError as exc:
        raise CommandError(f"--json {path}: cannot be written ({exc.strerror})") from None


def _write_bench_outputs(args: argparse.Namespace, result: BenchResult) -> None:
    if args.json:
        _write_json(args.json, result.to_json())
        timeline = " and leangraph's memory timeline" if result.report is not None else ""
        print(f"wrote {args.json} (every figure{',' if timeline else ' and'} the config{timeline})")
    if args.plot:
        plot_timeline(result, args.plot)
        print(f"wrote {args.plot} (leangraph's memory timeline)")
    if args.bars:
        plot_bars(result, args.bars)
        print(f"wrote {args.bars} (memory per method)")


# ----------------------------------------------------------------------------------- plan


@contextlib.contextmanager
def _working_folder_importable() -> Iterator[str]:
    """The working folder first on ``sys.path`` for an import, as ``python -m`` has it."""
    folder = os.getcwd()
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield folder
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


def _import_function(spec: str) -> Callable[[], Any]:
    module_name, colon, attr = spec.partition(":")
    if not (colon and module_name and attr) or ":" in attr:
        raise UsageError(f"--function {spec!r}: expected module:function, e.g. mymodel:make")
    with _working_folder_importable() as folder:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                raise UsageError(
                    f"--function {spec}: no module {missing!r} in the working folder ({folder}) "
                    "or on sys.path; run from the folder that holds it"
                ) from exc
            raise CommandError(f"--function {spec}: importing {module_name}: {exc}") from exc
        except SystemExit as exc:
            raise CommandError(
                f"--function {spec}: importing {module_name} called sys.exit({exc.code!r})"
            ) from exc
        except Exception as exc:
            raise CommandError(
                f"--function {spec}: importing {module_name} raised {type(exc).__name__}: "
                f"{_first_line(exc)}"
            ) from exc
    function = getattr(module, attr, None)
    if function is None:
        raise UsageError(f"--function {spec}: module {module_name} has no attribute {attr!r}")
    if not callable(function):
        kind = type(function).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise UsageError(
            f"--function {spec}: {module_name}.{attr} is {article} {kind}, not a function"
        )
    return function


def _workload_of(spec: str) -> tuple[Any, Any, dict[str, Any]]:
    """Call the ``--function`` and check what it returned."""
    function = _import_function(spec)
    try:
        made = function()
    except SystemExit as exc:  # not the command's own exit: the plan was never made
        raise CommandError(f"--function {spec}: it called sys.exit({exc.code!r})") from exc
    except Exception as exc:
        raise CommandError(
            f"--function {spec}: it raised {type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        got = f"a {len(made)}-tuple" if isinstance(made, (tuple, list)) else type(made).__name__
        raise UsageError(
            f"--function {spec}: must return (callables, sample_args) or (callables, "
            f"sample_args, dict of plan_memory keywords), got {got}"
        )
    keywords = made[2] if len(made) == 3 else {}
    if not isinstance(keywords, dict):
        raise UsageError(
            f"--function {spec}: the third item returned must be a dict of plan_memory "
            f"keywords, got {type(keywords).__name__}"
        )
    parameters = inspect.signature(leangraph.plan_memory).parameters.values()
    taken = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = [key for key in keywords if key not in taken]
    if unknown:
        raise UsageError(
            f"--function {spec}: the dict returned must hold plan_memory keywords "
            f"({', '.join(taken)}), got {', '.join(map(repr, unknown))}"
        )
    return made[0], made[1], keywords


# ``leangraph plan --accumulation``: each choice's (fuse_grad_accumulation,
# overlap_grad_accumulation).
_ACCUMULATION_MODES: dict[str, tuple[bool, bool]] = {
    "autograd": (False, False),
    "fused": (True, False),
    "overlap": (False, True),
}


def _accumulation_keywords(choice: str) -> dict[str, bool]:
    fuse, overlap = _ACCUMULATION_MODES[choice]
    return {"fuse_grad_accumulation": fuse, "overlap_grad_accumulation": overlap}


def _plan(args: argparse.Namespace) -> int:
    if args.function is not None:
        given = _workload_given(args)
        if given:
            them = "them" if len(given) > 1 else "it"
            raise UsageError(
                f"{', '.join(given)}: not used with --function (the function returns the "
                f"workload); drop {them} or drop --function"
            )
        callables, sample_args, keywords = _workload_of(args.function)
        if args.accumulation is not None:
            keywords = {**keywords, **_accumulation_keywords(args.accumulation)}
        plan = leangraph.plan_memory(callables, sample_args, **keywords)
        print(f"memory plan of {args.function}:")
    else:
        work = _workload(args, GPU_WORKLOAD, captured=False)
        shape = _shape(work)
        count = work.vp * work.layers
        fuse, overlap = _ACCUMULATION_MODES[args.accumulation or "autograd"]
        blocks = make_blocks(count, shape, "meta")
        samples = tuple((sample_hidden(shape, "meta"),) for _ in range(count * work.microbatches))
        plan = leangraph.plan_memory(
            tuple(blocks),
            samples,
            order=_order_of(work),
            num_layers_per_chunk=work.layers,
            fuse_grad_accumulation=fuse,
            overlap_grad_accumulation=overlap,
        )
        print(f"memory plan of {work.describe()}, computed on meta tensors:")
    print(plan.describe())
    return 0


# --------------------------------------------------------------------------------- parser


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on an error, show the Python traceback instead of one line",
    )
    return common


def _add_demo(sub: Any, common: argparse.ArgumentParser) -> None:
    demo = sub.add_parser(
        "demo",
        parents=[common],
        formatter_class=_HelpFormatter,
        help="capture a small transformer stack and train it eagerly and graphed",
        description="Capture the transformer blocks of rank 0 of a 2-rank pipeline with 2 "
        "chunks of 2 blocks (interleaved 1F1B), train them eagerly and graphed from the same "
        "weights, and print both losses per step (and memory on a GPU). Exit status 1 when "
        "they differ.",
    )
    demo.add_argument(
        "--steps",
        type=_count(1, (MAX_DEMO_STEPS, "its data is made before the first step")),
        metavar="N",
        default=5,
        help=f"training steps of each, at most {MAX_DEMO_STEPS}",
    )
    demo.add_argument(
        "--microbatches",
        type=_count(1),
        metavar="N",
        default=4,
        help="microbatches per step; a multiple of 2",
    )
    demo.add_argument(
        "--hidden",
        type=_count(1),
        metavar="N",
        default=64,
        help="hidden size of the blocks; a multiple of 4",
    )
    demo.add_argument(
        "--sequence", type=_count(1), metavar="N", default=32, help="tokens per microbatch"
    )
    _add_device(demo)
    _add_threads(demo)
    _add_no_progress(demo)
    demo.set_defaults(handler=_demo, command_parser=demo)


def _add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where to run (default: cuda when torch sees a GPU, else the CPU reference backend)",
    )


THREADS_PER_CPU = 4
"""``--threads`` takes up to this many threads per CPU: torch's thread pool crashes the process
(a segmentation fault, not an error) when it cannot start the threads asked for."""


def _add_threads(parser: argparse.ArgumentParser) -> None:
    cpus = os.cpu_count() or 1
    bound = (THREADS_PER_CPU * cpus, f"{THREADS_PER_CPU} per CPU, {plural(cpus, 'CPU')} here")
    parser.add_argument(
        "--threads",
        type=_count(1, bound),
        metavar="N",
        help=f"torch's intra-op CPU threads during the run, at most {THREADS_PER_CPU} per CPU "
        "(default: 1 on the CPU, where these "
        "small ops only contend for more, and many times slower on a busy machine; torch's "
        "own default on a GPU)",
    )


def _add_no_progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (a bar on a terminal, else one line per phase)",
    )


def _add_bench(sub: Any, common: argparse.ArgumentParser) -> None:
    bench = sub.add_parser(
        "bench",
        parents=[common],
        formatter_class=_HelpFormatter,
        help="eager vs torch.cuda.make_graphed_callables vs leangraph on one pipeline rank",
        description="Train one pipeline rank's blocks eagerly, with torch's "
        "make_graphed_callables, with leangraph's, and as one CUDA graph of the whole step "
        "(whole-step, the limit), one after the other from the same weights, and print memory "
        "and time per method, each step time also as a ratio to whole-step's (x limit). On "
        "the CPU: a small workload, eager and the leangraph methods (torch and whole-step "
        "need CUDA), times only.",
    )
    _add_workload_options(bench, GPU_WORKLOAD, CPU_WORKLOAD)
    bench.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a named workload at a real model's geometry instead of the flags above (GPU "
        "only; --sequence and --microbatches may change its size). llama3-70b-pp4vp5: rank 0 "
        "of PP4 x VP5, 20 Llama-3-70B layers as one TP2 rank holds them, sequence 4096, 16 "
        "microbatches, eager vs torch vs leangraph (the seed's A/B; about 16 GiB of weights, "
        "an H200); -norope: the same without RoPE",
    )
    bench.add_argument(
        "--steps",
        type=_count(1, (MAX_STEPS, "more would run for days")),
        metavar="N",
        help="timed training steps per method, after one measured for memory and one warm, "
        f"at most {MAX_STEPS} (default: 5 on a GPU, 3 on the CPU)",
    )
    bench.add_argument(
        "--methods",
        metavar="LIST",
        help=f"comma-separated, from {','.join(METHODS)} (default: all that can run here: "
        f"{' and '.join(CUDA_METHODS)} need CUDA, {FUSED} a leangraph whose "
        "make_graphed_callables takes fuse_grad_accumulation); whole-step is the whole "
        "training step captured as one CUDA graph, the limit the others' 'x limit' compares "
        f"with; {OVERLAP} is leangraph with overlap_grad_accumulation=True, {FUSED} with "
        f"fuse_grad_accumulation=True, {FUSED_PYTHON_HOOKS} also with "
        f"accumulator_hooks='python', {FUSED_NO_HOOKS} with accumulator_hooks=False",
    )
    _add_bench_measures(bench)
    _add_replay_micro(bench)
    _add_device(bench)
    _add_threads(bench)
    _add_no_progress(bench)
    bench.add_argument("--json", metavar="FILE", help="write every figure as JSON here")
    bench.add_argument(
        "--plot", metavar="FILE", help="write leangraph's memory timeline PNG here (GPU only)"
    )
    bench.add_argument(
        "--bars", metavar="FILE", help="write a bar chart of each method's memory here (GPU only)"
    )
    bench.set_defaults(handler=_bench, command_parser=bench)


def _add_bench_measures(bench: argparse.ArgumentParser) -> None:
    """What the bench measures besides each method's one run: rounds, launches, hooks."""
    bench.add_argument(
        "--rounds",
        type=_count(0, (MAX_ROUNDS, "each captures every graphed method again")),
        metavar="N",
        default=0,
        help="then capture and time the graphed methods again, taking turns, this many times "
        f"(at most {MAX_ROUNDS})",
    )
    bench.add_argument(
        "--launches",
        action="store_true",
        help=f"once all timing is done, profile {LAUNCH_STEPS} steps of each method "
        "(torch.profiler; graphed methods captured again) and print its graph launches and "
        "kernels launched outside graphs per step (GPU only)",
    )
    bench.add_argument(
        "--grad-hooks",
        action="store_true",
        help="register a gradient-ready hook on every parameter's accumulator node, as "
        "Megatron-core's DDP does, for every method but whole-step (after capture), and "
        f"print each method's hook calls per step ({FUSED_NO_HOOKS}, which would never run "
        "them, is left out)",
    )


def _add_replay_micro(bench: argparse.ArgumentParser) -> None:
    """The bench's replay microbenchmark, which runs instead of the bench."""
    bench.add_argument(
        "--replay-micro",
        action="store_true",
        help="instead of the bench: the host time of one forward+backward replay of one block "
        "graphed by torch and by leangraph, side by side, and their ratio (GPU only; give a "
        "small block, e.g. --hidden 256 --heads 4 --sequence 128, so that the host is the "
        "bound)",
    )
    bench.add_argument(
        "--replays",
        type=_count(1, (MAX_REPLAYS, "more would run for hours")),
        metavar="N",
        help="with --replay-micro: replays per method and round, at most "
        f"{MAX_REPLAYS} (default: {ReplayMicroConfig().replays}, in each of "
        f"{ReplayMicroConfig().rounds} rounds)",
    )


def _add_plan(sub: Any, common: argparse.ArgumentParser) -> None:
    plan = sub.add_parser(
        "plan",
        parents=[common],
        formatter_class=_HelpFormatter,
        help="print the memory plan of a workload, on meta tensors (no GPU needed)",
        description="Print leangraph.plan_memory's plan of one pipeline rank of transformer "
        "blocks, computed on meta tensors, or of your own workload with --function.",
    )
    _add_workload_options(plan, GPU_WORKLOAD)
    plan.add_argument(
        "--function",
        metavar="MODULE:FUNCTION",
        help="plan your own workload instead: FUNCTION() returns (callables, sample_args) or "
        "(callables, sample_args, dict of plan_memory keywords); MODULE is imported from the "
        "working folder or sys.path; the workload options above do not apply",
    )
    plan.add_argument(
        "--accumulation",
        choices=sorted(_ACCUMULATION_MODES),
        help="how parameter gradients accumulate: autograd (the default), fused "
        "(fuse_grad_accumulation=True: the buffers the graphs add into, counted as the "
        "parameters stand, every one on the meta workload) or overlap "
        "(overlap_grad_accumulation=True: capture keeps the latest backward's parameter "
        "gradients); with --function, over what its keywords say",
    )
    plan.set_defaults(handler=_plan, command_parser=plan)


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``leangraph`` command line (``demo``, ``bench``, ``plan``)."""
    common = _common_options()
    parser = _Parser(
        prog="leangraph",
        description=DESCRIPTION,
        epilog=EPILOG,
        parents=[common],
        formatter_class=_TableHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"leangraph {leangraph.__version__} (torch {torch.__version__})",
        help="print leangraph's and torch's versions and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(sub, common)
    _add_bench(sub, common)
    _add_plan(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``leangraph`` command line on ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, 1 when the run failed (one line on stderr), 2 for a wrong
        argument found by a command. ``--help``, ``--version`` and arguments argparse rejects
        exit through ``SystemExit`` (status 0, 0 and 2; a rejection is one line on stderr).
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the parser they came to, so its --help is the one named
        words = list(sys.argv[1:] if argv is None else argv)
        before = words[: words.index(args.command)] if args.command in words else []
        early = [word for word in unknown if word in before]
        if early:  # given before the command: the top level's (`leangraph --bogus plan`)
            parser.error(f"unrecognized arguments: {' '.join(early)}")
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    prog = f"leangraph {args.command}"
    if getattr(args, "debug", False):
        return int(args.handler(args))
    try:
        return int(args.handler(args))
    except CommandError as exc:
        return _fail(prog, str(exc), exc.status)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", 130)
    except BrokenPipeError:
        return _reader_gone()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {_first_line(exc)}"
        return _fail(prog, f"{reason} (run again with --debug for the traceback)", 1)


def _reader_gone() -> int:
    """Whoever read stdout stopped (``leangraph plan | head -1``): end quietly, with the
    status of a process SIGPIPE ended, as shell tools do; stdout goes to the null device, so
    the interpreter's last flush at exit cannot fail too."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: a stdout without a file
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
    return 128 + 13  # SIGPIPE


def _fail(prog: str, message: str, status: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status
