"""Full (unsharded) state dicts of models holding distributed modules."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from smp_tp.group import tp_rank, tp_size
from smp_tp.mappings import _all_gather
from smp_tp.params import param_spec


def _replaced(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that carry key translations (set by ``parallelize``), with their key prefix."""
    out = []
    for path, m in model.named_modules():
        if getattr(m, "_smp_tp_from_full", None) is not None:
            out.append((f"{path}." if path else "", m))
    return out


def _translate(sd: dict[str, torch.Tensor], prefix: str, fn) -> dict[str, torch.Tensor]:
    inner = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    rest = {k: v for k, v in sd.items() if not k.startswith(prefix)}
    rest.update({prefix + k: v for k, v in fn(inner).items()})
    return rest


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    """Shape of the full tensor this local tensor is a slice of."""
    spec = param_spec(t)
    shape = list(t.shape)
    if spec is not None and spec.kind == "shard" and spec.dim is not None:
        shape[spec.dim] *= tp_size(spec.tp_group)
    return tuple(shape)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unwrapped model: same keys and shapes, shards gathered.

    Collective: every rank of every TP group involved must call it. The result is on the
    parameters' device, detached.
    """
    sd: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        spec = param_spec(value)
        t = value.detach()
        if spec is not None and spec.kind == "shard":
            t = _all_gather(t, int(spec.dim or 0), spec.tp_group, "forward")
        sd[key] = t.clone()
    for prefix, m in _replaced(model):
        sd = _translate(sd, prefix, m._smp_tp_from_full)
    return sd


def _slice(full: torch.Tensor, local: torch.Tensor, key: str) -> torch.Tensor:
    spec = param_spec(local)
    if spec is not None and spec.kind == "shard":
        size, dim = tp_size(spec.tp_group), int(spec.dim or 0)
        if full.shape[dim] % size:
            raise ValueError(f"{key}: full size {tuple(full.shape)} cannot be split {size} ways")
        full = full.chunk(size, dim)[tp_rank(spec.tp_group)]
    if tuple(full.shape) != tuple(local.shape):
        raise ValueError(
            f"{key}: shape {tuple(full.shape)} does not match the local shape {tuple(local.shape)}"
        )
    return full


def load_full_into(module: nn.Module, full: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Copy this rank's slices of a full state dict (module's own keys) into ``module``."""
    local = module.state_dict(keep_vars=True)
    if strict:
        missing = sorted(set(local) - set(full))
        unexpected = sorted(set(full) - set(local))
        if missing or unexpected:
            raise KeyError(
                f"{type(module).__name__}: full state dict does not match; missing={missing}, "
                f"unexpected={unexpected}"
            )
    with torch.no_grad():
        for key, t in local.items():
            if key in full:
                t.copy_(_slice(full[key].to(t.device), t, key))


def load_full_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> None:
    """Load a full (unwrapped-model) state dict into a model holding distributed modules."""
    sd = dict(state_dict)
    for prefix, m in _replaced(model):
        sd = _translate(sd, prefix, m._smp_tp_to_full)
    load_full_into(model, sd, strict=strict)


def full_grad_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients in the unwrapped model's layout (keys of its parameters), shards gathered.

    Meant for checking equivalence; parameters without a gradient are omitted. Collective.
    """
    grads: dict[str, torch.Tensor] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        if p.grad is None:
            continue
        spec = param_spec(p)
        g = p.grad.detach()
        if spec is not None and spec.kind == "shard":
            g = _all_gather(g, int(spec.dim or 0), spec.tp_group, "forward")
        grads[key] = g.clone()
    for prefix, m in _replaced(model):
        grads = _translate(grads, prefix, lambda sd, m=m: _partial(m._smp_tp_from_full, sd))
    return grads


def _partial(fn, sd: dict) -> dict:
    """Apply a key translation to a dict that may lack some keys (e.g. buffers)."""
    try:
        return fn(sd)
    except KeyError:
        return sd
