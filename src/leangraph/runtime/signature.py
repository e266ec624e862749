"""What a graphed callable accepts at replay: the captured call's structure and tensors.

A :class:`CallSignature` is made once from the sample arguments. :meth:`CallSignature.bind`
turns a replay's ``(args, kwargs)`` into tensor leaves in capture order, or raises naming the
callable, what was captured and what was got. Non-tensor leaves are constants of the graph and
must equal their capture values. Nothing is broadcast, moved or cast: a dtype must be the
captured one, since eager would compute in the dtype it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..leaves import TENSOR, LeafTemplate, leaf_names, not_dense, same_constant, tensor_subclass

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

    def matches(self, value: object) -> bool:
        """Whether ``value`` is a plain tensor of exactly this spec's dtype, shape and device
        (the replay's usual argument; :meth:`check` accepts more, or says what differs)."""
        return (
            type(value) is torch.Tensor
            and value.dtype is self.dtype
            and value.shape == self.shape
            and value.device == self.device
        )

    def check(self, owner: str, value: object) -> torch.Tensor:
        """Return ``value`` if a replay may copy it into this spec's static buffer, else
        raise naming ``owner``.

        The dtype must be the captured one: even a widening copy (fp16 into an fp32 buffer)
        would compute in the buffer's dtype and return it, where eager computes in the
        argument's (and a bool mask copied into an int64 buffer would index instead of mask).
        ``requires_grad`` may differ: an input that requires grad only at replay gets no
        gradient (the caller warns), one that no longer does simply gets none.
        """
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{owner} {self.name} must be a tensor as at capture, got {type(value).__name__}"
            )
        subclass = tensor_subclass(value)
        if subclass is not None:
            raise TypeError(
                f"{owner} {self.name} must be a torch.Tensor as at capture, got a {subclass}; "
                "the graph replays the kernels capture recorded for a plain tensor and returns "
                "plain tensors, where eager would follow the subclass. Pass "
                "tensor.as_subclass(torch.Tensor), or leave this call eager"
            )
        if value.dtype != self.dtype:
            raise TypeError(
                f"{owner} {self.name} must keep dtype {self.dtype} as at capture, got "
                f"{value.dtype}; a graph computes in its captured dtypes, so make the samples "
                "in the dtype the callable receives (under autocast, the previous layer's "
                "output dtype)"
            )
        if tuple(value.shape) != self.shape:
            raise ValueError(
                f"{owner} {self.name} must keep shape {self.shape}, got {tuple(value.shape)}"
            )
        if value.device != self.device:
            raise ValueError(f"{owner} {self.name} must stay on {self.device}, got {value.device}")
        return value

    def check_dense(self, owner: str, value: torch.Tensor) -> None:
        """Raise naming ``owner`` if ``value`` is not a dense tensor with storage, which a
        replay could not copy into this spec's buffer. Asked only once something failed: a
        sparse tensor matches the spec's dtype, shape and device, so only its copy fails, and
        a nested one's sizes cannot be compared."""
        kind = not_dense(value)
        if kind is not None:
            raise TypeError(
                f"{owner} {self.name} must be a dense (strided) tensor as at capture, got a "
                f"{kind}; a replay copies its arguments into the graph's dense static inputs. "
                "Convert it first (to_dense(), to_padded_tensor())"
            )


