"""Ranks that must agree, checked where it is cheap: the configuration and a step's inputs.

- The configuration (``smp.init``, :mod:`smp_torch.config_agree`: one bounded exchange
  through rank 0): every rank must pass the same configuration, except keys that are only
  local (:data:`PER_RANK_KEYS`). A rank with another ``microbatches`` (or degree, schedule,
  ...) would otherwise split its batch differently and hang or garble the pipeline and the
  gradient reduction.
- :class:`StepInputs` (computed by ``@smp.step`` from the unsplit arguments): the batch size
  (the first split tensor's length along its split axis) and a digest of every tensor
  argument's shape and dtype.

  * Data-parallel ranks must pass batches of one size, or the averaged gradient is not the
    global batch's: the step's agreement, already one allreduce at the end of every step,
    carries the size (:func:`agreement_values`, no extra message) and raises on every rank
    when it differs, before the optimizer step.
  * Tensor-parallel ranks must pass tensors of the same shapes, or their collectives abort
    or hang inside the backend before the step ends: :func:`check_tp_inputs` costs one
    2-integer allreduce over the tensor-parallel group before each step, only when
    ``tensor_parallel_degree > 1``, only on the ranks that run the step function.

  Ranks of pipeline stages > 0 do not run the step function (stage 0 drives the pipeline),
  so their arguments are not checked.
"""

from __future__ import annotations

import array
import hashlib
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from smp_torch.errors import SMPError
from smp_torch.watch import FailureWatch

__all__ = [
    "PER_RANK_KEYS",
    "StepInputs",
    "agreement_values",
    "batch_mismatch",
    "by_value",
    "check_tp_inputs",
    "ranks_text",
]

#: Configuration keys that may differ between ranks (paths and local timeouts).
PER_RANK_KEYS = frozenset({"timeline", "timeout_s", "trace_device"})
# What a rank that does not run the step function sends in the agreement (see
# agreement_values): below every real value, so the maximum ignores it.
_ABSENT = -(2**62)


def ranks_text(ranks: list[int]) -> str:
    """``"rank [1]"`` or ``"ranks [0, 2]"``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {ranks}"


def by_value(values: list[tuple[int, Any]]) -> str:
    """``"4 on rank [1], 2 on ranks [0, 2]"`` for ``(rank, value)`` pairs (the least common
    value first)."""
    groups: dict[str, list[int]] = {}
    for r, v in values:
        groups.setdefault(repr(v), []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1]))
    return ", ".join(f"{v} on {ranks_text(rs)}" for v, rs in ordered)


@dataclass(frozen=True)
class StepInputs:
    """What a step's arguments must agree on across ranks.

    Attributes:
        batch: the first split tensor's length along its split axis (0: none).
        shapes: every tensor argument's ``(shape, dtype)``, in argument order, as text.
    """

    batch: int
    shapes: tuple[str, ...]

    def digest(self) -> int:
        """A 62-bit digest of :attr:`shapes` (for a max/min comparison)."""
        h = hashlib.blake2b("|".join(self.shapes).encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") >> 2


def agreement_values(inputs: StepInputs | None) -> list[int]:
    """The two values this rank adds to the step's agreement (an allreduce of maxima):
    ``[batch, -batch]``, so the result holds the largest and the smallest batch; a rank
    without inputs (a pipeline server) sends values below every real one."""
    if inputs is None:
        return [_ABSENT, _ABSENT]
    return [inputs.batch, -inputs.batch]


def batch_mismatch(agreed: list[int]) -> bool:
    """Whether the agreement's two values (:func:`agreement_values`) show different batch
    sizes on the ranks that ran the step function."""
    largest, neg_smallest = agreed
    return largest != _ABSENT and largest != -neg_smallest


def batch_error(step: int, batches: list[int | None]) -> SMPError:
    """The error every rank raises when the data-parallel batch sizes differ (``batches``:
    each rank's, ``None`` where it does not run the step function)."""
    desc = by_value([(r, b) for r, b in enumerate(batches) if b is not None])
    return SMPError(
        f"step {step}: the ranks passed batches of different sizes to the step function "
        f"({desc}; the size along the split axis); every data-parallel rank must pass the "
        "same batch size, or the averaged gradient is not the global batch's"
    )


def check_tp_inputs(watch: FailureWatch, comm: Any, inputs: StepInputs, step: int) -> None:
    """Collective over the tensor-parallel group ``comm`` (size > 1): raise :class:`SMPError`
    on every member, naming the ranks and their shapes, if their step inputs differ."""
    d = inputs.digest()
    send = array.array("q", [d, -d])
    recv = array.array("q", [0, 0])
    watch.wait_request(comm.Iallreduce(send, recv, op=MPI.MAX))
    if recv[0] == -recv[1]:
        return
    every = comm.allgather((watch.rank, inputs.shapes))  # (rare: only to name them)
    desc = "; ".join(f"rank {r}: {', '.join(s) or 'no tensors'}" for r, s in every)
    raise SMPError(
        f"step {step}: the tensor-parallel ranks passed different inputs to the step function "
        f"({desc}); every rank of a tensor-parallel group must pass tensors of the same shapes"
    )
