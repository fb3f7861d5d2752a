"""Partitioning a model over pipeline stages: graph -> ``smp_partition`` -> assignment.

The one place that turns a model into a ``{module path: pp rank}`` map:

- :func:`trace_dict` runs the model once with hooks and records, per module (§C.1): the
  first time it ran (a parent's children are listed by the first execution anywhere in their
  subtree, so a never-called container such as ``nn.ModuleList`` sits where its members ran;
  children that never ran follow in definition order), its inclusive forward cost (summed
  over calls; a container that is never called gets its children's sum; omitted on the meta
  device) and the bytes of its output tensors (summed over calls). The forward cost is, by
  default, *counted*, not timed (:data:`COSTS`): the same model and inputs give the same
  graph, hence the same partition, on every run; a timed trace varies with the machine's
  load, and near-equal splits then flip from run to run. Parameters are keyed by
  their first name in ``module.named_parameters()``, so a tied parameter has one key wherever
  it appears, and the partitioner keeps the modules sharing it together.
- :func:`static_graph_dict` builds the graph without running anything.
- :func:`auto_assignment` partitions a graph with ``smp_partition``;
  :func:`resolve_assignment` completes a manual (partial) map.
- :func:`partition_model` is the collective orchestration used by
  :class:`~smp_pipeline.PipelineRuntime` and usable from outside (the umbrella): the root
  traces (or reads the static graph), partitions, and hands the result to every rank through
  a broadcast the caller supplies.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import smp_partition
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from smp_pipeline.errors import PipelineConfigError, PipelineError
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


def _output_elements(out: Any) -> int:
    _, tensors = flatten(out)
    return sum(t.numel() for t in tensors)


#: How a trace measures a module's forward cost (``forward_ms`` of the graph):
#:
#: - ``"flops"`` (default): counted, so reproducible — the floating-point operations torch's
#:   ``FlopCounterMode`` attributes to the module's calls (matrix products, convolutions,
#:   attention) plus one per element of every output of it and its submodules (standing for
#:   the element-wise work: norms, activations, lookups, which the counter leaves out),
#:   reported as milliseconds at a nominal 1 TFLOP/s (the partitioner only compares them);
#: - ``"measured"``: wall-clock time of the traced forward: closer to this machine's truth,
#:   but it varies from run to run, and so may the partition.
COSTS = ("flops", "measured")


def trace_dict(
    module: nn.Module,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    run: Callable[[], Any] | None = None,
    device: str | torch.device | None = None,
    costs: str = "flops",
) -> dict[str, Any]:
    """Trace and return the ``smp-partition/module-graph@1`` dictionary.

    ``run`` replaces ``module(*args, **kwargs)`` (e.g. a whole step function). With
    ``device="meta"`` a copy of the model runs on the meta device (nothing allocated, costs
    omitted); another ``device`` runs a copy there. ``costs``: one of :data:`COSTS`.
    """
    if costs not in COSTS:
        raise PipelineConfigError(f"costs must be one of {COSTS}, got {costs!r}")
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
    flops = FlopCounterMode(display=False) if costs == "flops" else None
    elements = [0]  # output elements of every module call so far (the element-wise work)

    def now_ms() -> float:
        if flops is None:
            return time.perf_counter() * 1e3
        return (flops.get_total_flops() + elements[0]) / 1e9  # ms at 1 TFLOP/s

    def pre(mod: nn.Module, _args: Any) -> None:
        p = paths[id(mod)]
        if p not in first_seen:
            first_seen[p] = counter[0]
            counter[0] += 1
        starts.setdefault(p, []).append(now_ms())

    def post(mod: nn.Module, _args: Any, out: Any) -> None:
        p = paths[id(mod)]
        elements[0] += _output_elements(out)  # before reading: a module's own output counts
        times[p] = times.get(p, 0.0) + (now_ms() - starts[p].pop())
        act[p] = act.get(p, 0) + _output_bytes(out)

    handles = []
    for m in target.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with torch.no_grad(), flops if flops is not None else contextlib.nullcontext():
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
    costs: str = "flops",
) -> Any:
    """Trace ``module(*args, **kwargs)`` and return an ``smp_partition.ModuleGraph``.

    See :func:`trace_dict` for the arguments.
    """
    return smp_partition.ModuleGraph.from_dict(trace_dict(module, args, kwargs, run=run, device=device, costs=costs))


def resolve_assignment(root: nn.Module, manual: Mapping[str, int], pp_size: int) -> dict[str, int]:
    """Complete a partial ``{module path: pp rank}`` map.

    Unassigned modules inherit their parent's rank (the root defaults to 0). Any alias path of
    a module (e.g. ``encoder.embed_tokens`` for T5's ``shared``) may be used as its key.
    Raises :class:`PipelineConfigError` for unknown paths, ranks out of range, conflicting
    aliases, or a parameter shared by modules placed on different ranks.
    """
    canon = canonical_modules(root)
    alias_to_canon = {name: canon[id(m)] for name, m in root.named_modules(remove_duplicate=False)}
    wanted: dict[str, int] = {}
    for path, rank in manual.items():
        if path not in alias_to_canon:
            raise PipelineConfigError(f"assignment names module '{path}', which the model lacks")
        if not isinstance(rank, int) or not 0 <= rank < pp_size:
            raise PipelineConfigError(
                f"assignment of module '{path}': rank {rank!r} is outside 0..{pp_size - 1}"
            )
        c = alias_to_canon[path]
        if c in wanted and wanted[c] != rank:
            raise PipelineConfigError(
                f"module '{c}' is assigned to both rank {wanted[c]} and rank {rank} (via '{path}')"
            )
        wanted[c] = rank
    out: dict[str, int] = {}
    for name, _m in root.named_modules():
        if name in wanted:
            out[name] = wanted[name]
        elif name == "":
            out[name] = 0
        else:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            out[name] = out[parent]
    check_shared_parameters(root, out)
    return out


def check_shared_parameters(root: nn.Module, assignment: Mapping[str, int]) -> None:
    """A parameter registered on modules of different ranks cannot be trained: refuse it."""
    canon = canonical_modules(root)
    owner_of_param: dict[int, tuple[str, int]] = {}
    for m in root.modules():
        path = canon[id(m)]
        for pname, p in m._parameters.items():
            if p is None:
                continue
            rank = assignment[path]
            seen = owner_of_param.get(id(p))
            if seen is None:
                owner_of_param[id(p)] = (f"{path}.{pname}" if path else pname, rank)
            elif seen[1] != rank:
                raise PipelineConfigError(
                    f"parameter '{seen[0]}' is shared by a module on rank {seen[1]} and module "
                    f"'{path}' on rank {rank}: modules that share parameters must be on one rank"
                )


# Max loads within 15 % of the best count as equal, and then fewer cut edges win (each is a
# request round trip per microbatch). Measurements: docs/perf-notes.md, "Balance slack".
BALANCE_SLACK = 0.15


def auto_assignment(graph_dict: dict[str, Any], pp_size: int, alpha: float) -> dict[str, int]:
    """Partition a traced module graph with ``smp_partition`` (default method)."""
    _graph, result = _partition_graph(graph_dict, pp_size, alpha, BALANCE_SLACK)
    return {str(k): int(v) for k, v in result.assignment.items()}


def _partition_graph(
    graph_dict: dict[str, Any], num_stages: int, alpha: float, balance_slack: float
) -> tuple[Any, Any]:
    graph = smp_partition.ModuleGraph.from_dict(graph_dict)
    result = smp_partition.partition(
        graph, num_devices=num_stages, alpha=alpha, method="default", balance_slack=balance_slack
    )
    return graph, result


@dataclass(frozen=True)
class PartitionOutcome:
    """What :func:`partition_model` returns.

    Attributes:
        assignment: ``{canonical module path: pp rank}`` for every module (the same on every
            rank; not yet completed by :func:`resolve_assignment`).
        graph: the ``smp_partition.ModuleGraph`` that was partitioned (root only, else None).
        result: the ``smp_partition`` result, with loads and cut edges (root only, else None).
    """

    assignment: dict[str, int]
    graph: Any = None
    result: Any = None


def partition_model(
    module: nn.Module,
    num_stages: int,
    broadcast: Callable[[Any], Any],
    *,
    root: bool,
    run: Callable[[], Any] | None = None,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    static: bool = False,
    trace_here: bool | None = None,
    trace_device: str | None = None,
    warmup: bool = True,
    alpha: float = 0.8,
    balance_slack: float = BALANCE_SLACK,
    costs: str = "flops",
) -> PartitionOutcome:
    """Collective: build the module graph, partition it on the root, share the assignment.

    Call it on every rank that needs the assignment, with the same ``broadcast``.

    Args:
        module: the full model (identical on every rank).
        num_stages: the number of pipeline stages (devices of the partitioner).
        broadcast: ``broadcast(obj) -> obj``, a collective over the same ranks: the root passes
            its payload, the others pass None, every rank returns the root's payload (e.g.
            ``lambda o: mpi_comm.bcast(o, root=0)``). Called exactly once per rank.
        root: whether this rank partitions (exactly one rank).
        run: what the trace runs (e.g. a step function on the first microbatch); without it
            the trace runs ``module(*args, **kwargs)``.
        static: partition the static graph (definition order, parameter sizes, nothing run;
            see :func:`static_graph_dict`) instead of a trace.
        trace_here: whether this rank runs the trace (default: the root only). Ranks whose
            peers take part in the traced computation (tensor-parallel layers) pass True; only
            the root's graph is partitioned.
        trace_device: run the trace on a copy of the model on this device (``"meta"``: nothing
            allocated, no times). Only without ``run`` (a run function uses the real model).
        warmup: with ``run``, call it once under ``no_grad`` before the timed trace (first
            calls are slow: lazy initialisation would distort the times).
        alpha: the partitioner's memory weight.
        balance_slack: loads within this fraction of the best count as balanced, and then
            fewer cut edges win (see :data:`BALANCE_SLACK`).
        costs: how the trace measures forward costs (:data:`COSTS`): ``"flops"`` (default)
            gives the same partition for the same model, inputs and stages on every run.

    Returns:
        a :class:`PartitionOutcome` (graph and result on the root only).

    Raises:
        On the root, whatever tracing or partitioning raised (the other ranks are told first
        and raise :class:`PipelineError` with its text). A tracing failure on a non-root
        tracing rank is raised there after the broadcast.
    """
    if trace_here is None:
        trace_here = root
    graph_dict: dict[str, Any] | None = None
    failure: BaseException | None = None
    if trace_here and not static:
        try:
            if run is not None and warmup:
                with torch.no_grad():
                    run()
            graph_dict = trace_dict(
                module,
                args,
                dict(kwargs or {}),
                run=run,
                device=trace_device if run is None else None,
                costs=costs,
            )
        except Exception as exc:  # noqa: BLE001 - shared with every rank below
            failure = exc
    if not root:
        got = broadcast(None)
        if "error" in got:
            raise PipelineError(got["error"])
        if failure is not None:
            raise failure
        return PartitionOutcome(dict(got["assignment"]))
    graph: Any = None
    result: Any = None
    try:
        if failure is not None:
            raise failure
        if static:
            graph_dict = static_graph_dict(module)
        assert graph_dict is not None
        graph, result = _partition_graph(graph_dict, num_stages, alpha, balance_slack)
    except Exception as exc:
        broadcast({"error": f"the root failed to partition the model: {exc!r}"})
        raise
    assignment = {str(k): int(v) for k, v in result.assignment.items()}
    broadcast({"assignment": assignment})
    return PartitionOutcome(assignment, graph, result)
