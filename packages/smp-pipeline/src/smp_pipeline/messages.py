"""The flattening of nested Python structures holding tensors, for messages.

A request or response carries arbitrary Python structure (tuples, lists, dicts, dataclasses
such as Hugging Face ``ModelOutput``, named tuples, plain values) with tensors inside. We
flatten it into a *skeleton* (the structure with each tensor replaced by a placeholder) and a
flat list of tensors. The skeleton is plain picklable data; the tensors travel as a list so the
communication layer moves their bytes on its fast path. The ``requires_grad`` flags travel
beside the tensors explicitly, so we do not depend on how the transport treats them.
The message kinds themselves are in :mod:`smp_pipeline.protocol`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Placeholder for the ``index``-th tensor of a flattened structure."""

    index: int


def is_container(x: Any) -> bool:
    """Whether :func:`map_structure` walks into ``x`` (a tuple, list, mapping or dataclass
    instance) rather than treating it as a leaf."""
    return isinstance(x, (tuple, list, Mapping)) or (
        dataclasses.is_dataclass(x) and not isinstance(x, type)
    )


def map_structure(obj: Any, fn: Callable[[Any], Any], leaf: Callable[[Any], bool]) -> Any:
    """Rebuild ``obj`` with every leaf ``x`` (``leaf(x)`` true) replaced by ``fn(x)``; values
    that are neither leaves nor containers are kept as they are.

    ``torch.utils._pytree`` would walk tuples, lists and dicts the same way, but it keeps a
    dataclass (a user's batch, a Hugging Face ``ModelOutput`` without transformers' own
    registration) or a non-dict mapping (a tokenizer's ``BatchEncoding``) whole, as one leaf:
    their tensors would neither travel on the fast path nor be split into microbatches."""
    if leaf(obj):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_structure(v, fn, leaf) for v in obj]
        if type(obj) is tuple:
            return tuple(items)
        if hasattr(obj, "_fields"):  # named tuple
            return type(obj)(*items)
        try:  # another tuple subclass (torch.Size): rebuilt as itself where it can be
            return type(obj)(items)
        except Exception:
            return tuple(items)
    if isinstance(obj, list):
        return [map_structure(v, fn, leaf) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _map_dataclass(obj, fn, leaf)
    if isinstance(obj, (dict, Mapping)):
        mapped = {k: map_structure(v, fn, leaf) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        try:
            return type(obj)(mapped)  # type: ignore[call-arg]
        except Exception:  # an exotic mapping type: fall back to a plain dict
            return mapped
    return obj


def _map_dataclass(obj: Any, fn: Callable[[Any], Any], leaf: Callable[[Any], bool]) -> Any:
    fields = [f for f in dataclasses.fields(obj) if f.init]
    values = {f.name: map_structure(getattr(obj, f.name), fn, leaf) for f in fields}
    try:
        return type(obj)(**values)
    except Exception:
        # A dataclass whose __init__ does more than store fields: copy and set attributes.
        new = copy.copy(obj)
        for k, v in values.items():
            object.__setattr__(new, k, v)
        return new


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


# The skeletons of the structures almost every message carries, built once: a tensor (a
# module's output), one tensor in a list (a backward message's gradients), one positional
# tensor argument and no keyword (a forward request's inputs). flatten() returns these very
# objects, so :mod:`smp_pipeline.frames` can send a small code instead of pickling them
# (a dataclass instance costs pickle ~8x a plain value: docs/perf-notes.md), and unflatten()
# rebuilds them without walking. Never mutated: unflatten() builds new containers.
REF0 = TensorRef(0)
SKELETON_TENSOR: Any = REF0
SKELETON_LIST1: Any = [REF0]
SKELETON_ARG1: Any = ((REF0,), {})
COMMON_SKELETONS: tuple[Any, ...] = (SKELETON_TENSOR, SKELETON_LIST1, SKELETON_ARG1)


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` into a skeleton (tensors replaced by :class:`TensorRef`) and its tensors.

    Tensors are returned as they are (not detached), in depth-first order.
    """
    # The common structures first (see COMMON_SKELETONS): no walk, no closure.
    tp = type(obj)
    if isinstance(obj, torch.Tensor):
        return SKELETON_TENSOR, [obj]
    if tp is list and len(obj) == 1 and isinstance(obj[0], torch.Tensor):
        return SKELETON_LIST1, [obj[0]]
    if tp is tuple and len(obj) == 2:
        args, kwargs = obj
        if (
            type(kwargs) is dict
            and not kwargs
            and type(args) is tuple
            and len(args) == 1
            and isinstance(args[0], torch.Tensor)
        ):
            return SKELETON_ARG1, [args[0]]
    tensors: list[torch.Tensor] = []

    def take(t: torch.Tensor) -> TensorRef:
        tensors.append(t)
        return TensorRef(len(tensors) - 1)

    return map_structure(obj, take, _is_tensor), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`."""
    if skeleton is SKELETON_TENSOR:
        return tensors[0]
    if skeleton is SKELETON_ARG1:
        return ((tensors[0],), {})
    if skeleton is SKELETON_LIST1:
        return [tensors[0]]
    return map_structure(skeleton, lambda r: tensors[r.index], lambda x: isinstance(x, TensorRef))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``."""
    return map_structure(obj, fn, _is_tensor)


def detach_all(obj: Any) -> Any:
    """``obj`` with every tensor detached (used for step outputs kept after the step)."""
    return map_tensors(obj, lambda t: t.detach())


@dataclasses.dataclass(frozen=True, slots=True)
class Packed:
    """A structure flattened for sending: skeleton, detached tensors, requires_grad flags."""

    skeleton: Any
    tensors: list[torch.Tensor]
    flags: list[bool]

    def unpack(self) -> Any:
        """The structure with the received tensors as they are (see :func:`unpack_leaves`)."""
        return unflatten(self.skeleton, self.tensors)


def pack(obj: Any, grad_enabled: bool) -> Packed:
    """Flatten ``obj`` for sending: skeleton, detached tensors and their requires_grad flags."""
    skeleton, tensors = flatten(obj)
    flags = [bool(grad_enabled and t.requires_grad) for t in tensors]
    return Packed(skeleton, [t.detach() for t in tensors], flags)


def unpack_leaves(packed: Packed) -> tuple[Any, list[torch.Tensor]]:
    """Rebuild a packed structure whose tensors become fresh leaves with the sent flags.

    Returns the structure and the list of leaves that require grad (in flat order).
    """
    leaves: list[torch.Tensor] = []
    tensors = []
    for t, flag in zip(packed.tensors, packed.flags):
        t = t.detach()
        if flag:
            t.requires_grad_(True)
            leaves.append(t)
        tensors.append(t)
    return unflatten(packed.skeleton, tensors), leaves
