"""Giving every replica the same starting weights: broadcast, or delayed materialisation.

Used by both engines while the model is wrapped; nothing here knows about pipelines.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp_torch.errors import SMPError

__all__ = ["broadcast_tensors", "module_tensors", "materialize_meta", "has_meta", "Shallow"]


def broadcast_tensors(tensors: list[torch.Tensor], src: int, group: Any) -> None:
    """Broadcast tensors from global rank ``src``, one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for _, ts in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad():
            for t in ts:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every distinct, materialised parameter and buffer of ``module``."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen and not t.is_meta:
            seen.add(id(t))
            out.append(t)
    return out


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the ``meta`` device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialize_meta(module: nn.Module, device: torch.device, seed: int) -> None:
    """Give every ``meta`` parameter real storage and initialise it with ``reset_parameters``.

    Runs with a private RNG seeded by ``seed`` so every rank initialises identically.
    """
    metas = [
        m
        for m in module.modules()
        if any(t.is_meta for t in m._parameters.values() if t is not None)
        or any(t.is_meta for t in m._buffers.values() if t is not None)
    ]
    if not metas:
        return
    for m in metas:
        has_direct = any(p is not None for p in m._parameters.values())
        if has_direct and not hasattr(m, "reset_parameters"):
            raise SMPError(
                f"module {type(m).__name__} was created under delay_param_initialization but "
                "has no reset_parameters() to initialise its parameters after materialisation"
            )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in metas:
            m.to_empty(device=device, recurse=False)
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()


class Shallow(nn.Module):
    """Presents one module without its children to :func:`materialize_meta`."""

    _target: nn.Module

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        # Not a child: set around nn.Module.__setattr__, so it stays out of modules().
        object.__setattr__(self, "_target", m)

    def modules(self) -> Iterator[nn.Module]:  # type: ignore[override]
        yield self._target