class CallSignature:
    """The structure (``tree``, of ``(args, kwargs)``), tensor specs and constants of a
    captured call.

    Args:
        owner: How errors name the callable.
        leaves: The sample call's leaves: tensors, and the constants between them.
        tree: The sample call's pytree structure, as ``(args, kwargs)``.
        like: A signature of another call whose structure may be the same (the same layer's
            graph for another microbatch): where ``tree`` equals its tree, the leaves' names
            and the tree's facts are taken from it rather than walked again.
        named_keywords: For a callable taking ``**kwargs``, whose order it sees, the
            keywords that bind to named parameters: a replay must pass the others in the
            captured order, which the graph's kernels follow. None (no ``**kwargs``): any
            order binds.
    """

    _names: list[str]
    _kwarg_names: tuple[str, ...]
    _positional: bool

    def __init__(
        self,
        owner: str,
        leaves: Sequence[Any],
        tree: pytree.TreeSpec,
        *,
        like: CallSignature | None = None,
        named_keywords: frozenset[str] | None = None,
    ):
        self.owner = owner
        self._named_keywords = named_keywords
        self.tree = tree
        self.template = LeafTemplate.of(leaves)
        if like is not None and like.tree == tree:
            names, kwarg_names, positional = like._names, like._kwarg_names, like._positional
        else:
            sample_call = pytree.tree_unflatten(list(leaves), tree)
            names = leaf_names(sample_call)
            kwarg_names = tuple(sample_call[1])
            positional = tree == pytree.tree_structure((tuple(leaves), {}))
        # Facts of the tree alone, which a signature made like this one takes over.
        self._names, self._kwarg_names, self._positional = names, kwarg_names, positional
        self.specs = tuple(
            TensorSpec.of(name, t) for name, t in zip(names, leaves) if isinstance(t, torch.Tensor)
        )
        self._constants = tuple((names[i], i, value) for i, value in self.template.constants())
        # Tensors passed positionally, the usual call: binding then skips the pytree walk.
        self._positional_arity = len(leaves) if self.template.all_tensors and positional else None

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensor leaves of a replay's arguments, checked against the captured ones.

        Raises:
            TypeError, ValueError: if they differ in structure, keys, constants, dtype, shape
                or device, or a tensor is nested or a subclass that computes otherwise than a
                plain tensor, naming the argument (a sparse one is named
                where its copy fails).
        """
        positional = not kwargs and len(args) == self._positional_arity
        try:
            if positional and all(map(TensorSpec.matches, self.specs, args)):
                return list(args)  # the usual call: what pytree gives here, without its walk
            if positional and all(isinstance(arg, torch.Tensor) for arg in args):
                leaves: list[Any] = list(args)
            else:
                leaves = self._structured_leaves(args, kwargs)
                self._check_constants(leaves)
                leaves = self._tensor_leaves(leaves)
            return [spec.check(self.owner, leaf) for spec, leaf in zip(self.specs, leaves)]
        except RuntimeError:
            # A nested tensor has no sizes to compare: named here, off the path of every call.
            self._refuse_not_dense(args, kwargs)
            raise

    def _tensor_leaves(self, leaves: Sequence[Any]) -> list[Any]:
        """The leaves in the captured tensors' places."""
        return [leaf for i, leaf in enumerate(leaves) if self.template.leaves[i] is TENSOR]

    def _refuse_not_dense(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise naming the first tensor argument that is not dense, if any (R25)."""
        if not kwargs and len(args) == self._positional_arity:
            leaves: list[Any] = list(args)
        else:
            leaves = self._tensor_leaves(self._structured_leaves(args, kwargs))
        for spec, leaf in zip(self.specs, leaves):
            if isinstance(leaf, torch.Tensor):
                spec.check_dense(self.owner, leaf)

    def _check_constants(self, leaves: Sequence[Any]) -> None:
        for name, position, value in self._constants:
            got = leaves[position]
            if not same_constant(got, value):
                shown = "a tensor" if isinstance(got, torch.Tensor) else repr(got)
                raise ValueError(
                    f"{self.owner} {name} must be the constant {value!r} it was at capture, "
                    f"got {shown}; graphs replay the kernels that constant chose, so capture "
                    "another graph for another value"
                )

    def unflatten(self, tensors: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of the captured structure over ``tensors``, constants in place."""
        args, kwargs = pytree.tree_unflatten(self.template.fill(tensors), self.tree)
        return args, kwargs

    def _structured_leaves(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Leaves of a call with containers or keywords, checked against the captured tree."""
        if set(kwargs) == set(self._kwarg_names) and tuple(kwargs) != self._kwarg_names:
            named = self._named_keywords
            if named is not None:
                free = [k for k in kwargs if k not in named]
                captured = [k for k in self._kwarg_names if k not in named]
                if free != captured:
                    raise TypeError(
                        f"{self.owner} takes **kwargs, so it sees the order of the keyword "
                        f"arguments that land there: pass {captured} in their order at capture, "
                        f"got {free}; the graph replays what the captured order computed"
                    )
            kwargs = {name: kwargs[name] for name in self._kwarg_names}  # bound by name
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


def _describe(value: Any) -> str:
    """A short description of an argument's pytree structure for error messages, with its
    layout, so two structures of as many leaves differ visibly."""
    if isinstance(value, torch.Tensor):
        return "a tensor"
    count = len(pytree.tree_leaves(value))
    leaves = "leaf" if count == 1 else "leaves"
    return f"a {type(value).__name__} of {count} {leaves}: {_layout(value)}"


def _layout(value: Any, depth: int = 0) -> str:
    """``[tensor, (tensor, None)]``, ``{'a': tensor, 'b': 3}``: containers as written."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if depth > 4:
        return "..."
    if isinstance(value, dict):
        items = ", ".join(f"{k!r}: {_layout(v, depth + 1)}" for k, v in value.items())
        return "{" + items + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_layout(v, depth + 1) for v in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)
