"""Activation checkpointing per module, recomputed on the owner during its backward segment.

Strategies (set per module path):

- ``None`` / ``"module"``: checkpoint the module itself (its whole subtree must live on its
  owner, because recomputation runs inside a backward segment, which must never wait for
  another rank);
- for ``nn.Sequential`` containers: ``"each"`` checkpoints every child separately,
  ``"group_N"`` checkpoints consecutive groups of N children, ``"contiguous"`` checkpoints
  each maximal run of consecutive children that live on the same rank. A group that lives on
  the container's owner is recomputed as one unit; children of a group that live elsewhere are
  checkpointed one by one on their owner (the request carries the checkpointing flag).

So ``"contiguous"`` means one thing at every pipeline degree: the maximal runs of consecutive
children on one rank; with one rank (:func:`checkpoint_in_place`) that is all the children.

Recomputation uses ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, which restores
torch's default RNG state and works with the retained graphs of several backward segments.
Random streams of other libraries (e.g. smp-tp's tensor-parallel dropout generators) join in
through :func:`add_checkpoint_context`. With activation offloading, what a checkpoint keeps
for backward (its inputs) waits in host memory (:mod:`smp_pipeline.offload`).

The same implementation serves a model without a pipeline: :func:`checkpoint_in_place` plans
with every module on one rank and wraps the forwards in place (per-module
:class:`CheckpointOptions` add ``preserve_rng_state`` and ``pack_args_as_tuple``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from smp_pipeline.errors import PipelineConfigError
from smp_pipeline.offload import offload_scope
from smp_pipeline.partition import canonical_modules

STRATEGIES = ("module", "each", "contiguous")

# ``context_fn``s (see torch.utils.checkpoint) every recomputation runs under, in order.
_CONTEXTS: list[Callable[[], tuple[Any, Any]]] = []


def add_checkpoint_context(context_fn: Callable[[], tuple[Any, Any]]) -> None:
    """Run every checkpointed forward and recomputation under ``context_fn()``'s two context
    managers (as ``torch.utils.checkpoint``'s ``context_fn``), e.g. to replay a library's
    own random streams. Adding the same function twice has no further effect."""
    if context_fn not in _CONTEXTS:
        _CONTEXTS.append(context_fn)


def _context() -> tuple[Any, Any]:
    pairs = [fn() for fn in _CONTEXTS]

    @contextlib.contextmanager
    def enter(which: int) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for pair in pairs:
                stack.enter_context(pair[which])
            yield

    return enter(0), enter(1)


def _no_context() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def _checkpoint(
    fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True, **kwargs: Any
) -> Any:
    # Without RNG preservation the registered contexts (random streams) are skipped too.
    # Outside the checkpoint's own saved-tensor hook, the offload scope sees exactly what the
    # checkpoint keeps for backward: its inputs (see smp_pipeline.offload).
    with offload_scope():
        return checkpoint(
            fn,
            *args,
            use_reentrant=False,
            preserve_rng_state=preserve_rng_state,
            context_fn=_context if preserve_rng_state else _no_context,
            **kwargs,
        )


@dataclass(frozen=True)
class CheckpointOptions:
    """Per-module options of :func:`checkpoint_in_place` (defaults: what the runtime uses).

    Attributes:
        preserve_rng_state: replay random streams in recomputation (dropout masks match).
        pack_args_as_tuple: for ``nn.Sequential`` groups, pass the group's input to its
            first child as one tuple (and unpack a tuple output) instead of one argument.
    """

    preserve_rng_state: bool = True
    pack_args_as_tuple: bool = False


@dataclass
class CheckpointPlan:
    """Which modules are checkpointed whole, and how Sequential containers are grouped."""

    modules: set[str] = field(default_factory=set)
    # Sequential path -> groups of child indices checkpointed together on the owner.
    groups: dict[str, list[list[int]]] = field(default_factory=dict)


def subtree_ranks(root: nn.Module, assignment: Mapping[str, int]) -> dict[str, set[int]]:
    """``path -> set of ranks`` owning some module in that module's subtree."""
    canon = canonical_modules(root)
    memo: dict[str, set[int]] = {}

    def visit(m: nn.Module) -> set[int]:
        p = canon[id(m)]
        if p in memo:
            return memo[p]
        memo[p] = {assignment[p]}  # guards against cycles through aliases
        ranks = {assignment[p]}
        for c in m.children():
            ranks |= visit(c)
        memo[p] = ranks
        return ranks

    visit(root)
    return memo


def plan_checkpointing(
    root: nn.Module, config: Mapping[str, str | None], assignment: Mapping[str, int]
) -> CheckpointPlan:
    """Turn ``{path: strategy}`` into a :class:`CheckpointPlan`, validating it."""
    canon = canonical_modules(root)
    by_alias = dict(root.named_modules(remove_duplicate=False))
    ranks = subtree_ranks(root, assignment)
    plan = CheckpointPlan()
    for path, strategy in config.items():
        if path not in by_alias:
            raise PipelineConfigError(f"activation checkpointing names module '{path}', which the model lacks")
        mod = by_alias[path]
        cpath = canon[id(mod)]
        strategy = strategy or "module"
        if strategy == "module":
            if len(ranks[cpath]) > 1:
                raise PipelineConfigError(
                    f"cannot checkpoint module '{cpath}': its submodules live on ranks "
                    f"{sorted(ranks[cpath])}; checkpoint its children instead"
                )
            plan.modules.add(cpath)
            continue
        if not isinstance(mod, nn.Sequential):
            raise PipelineConfigError(
                f"strategy '{strategy}' for '{path}' needs an nn.Sequential, got {type(mod).__name__}"
            )
        children = [canon[id(c)] for c in mod]
        if strategy == "each":
            groups = [[i] for i in range(len(children))]
        elif strategy == "contiguous":
            groups = []
            for i, c in enumerate(children):
                r = ranks[c]
                if groups and len(r) == 1 and r == ranks[children[groups[-1][-1]]]:
                    groups[-1].append(i)
                else:
                    groups.append([i])
        elif strategy.startswith("group_") and strategy[6:].isdigit() and int(strategy[6:]) > 0:
            n = int(strategy[6:])
            groups = [list(range(i, min(i + n, len(children)))) for i in range(0, len(children), n)]
        else:
            raise PipelineConfigError(
                f"unknown checkpointing strategy {strategy!r} for '{path}' "
                "(use 'each', 'contiguous', 'group_N' or None)"
            )
        owner = assignment[cpath]
        local_groups = []
        for g in groups:
            if all(ranks[children[i]] == {owner} for i in g):
                local_groups.append(g)
            else:  # checkpoint members one by one where each lives
                for i in g:
                    if len(ranks[children[i]]) == 1:
                        plan.modules.add(children[i])
        plan.groups[cpath] = local_groups
    return plan


def grouped_sequential_forward(
    seq: nn.Sequential, groups: list[list[int]], options: CheckpointOptions | None = None
) -> Callable[[Any], Any]:
    """A forward for ``seq`` that checkpoints each group of ``groups`` as one unit."""
    grouped = {g[0]: g for g in groups}
    children = list(seq)
    opts = options or CheckpointOptions()

    def run_group(g: list[int]) -> Callable[..., Any]:
        def fn(*inputs: Any) -> Any:
            x: Any = tuple(inputs) if opts.pack_args_as_tuple else inputs[0]
            for i in g:
                x = children[i](x)
            return x

        return fn

    def forward(x: Any) -> Any:
        i = 0
        while i < len(children):
            g = grouped.get(i)
            if g is not None:
                inputs = tuple(x) if opts.pack_args_as_tuple else (x,)
                if torch.is_grad_enabled():
                    x = _checkpoint(
                        run_group(g), *inputs, preserve_rng_state=opts.preserve_rng_state
                    )
                else:
                    x = run_group(g)(*inputs)
                i = g[-1] + 1
            else:
                x = children[i](x)
                i += 1
        return x

    return forward


def run_checkpointed(
    call: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    preserve_rng_state: bool = True,
) -> Any:
    """Run ``call(*args, **kwargs)`` under non-reentrant checkpointing (when grad is on)."""
    if not torch.is_grad_enabled():
        return call(*args, **kwargs)
    return _checkpoint(call, *args, preserve_rng_state=preserve_rng_state, **kwargs)


_WRAPPED = "_smp_checkpointed"


def checkpoint_in_place(
    root: nn.Module,
    config: Mapping[str, str | None],
    options: Mapping[str, CheckpointOptions] | None = None,
) -> CheckpointPlan:
    """Checkpoint a model that runs on one rank: plan as :func:`plan_checkpointing` does with
    every module on rank 0, then wrap the forwards of the planned modules in place.

    ``config`` is ``{module path: strategy}`` as for the runtime; ``options`` gives per-path
    :class:`CheckpointOptions`. A module already wrapped is left alone. Returns the plan.
    """
    opts = dict(options or {})
    assignment = {path: 0 for path in canonical_modules(root).values()}
    plan = plan_checkpointing(root, config, assignment)
    canon = canonical_modules(root)
    by_path = {canon[id(m)]: m for m in root.modules()}
    by_alias = dict(root.named_modules(remove_duplicate=False))
    owner_opts = {canon[id(by_alias[p])]: o for p, o in opts.items() if p in by_alias}
    for path in sorted(plan.modules):
        m = by_path[path]
        # A marker, not "forward in __dict__": some libraries give modules an instance-level
        # forward, which must be wrapped too.
        if m.__dict__.get(_WRAPPED, False):
            continue
        o = owner_opts.get(path, CheckpointOptions())
        original = m.forward

        def forward(
            *args: Any, _orig: Any = original, _rng: bool = o.preserve_rng_state, **kwargs: Any
        ) -> Any:
            return run_checkpointed(_orig, args, kwargs, preserve_rng_state=_rng)

        m.forward = forward  # type: ignore[method-assign]
        m.__dict__[_WRAPPED] = True
    for path, groups in plan.groups.items():
        seq = cast(nn.Sequential, by_path[path])  # the plan groups children of Sequentials only
        if seq.__dict__.get(_WRAPPED, False):
            continue
        seq.forward = grouped_sequential_forward(  # type: ignore[method-assign]
            seq, groups, owner_opts.get(path)
        )
        seq.__dict__[_WRAPPED] = True
    return plan
