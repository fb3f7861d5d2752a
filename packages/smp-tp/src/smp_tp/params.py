"""How each parameter of a distributed module relates to the full (unwrapped) parameter.

Every parameter created by a :class:`~smp_tp.DistributedModule` carries a :class:`ParamSpec`
(attribute ``_smp_tp_spec``):

* ``kind="shard"`` — this rank holds slice ``tp_rank`` of the full tensor along ``dim``
  (equal slices). Its gradient covers the whole TP batch.
* ``kind="tp_replicated"`` — identical on every TP rank and applied to the whole TP batch,
  so its gradient is already identical on every rank.
* ``kind="dp_replicated"`` — identical on every TP rank but applied to this rank's own
  samples only (like any ordinary data-parallel parameter); gradients must be averaged.

``grad_scale`` is what :func:`~smp_tp.sync_gradients` multiplies shard and tp_replicated
gradients by: ``1/tp_size`` in scaled-batch mode (the backward summed every rank's local
mean loss), ``1`` in prescaled mode (every rank holds the same batch and loss).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from smp_tp.group import ProcessGroup
from smp_tp.random import get_generator


@dataclass(frozen=True)
class ParamSpec:
    """Relation of a local parameter to the full one (see module docstring)."""

    kind: str
    dim: int | None
    grad_scale: float
    tp_group: ProcessGroup = None


def param_spec(p: torch.Tensor) -> ParamSpec | None:
    """The spec of a distributed module's parameter, or None for an ordinary parameter."""
    return getattr(p, "_smp_tp_spec", None)


def set_param_spec(p: torch.Tensor, spec: ParamSpec) -> None:
    """Attach ``spec`` to ``p``."""
    p._smp_tp_spec = spec  # type: ignore[attr-defined]


def is_distributed_parameter(p: torch.Tensor) -> bool:
    """True when ``p`` is a shard of a larger parameter (its gradient must not be averaged
    with other TP ranks; data parallelism must reduce it over the group of ranks that hold
    the same shard)."""
    spec = param_spec(p)
    return spec is not None and spec.kind == "shard"


def _params(module: nn.Module) -> dict[int, nn.Parameter]:
    return {id(p): p for p in module.parameters()}


def _module_settings(module: nn.Module) -> tuple[ProcessGroup, float, int]:
    size = int(getattr(module, "tp_size", 1))
    scaled = not bool(getattr(module, "prescaled_batch", False))
    return getattr(module, "tp_group", None), (1.0 / size if scaled else 1.0), size


def _new_params(module: nn.Module, before: dict[int, nn.Parameter]) -> list[nn.Parameter]:
    return [p for i, p in _params(module).items() if i not in before and param_spec(p) is None]


@contextmanager
def _partition(module: nn.Module, dim_of: Any) -> Iterator[None]:
    before = _params(module)
    yield
    group, scale, _ = _module_settings(module)
    for p in _new_params(module, before):
        dim = dim_of(p)
        if dim is None:
            continue  # left for the enclosing parameter_creation_scope to classify
        set_param_spec(p, ParamSpec("shard", dim, scale, group))


@contextmanager
def initialize_with_input_partition(module: nn.Module) -> Iterator[None]:
    """Parameters created inside are split across their input channels (last dimension).

    One-dimensional parameters (biases) have no input dimension and are left to the
    enclosing :func:`parameter_creation_scope`.
    """
    with _partition(module, lambda p: p.dim() - 1 if p.dim() >= 2 else None):
        yield


@contextmanager
def initialize_with_output_partition(module: nn.Module) -> Iterator[None]:
    """Parameters created inside are split across their output channels (dimension 0)."""
    with _partition(module, lambda p: 0):
        yield


@contextmanager
def parameter_creation_scope(
    module: nn.Module,
    scaled_batch: bool = True,
    dtype: torch.dtype | None = None,
    use_normal: bool = False,
    initializer_range: float = 0.02,
) -> Iterator[None]:
    """Create a distributed module's parameters inside this block (paper I.6).

    New parameters not claimed by a partition context become ``tp_replicated`` when
    ``scaled_batch`` (they see the whole TP group's batch) and ``dp_replicated`` otherwise.
    On exit, new matrices (``dim >= 2``) are initialised, normal(0, ``initializer_range``)
    when ``use_normal`` else uniform with the fan-in of the *full* matrix, from the
    per-rank stream for shards and the shared stream for replicas; vectors keep the values
    they were created with. ``dtype`` converts the new parameters.
    """
    before = _params(module)
    yield
    group, scale, size = _module_settings(module)
    new = [p for i, p in _params(module).items() if i not in before]
    for p in new:
        if param_spec(p) is None:
            kind = "tp_replicated" if scaled_batch else "dp_replicated"
            set_param_spec(p, ParamSpec(kind, None, scale if scaled_batch else 1.0, group))
        spec = param_spec(p)
        assert spec is not None
        with torch.no_grad():
            if dtype is not None and p.dtype != dtype:
                p.data = p.data.to(dtype)
            if p.dim() < 2 or p.device.type == "meta":
                continue
            stream = "tp_rank" if spec.kind == "shard" else "tp_shared"
            gen = get_generator(p.device, stream, group)
            if use_normal:
                p.normal_(0.0, initializer_range, generator=gen)
            else:
                fan_in = p.shape[-1] * (size if spec.kind == "shard" and spec.dim == p.dim() - 1 else 1)
                bound = 1.0 / math.sqrt(max(fan_in, 1))
                p.uniform_(-bound, bound, generator=gen)
