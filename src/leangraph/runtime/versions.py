"""What a backward graph reads in place, version-checked as eager's backward checks it.

Eager autograd refuses a backward once a tensor it saved was modified in place after the
forward ("one of the variables needed for gradient computation has been modified by an
inplace operation"). A backward graph reads such tensors where they are, so without this
check it would compute with the new values: outputs it reads (R24; an input returned as is
among them, which on CUDA is the static input itself), static inputs it reads (R24 too: a
chained layer's is the previous layer's output buffer itself, which the caller holds),
parameters it reads (R28; an optimizer step before the backward) and module buffers it reads
(R28 too: a scale written between the forward and the backward). A static input that a
replay copied its argument into is not the caller's: an argument modified in place after
the forward leaves the graph's copy, and so the gradient, as at the forward.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence

import torch

from ..build.record import GraphRecord

__all__ = ["SavedReads"]

_VERSION = operator.attrgetter("_version")


class SavedReads:
    """The outputs, static inputs, parameters and module buffers one graph's backward reads,
    and their versions after its last forward replay; make one only where the record has
    some (``SavedReads.of``)."""

    def __init__(self, label: str, record: GraphRecord) -> None:
        self._label = label
        self._record = record
        buffers = dict(record.modules.buffers) if record.modules is not None else {}
        self._tensors: tuple[torch.Tensor, ...] = (
            tuple(record.static_outputs[i] for i in record.saved_outputs)
            + tuple(record.static_inputs[i] for i in record.saved_inputs)
            + tuple(record.params[i] for i in record.saved_params)
            + tuple(buffers[name] for name in record.saved_buffers)
        )
        self._versions: tuple[int, ...] = ()
        # A chained input is the previous layer's output the caller holds, another tensor
        # than the static input over that memory on CUDA (whose version counter is its own):
        # its version is read on the argument each forward replay took, held weakly (the
        # caller's tensor keeps its autograd graph alive).
        self._chained = tuple(
            (k, i) for k, i in enumerate(record.saved_inputs) if record.chained_from[i] is not None
        )
        self._arguments: tuple[tuple[int, weakref.ref[torch.Tensor], int], ...] = ()

    @classmethod
    def of(cls, label: str, record: GraphRecord) -> SavedReads | None:
        """The check for ``record``'s graph, or None where its backward reads none."""
        reads = (
            record.saved_outputs
            or record.saved_inputs
            or record.saved_params
            or record.saved_buffers
        )
        return cls(label, record) if reads else None

    def note(self, inputs: Sequence[torch.Tensor]) -> None:
        """After a forward replay on ``inputs`` (its tensor arguments): the versions its
        backward must find."""
        self._versions = tuple(map(_VERSION, self._tensors))
        if self._chained:
            self._arguments = tuple(
                (k, weakref.ref(inputs[i]), inputs[i]._version) for k, i in self._chained
            )

    def check(self) -> None:
        """Before a backward replay.

        Raises:
            RuntimeError: naming the first output or input (R24), or parameter or buffer
                (R28), modified in place since the forward replay.
        """
        if tuple(map(_VERSION, self._tensors)) == self._versions and all(
            _unchanged(*argument) for argument in self._arguments
        ):
            return
        record, label = self._record, self._label
        outputs, inputs = len(record.saved_outputs), len(record.saved_inputs)
        read = list(zip(self._tensors, self._versions))
        for k, ref, version in self._arguments:
            argument = ref()
            if argument is not None:
                read[outputs + k] = (argument, version)
        for position, (tensor, version) in enumerate(read):
            if tensor._version == version:
                continue
            if position < outputs:
                raise RuntimeError(
                    f"{label}: output {record.saved_outputs[position]} was modified in place "
                    f"after its forward replay (version {version}, now {tensor._version}), but "
                    "the backward reads it (it is saved for the gradient); eager's backward "
                    "refuses this too (one of the variables needed for gradient computation "
                    "has been modified by an inplace operation). Clone the output before "
                    "modifying it"
                )
            if position < outputs + inputs:
                index = record.saved_inputs[position - outputs]
                source = record.chained_from[index]
                what = f"the output buffer of {source}" if source else "its static buffer"
                raise RuntimeError(
                    f"{label}: input {index} ({what}) was modified in place after the "
                    f"forward replay (version {version}, now {tensor._version}), but the "
                    "backward reads it (it is saved for the gradient), so the backward graph "
                    "would compute with the new values; eager's backward refuses this too "
                    "(one of the variables needed for gradient computation has been modified "
                    "by an inplace operation). Clone it before modifying it"
                )
            if position >= outputs + inputs + len(record.saved_params):
                name = record.saved_buffers[position - outputs - inputs - len(record.saved_params)]
                raise RuntimeError(
                    f"{label}: buffer {name!r} was modified in place after the forward replay "
                    f"(version {version}, now {tensor._version}), but the backward reads it "
                    "(it is saved for the gradient), so the backward graph would compute with "
                    "the new values; eager's backward refuses this too (one of the variables "
                    "needed for gradient computation has been modified by an inplace "
                    "operation). Update the buffer after the backward"
                )
            name = record.param_names[record.saved_params[position - outputs - inputs]]
            raise RuntimeError(
                f"{label} parameter {name!r} was modified in place after the forward replay "
                f"(version {version}, now {tensor._version}), but the backward reads it (it is "
                "saved for the gradient), so the backward graph would compute with the new "
                "values; eager's backward refuses this too (one of the variables needed for "
                "gradient computation has been modified by an inplace operation). Run the "
                "backward before the optimizer step (or any other in-place write into the "
                "parameters)"
            )


def _unchanged(_: int, ref: weakref.ref[torch.Tensor], version: int) -> bool:
    """Whether a chained argument noted at ``version`` is gone or still at it."""
    held = ref()
    return held is None or held._version == version
