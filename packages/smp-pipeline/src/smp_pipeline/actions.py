"""Actions as data: the one vocabulary of what a pipeline rank does, and its recorded program.

:class:`ActionKind` names every kind of action; its ``FORWARD`` and ``BACKWARD`` members are
also the *phase* of a task, a schedule entry and a timeline event (:data:`Phase`). It is a
``StrEnum`` whose values are the strings the runtime used before (``"forward"``,
``"backward"``), so an old string compares equal to its member and public entry points keep
accepting it (:func:`as_phase`).

An :class:`Action` is one immutable step of a rank's *program*: a task that ran a module's
forward or backward for a microbatch, or a message that carries tensors sent to (received
from) a peer rank. A dynamic step records each rank's program (:class:`ProgramRecorder`);
:func:`validate_programs` checks every rank's together, with no process started. Actions
print compactly and parse back (:meth:`Action.parse`)::

    F0 <step>                  forward of microbatch 0, the step function (driver)
    S0>1 fq 4x8 blocks.1       microbatch 0: a forward request to pp rank 1, one 4x8 tensor
    R0<1 fr 4x8                microbatch 0: a forward response from pp rank 1
    B0 blocks.1                backward of module blocks.1, microbatch 0

Message kinds (``fq`` forward request, ``fr`` forward response, ``bq`` backward request,
``br`` backward response) are the four kinds that carry tensors; control notes (a finished
microbatch, the step's end, aborts, stall queries) are not part of a program.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MESSAGE_KINDS",
    "Action",
    "ActionKind",
    "Phase",
    "ProgramRecorder",
    "as_phase",
    "format_program",
    "parse_program",
    "validate_programs",
]


class ActionKind(enum.StrEnum):
    """What an action does. ``FORWARD``/``BACKWARD`` double as task phases (:data:`Phase`);
    ``WEIGHT_GRAD`` is a zero-bubble weight-gradient task (its module: the operator, such as
    ``linear``); ``INPUT_GRAD`` is reserved (zero-bubble's input-gradient part runs as the
    ``BACKWARD`` task it is)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    INPUT_GRAD = "input_grad"
    WEIGHT_GRAD = "weight_grad"
    SEND = "send"
    RECV = "recv"

    @property
    def code(self) -> str:
        """The one-letter code of the compact form (``F B I W S R``)."""
        return _CODES[self]


# A task's phase is one of the compute kinds (FORWARD or BACKWARD today): the same enum, so
# a phase is an action kind without conversion.
Phase = ActionKind
FORWARD = ActionKind.FORWARD
BACKWARD = ActionKind.BACKWARD

_CODES = {
    ActionKind.FORWARD: "F",
    ActionKind.BACKWARD: "B",
    ActionKind.INPUT_GRAD: "I",
    ActionKind.WEIGHT_GRAD: "W",
    ActionKind.SEND: "S",
    ActionKind.RECV: "R",
}
_KINDS_BY_CODE = {c: k for k, c in _CODES.items()}
_PHASES = (ActionKind.FORWARD, ActionKind.BACKWARD)
_MESSAGE = (ActionKind.SEND, ActionKind.RECV)
# The messages a program holds (those that carry tensors), by short name.
MESSAGE_KINDS = ("fq", "fr", "bq", "br")

Shape = tuple[int, ...]


def as_phase(phase: str) -> ActionKind:
    """``phase`` (a member, or its old string ``"forward"``/``"backward"``) as the enum
    member; ValueError for anything else."""
    kind = ActionKind(phase)
    if kind not in _PHASES:
        raise ValueError(f"{phase!r} is not a phase: use 'forward' or 'backward'")
    return kind


def _shape_text(shapes: tuple[Shape, ...]) -> str:
    if not shapes:
        return "-"
    return ",".join("x".join(map(str, s)) if s else "()" for s in shapes)


def _parse_shapes(text: str) -> tuple[Shape, ...]:
    if text == "-":
        return ()
    return tuple(() if s == "()" else tuple(int(d) for d in s.split("x")) for s in text.split(","))


