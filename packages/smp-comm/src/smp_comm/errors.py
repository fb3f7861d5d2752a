"""Exceptions raised by smp-comm. Every one names the peer rank (and tag) involved."""

from __future__ import annotations

__all__ = ["CommClosedError", "CommError", "CommTimeoutError", "PeerClosedError"]


class CommError(RuntimeError):
    """Base class: a message could not be sent or received."""


class CommTimeoutError(CommError, TimeoutError):
    """``Handle.wait(timeout)`` ran out of time; the message names the peer rank and tag."""

    def __init__(self, message: str, peer: int, tag: int) -> None:
        super().__init__(message)
        self.peer = peer
        self.tag = tag


class PeerClosedError(CommError):
    """The peer rank closed its :class:`~smp_comm.Communicator` (or left the job)."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class CommClosedError(CommError):
    """This rank's own :class:`~smp_comm.Communicator` is closed."""
