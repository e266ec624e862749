"""What a graphed callable accepts at replay: the captured call's structure and tensors.

A :class:`CallSignature` is made once from the sample arguments. :meth:`CallSignature.bind`
turns a replay's ``(args, kwargs)`` into tensor leaves in capture order, or raises naming the
callable, what was captured and what was got. Nothing is cast, broadcast or moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["CallSignature", "TensorSpec"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a replay argument must match: the captured tensor's metadata."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype, tensor.device, tensor.requires_grad)

    def check(self, owner: str, value: object) -> torch.Tensor:
        """Return ``value`` if it matches this spec, else raise naming ``owner``."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{owner} {self.name} must be a tensor as at capture, got {type(value).__name__}"
            )
        if value.dtype != self.dtype:
            raise TypeError(f"{owner} {self.name} must keep dtype {self.dtype}, got {value.dtype}")
        if tuple(value.shape) != self.shape:
            raise ValueError(
                f"{owner} {self.name} must keep shape {self.shape}, got {tuple(value.shape)}"
            )
        if value.device != self.device:
            raise ValueError(f"{owner} {self.name} must stay on {self.device}, got {value.device}")
        if value.requires_grad != self.requires_grad:
            raise ValueError(
                f"{owner} {self.name} must have requires_grad={self.requires_grad} as at "
                f"capture, got requires_grad={value.requires_grad}"
            )
        return value


class CallSignature:
    """The structure (``tree``, of ``(args, kwargs)``) and tensor specs of a captured call.

    Args:
        owner: How errors name the callable.
        samples: The sample call's tensor leaves.
        tree: The sample call's pytree structure, as ``(args, kwargs)``.
    """

    def __init__(self, owner: str, samples: Sequence[torch.Tensor], tree: pytree.TreeSpec):
        self.owner = owner
        self.tree = tree
        sample_call = pytree.tree_unflatten(list(samples), tree)
        self.specs = tuple(
            TensorSpec.of(name, t) for name, t in zip(_leaf_names(sample_call), samples)
        )
        self._kwarg_names = tuple(sample_call[1])
        # Tensors passed positionally, the usual call: binding then skips the pytree walk.
        self._positional_arity = (
            len(samples) if tree == pytree.tree_structure((tuple(samples), {})) else None
        )

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensor leaves of a replay's arguments, checked against the captured ones.

        Raises:
            TypeError, ValueError: if they differ in structure, keys, dtype, shape, device or
                ``requires_grad``, naming the argument.
        """
        if (
            not kwargs
            and len(args) == self._positional_arity
            and all(isinstance(arg, torch.Tensor) for arg in args)
        ):
            leaves: list[Any] = list(args)  # what pytree gives here, without its walk
        else:
            leaves = self._structured_leaves(args, kwargs)
        return [spec.check(self.owner, leaf) for spec, leaf in zip(self.specs, leaves)]

    def unflatten(self, leaves: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of the captured structure over ``leaves``."""
        args, kwargs = pytree.tree_unflatten(list(leaves), self.tree)
        return args, kwargs

    def _structured_leaves(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Leaves of a call with containers or keywords, checked against the captured tree."""
        if set(kwargs) == set(self._kwarg_names):  # keyword order is the caller's business
            kwargs = {name: kwargs[name] for name in self._kwarg_names}
        leaves, tree = pytree.tree_flatten((args, kwargs))
        if tree != self.tree:
            self._raise_mismatch(args, kwargs, tree)
        return leaves

    def _raise_mismatch(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], tree: pytree.TreeSpec
    ) -> None:
        """Name the first argument whose structure differs from capture."""
        placeholder = torch.empty(0, device="meta")  # only the structure is described
        want_args, want_kwargs = self.unflatten([placeholder] * len(self.specs))
        if len(args) != len(want_args):
            raise TypeError(
                f"{self.owner} takes {len(want_args)} positional arguments as at capture, "
                f"got {len(args)}"
            )
        if set(kwargs) != set(want_kwargs):
            raise TypeError(
                f"{self.owner} takes keyword arguments {sorted(want_kwargs)} as at capture, "
                f"got {sorted(kwargs)}"
            )
        pairs = [(f"input {i}", got, want) for i, (got, want) in enumerate(zip(args, want_args))]
        pairs += [(f"kwarg {key!r}", kwargs[key], want_kwargs[key]) for key in want_kwargs]
        for name, got, want in pairs:
            if pytree.tree_structure(got) != pytree.tree_structure(want):
                raise TypeError(
                    f"{self.owner} {name} must keep its structure from capture "
                    f"({_describe(want)}), got {_describe(got)}"
                )
        raise TypeError(
            f"{self.owner}: arguments must keep their structure from capture ({self.tree}), "
            f"got {tree}"
        )


def _leaf_names(tree: Any) -> list[str]:
    """Readable names for the tensor leaves of ``(args, kwargs)``."""
    names = []
    for path, _ in pytree.tree_flatten_with_path(tree)[0]:
        group, head, *rest = path
        suffix = "".join(str(k) for k in rest)
        if isinstance(group, pytree.SequenceKey) and group.idx == 0:  # positional arguments
            assert isinstance(head, pytree.SequenceKey)
            names.append(f"input {head.idx}{suffix}")
        else:
            assert isinstance(head, pytree.MappingKey)
            names.append(f"kwarg {head.key!r}{suffix}")
    return names


def _describe(value: Any) -> str:
    """A short description of an argument's pytree structure for error messages."""
    if isinstance(value, torch.Tensor):
        return "a tensor"
    count = len(pytree.tree_leaves(value))
    return f"a {type(value).__name__} of {count} {'leaf' if count == 1 else 'leaves'}"