@dataclass(frozen=True, slots=True)
class Action:
    """One action of a rank's program (immutable, comparable, hashable).

    Attributes:
        kind: what it does.
        mb: the microbatch.
        module: the module (path, or a run's label; ``<step>`` is the step function on the
            driver); for a message, the module a request names ("" for a response).
        peer: the pp rank a message goes to (SEND) or comes from (RECV); None otherwise.
        message: a message's kind (one of :data:`MESSAGE_KINDS`); "" for compute.
        shapes: the shapes of the tensors a message carries, in order.
    """

    kind: ActionKind
    mb: int
    module: str = ""
    peer: int | None = None
    message: str = ""
    shapes: tuple[Shape, ...] = ()

    def __post_init__(self) -> None:
        if self.mb < 0:
            raise ValueError(f"microbatch must be >= 0, got {self.mb}")
        if self.kind in _MESSAGE:
            if self.peer is None or self.message not in MESSAGE_KINDS:
                raise ValueError(
                    f"a {self.kind} needs a peer and a message kind in {MESSAGE_KINDS}"
                )
        elif self.peer is not None or self.message or self.shapes:
            raise ValueError(f"a {self.kind} has no peer, message or shapes")

    def __str__(self) -> str:
        head = f"{self.kind.code}{self.mb}"
        if self.kind in _MESSAGE:
            arrow = ">" if self.kind is ActionKind.SEND else "<"
            head = f"{head}{arrow}{self.peer} {self.message} {_shape_text(self.shapes)}"
        return f"{head} {self.module}" if self.module else head

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action :meth:`__str__` printed as ``text`` (ValueError if malformed)."""
        m = _HEAD.match(text)
        if m is None:
            raise ValueError(f"not an action: {text!r}")
        kind = _KINDS_BY_CODE[m["code"]]
        rest = text[m.end() :]
        if kind in _MESSAGE:
            if m["arrow"] != (">" if kind is ActionKind.SEND else "<"):
                raise ValueError(f"not an action: {text!r}")
            parts = rest.split(" ", 3)  # "", message, shapes[, module (may hold spaces)]
            if len(parts) < 3 or parts[0]:
                raise ValueError(f"not an action: {text!r}")
            module = parts[3] if len(parts) == 4 else ""
            return cls(
                kind, int(m["mb"]), module, int(m["peer"]), parts[1], _parse_shapes(parts[2])
            )
        if m["arrow"] or (rest and not rest.startswith(" ")):
            raise ValueError(f"not an action: {text!r}")
        return cls(kind, int(m["mb"]), rest[1:])


_HEAD = re.compile(r"(?P<code>[FBIWSR])(?P<mb>\d+)(?:(?P<arrow>[<>])(?P<peer>\d+))?")


def format_program(program: Iterable[Action]) -> str:
    """A program one action a line (what :func:`parse_program` reads)."""
    return "\n".join(str(a) for a in program)


def parse_program(text: str) -> tuple[Action, ...]:
    """The program :func:`format_program` printed (blank lines and indentation ignored)."""
    return tuple(Action.parse(line.lstrip()) for line in text.splitlines() if line.strip())


class ProgramRecorder:
    """Records the actions of one rank during its steps, cheaply: a plain tuple per action,
    turned into :class:`Action` records only when a program is asked for.

    Actions are filed under the step they belong to (a message under its own ``step``): a
    receive taken while a step ends may already belong to the next one.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._steps: dict[int, list[tuple[Any, ...]]] = {}

    def begin(self, step: int) -> None:
        """A step starts: forget steps older than the previous one."""
        for s in [s for s in self._steps if s < step - 1]:
            del self._steps[s]

    def task(self, step: int, phase: ActionKind, mb: int, module: str) -> None:
        """A task started: the forward or backward of ``module`` for microbatch ``mb``, or
        (zero-bubble) a weight-gradient task of microbatch ``mb`` for operator ``module``."""
        if self.enabled:
            self._steps.setdefault(step, []).append((phase, mb, module))

    def message(
        self,
        step: int,
        kind: ActionKind,
        peer: int,
        msg: str,
        mb: int,
        module: str,
        tensors: Sequence[Any],
    ) -> None:
        """A tensor-carrying message was sent to / taken from ``peer``."""
        if self.enabled:
            shapes = tuple([t.shape for t in tensors])  # (torch.Size: made plain in program())
            self._steps.setdefault(step, []).append((kind, mb, module, peer, msg, shapes))

    def program(self, step: int) -> tuple[Action, ...]:
        """The actions recorded for ``step``, in order (empty if none, or forgotten)."""
        out = []
        for t in self._steps.get(step, ()):
            if len(t) == 3:
                out.append(Action(t[0], t[1], t[2]))
            else:
                kind, mb, module, peer, msg, shapes = t
                out.append(Action(kind, mb, module, peer, msg, tuple(tuple(s) for s in shapes)))
        return tuple(out)


