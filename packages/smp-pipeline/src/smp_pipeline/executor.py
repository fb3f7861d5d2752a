"""Running tasks on worker threads, one at a time, by handing over the execution token.

The :class:`Executor` owns the workers (idle, ready to resume, waiting for a value, yielded
at a yield point), the task holding the token, device work, and the timeline of task spans.
It knows nothing of messages: the server starts tasks and wakes waiting workers; aborts and
task failures go through the small :class:`Aborts` interface (the transport).

Everything that touches this state runs while holding the token (the main loop, or the one
EXECUTING worker), so no locks are needed besides the hand-off primitives; the exceptions
are the device-work queue and the preemption flag, set from other threads.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, Protocol

from smp_pipeline.actions import BACKWARD, FORWARD, Phase, ProgramRecorder
from smp_pipeline.offload import ActivationOffloader, Key
from smp_pipeline.offload import offloading as _offloading
from smp_pipeline.order import OrderChannel
from smp_pipeline.worker import (
    DEVICE,
    Baton,
    DeviceQueue,
    Task,
    Worker,
    current_worker,
    inline_task,
    set_inline_task,
)

# (pp rank, microbatch, module, phase, start, end): one EXECUTING span of a task.
TimelineEvent = tuple[int, int, str, Phase, float, float]


class Aborts(Protocol):
    """How the executor learns of, and reports, failures (implemented by the transport)."""

    def raise_if_aborted(self) -> None:
        """Raise if the step was aborted."""

    def poll_abort(self) -> None:
        """Take arrived messages; raise if one aborts the step."""

    def fail(self, exc: BaseException, during: str, tb: str) -> NoReturn:
        """A task failed: abort every rank and raise."""


class Executor:
    """The workers of one rank and the token they pass around (see :mod:`smp_pipeline.worker`).

    Args:
        pp_rank: this rank's pipeline index (timeline events name it).
        aborts: the abort check and failure report.
        wake: releases the main loop's wake-up baton (device work ended).
        order: tensor-parallel leader's channel: every token grant is published.
        preemption: forwards yield at yield points when work another rank waits for arrives.
        record_timeline: keep every task span in :attr:`events`.
        inline_max_s: static mode (:meth:`run_inline`): a served task that last held the
            token this briefly runs on the main loop (0: static mode off).
        on_diverged: called once, with the task, when a recorded straight-through task
            first does not run straight through (static mode).
        offload_horizon: activation offloading with this loading horizon (None: off; see
            :class:`~smp_pipeline.offload.ActivationOffloader`).
        recorder: notes every task's start (its phase, microbatch and module) in this
            rank's program (see :mod:`smp_pipeline.actions`); None: a disabled one.
    """

    def __init__(
        self,
        pp_rank: int,
        aborts: Aborts,
        wake: Baton,
        *,
        order: OrderChannel | None = None,
        preemption: bool = False,
        record_timeline: bool = False,
        inline_max_s: float = 0.0,
        on_diverged: Callable[[Task[Any]], None] | None = None,
        offload_horizon: int | None = None,
        recorder: ProgramRecorder | None = None,
    ) -> None:
        self.pp_rank = pp_rank
        self.recorder = recorder if recorder is not None else ProgramRecorder(enabled=False)
        self._aborts = aborts
        self._wakeup = wake
        self._order = order if order is not None and order.is_leader else None
        self.preemption = preemption
        self.record_timeline = record_timeline
        self.events: list[TimelineEvent] = []
        self._main_sem = Baton()
        self.workers: list[Worker] = []
        self.idle: list[Worker] = []
        # Workers to resume, with the value each gets (local wake-ups, device work's end).
        self.ready: collections.deque[tuple[Worker, Any]] = collections.deque()
        self.waiting: dict[Any, Worker] = {}
        self.current: Task[Any] | None = None
        self.current_since = 0.0  # time.time() of the last token grant (stall reports)
        self.failure: tuple[Task[Any], BaseException, str] | None = None
        self.shutting_down = False
        self.last_progress = time.monotonic()  # a task ran or a message was handled
        # device_work(): workers whose device work ended, waiting to get the token back.
        self._returning: queue.SimpleQueue[tuple[Worker, Task[Any], float, float]] = (
            queue.SimpleQueue()
        )
        self.device_active = 0
        self._device = DeviceQueue()
        # Preemption at yield points: set when a message that unblocks other work arrives
        # while a forward task runs; workers that gave the token back.
        self._preempt = False
        self.yields = 0  # forwards that gave the token back at a yield point
        self.yielded: collections.deque[Worker] = collections.deque()
        # Token grants per (step, microbatch): tensor-parallel followers check the order.
        self.grants: dict[tuple[int, int], int] = {}
        # Called on the main loop before each grant: a tensor-parallel follower's zero-bubble
        # memory bound (its loop follows the leader's order and has no idle point to run W
        # tasks in; see PipelineRuntime).
        self.before_grant: Callable[[], None] | None = None
        # Activation offloading: told when a backward task gets the token (its prefetch
        # trigger); checkpointed calls on this executor's workers find it here. Built here
        # because it reads the task holding the token, which only the executor knows.
        self.offloader: ActivationOffloader | None = None
        if offload_horizon is not None:
            self.offloader = ActivationOffloader(offload_horizon, self._forward_key)
        # Static mode (run_inline): the served tasks (phase, module) that ran straight through,
        # within inline_max_s, the last time they ran.
        self.inline_max_s = inline_max_s  # 0: static mode off (tests raise it to force inlining)
        self._straight: set[tuple[Phase, str]] = set()
        # The tasks (phase, module) that ran device work the last time they ran.
        self.device_kinds: set[tuple[Phase, str]] = set()
        self.inlined = 0  # tasks run on the main loop's thread
        self.diverged = 0  # recorded straight-through tasks that did not run straight through
        # called once, with the task, at the first divergence
        self.on_diverged = on_diverged
        # Static mode's replay: at a yield point of a forward it runs inline, serve the work
        # other ranks wait for nested on this thread (None: yield points do nothing inline).
        self.inline_yield: Callable[[Task[Any]], None] | None = None

    def _forward_key(self) -> Key | None:
        """The offloader's owner of saved tensors: the microbatch of the forward task holding
        the token; outside a forward (a backward recomputing) none move."""
        task = self.current
        if task is None or task.phase != FORWARD:
            return None
        return task.step, task.mb

    # ------------------------------------------------------------------ WorkerHost
    def token_returned(self) -> None:
        self._main_sem.release()

    def register_wait(self, key: Any, worker: Worker) -> None:
        self.waiting[key] = worker

    def worker_yielded(self, worker: Worker) -> None:
        self.yielded.append(worker)

    def worker_idle(self, worker: Worker) -> None:
        self.idle.append(worker)

    def report_failure(self, task: Task[Any], exc: BaseException, tb: str) -> None:
        self.failure = (task, exc, tb)

    def raise_if_aborted(self) -> None:
        self._aborts.raise_if_aborted()

    # ------------------------------------------------------------------ starting and resuming
    def wake(self, key: Any, value: Any) -> None:
        """Resume the worker waiting for ``key`` with ``value`` (queued: the loop resumes it)."""
        worker = self.waiting.pop(key)
        self.ready.append((worker, value))

    def start(self, task: Task[Any], kind: str = "task") -> None:
        """Run ``task`` on an idle (or new) worker until it gives the token back.
        ``kind``: how the grant is announced to tensor-parallel followers."""
        self.recorder.task(task.step, task.phase, task.mb, task.module)
        worker = self.idle.pop() if self.idle else self._new_worker()
        worker.task = task
        task.worker = worker
        worker.grant_kind = kind
        self.switch(worker)

    def resume(self, worker: Worker, value: Any) -> None:
        """Resume a PENDING worker with ``value`` until it gives the token back."""
        worker.value = value
        self.switch(worker)

    def resume_ready(self) -> None:
        """Resume the first ready worker, or before it a forward that gave the token back at
        a yield point (:attr:`yielded`) for an older microbatch of the step.

        Why: a forward yields so that arrived messages are handled; one of them may make a
        younger microbatch's worker ready (its stage-1 forward response). Resumed first, the
        younger one reached ``backward(loss)`` first (measured on the driver of
        bench_sequential: backwards ``3 0 1 2`` in a wave of four), and deterministic
        accumulation had to buffer its gradients until the older ones were folded (3-10 of
        24 contributions per microbatch) instead of streaming them (docs/performance.md).
        """
        worker, value = self.ready[0]
        task = worker.task
        if task is not None:
            for other in self.yielded:
                t = other.task
                if t is not None and (t.step, t.mb) < (task.step, task.mb):
                    self.yielded.remove(other)
                    self.switch(other)
                    return
        self.ready.popleft()
        self.resume(worker, value)

    def resume_ready_of(self, step: int, mb: int) -> bool:
        """Resume the ready worker of microbatch ``mb`` of ``step``, if any."""
        for i, (worker, value) in enumerate(self.ready):
            t = worker.task
            if t is not None and t.step == step and t.mb == mb:
                del self.ready[i]
                self.resume(worker, value)
                return True
        return False

    def _new_worker(self) -> Worker:
        w = Worker(self, len(self.workers))
        self.workers.append(w)
        return w

    def switch(self, worker: Worker) -> None:
        """Hand the token to ``worker`` and wait until it comes back."""
        task = worker.task
        assert task is not None
        start = self._grant(task, worker.grant_kind)
        worker.grant_kind = "task"
        worker.give_token()
        while not self._main_sem.acquire(timeout=0.1):
            # A stalled task here: raise if the others gave up on us.
            self._aborts.poll_abort()
        self._token_back(task, start, finished=worker.task is None)

    def _grant(self, task: Task[Any], kind: str) -> float:
        """``task`` gets the token (counted, announced to tensor-parallel followers as
        ``kind``, a backward's offload prefetch moved); the grant's time."""
        if self.before_grant is not None:
            self.before_grant()
        key = (task.step, task.mb)
        index = self.grants.get(key, 0)
        self.grants[key] = index + 1
        if self._order is not None:
            self._order.publish((task.step, task.mb, kind, index))
        if self.offloader is not None and task.phase == BACKWARD:
            self.offloader.backward_started(task.step, task.mb)
        self.current = task
        self.current_since = time.time()
        return self.current_since

    def _token_back(self, task: Task[Any], start: float, finished: bool) -> None:
        """The token came back from ``task`` (granted at ``start``): timeline, static mode's
        record (if it ``finished``), progress; a failure of the task aborts every rank."""
        self.current = None
        # A flag the task did not act on (it set no yield point after the arrival) is stale:
        # the loop serves the message now; left set, it would stop the next forward for nothing.
        self._preempt = False
        end = time.time()
        if self.record_timeline:
            self.events.append((self.pp_rank, task.mb, task.module, task.phase, start, end))
        if self.inline_max_s and finished:  # record how it ran
            self._record(task, end - start)
        self.last_progress = time.monotonic()
        if self.failure is not None:
            failed, error, tb = self.failure
            self._aborts.fail(error, failed.describe(), tb)

    # ------------------------------------------------------------------ static mode
    def _record(self, task: Task[Any], held: float) -> None:
        """Note how ``task`` ran, for the next task of its kind (see :meth:`may_inline`)."""
        key = (task.phase, task.module)
        if task.device:
            self.device_kinds.add(key)
        else:
            self.device_kinds.discard(key)
        if not task.gave_back and held <= self.inline_max_s:
            self._straight.add(key)
        elif key in self._straight:
            self._straight.discard(key)  # back to a worker from the next task of its kind
            if task.worker is None and task.gave_back:
                # Recorded straight-through, served inline, and it was not: say so once. (One
                # that only took longer is no divergence: a worker lets it yield.)
                self.diverged += 1
                if self.diverged == 1 and self.on_diverged is not None:
                    self.on_diverged(task)

    def may_inline(self, phase: Phase, module: str) -> bool:
        """Whether a task of this kind ran straight through, briefly, the last time (static
        mode): it may then run on the main loop's thread (:meth:`run_inline`)."""
        return bool(self.inline_max_s) and (phase, module) in self._straight

    def run_inline(self, task: Task[Any]) -> None:
        """Run ``task`` on the calling thread (the main loop), without handing the token to a
        worker and back: for a task that cannot wait on another rank (every module it runs
        lives here) and last ran straight through (static mode). Exact like :meth:`start`:
        the same code runs in the same order; what differs is what a worker would allow
        meanwhile: device work runs synchronously, yield points do nothing, and the main
        loop notices an abort only when the task ends."""
        self.inlined += 1
        self.recorder.task(task.step, task.phase, task.mb, task.module)
        # ("inline": a tensor-parallel follower runs the same task inline too.)
        start = self._grant(task, "inline")
        set_inline_task(task)
        try:
            with _offloading(self.offloader):
                task.fn(task)
        except BaseException as exc:
            self.failure = (task, exc, traceback.format_exc())
        finally:
            set_inline_task(None)
        self._token_back(task, start, finished=True)

    # ------------------------------------------------------------------ preemption
    def running_forward(self) -> bool:
        """Whether a forward task holds the token and preemption is on (any thread)."""
        task = self.current
        return self.preemption and task is not None and task.phase == FORWARD

    def request_preemption(self) -> None:
        """Work another rank waits for arrived: the running forward yields at its next
        yield point (called on the communicator's thread)."""
        if self.running_forward():
            self._preempt = True

    def yield_point(self) -> None:
        """Called before each block of a forward (children of owned sequential containers):
        after :meth:`request_preemption`, the running forward gives the token back; the main
        loop serves the messages that unblock work and resumes it right after (before any
        other work). A flag test otherwise."""
        if not self._preempt:
            return
        self._preempt = False
        worker = current_worker()
        task = self.current
        if worker is None and self.inline_yield is not None:
            # A forward static mode's replay runs on the main loop's thread: no token to give
            # back, so the replay serves the waiting work nested here (see replay.py).
            if task is not None and task.phase == FORWARD and not task.in_segment:
                if inline_task() is task:
                    self.inline_yield(task)
            return
        if (
            worker is None
            or worker.host is not self
            or task is None
            or task.worker is not worker
            or task.phase != FORWARD
            or task.in_segment
        ):
            return
        self.yields += 1
        worker.yield_token()

    # ------------------------------------------------------------------ device work
    @contextlib.contextmanager
    def device_work(self) -> Iterator[None]:
        """Run the block as *device* work: the token goes back to the main loop meanwhile.

        The block must not touch the runtime (no module calls, no messages). Device work of a
        rank runs one block at a time, in the order the blocks were reached (one device, one
        stream: :class:`~smp_pipeline.worker.DeviceQueue`), while the main loop keeps serving
        other tasks' CPU work, as with asynchronous GPU kernels. Outside a worker it just
        runs.
        """
        worker = current_worker()
        task = self.current
        if worker is None or worker.host is not self or task is None or task.worker is not worker:
            _mark_inline_device_work()
            yield
            return
        task.gave_back = task.device = True
        worker.state = DEVICE
        start = end = time.time()
        self.device_active += 1
        # In line before the token goes back: device work runs in token order, as kernels
        # run in the order they were issued.
        place = self._device.queue()
        self.current = None
        self.token_returned()
        try:
            self._device.wait(place)
            try:
                start = time.time()
                yield
                end = time.time()
            finally:
                self._device.leave()
        finally:
            self._returning.put((worker, task, start, end))
            self._wakeup.release()
            worker.wait_resume()

    def device_ended(self) -> bool:
        """Whether device work ended and its worker waits to be resumed."""
        return not self._returning.empty()

    def take_returning(self) -> None:
        """Workers whose device work finished go first among the ready ones."""
        while not self._returning.empty():
            worker, task, start, end = self._returning.get()
            self.device_active -= 1
            if self.record_timeline:
                self.events.append((self.pp_rank, task.mb, task.module, task.phase, start, end))
            self.ready.appendleft((worker, None))

    # ------------------------------------------------------------------ steps and shutdown
    def forget_step(self, step: int) -> None:
        """Forget the grant counters of ``step`` and earlier."""
        for g in [g for g in self.grants if g[0] <= step]:
            del self.grants[g]

    def threads(self) -> list[threading.Thread]:
        """The worker threads started (alive or not)."""
        return [w.thread for w in self.workers]

    def has_stuck_workers(self) -> bool:
        """Workers blocked mid-task (waiting, ready or yielded): only after a failed step."""
        return bool(self.waiting or self.ready or self.yielded)

    def close(self) -> None:
        """End every worker thread. Workers still blocked after an aborted step (a remote
        call or a joined backward waiting for an answer) hold their tasks' graphs: they are
        resumed so they raise (the abort is set by then), end their task and go idle, rather
        than block for the life of the process."""
        self.shutting_down = True
        stuck = list(self.waiting.values()) + [w for w, _ in self.ready] + list(self.yielded)
        self.waiting.clear()
        self.ready.clear()
        self.yielded.clear()
        for w in stuck:
            w.give_token()
            self._main_sem.acquire(timeout=1)
        for w in self.idle:
            w.give_token()  # an idle worker given the token while shutting down exits
            self._main_sem.acquire(timeout=1)
        self.idle.clear()


@contextlib.contextmanager
def device_work() -> Iterator[None]:
    """Mark a block as device work (see :meth:`Executor.device_work`).

    Usable anywhere, e.g. in a module's forward or in an autograd Function: inside a pipeline
    worker the rank keeps serving other requests meanwhile; elsewhere it simply runs the
    block. Do not use it inside autograd functions on CUDA (there, backward runs on a shared
    device thread, and kernels are asynchronous anyway).
    """
    worker = current_worker()
    if worker is None:
        _mark_inline_device_work()
        yield
        return
    with worker.host.device_work():
        yield


def _mark_inline_device_work() -> None:
    """Device work in a task static mode runs inline: it runs synchronously (exact), and the
    task's kind goes back to a worker (where it overlaps) from its next request on."""
    task = inline_task()
    if task is not None:
        task.gave_back = task.device = True
