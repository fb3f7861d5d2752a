"""Optimizer state between this rank's layout and the layout-free "full" form.

The full form names every per-parameter state by the *unwrapped* model's parameter names, with
tensor-parallel shards gathered, so it can be loaded onto any pipeline / tensor-parallel layout.

Per-parameter tensors that have the parameter's shape (``exp_avg``, ``momentum_buffer``, ...)
are gathered and sliced exactly as smp-tp gathers and slices the parameters themselves: the
state tensors temporarily stand in for the parameters while smp-tp's ``full_state_dict`` /
``load_full_state_dict`` run. Other state (scalars such as Adam's ``step``) is taken from the
first local parameter that has it — exact whenever it is the same for every parameter, as it
is for the optimizers in ``torch.optim``.
"""

from __future__ import annotations

from typing import Any

import torch

from smp_torch import tp_glue

__all__ = ["optimizer_state_to_full", "optimizer_state_from_full"]


def _is_param_shaped(v: Any, p: torch.Tensor) -> bool:
    return torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape) and v.dim() > 0


def _swap_params(model: Any, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    saved = {}
    for n, p in model.named_parameters():
        saved[n] = p.data
        p.data = values[n]
    return saved


def _restore(model: Any, saved: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        p.data = saved[n]


def _tp_state_keys(model: Any, named: dict[str, dict[str, Any]]) -> list[str]:
    params = dict(model.named_parameters())
    mine = {
        k
        for n, st in named.items()
        for k, v in st.items()
        if n in params and _is_param_shaped(v, params[n])
    }
    keys: set[str] = set()
    for ks in model.context.mpi_comms["tp"].allgather(sorted(mine)):
        keys.update(ks)
    return sorted(keys)


def _scalars(named: dict[str, dict[str, Any]], params: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n, st in named.items():
        for k, v in st.items():
            if k not in out and not (n in params and _is_param_shaped(v, params[n])):
                out[k] = v
    return out


def optimizer_state_to_full(
    model: Any,
    named: dict[str, dict[str, Any]],
    groups: list[dict[str, Any]],
    merge_stages: bool = True,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Local state by wrapped parameter name → full state by unwrapped parameter name."""
    cfg = model.context.config
    if cfg.tp > 1:
        params = dict(model.named_parameters())
        full_names = set(model.full_param_names())
        scalars = _scalars(named, params)
        out: dict[str, dict[str, Any]] = {}
        for key in _tp_state_keys(model, named):
            values = {
                n: (
                    named[n][key].to(p.device, p.dtype)
                    if key in named.get(n, {})
                    else torch.zeros_like(p)
                )
                for n, p in params.items()
            }
            saved = _swap_params(model, values)
            try:
                full = tp_glue.full_state_dict(model.module, cfg.tp)
            finally:
                _restore(model, saved)
            for fname, t in full.items():
                if fname in full_names and model.owns_full_key(fname):
                    out.setdefault(fname, {})[key] = t.detach().cpu().clone()
        if named:
            for st in out.values():
                st.update(scalars)
        named = out
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": sorted(out)}
            for g in groups[:1]
        ] + [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups[1:]]
    if cfg.pp > 1 and merge_stages:
        pp_comm = model.context.mpi_comms["pp"]
        merged: dict[str, dict[str, Any]] = {}
        stage_groups = pp_comm.allgather(groups)
        for part in pp_comm.allgather(named):
            merged.update(part)
        named = merged
        groups = []
        for sg in stage_groups:
            for i, g in enumerate(sg):
                if i < len(groups):
                    groups[i]["params"] = groups[i]["params"] + list(g["params"])
                else:
                    groups.append({**g, "params": list(g["params"])})
    return named, groups


def optimizer_state_from_full(
    model: Any, full_state: dict[str, dict[str, Any]], full_groups: list[dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Full state → ``(state by this rank's parameter names, hyper-parameters by name)``."""
    cfg = model.context.config
    params = dict(model.named_parameters())
    hyper_by_full = {}
    for g in full_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        for name in g["params"]:
            hyper_by_full[name] = hyper
    named: dict[str, dict[str, Any]]
    if cfg.tp == 1:
        named = {n: dict(full_state[n]) for n in params if n in full_state}
        hyper = {n: hyper_by_full[n] for n in params if n in hyper_by_full}
        return named, hyper
    tensor_keys = sorted(
        {
            k
            for st in full_state.values()
            for k, v in st.items()
            if torch.is_tensor(v) and v.dim() > 0
        }
    )
    scalars: dict[str, Any] = {}
    for st in full_state.values():
        for k, v in st.items():
            if not (torch.is_tensor(v) and v.dim() > 0):
                scalars.setdefault(k, v)
    # Buffers ride along unchanged (smp-tp translates whole modules); parameter entries carry
    # the state. Tied aliases without state are left out so they cannot overwrite it.
    # With a pipeline, only this stage's entries: other stages' parameters are empty
    # stand-ins here, which smp-tp cannot slice a full tensor into.
    param_keys = set(model.full_param_names())
    current = tp_glue.full_state_dict(model.module, cfg.tp)
    buffers = {k: v for k, v in current.items() if k not in param_keys and model.owns_full_key(k)}
    named = {}
    for key in tensor_keys:
        sd = dict(buffers)
        for fname, st in full_state.items():
            if key in st and model.owns_full_key(fname):
                sd[fname] = st[key]
        # NaN marks "not loaded": a parameter without this state keeps none.
        fresh = {n: torch.full_like(p, float("nan")) for n, p in params.items()}
        saved = _swap_params(model, fresh)
        try:
            tp_glue.load_full_state_dict(model.module, sd, cfg.tp, strict=False)
            for n, p in model.named_parameters():
                value = p.data.detach()
                if value.numel() and not torch.isnan(value).all():
                    named.setdefault(n, dict(scalars))[key] = value.clone()
        finally:
            _restore(model, saved)
    first_hyper = next(iter(hyper_by_full.values()), {})
    hyper = {n: first_hyper for n in params} if first_hyper else {}
    return named, hyper
