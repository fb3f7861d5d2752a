"""What smp's failure channel carries (:class:`Failure`) and how an error is read: its one-line
report, and whether it may be the local sign of another rank's failure."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed
from smp_comm.errors import CommError
from smp_pipeline.errors import PipelineError, PipelineInterruptedError

__all__ = ["Failure", "first_line", "maybe_consequence"]


@dataclass(frozen=True)
class Failure:
    """A failure as the channel carries it.

    Attributes:
        rank: the rank that failed.
        error: ``"<type>: <message>"``, or how its process ended.
        where: what it was doing ("" if unknown).
        dead: its process is gone (no orderly exit can wait for it).
    """

    rank: int
    error: str
    where: str
    dead: bool = False


# torch.distributed's own errors (a backend's failed collective), and what gloo says when
# the other end of a connection went away.
_DIST_ERRORS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch.distributed, "DistError", None),) if isinstance(t, type)
)
_CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def first_line(error: BaseException) -> str:
    """``"<type>: <first line of the message>"``, for notices and reports."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:500]}" if text else type(error).__name__


def maybe_consequence(error: BaseException, rank: int) -> bool:
    """Whether ``error`` may be how another rank's failure showed here, before this rank's
    watcher learnt of it: an interrupted pipeline, or a broken connection anywhere in the
    exception's chain. (A pipeline abort reported by another rank is not: the step's
    agreement names its origin.)"""
    if isinstance(error, PipelineInterruptedError):
        return True
    if isinstance(error, PipelineError) and error.origin not in (None, rank):
        return False
    seen: BaseException | None = error
    for _ in range(8):  # the cause/context chain, bounded
        if seen is None:
            break
        if isinstance(seen, (CommError, *_DIST_ERRORS)):
            return True
        if isinstance(seen, RuntimeError) and any(s in str(seen) for s in _CONNECTION_LOST):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
