"""The main loop of one pipeline rank's execution server: which arrived message is served when.

Serving order: workers whose device work ended, then local wake-ups, then the driver's
schedule (new top-level work, bounded by ``active_microbatches``), then arrived messages by
kind (responses that resume a caller, then backward work, then new forward requests) and,
within a kind, older microbatches first. Under tensor-parallel ordering a follower starts
tasks in the order its leader announces instead (:meth:`ServingLoop._serve_follower`).

Each turn fails fast on an abort and checks request timeouts every 0.2 s; an unexpected error
of the loop itself is broadcast as an abort, so the other ranks raise too instead of waiting
for this one. The loop is given the objects it drives at construction (the server owns
them); static mode's replay (:mod:`smp_pipeline.replay`) runs its own loop over the same
pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from smp_pipeline.actions import BACKWARD, FORWARD, Phase
from smp_pipeline.errors import PipelineError
from smp_pipeline.executor import Executor
from smp_pipeline.handlers import MessageHandlers
from smp_pipeline.order import OrderChannel
from smp_pipeline.protocol import PREEMPTING, BwdReq, FwdReq, Message
from smp_pipeline.transport import Transport
from smp_pipeline.worker import Baton
from smp_pipeline.zerobubble import WeightGradWork

__all__ = ["ServingLoop"]

_R = TypeVar("_R")


class ServingLoop:
    """One rank's main loop over its transport, executor and message handlers.

    Args:
        pp_rank: this rank's pipeline rank (named in errors).
        transport, executor, handlers: the server's own.
        order: the tensor-parallel order channel (None: no tensor-parallel ordering).
        wakeup: released when a message arrives or device work ends (the idle loop sleeps
            on it).
        current_step: the step being run (named in timeouts).
    """

    def __init__(
        self, pp_rank: int, transport: Transport, executor: Executor,
        handlers: MessageHandlers, order: OrderChannel | None, wakeup: Baton,
        current_step: Callable[[], int],
    ) -> None:  # fmt: skip
        self.pp_rank = pp_rank
        self.transport, self.executor, self.handlers = transport, executor, handlers
        self.order = order
        self._wakeup = wakeup
        self._current_step = current_step
        # Once per served message: bound once (static mode records through a wrapper).
        self.handle: Callable[[Message], None] = handlers.handle
        # Set while the driver runs a step under tensor-parallel ordering: starts a
        # microbatch's forward or admits its backward when the leader says so.
        self.follower_start: Callable[[int, Phase], None] | None = None
        self._next_timeout_check = time.monotonic() + 0.2
        # Zero-bubble: this rank's deferred weight-gradient tasks, run when the loop is idle
        # (wait_message) or, past their memory bound, before new work (zerobubble.py).
        self.weight_grads: WeightGradWork | None = None

    def serve(self, until: Callable[[], bool], hook: Callable[[bool], bool] | None = None) -> None:
        """Run the main loop until ``until()``; ``hook(urgent)`` starts scheduled work
        (driver): True if it started a task. ``urgent``: only a backward, which may go before
        a preempted forward resumes.

        Any unexpected error of the loop itself is broadcast as an abort, so the other ranks
        raise too instead of waiting for this one.
        """
        self.guarded(lambda: self._run(until, hook))

    def guarded(self, run: Callable[[], _R]) -> _R:
        """``run()``, an unexpected error broadcast as an abort (see :meth:`serve`)."""
        try:
            return run()
        except PipelineError:
            raise
        except BaseException as exc:
            if self.transport.abort_msg is None:
                try:
                    self.transport.abort(
                        "error", f"pp rank {self.pp_rank}: internal error: {exc!r}"
                    )
                except PipelineError as err:
                    raise err from exc
            raise

    def _run(self, until: Callable[[], bool], hook: Callable[[bool], bool] | None) -> None:
        if self.order is not None and not self.order.is_leader:
            self._serve_follower(until)
            return
        transport, executor = self.transport, self.executor
        self.start()
        while not until():
            self.housekeeping()
            if executor.ready:
                executor.resume_ready()
                continue
            if executor.yielded:
                # A forward gave the token back at a yield point: serve the arrived messages
                # that unblock work (not new forward requests), then resume it.
                msg = transport.pick(only=PREEMPTING)
                if msg is not None:
                    self.handle(msg)
                elif hook is None or not hook(True):
                    # (A backward the schedule would start now goes first too: it sends the
                    # next stage the backward request it waits for.)
                    executor.switch(executor.yielded.popleft())
                continue
            wg = self.weight_grads
            if wg is not None and wg.over_limit():
                # Past zero-bubble's memory bound: W tasks before new forward work, but not
                # before what unblocks a backward (the critical path) or a waiting caller.
                msg = transport.pick(only=PREEMPTING)
                if msg is not None:
                    self.handle(msg)
                else:
                    wg.run_one("eager")
                continue
            # Scheduled top-level work before queued requests: the schedule's own bound
            # (active microbatches) keeps the pipeline full without flooding it. Except the
            # messages a new forward would yield to at its first block anyway.
            if executor.preemption and hook is not None:
                msg = transport.pick(only=PREEMPTING)
                if msg is not None:
                    self.handle(msg)
                    continue
            if hook is not None and hook(False):
                continue
            msg = transport.pick()
            if msg is not None:
                self.handle(msg)
                continue
            msg = self.wait_message()
            if msg is not None:
                self.handle(msg)

    def wait_message(self) -> Message | None:
        """Idle: wait for a message, or for device work to end (whichever comes first);
        with zero-bubble's weight-gradient tasks queued, run one instead (None).

        Without device work under way, one blocking receive (see
        :meth:`Transport.wait_message`); with device work under way, sleep (up to 50 ms)
        until a message arrives or the device work ends.
        """
        wg = self.weight_grads
        if wg is not None and wg.pending():
            # Zero-bubble: idle time is where weight gradients go, one task per look.
            wg.run_one("idle")
            return None
        if not self.executor.device_active:
            return self.transport.wait_message()
        return self._sleep_for_message(0.05)

    def _sleep_for_message(self, timeout: float) -> Message | None:
        """Sleep until a message arrives or device work ends (or ``timeout``); the message
        if one did."""
        msg = self.transport.next_message(0)
        if msg is not None or self.executor.device_ended():
            return msg
        # Set by an arrival or a device end since the last sleep: then one quick turn more.
        self._wakeup.acquire(timeout=timeout)  # taking it clears it
        return self.transport.next_message(0)

    def start(self) -> None:
        self.executor.last_progress = time.monotonic()
        self._next_timeout_check = self.executor.last_progress + 0.2

    def housekeeping(self) -> None:
        """Each main-loop turn: fail fast on an abort, check timeouts every 0.2 s, and resume
        workers whose device work finished."""
        self.transport.raise_if_aborted()
        now = time.monotonic()
        if now > self._next_timeout_check:
            self.transport.check_timeouts(self.executor.last_progress, self._current_step())
            self._next_timeout_check = now + 0.2
        self.executor.take_returning()

    def _serve_follower(self, until: Callable[[], bool]) -> None:
        """Main loop of a tensor-parallel follower: start tasks in the leader's order."""
        assert self.order is not None
        inbox = self.transport.inbox
        self.start()
        while not until():
            self.housekeeping()
            self.transport.poll()
            for msg in [m for m in inbox if not self.handlers.starts_task(m)]:
                inbox.remove(msg)
                self.handle(msg)  # responses become ready wake-ups; no grant yet
            if until():
                return
            want = self.order.peek()
            if want is not None and self._grant_follower(want):
                self.order.pop()
                continue
            arrived = self._sleep_for_message(0.05)
            if arrived is not None:
                inbox.append(arrived)

    def _grant_follower(self, want: tuple[int, int, str, int]) -> bool:
        """Start the task the leader announced, if it is ready here."""
        step, mb, kind, index = want
        mine = self.executor.grants.get((step, mb), 0)
        if index != mine:
            self.transport.abort(
                "error",
                f"pp rank {self.pp_rank}: tensor-parallel order diverged: the leader started "
                f"task {index} of microbatch {mb} (step {step}), this rank is at task {mine}",
            )
        if kind == "start":
            if self.follower_start is None:
                return False
            self.follower_start(mb, FORWARD)
            return True
        if kind == "admit":
            if ("admit", step, mb) not in self.executor.waiting or self.follower_start is None:
                return False
            self.follower_start(mb, BACKWARD)  # wakes the microbatch's step task
        if kind == "inline":
            # The leader served this request on its main thread (static mode): so does this
            # rank, so the task is one grant here too (on a worker it could give the token
            # back, e.g. for device work, and be granted again: an announcement the leader
            # never makes).
            msg = self._arrived_task(step, mb, (FwdReq, BwdReq))
            if msg is None:
                return False
            self.handlers.serve_request(msg, inline=True)  # type: ignore[arg-type]
            return True
        if self.executor.resume_ready_of(step, mb):
            return True
        msg = self._arrived_task(step, mb, None)
        if msg is None:
            return False
        self.handle(msg)
        return True

    def _arrived_task(self, step: int, mb: int, types: tuple[type, ...] | None) -> Message | None:
        """Take the first arrived message (of ``types``, if given) that starts a task of
        microbatch ``mb`` of ``step``; None if none arrived yet."""
        inbox = self.transport.inbox
        for msg in inbox:
            if (
                (types is None or isinstance(msg, types))
                and self.handlers.starts_task(msg)
                and getattr(msg, "step", None) == step
                and getattr(msg, "mb", None) == mb
            ):
                inbox.remove(msg)
                return msg
        return None
