"""Giving every replica the same starting weights: a broadcast, or delayed materialisation.

Used by both engines while the model is wrapped; nothing here knows about pipelines.

- A model built normally is identical on every rank once rank 0's values are broadcast.
  The broadcast runs on the host, over MPI, *before* anything moves to the device
  (:func:`broadcast_on_host`): every rank already holds the whole model there, and only what
  a rank owns goes to its device afterwards (the paper's order), whatever the device and the
  backend of smp's process groups.
- A model built under ``smp.delay_param_initialization()`` is materialised from the recording
  of its construction (:mod:`smp_torch.deferred`): every rank replays it from rank 0's
  generator state (:func:`shared_rng_state`), so replicas agree bitwise without a broadcast,
  and each rank materialises only the tensors it owns (:func:`materialize_named`), or slices
  them into its shards as each becomes final (:func:`fill_shards`), never holding the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp_torch.deferred import DeferredInit, materialize
from smp_torch.sharded import is_sharded, shard_like

__all__ = [
    "broadcast_tensors",
    "broadcast_on_host",
    "module_tensors",
    "has_meta",
    "owned_tensor_names",
    "shared_rng_state",
    "materialize_named",
    "fill_shards",
]

# Large tensors travel in pieces of this size: MPI counts are C ints, and one piece at a time
# keeps no second copy of the model around.
_HOST_CHUNK = 64 << 20


def broadcast_tensors(tensors: list[torch.Tensor], src: int, group: Any) -> None:
    """Broadcast device tensors from global rank ``src`` over ``group``, one flat buffer per
    dtype (the tensors must live on the device ``group`` serves)."""
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


def broadcast_on_host(tensors: list[torch.Tensor], comm: Any, root: int = 0) -> None:
    """Broadcast host (CPU) tensors in place from ``root`` over the mpi4py communicator
    ``comm``, tensor by tensor in pieces of at most 64 MiB: no device, no process group (smp's
    may be NCCL's, which take device tensors only), no second copy of the model. Every rank
    passes tensors of the same shapes in the same order."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"broadcast_on_host takes host tensors, got one on {t.device}")
        if t.numel() == 0:
            continue
        buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
        raw = buf.reshape(-1).view(torch.uint8).numpy()
        for start in range(0, raw.size, _HOST_CHUNK):
            comm.Bcast(raw[start : start + _HOST_CHUNK], root=root)
        if buf.data_ptr() != t.data_ptr():
            with torch.no_grad():
                t.copy_(buf)


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


def owned_tensor_names(module: nn.Module, owned_modules: Iterable[str]) -> list[str]:
    """Qualified names of the parameters and buffers held directly by the modules at the
    ``owned_modules`` paths (a tied tensor is named through each owned module holding it)."""
    modules = dict(module.named_modules())
    names: list[str] = []
    for path in owned_modules:
        m = modules[path]
        prefix = f"{path}." if path else ""
        for slots in (m._parameters, m._buffers):
            names += [prefix + n for n, t in slots.items() if t is not None]
    return names


def shared_rng_state(init: DeferredInit, comm: Any) -> torch.Tensor:
    """Collective over the mpi4py ``comm``: the generator state rank 0 recorded when its model
    was built, so every rank replays the same construction (as a broadcast of rank 0's
    weights would make them agree)."""
    state = init.rng_state.clone()
    comm.Bcast(state.numpy(), root=0)
    return state


def materialize_named(
    module: nn.Module, device: torch.device, names: Iterable[str] | None, rng_state: torch.Tensor
) -> None:
    """Replace the ``meta`` tensors ``names`` (all, with None) of a delayed construction by
    their values in a normal construction, on ``device``."""
    materialize(module, device, names=names, rng_state=rng_state)


def fill_shards(
    module: nn.Module,
    targets: dict[str, torch.Tensor],
    init: DeferredInit,
    device: torch.device,
    rng_state: torch.Tensor,
) -> None:
    """Materialise a delayed construction *into an already sharded* ``module``, one tensor at
    a time: ``targets`` are the meta tensors by name taken before sharding
    (:meth:`DeferredInit.targets`); the sharded module's storage is allocated here
    (shards only) and each replayed full value is sliced into this rank's shard
    and dropped at once, so no rank holds more than its shards and one full tensor."""
    # Storage for the meta tensors only (shards, where sharded); tensors the construction
    # made real (``torch.tensor`` data, e.g. Gemma2's ``embed_scale``) keep their values.
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    slots: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    slots.update(dict(module.named_buffers(remove_duplicate=False)))

    def sink(name: str, value: torch.Tensor) -> None:
        slot = slots[name]
        with torch.no_grad():
            if is_sharded(slot):
                slot.to_local().copy_(shard_like(value, slot).to_local())  # type: ignore[attr-defined,arg-type]
            else:
                slot.copy_(value)

    init.replay(targets, device, sink, rng_state=rng_state)