def validate_programs(programs: Sequence[Sequence[Action]], driver: int = 0) -> list[str]:
    """Check every rank's program of one step together (``programs[r]``: pp rank r's);
    returns the problems found, worded (empty: consistent).

    - every message one rank sent to a peer is received there, in the same order among the
      messages of that pair of ranks (what the communicator guarantees), with the same kind,
      microbatch, module and shapes; nothing is received that was not sent;
    - on every rank, each backward of ``(mb, module)`` comes after a forward of it there
      (the driver's step function ``<step>`` included), and each weight-gradient task of a
      microbatch (zero-bubble) after a backward of that microbatch there;
    - the driver ran the step function forward once for each microbatch ``0..m-1``, and every
      microbatch named anywhere is one of them; a microbatch some rank ran backward for had
      its backward started by the driver.
    """
    problems: list[str] = []
    n = len(programs)
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            sent = [x for x in programs[a] if x.kind is ActionKind.SEND and x.peer == b]
            got = [x for x in programs[b] if x.kind is ActionKind.RECV and x.peer == a]
            for i in range(max(len(sent), len(got))):
                s = sent[i] if i < len(sent) else None
                r = got[i] if i < len(got) else None
                if s is None or r is None or _key(s) != _key(r):
                    problems.append(
                        f"message {i} from rank {a} to rank {b}: sent {s}, received {r}"
                    )
                    break
    for rank, program in enumerate(programs):
        seen: set[tuple[int, str]] = set()
        backwards: set[int] = set()
        for x in program:
            if x.kind is ActionKind.FORWARD:
                seen.add((x.mb, x.module))
            elif x.kind is ActionKind.BACKWARD:
                backwards.add(x.mb)
                if (x.mb, x.module) not in seen:
                    problems.append(f"rank {rank}: backward {x} before any forward of it")
            elif x.kind is ActionKind.WEIGHT_GRAD and x.mb not in backwards:
                problems.append(f"rank {rank}: weight-gradient task {x} before any backward "
                                f"of microbatch {x.mb} there")  # fmt: skip
    if not 0 <= driver < n:
        return [*problems, f"no program for the driver (rank {driver})"]
    steps = [
        x.mb for x in programs[driver] if x.kind is ActionKind.FORWARD and x.module == "<step>"
    ]
    m = len(steps)
    if not m:
        return [*problems, "driver: the step function ran forward for no microbatch"]
    if sorted(steps) != list(range(m)):
        problems.append(f"driver: step-function forwards of microbatches {steps}, not 0..{m - 1}")
    started = {
        x.mb for x in programs[driver] if x.kind is ActionKind.BACKWARD and x.module == "<step>"
    }
    for rank, program in enumerate(programs):
        for x in program:
            if not 0 <= x.mb < m:
                problems.append(f"rank {rank}: {x} names microbatch {x.mb} outside 0..{m - 1}")
            elif x.kind in _AFTER_BACKWARD and x.mb not in started:
                problems.append(f"rank {rank}: {x} but the driver never started its backward")
    return problems


_AFTER_BACKWARD = (ActionKind.BACKWARD, ActionKind.WEIGHT_GRAD)


def _key(a: Action) -> tuple[Any, ...]:
    """What a send and its receive share."""
    return (a.message, a.mb, a.module, a.shapes)
