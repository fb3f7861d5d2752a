"""Exceptions raised by smp."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointPeerError",
    "ConfigError",
    "SMPError",
    "NotInitializedError",
    "PeerFailedError",
    "StallError",
]


class SMPError(RuntimeError):
    """Base class of every error smp raises on purpose."""


class ConfigError(SMPError, ValueError):
    """A configuration key is unknown, has the wrong type or an impossible value, or the
    ranks passed different values for it.

    :func:`smp.init` checks each rank's configuration locally first, then the ranks compare
    their results (one exchange through rank 0, bounded by ``timeout_s``): when the
    configuration is invalid on any rank, or the ranks disagree, *every* rank raises it,
    naming the key and the ranks (``smp config key 'microbatchs': invalid on rank [1]:
    unknown key (...)``). A rank whose own configuration is invalid leads with its own key and
    text and chains its original error. So a configuration wrong on one rank only never leaves
    the others waiting for it.

    Attributes:
        key: the configuration key concerned.
        detail: what is wrong with it (the message without the ``smp config key`` prefix).
    """

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.detail = message
        super().__init__(f"smp config key {key!r}: {message}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Picklable with both arguments (the default passes only the formatted message).
        return (type(self), (self.key, self.detail))


class NotInitializedError(SMPError):
    """An smp function that needs the runtime was called before :func:`smp.init`."""


class PeerFailedError(SMPError):
    """A rank of the job failed: raised on every *other* rank, wherever smp is waiting.

    A rank fails when an exception goes uncaught in any of its threads, when its step raises,
    or when its process ends without exiting (killed, crashed). The other ranks learn of it
    through smp's failure channel within a fraction of a second and raise this error at once
    if they are inside smp (in a step, its agreement, a pipeline wait, a collective smp
    issues); a rank outside smp that does not enter it within a second is ended instead, with
    this message on stderr (see the package README, "Failures").

    Attributes:
        rank: the global rank that failed (this rank itself when one of its own threads
            failed).
        error: what happened there: ``"<ExceptionType>: <message>"`` (first line), or how
            its process ended.
        where_failed: what the failed rank was doing (``"outside smp, after step 2"``,
            ``"in step 3, running the step function"``, ``"in thread 'loader'"``...).
        waiting_for: what this rank was doing when it learnt of it.
        this_rank: the rank raising it.
    """

    def __init__(
        self,
        rank: int,
        error: str,
        where_failed: str,
        waiting_for: str,
        this_rank: int | None = None,
    ) -> None:
        self.rank = rank
        self.error = error
        self.where_failed = where_failed
        self.waiting_for = waiting_for
        self.this_rank = this_rank
        who = f"rank {rank}" + (" (this rank)" if rank == this_rank else "")
        where = f" ({where_failed})" if where_failed else ""
        here = "this rank" if this_rank is None else f"rank {this_rank}"
        super().__init__(f"{who} failed{where}: {error}; {here} was {waiting_for}")

    def __reduce__(self) -> tuple[type, tuple[int, str, str, str, int | None]]:
        # Picklable (exceptions with required arguments are not, by default).
        args = (self.rank, self.error, self.where_failed, self.waiting_for, self.this_rank)
        return (type(self), args)


class CheckpointError(SMPError):
    """A checkpoint could not be written or is missing, incomplete, corrupt or unsafe."""


class CheckpointPeerError(CheckpointError, PeerFailedError):
    """Saving or loading a checkpoint failed on another rank (``rank``): raised on every
    rank where it did not fail. Catchable as either base class; its message is
    :class:`~smp_torch.errors.PeerFailedError`'s (the failed rank, its error, what it and
    this rank were doing)."""


class StallError(SMPError, TimeoutError):
    """This rank held the job up: a wait of another rank inside smp (or of this one) lasted
    ``timeout_s`` while this rank ran user code or a module that did not return. Raised on
    this rank, if it can still raise; the other ranks raise :class:`PeerFailedError` naming
    it (see the package README, "Failures")."""
