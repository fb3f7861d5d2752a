"""``fast_mode``: an ``nn.Sequential``'s consecutive children on one other rank as one request.

Without it, a sequential container owned here calls each child owned elsewhere as its own
request: a stage of k blocks costs k round trips per microbatch forward, and k backward
requests. With it, the container's forward walks a *plan*: children owned here are called
as usual, and each run of >= 2 consecutive children owned by one other rank is a single
request carrying the run's module paths (Appendix B's "subset of consecutive modules"); the
owner calls them in order on its side, so only the run's input and output cross ranks.

Consecutive runs on two or more other ranks are one :class:`Relay`: the first owner's output
goes straight to the next owner, and so on, and the last answers; in backward the gradients
come back the same way (see :meth:`smp_pipeline.remote.RemoteCalls.run_forward_request`).

Nested plain ``nn.Sequential`` containers owned here are flattened into their parent's plan,
so a run may cross their boundary (a partition that cuts inside block 4 of a stack of
``nn.Sequential`` blocks makes one request of ``4.3, 5, 6, 7``, not two). Flattening skips
the nested container's own ``__call__``, so it applies only while nothing would notice:

- statically, the nested container is a plain ``nn.Sequential`` (its class keeps
  ``Sequential.forward`` and no ``forward`` was set on the instance), owned here, and neither
  checkpointed nor grouped (:class:`~smp_pipeline.checkpointing.CheckpointPlan`);
- at every call, it has no hooks of its own (forward, pre-forward, backward; the runtime's
  yield-point hooks excepted) and no global module hooks are registered. Otherwise that
  call uses the *shallow* plan (direct children only), whose runs are exactly as above.

Why this is exact: the run's children execute on their owner, through their own
``__call__`` (hooks, checkpointing wrappers, yield points), on the same inputs, in the same
order as the per-child requests would run them there; only the intermediate tensors stay
on the owner instead of making a round trip as detached leaves, and a child's output of a
sequential container has exactly one consumer (the next child), so every gradient is the
same sum of the same terms (bitwise, in joined mode).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn
from torch.nn.modules import module as _torch_module


@dataclass(frozen=True)
class Relay:
    """Consecutive runs owned by two or more other ranks, one after another (``hops``: (owner
    pp rank, module paths) each): one request to the first owner, whose output goes
    straight to the next owner as its input, and so on; the last owner answers the caller.
    In backward the gradients take the way back the same way (last owner first, the first
    answers). So a stage boundary costs one transfer each way, not two through the caller."""

    hops: tuple[tuple[int, tuple[str, ...]], ...]


# Relays on (read when a container is planned, at placement): False sends every run through
# the container's rank, as before relays (benchmarks compare the two).
RELAY = True

# One step of a plan: a module to call here, (owner pp rank, module paths) to request, or a
# relay through several owners.
Item = nn.Module | tuple[int, tuple[str, ...]] | Relay


@dataclass(frozen=True)
class SequentialPlan:
    """How an owned ``nn.Sequential``'s forward runs (see the module docstring)."""

    flat: list[Item]  # nested plain containers owned here flattened in
    shallow: list[Item]  # direct children only
    expanded: list[nn.Module] = field(default_factory=list)  # containers flattened into flat

    @property
    def useful(self) -> bool:
        """Whether either plan sends a run as one request (else keep the plain forward)."""
        return any(isinstance(i, (tuple, Relay)) for i in (*self.flat, *self.shallow))


def is_plain_sequential(m: nn.Module, ours: Callable[[nn.Module], bool]) -> bool:
    """``m`` is an ``nn.Sequential`` whose forward is ``Sequential.forward``, or one that the
    runtime itself replaced (``ours``)."""
    if not isinstance(m, nn.Sequential) or type(m).forward is not nn.Sequential.forward:
        return False
    return "forward" not in m.__dict__ or ours(m)


def plan_sequential(
    seq: nn.Sequential,
    canon: Mapping[int, str],
    assignment: Mapping[str, int],
    pp_rank: int,
    expandable: Callable[[nn.Module, str], bool],
) -> SequentialPlan:
    """The flat and shallow plans of ``seq`` (owned by ``pp_rank``); ``expandable(child,
    path)`` says whether a nested container may be flattened (see the module docstring)."""
    expanded: list[nn.Module] = []

    def leaves(container: nn.Sequential, flatten: bool) -> list[tuple[nn.Module, str]]:
        out: list[tuple[nn.Module, str]] = []
        for child in container:
            path = canon[id(child)]
            if flatten and assignment[path] == pp_rank and expandable(child, path):
                assert isinstance(child, nn.Sequential)
                expanded.append(child)
                out.extend(leaves(child, True))
            else:
                out.append((child, path))
        return out

    return SequentialPlan(
        _runs(leaves(seq, True), assignment, pp_rank),
        _runs(leaves(seq, False), assignment, pp_rank),
        expanded,
    )


def _runs(
    steps: list[tuple[nn.Module, str]], assignment: Mapping[str, int], pp_rank: int
) -> list[Item]:
    """Group maximal runs of steps owned by one rank. Consecutive runs on two or more other
    ranks become one :class:`Relay` (a rank at most once per relay: an owner keeps one call
    record per call key); otherwise a run of >= 2 steps on one other rank is one request,
    and a lone remote step stays a module call (its own request, with its checkpointing
    flag)."""
    groups: list[tuple[int, list[tuple[nn.Module, str]]]] = []
    for m, p in steps:
        owner = assignment[p]
        if groups and groups[-1][0] == owner:
            groups[-1][1].append((m, p))
        else:
            groups.append((owner, [(m, p)]))
    items: list[Item] = []
    i = 0
    while i < len(groups):
        j = i
        owners: set[int] = set()
        while j < len(groups) and groups[j][0] != pp_rank and groups[j][0] not in owners:
            owners.add(groups[j][0])
            j += 1
        if RELAY and j - i >= 2:
            items.append(Relay(tuple((o, tuple(p for _, p in g)) for o, g in groups[i:j])))
            i = j
            continue
        owner, group = groups[i]
        if owner != pp_rank and len(group) >= 2:
            items.append((owner, tuple(p for _, p in group)))
        else:
            items.extend(m for m, _ in group)
        i += 1
    return items


def has_own_hooks(m: nn.Module, ignore: set[int]) -> bool:
    """Whether calling ``m`` would run hooks of its own (handle ids in ``ignore`` aside)."""
    if m._forward_hooks or m._backward_hooks or m._backward_pre_hooks:
        return True
    return any(k not in ignore for k in m._forward_pre_hooks)


def global_hooks() -> bool:
    """Whether module hooks registered for every module are active (they would miss the
    calls of a flattened container)."""
    g = _torch_module
    return bool(
        g._global_forward_hooks
        or g._global_forward_pre_hooks
        or g._global_backward_hooks
        or g._global_backward_pre_hooks
    )


def span_label(path: str, span: tuple[str, ...] | None) -> str:
    """How a request is named in messages, the timeline and stall reports: the module path,
    or for a run ``first..last`` of its module paths."""
    if not span:
        return path
    return span[0] if len(span) == 1 else f"{span[0]}..{span[-1]}"
