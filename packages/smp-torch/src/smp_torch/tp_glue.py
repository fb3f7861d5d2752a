"""The umbrella's use of smp-tp: parallelize a model, classify parameters, gather weights."""

from __future__ import annotations

from typing import Any

import smp_tp
import torch
from torch import nn

from smp_torch.annotations import carry_marks

__all__ = [
    "parallelize",
    "is_distributed",
    "is_distributed_module",
    "full_state_dict",
    "load_full_state_dict",
]


def parallelize(
    module: nn.Module,
    tp_group: Any,
    prescaled_batch: bool,
    optimize: str,
    seed: int,
    record: list[smp_tp.TPDecision] | None = None,
) -> nn.Module:
    """Replace the marked submodules of ``module`` by smp-tp's distributed modules, with
    ``seed`` as the tensor-parallel dropout seed; ``record`` receives smp-tp's decision per
    module (and smp-tp then leaves the warnings to the caller: :mod:`smp_torch.report`)."""
    smp_tp.set_tensor_parallel_seed(seed)
    before = dict(module.named_modules())
    out = smp_tp.parallelize(
        module, tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=optimize,
        record=record,
    )
    # A replaced module keeps what the user marked on the original (activation
    # checkpointing, pipeline stage): the marks live on the module objects.
    for name, new in out.named_modules():
        old_module = before.get(name)
        if old_module is not None and old_module is not new:
            carry_marks(old_module, new)
    return out


def _spec(param: torch.Tensor) -> Any:
    return getattr(param, "_smp_tp_spec", None)


def is_distributed(param: torch.Tensor) -> bool:
    """Whether a parameter's gradient already covers its whole TP group's batch.

    True for tensor-parallel shards and for parameters replicated *inside* a TP region
    (smp-tp kinds ``shard`` and ``tp_replicated``): such a gradient is reduced over the reduced
    data-parallel group, scaled by smp-tp's ``grad_scale``. Everything else is an ordinary
    data-parallel parameter.
    """
    spec = _spec(param)
    return spec is not None and spec.kind in ("shard", "tp_replicated")


def is_distributed_module(module: nn.Module) -> bool:
    """Whether ``module`` is one of smp-tp's distributed modules (which may use their
    submodules' parameters directly, without calling the submodules)."""
    return isinstance(module, smp_tp.DistributedModule)


def is_shard(param: torch.Tensor) -> bool:
    """Whether a parameter is a slice of a larger one (differs across TP ranks)."""
    spec = _spec(param)
    return spec is not None and spec.kind == "shard"


def grad_scale(param: torch.Tensor) -> float:
    """smp-tp's factor turning this parameter's gradient into its TP-batch-mean gradient."""
    spec = _spec(param)
    return float(spec.grad_scale) if spec is not None else 1.0


def full_state_dict(module: nn.Module, tp_size: int) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict (TP shards gathered when ``tp_size > 1``)."""
    if tp_size > 1:
        return dict(smp_tp.full_state_dict(module))
    return dict(module.state_dict())


def load_full_state_dict(
    module: nn.Module, sd: dict[str, torch.Tensor], tp_size: int, strict: bool = True
) -> None:
    """Load an unwrapped model's state dict, slicing TP shards when ``tp_size > 1``."""
    if tp_size > 1:
        smp_tp.load_full_state_dict(module, sd, strict=strict)
    else:
        module.load_state_dict(sd, strict=strict)
