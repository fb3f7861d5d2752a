"""The messages pipeline ranks exchange: one frozen dataclass per kind.

Every message names its sender's pp rank (``src``). Structures holding tensors travel as
:class:`~smp_pipeline.messages.Packed`. On the wire a message is a plain tuple
(:func:`to_wire`, :func:`from_wire`): a kind code and the field values, the ``Packed`` field
as a tuple too. smp-comm's pickler passes plain tuples straight through, so a message costs
no more to send than the dict literals these classes replaced (see docs/perf-notes.md, "Message
encoding"), and the skeleton carries no key strings.

``PRIORITY`` is the serve order among arrived messages of different kinds (lower first; see
:mod:`smp_pipeline.transport`): control messages, then forward responses (they resume a
pending caller: cheap, and unblock the microbatch), then backward work (before new forward
work, as in 1F1B), then new forward requests.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, cast

from smp_pipeline.messages import Packed

CallKey = tuple[int, int]  # (pp rank of the caller, per-rank call counter)


@dataclass(frozen=True, slots=True)
class FwdReq:
    """Run a module's forward for a remote caller (Appendix B's request fields)."""

    PRIORITY: ClassVar[int] = 3
    src: int
    key: CallKey
    path: str  # canonical module path
    step: int
    mb: int
    grad: bool  # the caller's grad mode
    autocast: list[tuple[str, str]]  # the caller's autocast contexts (device type, dtype)
    checkpoint: bool  # run the module under activation checkpointing
    span: tuple[str, ...] | None  # fast_mode: a run of children of the Sequential at ``path``
    # fast_mode's relay: the further runs ((pp rank, span), ...) of the Sequential at
    # ``path`` the output goes to, each straight from the previous owner; the last owner
    # answers the caller (``key[0]``). Empty: answer the caller.
    then: tuple[tuple[int, tuple[str, ...]], ...]
    # fast_mode's ModuleList chain (smp_pipeline.chains): the blocks ((path, checkpoint),
    # ...) run after ``path``, each on its predecessor's output; every output is answered.
    chain: tuple[tuple[str, bool], ...]
    inputs: Packed  # (args, kwargs)

    def modules(self) -> tuple[str, ...] | None:
        """The module paths a request runs in order when more than ``path``'s (a span, or
        ``path`` and its chain); None: ``path`` alone."""
        if self.chain:
            return (self.path, *(p for p, _ in self.chain))
        return self.span


@dataclass(frozen=True, slots=True)
class FwdResp:
    """The outputs of a forward request."""

    PRIORITY: ClassVar[int] = 1
    src: int
    key: CallKey
    step: int
    mb: int
    outputs: Packed


@dataclass(frozen=True, slots=True)
class BwdReq:
    """Gradients of a remote call's outputs, from the caller to the owner."""

    PRIORITY: ClassVar[int] = 2
    src: int
    key: CallKey
    req: int  # the caller's backward request number (a boundary may fire more than once)
    path: str
    step: int
    mb: int
    joined: bool  # joined mode: answered once, so the owner may free its graph
    once: bool  # the caller's backward is one run: no further request for this call comes
    grads: Packed


@dataclass(frozen=True, slots=True)
class BwdResp:
    """Gradients of a remote call's inputs, from the owner back to the caller."""

    PRIORITY: ClassVar[int] = 2
    src: int
    key: CallKey
    req: int
    step: int
    mb: int
    grads: Packed

    @property
    def wait_key(self) -> tuple[str, CallKey, int]:
        """The key this response is awaited (and tracked as outstanding) under."""
        return ("bwd", self.key, self.req)


@dataclass(frozen=True, slots=True)
class MbDone:
    """A microbatch finished: every rank may drop its saved call records."""

    PRIORITY: ClassVar[int] = 0
    src: int
    step: int
    mb: int


@dataclass(frozen=True, slots=True)
class StepEnd:
    """The step finished on the driver: serve loops return (the step's outputs inside)."""

    PRIORITY: ClassVar[int] = 0
    src: int
    step: int
    outputs: Packed


@dataclass(frozen=True, slots=True)
class Abort:
    """A failure (``error="error"``) or a timeout (``"timeout"``) somewhere: every rank raises."""

    PRIORITY: ClassVar[int] = 0
    src: int
    comm_rank: int  # the reporting rank on the communicator (it may be another pipeline's)
    error: str
    text: str
    culprit: int | None = None  # the communicator rank a stall is attributed to (None: src)


@dataclass(frozen=True, slots=True)
class StallQuery:
    """A request of ``src`` timed out: answer with a :class:`StallReport` of this rank's
    pending work (taken by the transport itself, whatever the rank is doing: see
    :mod:`smp_pipeline.diagnosis`)."""

    PRIORITY: ClassVar[int] = 0
    src: int
    query: int  # the querying rank's query number


@dataclass(frozen=True, slots=True)
class StallReport:
    """A rank's pending work, answering a :class:`StallQuery`."""

    PRIORITY: ClassVar[int] = 0
    src: int
    query: int
    state: Any  # a smp_pipeline.stall.RankState (plain named tuples)


Message = FwdReq | FwdResp | BwdReq | BwdResp | MbDone | StepEnd | Abort | StallQuery | StallReport

# Arrivals that make a running forward yield at its next yield point: work another rank waits
# for. A forward response resumes a pending caller (on the driver: the loss, then the backward
# request the next stage waits for); a backward request's answer goes back to the rank that
# sent it. (A backward response is not: on the first stage it only continues local backward,
# while the forward it would delay feeds the next stage.)
PREEMPTING: tuple[type, ...] = (FwdResp, BwdReq)


def priority(msg: Message) -> tuple[int, int, int]:
    """Serve order among arrived messages: by kind, then older microbatches first."""
    return (msg.PRIORITY, getattr(msg, "step", 0), getattr(msg, "mb", 0))


# Wire codes: a message's position in this tuple (the same on every rank of one installation).
_KINDS: tuple[type, ...] = (
    FwdReq, FwdResp, BwdReq, BwdResp, MbDone, StepEnd, Abort, StallQuery, StallReport,
)  # fmt: skip


def _codec(cls: type) -> tuple[int, Callable[[Any], tuple[Any, ...]], bool]:
    names = [f.name for f in fields(cls)]
    # The Packed payload, where a kind has one, is its last field.
    return _KINDS.index(cls), operator.attrgetter(*names), names[-1] in _PACKED_FIELDS


_PACKED_FIELDS = ("inputs", "outputs", "grads")
_ENCODE = {cls: _codec(cls) for cls in _KINDS}
_DECODE = tuple((cls, _ENCODE[cls][2]) for cls in _KINDS)
# PREEMPTING by wire code, for a look at an arrival before it is decoded.
PREEMPTING_CODES = frozenset(_KINDS.index(cls) for cls in PREEMPTING)


def has_payload(code: int) -> bool:
    """Whether messages of wire code ``code`` end with a ``Packed`` payload."""
    return _DECODE[code][1]


def to_wire(msg: Message) -> tuple[Any, ...]:
    """``msg`` as a plain tuple: its kind code, then its field values."""
    code, get, packed = _ENCODE[type(msg)]
    values = get(msg)
    if packed:
        p = values[-1]
        return (code, *values[:-1], (p.skeleton, p.tensors, p.flags))
    return (code, *values)


def from_wire(t: tuple[Any, ...]) -> Message:
    """Inverse of :func:`to_wire`."""
    cls, packed = _DECODE[t[0]]
    if packed:
        return cast(Message, cls(*t[1:-1], Packed(*t[-1])))
    return cast(Message, cls(*t[1:]))
