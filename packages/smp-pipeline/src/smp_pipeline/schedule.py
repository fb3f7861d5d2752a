"""Pipeline schedules: when the driver rank starts a microbatch's forward or backward.

A schedule only decides the *start* of the two top-level tasks of each microbatch (the step
function's forward part, and its backward after ``backward(loss)``); everything else is driven
by requests. Schedules are data: a built-in policy name or a sequence of
``(microbatch, phase)`` pairs, the phase an :class:`~smp_pipeline.actions.ActionKind`
(``FORWARD``/``BACKWARD``) or its old string ``"forward"``/``"backward"``; decisions come out as
the enum members.

- ``interleaved``: a microbatch ready for backward starts first; otherwise the next forward
  starts if fewer than ``active_microbatches`` are in flight (1F1B-like, adapts to timing).
- ``zero_bubble``: starts tasks as ``interleaved`` does; every rank splits its backwards
  into input-grad now and weight-grad tasks run in its idle time (:mod:`smp_pipeline.zerobubble`;
  chosen when the runtime is built, since every rank takes part).
- ``simple``: forwards start while they may; backwards start only when no forward is running
  and none may start (with enough active microbatches: all forwards, then all backwards; with
  fewer, GPipe-like waves).
- a custom sequence: tasks start exactly in the listed order (a backward waits until its
  microbatch reached ``backward(loss)``); microbatches whose step never calls backward skip
  their backward entry.
"""

from __future__ import annotations

from collections.abc import Sequence

from smp_pipeline.actions import BACKWARD, FORWARD, Phase, as_phase
from smp_pipeline.errors import PipelineConfigError

__all__ = ["SCHEDULES", "Phase", "ScheduleSpec", "Scheduler", "validate_custom"]

ScheduleSpec = str | Sequence[tuple[int, str]]  # (an ActionKind phase is a str too)
#: the built-in schedule names
SCHEDULES = ("simple", "interleaved", "zero_bubble")


class Scheduler:
    """Decides the next top-level task on the driver rank (one instance per step)."""

    def __init__(self, spec: ScheduleSpec, num_microbatches: int, active_microbatches: int):
        if active_microbatches < 1:
            raise PipelineConfigError(f"active_microbatches must be >= 1, got {active_microbatches}")
        self.m = num_microbatches
        self.active = active_microbatches
        self.custom: list[tuple[int, Phase]] | None = None
        if isinstance(spec, str):
            if spec not in SCHEDULES:
                raise PipelineConfigError(
                    f"unknown schedule '{spec}': use 'simple', 'interleaved', 'zero_bubble' or "
                    "a sequence of (microbatch, 'forward'|'backward') pairs"
                )
            # zero_bubble starts tasks as interleaved does; the split and the placement of
            # weight-gradient tasks are every rank's own (smp_pipeline.zerobubble).
            self.kind = "interleaved" if spec == "zero_bubble" else spec
        else:
            self.kind = "custom"
            self.custom = validate_custom(spec, num_microbatches)
        self.pos = 0  # next entry of a custom schedule
        self.next_forward = 0
        self.ready: list[int] = []  # microbatches waiting in backward(loss), in arrival order
        self.running_forward: set[int] = set()
        self.in_flight: set[int] = set()  # started and not completed
        self.completed: set[int] = set()
        self.backward_started: set[int] = set()

    # events -------------------------------------------------------------------------------
    def ready_for_backward(self, mb: int) -> None:
        self.running_forward.discard(mb)
        self.ready.append(mb)

    def completed_microbatch(self, mb: int) -> None:
        self.running_forward.discard(mb)
        self.in_flight.discard(mb)
        self.completed.add(mb)

    def take(self, mb: int, phase: str) -> None:
        """Record an action decided elsewhere (a tensor-parallel leader's choice)."""
        if as_phase(phase) is FORWARD:
            self.next_forward = max(self.next_forward, mb + 1)
            self.in_flight.add(mb)
            self.running_forward.add(mb)
        else:
            if mb in self.ready:
                self.ready.remove(mb)
            self.backward_started.add(mb)

    def done(self) -> bool:
        return len(self.completed) == self.m

    # decisions ----------------------------------------------------------------------------
    def next_action(self) -> tuple[int, Phase] | None:
        """The task to start now, or None (wait for an event)."""
        if self.kind == "custom":
            return self._next_custom()
        can_forward = self.next_forward < self.m and len(self.in_flight) < self.active
        if self.kind == "interleaved":
            backward = self.next_backward()
            if backward is not None:
                return backward
            if can_forward:
                return self._start_forward()
            return None
        # simple
        if can_forward:
            return self._start_forward()
        if self.ready and not self.running_forward:
            return self._start_backward(min(self.ready))
        return None

    def next_backward(self) -> tuple[int, Phase] | None:
        """A backward to start now, before a preempted forward resumes, or None: what
        ``next_action`` would start, if that is a backward (``interleaved`` only: the other
        policies keep their order)."""
        if self.kind == "interleaved" and self.ready:
            return self._start_backward(self.ready[0])
        return None

    def _start_forward(self) -> tuple[int, Phase]:
        mb = self.next_forward
        self.next_forward += 1
        self.in_flight.add(mb)
        self.running_forward.add(mb)
        return mb, FORWARD

    def _start_backward(self, mb: int) -> tuple[int, Phase]:
        self.ready.remove(mb)
        self.backward_started.add(mb)
        return mb, BACKWARD

    def _next_custom(self) -> tuple[int, Phase] | None:
        assert self.custom is not None
        while self.pos < len(self.custom):
            mb, phase = self.custom[self.pos]
            if phase is FORWARD:
                self.pos += 1
                self.next_forward = max(self.next_forward, mb + 1)
                self.in_flight.add(mb)
                self.running_forward.add(mb)
                return mb, FORWARD
            if mb in self.completed:  # finished without calling backward: skip its entry
                self.pos += 1
                continue
            if mb in self.ready:
                self.pos += 1
                return self._start_backward(mb)
            return None
        return None


def validate_custom(spec: Sequence[tuple[int, str]], m: int) -> list[tuple[int, Phase]]:
    """Check a custom schedule: each microbatch once forward, then once backward. Phases
    may be the enum members or their strings; the result holds the members."""
    out: list[tuple[int, Phase]] = []
    seen: dict[tuple[int, Phase], int] = {}
    for i, item in enumerate(spec):
        try:
            mb, phase = item
            mb = int(mb)
        except (TypeError, ValueError):
            raise PipelineConfigError(
                f"schedule entry {i} is {item!r}: expected (microbatch, 'forward'|'backward')"
            ) from None
        try:
            phase = as_phase(phase)
        except (TypeError, ValueError):
            raise PipelineConfigError(f"schedule entry {i}: unknown phase {phase!r}") from None
        if not 0 <= mb < m:
            raise PipelineConfigError(f"schedule entry {i}: microbatch {mb} outside 0..{m - 1}")
        if (mb, phase) in seen:
            raise PipelineConfigError(f"schedule entry {i}: ({mb}, '{phase}') appears twice")
        if phase is BACKWARD and (mb, FORWARD) not in seen:
            raise PipelineConfigError(f"schedule entry {i}: backward of {mb} before its forward")
        seen[(mb, phase)] = i
        out.append((mb, phase))
    for mb in range(m):
        for want in (FORWARD, BACKWARD):
            if (mb, want) not in seen:
                raise PipelineConfigError(f"schedule lacks ({mb}, '{want}')")
    return out
