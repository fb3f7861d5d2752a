"""Exceptions raised by the pipeline runtime.

Every failure that involves more than one rank is raised on *every* pipeline rank (the rank
that detects it broadcasts an abort message), so no rank is left waiting forever.
"""

from __future__ import annotations


class PipelineError(RuntimeError):
    """Base class of every error raised by smp_pipeline.

    Attributes:
        origin: for an error an abort raised on every rank, the communicator rank that
            reported it (this rank for the rank where it happened); None otherwise.
    """

    origin: int | None = None


class PipelineConfigError(PipelineError, ValueError):
    """Bad input: an unknown module path, a rank out of range, an invalid schedule, ..."""


class PipelineTimeoutError(PipelineError, TimeoutError):
    """A request waited longer than ``timeout_s``; raised on every pipeline rank.

    The message names the rank that waited, the module, the microbatch and what it waited for.
    """


class PipelineRemoteError(PipelineError):
    """An exception inside a module (or the step function) on some pipeline rank.

    Raised on every pipeline rank; the message holds the original traceback text.
    """


class PipelineInterruptedError(PipelineError):
    """The runtime was interrupted from outside (:meth:`PipelineRuntime.interrupt`): raised on
    this rank only, at its next wait, with the reason the caller gave (e.g. another rank of
    the job failed outside the pipeline)."""
