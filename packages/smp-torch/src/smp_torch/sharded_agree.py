"""Sharded data parallelism when ranks run different code: matched collectives, exact sums.

FSDP2 issues its collectives from module hooks: a unit's all-gather before it runs (again
in backward when it was resharded after forward) and its gradient reduce-scatter once its
backward is done. When the data decides what runs (a mixture of experts whose router sends
one rank's samples to one expert and another rank's to another), two things go wrong:

- **A parameter with a gradient on some ranks only.** FSDP2 reduce-scatters just the
  parameters of a unit that have a gradient, so a rank whose branch did not reach one sends
  a shorter buffer than its peers and gloo aborts ("Received data size doesn't match
  expected size"). :func:`fill_missing_grads` first agrees over the reduced data-parallel
  group on which parameters have a gradient on *some* rank and gives each of those a zero
  gradient where it has none: the reduced sum is then what one process accumulating every
  rank's microbatches computes. A parameter with a gradient on *no* rank keeps
  ``grad = None`` on every rank, as in that one process: an optimizer skips such a
  parameter, while a zero gradient would still move it (weight decay, momentum, Adam's
  moments).
- **A unit that runs on some ranks only.** Its all-gather cannot be matched (a rank that
  does not run the unit has no call to gather for), so this cannot train exactly, and the
  ranks must not reach FSDP2's collectives out of step (a gloo abort, or a hang). Without a
  pipeline (:func:`guard_units`), before every all-gather and reduction of a unit, and at
  the end of every step, the ranks exchange what they are about to do (the unit's index
  and the phase, with the gradient flags: one small MPI all-gather on the host,
  :class:`UnitAgreement`). A difference raises :class:`~smp_torch.errors.SMPError` on every
  rank, naming each rank's unit, before any FSDP2 collective is issued out of step.

With a pipeline (:mod:`smp_torch.sharded_pp`) a stage's units are gathered before the step
and reduced after it, at fixed points, so only the gradient flags are exchanged there and a
branch at any level (a whole unit included) trains exactly.

The guards use FSDP2 internals (each parameter group's ``unshard`` / ``post_backward`` and
``fsdp_params``, the parameters' ``unsharded_param``), as :mod:`smp_torch.sharded_pp` does;
the data-dependent equivalence tests fail if their behaviour changes.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from smp_torch.errors import SMPError

__all__ = [
    "GATHER_FORWARD",
    "GATHER_BACKWARD",
    "GATHER",
    "REDUCE",
    "END",
    "UnitAgreement",
    "fill_missing_grads",
    "guard_units",
    "param_groups",
]

# What a rank is about to do (the first number of an exchange).
GATHER_FORWARD, GATHER_BACKWARD, GATHER, REDUCE, END = range(5)
_DOING = {
    GATHER_FORWARD: "all-gather {unit} for forward",
    GATHER_BACKWARD: "all-gather {unit} for backward",
    GATHER: "all-gather {unit}",
    REDUCE: "reduce the gradients of {unit}",
    END: "end its step",
}


class UnitAgreement:
    """Small host-side exchanges over the reduced data-parallel group (the ranks of one
    sharding mesh) that keep FSDP2's collectives in step; see the module docstring.

    Args:
        comm: a private MPI communicator over the group (closed by :meth:`close`).
        members: the world rank of each of its ranks (for messages).
        names: the units' module paths, by index (the same on every rank).
        width: the most gradient flags one exchange carries.
        wait: waits for an MPI request (smp's raises if a peer failed meanwhile).
    """

    def __init__(
        self,
        comm: Any,
        members: Sequence[int],
        names: Sequence[str],
        width: int,
        wait: Callable[[Any], None],
    ) -> None:
        self._comm = comm
        self._members = list(members)
        self._names = list(names)
        self._width = width
        self._wait = wait
        self.exchanges = 0  # (for tests and measurements)

    @classmethod
    def over_rdp(cls, ctx: Any, names: Sequence[str], width: int) -> UnitAgreement:
        """Collective over the reduced data-parallel group: an agreement on a duplicate of its
        MPI communicator, closed with the context."""
        agreement = cls(ctx.mpi_comms["rdp"].Dup(), ctx.groups["rdp"], names, width, ctx.watch.wait_request)
        ctx.closers.append(agreement.close)
        return agreement

    def exchange(self, doing: int, unit: int, flags: Sequence[int] = ()) -> list[int]:
        """Collective over the group: this rank is about to do ``doing`` (:data:`REDUCE`,
        ...) on unit ``unit``. Raises :class:`SMPError` on every rank if the ranks are about
        to do different things; else returns ``flags``' element-wise maximum over the ranks."""
        if len(flags) > self._width:
            raise AssertionError(f"{len(flags)} gradient flags, room for {self._width}")
        n = self._comm.Get_size()
        self.exchanges += 1
        if n == 1:
            return list(flags)
        row = 2 + self._width
        send = array.array("q", [doing, unit, *flags, *[0] * (self._width - len(flags))])
        recv = array.array("q", [0]) * (row * n)
        self._wait(self._comm.Iallgather(send, recv))
        rows = [recv[i * row : (i + 1) * row] for i in range(n)]
        if len({(r[0], r[1]) for r in rows}) > 1:
            raise SMPError(self._diverged([(r[0], r[1]) for r in rows]))
        return [max(r[2 + i] for r in rows) for i in range(len(flags))]

    def _diverged(self, doing: list[tuple[int, int]]) -> str:
        def unit(index: int) -> str:
            name = self._names[index] if 0 <= index < len(self._names) else "?"
            return f"unit '{name}'" if name else "the root module's unit"

        parts: list[str] = []
        for what in dict.fromkeys(doing):  # first-seen order
            ranks = [self._members[i] for i, d in enumerate(doing) if d == what]
            who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
            parts.append(f"{who}: {_DOING[what[0]].format(unit=unit(what[1]))}")
        return (
            "sharded data parallelism: the data-parallel ranks of a sharding group ran different "
            f"modules ({'; '.join(parts)}). A module that runs on some data-parallel ranks and not "
            "on others (a data-dependent branch) cannot be an FSDP2 unit of its own: its "
            "all-gathers cannot match. Keep it inside a unit that runs on every rank (raise "
            "sdp_param_persistence_threshold above its parameter count), or run it on every rank"
        )

    def close(self) -> None:
        """Free the communicator (idempotent)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.Free()
            except Exception:  # noqa: BLE001 - re-initialising anyway
                pass


def param_groups(unit: nn.Module) -> list[Any]:
    """FSDP2's parameter groups of a ``fully_shard``-ed module (one, without per-parameter
    meshes)."""
    from torch.distributed.fsdp import fully_shard

    return list(fully_shard.state(unit)._fsdp_param_groups)  # type: ignore[attr-defined]


def _has_grad(fsdp_param: Any) -> bool:
    if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
        return True
    return hasattr(fsdp_param, "_unsharded_param") and fsdp_param.unsharded_param.grad is not None


def fill_missing_grads(groups: Sequence[Any], agreement: UnitAgreement, doing: int, unit: int) -> None:
    """Collective over the agreement's group, before FSDP2 reduces ``groups``' gradients:
    a zero gradient for every gathered parameter that has a gradient on another rank but not
    here (see the module docstring); a parameter with a gradient on no rank keeps None."""
    params = [fp for g in groups for fp in g.fsdp_params]
    agreed = agreement.exchange(doing, unit, [int(_has_grad(fp)) for fp in params])
    for fp, anywhere in zip(params, agreed):
        if anywhere and not _has_grad(fp):
            if not hasattr(fp, "_unsharded_param"):
                raise SMPError(
                    f"sharded data parallelism: parameter '{fp._param_fqn}' has a gradient on "
                    "another data-parallel rank but was never gathered here"
                )
            fp.unsharded_param.grad = torch.zeros_like(fp.unsharded_param)


def guard_units(units: Sequence[nn.Module], agreement: UnitAgreement) -> None:
    """Without a pipeline: before each all-gather and each gradient reduction of a unit
    (``units[i]`` has index ``i`` in ``agreement``'s names), the ranks exchange what they are
    about to do, and a reduction fills missing gradients (see the module docstring)."""
    for index, unit in enumerate(units):
        for group in param_groups(unit):
            _guard(group, index, agreement)


def _guard(group: Any, index: int, agreement: UnitAgreement) -> None:
    unshard: Callable[..., Any] = group.unshard
    post_backward: Callable[..., Any] = group.post_backward

    # FSDP2 calls these through the group's attributes (its hooks, prefetches and the root's
    # final backward callback), so per-instance wrappers see every call. Every call is
    # exchanged, also one that turns out a no-op: FSDP2 makes the same calls on ranks that
    # run the same modules.
    def guarded_unshard(*args: Any, **kwargs: Any) -> Any:
        state = getattr(group._training_state, "name", "")
        doing = {"FORWARD": GATHER_FORWARD, "PRE_BACKWARD": GATHER_BACKWARD}.get(state, GATHER)
        agreement.exchange(doing, index)
        return unshard(*args, **kwargs)

    def guarded_post_backward(*args: Any) -> Any:
        fill_missing_grads([group], agreement, REDUCE, index)
        return post_backward(*args)

    group.unshard = guarded_unshard
    group.post_backward = guarded_post_backward
