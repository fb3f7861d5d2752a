"""Tracing a model: execution order, forward time and activation bytes per module (§C.1).

One forward pass with hooks on every module records, per module: the first time it ran (a
parent's children are listed by the first execution anywhere in their subtree, so a never-
called container such as ``nn.ModuleList`` sits where its members ran; children that never
ran follow in definition order), its inclusive forward time (summed over calls; a container
that is never called gets its children's sum; omitted on the meta device) and the bytes of
its output tensors (summed over calls). Parameters are keyed by their first
name in ``module.named_parameters()``, so a tied parameter has one key wherever it appears,
and the partitioner keeps the modules sharing it together.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from smp_pipeline.messages import flatten, map_tensors


def canonical_modules(root: nn.Module) -> dict[int, str]:
    """``id(module) -> path``: the first name of every module (aliases share one path)."""
    return {id(m): name for name, m in root.named_modules()}


def module_children(root: nn.Module) -> Iterator[tuple[str, nn.Module, list[nn.Module]]]:
    """Each distinct module with its canonical path and its direct children (with aliases)."""
    for name, m in root.named_modules():
        yield name, m, [c for _, c in m._modules.items() if c is not None]


def _output_bytes(out: Any) -> int:
    _, tensors = flatten(out)
    return sum(t.numel() * t.element_size() for t in tensors)


def trace_dict(
    module: nn.Module,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    run: Callable[[], Any] | None = None,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Trace and return the ``smp-partition/module-graph@1`` dictionary.

    ``run`` replaces ``module(*args, **kwargs)`` (e.g. a whole step function). With
    ``device="meta"`` a copy of the model runs on the meta device (nothing allocated, times
    omitted); another ``device`` runs a copy there.
    """
    kwargs = dict(kwargs or {})
    target = module
    timed = True
    if device is not None:
        dev = torch.device(device)
        timed = dev.type != "meta"
        target = copy.deepcopy(module).to(dev)
        args = map_tensors(args, lambda t: t.to(dev))
        kwargs = map_tensors(kwargs, lambda t: t.to(dev))
    paths = canonical_modules(target)
    param_key = {id(p): name for name, p in target.named_parameters()}
    first_seen: dict[str, int] = {}
    times: dict[str, float] = {}
    act: dict[str, int] = {}
    starts: dict[str, list[float]] = {}
    counter = [0]

    def pre(mod: nn.Module, _args: Any) -> None:
        p = paths[id(mod)]
        if p not in first_seen:
            first_seen[p] = counter[0]
            counter[0] += 1
        starts.setdefault(p, []).append(time.perf_counter())

    def post(mod: nn.Module, _args: Any, out: Any) -> None:
        p = paths[id(mod)]
        t0 = starts[p].pop()
        times[p] = times.get(p, 0.0) + (time.perf_counter() - t0) * 1e3
        act[p] = act.get(p, 0) + _output_bytes(out)

    handles = []
    for m in target.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with torch.no_grad():
            if run is not None:
                run()
            else:
                target(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()

    # Children are ordered by the first execution anywhere in their subtree, so a container
    # that is never called itself (nn.ModuleList) sits where its members ran; containers
    # that never ran get the summed time of their children (inclusive-time invariant).
    child_lists: dict[str, list[str]] = {}
    for name, _m, children in module_children(target):
        kids: list[str] = []
        for c in children:
            cp = paths[id(c)]
            if cp not in kids:
                kids.append(cp)
        child_lists[name] = kids
    inf = float("inf")
    first_memo: dict[str, float] = {}

    def subtree_first(p: str, stack: frozenset[str] = frozenset()) -> float:
        if p in first_memo:
            return first_memo[p]
        best = float(first_seen.get(p, inf))
        for c in child_lists[p]:
            if c not in stack:
                best = min(best, subtree_first(c, stack | {p}))
        first_memo[p] = best
        return best

    def inclusive_ms(p: str, stack: frozenset[str] = frozenset()) -> float:
        if p in first_seen:
            return times.get(p, 0.0)
        return sum(inclusive_ms(c, stack | {p}) for c in child_lists[p] if c not in stack)

    modules = []
    for name, m, _children in module_children(target):
        kids = child_lists[name]
        definition = {p: i for i, p in enumerate(kids)}
        kids = sorted(kids, key=lambda p: (subtree_first(p), definition[p]))
        params = {
            param_key[id(p)]: p.numel() for p in m._parameters.values() if p is not None
        }
        modules.append(
            {
                "name": name,
                "type": type(m).__name__,
                "children": kids,
                "params": params,
                "activation_bytes": act.get(name, 0),
                "forward_ms": inclusive_ms(name) if timed else None,
            }
        )
    return {"schema": "smp-partition/module-graph@1", "modules": modules}


def static_graph_dict(module: nn.Module) -> dict[str, Any]:
    """The module graph without running anything: definition order, parameters only.

    For models too large to trace at all (times omitted, activation bytes 0).
    """
    paths = canonical_modules(module)
    param_key = {id(p): name for name, p in module.named_parameters()}
    modules = []
    for name, m, children in module_children(module):
        kids: list[str] = []
        for c in children:
            if paths[id(c)] not in kids:
                kids.append(paths[id(c)])
        modules.append(
            {
                "name": name,
                "type": type(m).__name__,
                "children": kids,
                "params": {param_key[id(p)]: p.numel() for p in m._parameters.values() if p is not None},
                "activation_bytes": 0,
                "forward_ms": None,
            }
        )
    return {"schema": "smp-partition/module-graph@1", "modules": modules}


def trace(
    module: nn.Module,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    run: Callable[[], Any] | None = None,
    device: str | torch.device | None = None,
) -> Any:
    """Trace ``module(*args, **kwargs)`` and return an ``smp_partition.ModuleGraph``.

    See :func:`trace_dict` for the arguments.
    """
    from smp_partition import ModuleGraph

    return ModuleGraph.from_dict(trace_dict(module, args, kwargs, run=run, device=device))
