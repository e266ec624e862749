"""A graphed module at replay: its tree, training modes, hooks and buffers as capture saw them.

A graph replays the kernels its capture recorded, so a module's graphs stand for it only as it
was then: the same submodules in the same places, each in the training mode it had (dropout,
batch norm and anything reading ``self.training`` chose their kernels by it), no module hook
inside it (capture refuses them: a replay cannot run them), and the same buffers on the same
memory (the kernels read the captured tensors' memory; writes in place are what they see).
:class:`ModuleWatch` checks them at every replay in C-level loops (a transformer layer has
about ten submodules).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

import torch

from .._call import (
    MODULE_HOOKS,
    RECORDING_OUTPUTS_HINT,
    global_module_hooks,
    inert_hook,
    transformers_recording,
)
from ..build.record import ModuleState

__all__ = ["ModuleWatch"]


class ModuleWatch:
    """Whether a graphed module is still as its graphs were captured.

    Args:
        label: How errors name the callable.
        state: The module's tree as capture saw it.
        params: The module's captured parameters, by qualified name.
        root_hooks_run: Whether hooks on the module itself run around a replay (a module
            graphed without an order: its ``__call__`` runs them, then the graphed forward).
    """

    def __init__(
        self,
        label: str,
        state: ModuleState,
        params: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        root_hooks_run: bool,
    ) -> None:
        self._label = label
        self._root = state.root
        self._names = ("", *(name for name, _ in state.submodules))
        self._submodules = tuple(module for _, module in state.submodules)
        self._parents = state.parents
        self._local_names = state.local_names
        self._training = state.training
        self._submodule_training = state.training[1:]
        self._hooked_from = 1 if root_hooks_run else 0
        root = state.root()
        modules = () if root is None else (root, *self._submodules)
        # The dicts themselves, held for the fast checks: torch fills and empties a module's
        # `_modules` and hook dicts in place (they are bound once, at construction).
        self._parent_dicts = tuple(modules[i]._modules for i in self._parents)
        position = {name: i for i, name in enumerate(self._names)}
        buffers = state.buffers if modules else ()
        self._param_names = tuple(name for name, _ in params)
        self._params = tuple(param for _, param in params)
        # Where the parameters' data is now, after capture: the graphs read and train that
        # memory, whether the module is still alive or not.
        self._param_pointers = tuple(map(_DATA_PTR, self._params))
        self._param_dicts, self._param_locals = _owner_dicts(
            modules, position, params if modules else (), "_parameters"
        )
        self._buffer_names = tuple(name for name, _ in buffers)
        self._buffers = tuple(buffer for _, buffer in buffers)
        self._buffer_dicts, self._buffer_locals = _owner_dicts(
            modules, position, buffers, "_buffers"
        )
        # Where the buffers' data is now, after capture: the graphs read that memory. A buffer
        # with no storage to point at (a sparse one) is checked by identity only.
        self._pointed = tuple(b for b in self._buffers if _data_ptr(b) is not None)
        self._pointers = tuple(map(_DATA_PTR, self._pointed))
        self._hook_dicts = tuple(
            getattr(module, kind)
            for module in modules[self._hooked_from :]
            for kind in MODULE_HOOKS
        )
        # The slots that held None at capture (a Linear without bias, a buffer registered as
        # None, an optional submodule): eager's forward uses what is set there later, which
        # the graphs, captured without it, would neither use nor train.
        empty: list[tuple[tuple[str, str], dict[str, Any], str]] = []
        for path, module in zip(self._names, modules):
            for kind in _SLOT_KINDS:
                owned = getattr(module, kind)
                empty += [
                    ((f"{path}.{local}" if path else local, kind), owned, local)
                    for local, value in owned.items()
                    if value is None
                ]
        self._empty = tuple(named for named, _, _ in empty)
        self._empty_dicts = tuple(owned for _, owned, _ in empty)
        self._empty_locals = tuple(local for _, _, local in empty)
        # Per module, its children's names: a submodule assigned since capture (over a plain
        # attribute, `self.post = None` first) is a new entry, which eager's forward may run.
        self._child_dicts = tuple(module._modules for module in modules)
        self._child_counts = tuple(map(len, self._child_dicts))
        self._child_names = tuple(frozenset(children) for children in self._child_dicts)

    def modes_as_captured(self) -> bool:
        """Whether the module and every submodule are in their capture-time training modes
        (True once the module is gone)."""
        root = self._root()
        if root is None:
            return True
        return root.training is self._training[0] and all(
            map(operator.is_, map(_TRAINING, self._submodules), self._submodule_training)
        )

    def check_replayable(self) -> None:
        """Refuse a replay of a module changed since capture in what its graphs cannot follow.

        Raises:
            RuntimeError: naming the callable and the submodule, parameter or buffer: for a
                submodule replaced or removed since capture; a module hook registered since
                capture on a submodule (on the module itself too where a replay would not run
                it), or globally; a parameter replaced, or whose data was swapped or moved;
                a buffer replaced, removed or moved. Parameters are checked before buffers,
                so that ``module.half()`` names a parameter.
        """
        registered = map(dict.get, self._parent_dicts, self._local_names)
        replaced = not all(map(operator.is_, registered, self._submodules))
        added = not all(map(operator.eq, map(len, self._child_dicts), self._child_counts))
        if replaced or added or any(self._hook_dicts) or any(_GLOBAL_HOOK_DICTS):
            root = self._root()
            if root is not None:
                if replaced:
                    self._raise_replaced()
                if added:
                    self._raise_added()
                self._check_hooks((root, *self._submodules)[self._hooked_from :])
        # The usual replay, nothing changed, in C-level loops (no call of the methods below).
        params = map(dict.get, self._param_dicts, self._param_locals)
        if not (
            all(map(operator.is_, params, self._params))
            and all(map(operator.eq, map(_DATA_PTR, self._params), self._param_pointers))
        ):
            self._refuse_parameters()
        buffers = map(dict.get, self._buffer_dicts, self._buffer_locals)
        if self._buffers and not (
            all(map(operator.is_, buffers, self._buffers))
            and all(map(operator.eq, map(_DATA_PTR, self._pointed), self._pointers))
        ):
            self._refuse_buffers()
        if self._empty and not all(
            map(operator.is_, map(dict.get, self._empty_dicts, self._empty_locals), _NONES)
        ):
            self._refuse_filled()

    def _refuse_filled(self) -> None:
        """Refuse a replay of a module that got a parameter, buffer or submodule where it had
        None at capture (``module.bias = nn.Parameter(...)`` on a Linear made without one)."""
        if self._root() is None:
            return
        for (name, kind), owned, local in zip(self._empty, self._empty_dicts, self._empty_locals):
            current = owned.get(local)
            if current is not None:
                what = _SLOT_KINDS[kind]
                raise RuntimeError(
                    f"{self._label}: {what} {name!r} was None at capture and is a "
                    f"{type(current).__name__} now; the graphs were captured without it, so "
                    f"a replay would neither use nor train it, where eager's forward would. "
                    f"Set the {what} before capture, or capture again"
                )

    def _refuse_parameters(self) -> None:
        """Refuse a replay of a module whose parameters were replaced after capture (FSDP2's
        ``fully_shard`` swaps in sharded and all-gathered ones), or whose data was swapped
        (``param.data = ...``, a module's ``.half()`` or ``.to()``, a sharding library
        re-pointing it): the graphs read and train the captured tensors' memory only, so the
        new parameters or data would be neither used nor trained."""
        for name, owned, local, param in zip(
            self._param_names, self._param_dicts, self._param_locals, self._params
        ):
            current = owned.get(local)
            if current is not param:
                raise RuntimeError(
                    f"{self._label} parameter {name!r} must be the tensor it was captured with, "
                    f"got another {type(current).__name__}: the graph reads and trains the "
                    "captured one, so the new one would get no gradient. Replace parameters "
                    "before capture; FSDP2's fully_shard swaps them at every forward and does "
                    "not compose with a graphed module (docs/composition.md)"
                )
        for name, param, pointer in zip(self._param_names, self._params, self._param_pointers):
            if param.data_ptr() != pointer:
                raise RuntimeError(
                    f"{self._label} parameter {name!r} must keep the data it was captured "
                    f"with, got other memory ({param.dtype}, {param.device}): the graphs read "
                    "and train the captured memory, so the new data would be neither used nor "
                    "trained. Change dtypes, devices or data (module.half(), .to(), "
                    "param.data = ...) before capture, or capture again"
                )

    def _refuse_buffers(self) -> None:
        """Refuse a replay of a module whose buffers were replaced, removed or moved since
        capture (an assignment, ``module.to()``, ``load_state_dict(assign=True)``,
        ``buf.data = ...``): the graphs read the captured tensors' memory, so they would not
        see the new values. Writes in place (``buf.copy_``, BatchNorm's statistics) are fine."""
        if self._root() is None:
            return
        pointers = dict(zip(map(id, self._pointed), self._pointers))
        for name, owned, local, buffer in zip(
            self._buffer_names, self._buffer_dicts, self._buffer_locals, self._buffers
        ):
            current = owned.get(local)
            if current is None:
                raise RuntimeError(
                    f"{self._label}: buffer {name!r} was removed after capture: the graphs "
                    "still read the captured tensor's memory, where the module's forward "
                    "would no longer find it. Register it again (the same tensor), or capture "
                    "again"
                )
            if current is not buffer:
                raise RuntimeError(
                    f"{self._label}: buffer {name!r} was replaced after capture (another "
                    f"{type(current).__name__}, {current.dtype} on {current.device}, is "
                    "registered now: by an assignment, module.to() or "
                    "load_state_dict(assign=True), or by the forward itself, whose assignment "
                    "a replay does not run); the graphs read the captured tensor's memory, so "
                    "they would not see the new one. Update it in place "
                    "(buf.copy_(new)), or capture again"
                )
            if id(buffer) in pointers and buffer.data_ptr() != pointers[id(buffer)]:
                raise RuntimeError(
                    f"{self._label}: buffer {name!r} must keep the data it was captured with, "
                    f"got other memory ({buffer.dtype}, {buffer.device}; buf.data = ...): the "
                    "graphs read the captured tensor's memory, so they would not see the new "
                    "data. Update it in place (buf.copy_(new)), or capture again"
                )

    def changed_mode(self) -> str:
        """The first module whose training mode differs from capture's, described."""
        root = self._root()
        modules = () if root is None else (root, *self._submodules)
        for name, module, was in zip(self._names, modules, self._training):
            if module.training is not was:
                where = f"submodule {name!r}" if name else "the module"
                return (
                    f"{where} is in {_mode(module.training)} mode but was captured in "
                    f"{_mode(was)} mode"
                )
        return "the modes are as captured"

    def _raise_replaced(self) -> None:
        for name, parent, local, child in zip(
            self._names[1:], self._parent_dicts, self._local_names, self._submodules
        ):
            current = parent.get(local)
            if current is not child:
                got = "nothing" if current is None else f"another {type(current).__name__}"
                raise RuntimeError(
                    f"{self._label} submodule {name!r} must be the module it was captured "
                    f"with, got {got}: the graphs replay the captured one's kernels on its "
                    "parameters. Change the module before capture, or capture again"
                )

    def _raise_added(self) -> None:
        """Refuse a replay of a module that got a submodule since capture (in a new entry;
        one where capture saw None is :meth:`_refuse_filled`'s)."""
        for path, children, known in zip(self._names, self._child_dicts, self._child_names):
            for local in children.keys() - known:
                child = children[local]
                if child is None:
                    continue
                name = f"{path}.{local}" if path else local
                raise RuntimeError(
                    f"{self._label}: submodule {name!r} was added since capture (a "
                    f"{type(child).__name__}); the graphs were captured without it, so a "
                    "replay would neither run nor train it, where eager's forward may. Add it "
                    "before capture, or capture again"
                )

    def _check_hooks(self, hooked: tuple[torch.nn.Module, ...]) -> None:
        """Raise for the first hook a replay would leave out, unless every one is inert now."""
        globals_ = [
            f"_global{kind}"
            for kind, hooks in zip(MODULE_HOOKS, _GLOBAL_HOOK_DICTS)
            if not all(map(inert_hook, hooks.values()))
        ]
        if globals_:
            raise RuntimeError(
                f"{self._label}: global module hooks were registered since capture "
                f"({', '.join(globals_)}); a replay cannot run them on the modules inside its "
                "graphs. Remove them, or run the eager module"
            )
        offset = len(self._names) - len(hooked)
        for name, module in zip(self._names[offset:], hooked):
            kinds = [
                kind
                for kind in MODULE_HOOKS
                if not all(map(inert_hook, getattr(module, kind).values()))
            ]
            if not kinds:
                continue
            where = f"submodule {name!r}" if name else "the module"
            if all(transformers_recording(getattr(module, kind)) for kind in kinds):
                raise RuntimeError(
                    f"{self._label}: {where} has {', '.join(kinds)} recording outputs; "
                    f"{RECORDING_OUTPUTS_HINT}"
                )
            raise RuntimeError(
                f"{self._label}: {where} got {', '.join(kinds)} since capture; a replay "
                "runs the captured kernels and cannot run them. Remove them, or run the "
                "eager module"
            )


def _owner_dicts(
    modules: Sequence[torch.nn.Module],
    position: dict[str, int],
    named: Sequence[tuple[str, torch.Tensor]],
    kind: str,
) -> tuple[tuple[dict[str, Any], ...], tuple[str, ...]]:
    """Per qualified name in ``named``, its owner's ``kind`` dict (``_parameters`` or
    ``_buffers``, held: torch fills and empties it in place) and its local name there."""
    split = [name.rpartition(".") for name, _ in named]
    dicts = tuple(getattr(modules[position[path]], kind) for path, _, _ in split)
    return dicts, tuple(local for _, _, local in split)


def _mode(training: bool) -> str:
    return "training" if training else "eval"


# Filled and emptied in place by torch's register_module_*_hook and their handles.
_GLOBAL_HOOK_DICTS = global_module_hooks()


_TRAINING = operator.attrgetter("training")
_NONES = itertools.repeat(None)
# The per-module dicts whose slots a forward reads by name, and what errors call an entry.
_SLOT_KINDS = {"_parameters": "parameter", "_buffers": "buffer", "_modules": "submodule"}
_DATA_PTR = torch.Tensor.data_ptr


def _data_ptr(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s data is, or None for a tensor without storage (a sparse one)."""
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return None
