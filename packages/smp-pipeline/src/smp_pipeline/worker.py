"""Worker threads and the execution token.

Exactly one thread of a rank runs at a time: either the server's main loop or one worker in
state EXECUTING. Control moves by handing over a token: the main loop releases a worker's
semaphore and waits on its own; the worker runs until it finishes its task (-> IDLE) or
needs a remote result (-> PENDING), then releases the main loop's semaphore and, if PENDING,
waits on its own semaphore until the main loop resumes it with the result. Threads are used
only to switch between microbatches cheaply, never for parallel computation.

A worker knows nothing of the server: what it needs (giving the token back, registering a
wait, reporting a failure, the abort check, device work) comes through the narrow
:class:`WorkerHost` interface, which :class:`~smp_pipeline.executor.Executor` implements.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from smp_pipeline.actions import Phase

if TYPE_CHECKING:  # pragma: no cover
    from smp_pipeline.autograd import Context

IDLE = "IDLE"
EXECUTING = "EXECUTING"
PENDING = "PENDING"
DEVICE = "DEVICE"  # inside device_work(): token given back, waiting for simulated/device work

_local = threading.local()


def current_worker() -> Worker | None:
    """The worker running on this thread, if any."""
    return getattr(_local, "worker", None)


def inline_task() -> Task[Any] | None:
    """The task static mode runs on this thread (a main loop), if any."""
    return getattr(_local, "inline", None)


def set_inline_task(task: Task[Any] | None) -> None:
    """Mark ``task`` as running inline on this thread (None: no longer)."""
    _local.inline = task


class Baton:
    """A binary semaphore on a raw lock, for handing the token between threads.

    Both calls are one C call, on a path taken several times per task (why it matters:
    docs/perf-notes.md, "Token hand-off"). Releasing a baton that is already released is
    absorbed, like setting a set ``threading.Event``: the main loop's wake-up baton is
    released by every arrival, and the shutdown path may release a token after a timed-out
    wait.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def release(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already released: the waiter has not taken it yet
            pass

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the baton (waiting up to ``timeout`` seconds, forever if -1); True if taken."""
        return self._lock.acquire(blocking, timeout)


class DeviceQueue:
    """One device: blocks of device work run one at a time, in the order they were queued.

    A GPU runs the kernels of one stream in the order they were issued; a plain lock would
    let whichever waiting thread the OS wakes first go next, so a forward queued later could
    overtake the backward the rest of the pipeline waits for. Each waiter gets its own
    :class:`Baton` and the one leaving hands the device straight to the oldest waiter.
    """

    __slots__ = ("_busy", "_lock", "_waiters")

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._waiters: collections.deque[Baton] = collections.deque()
        self._busy = False

    def queue(self) -> Baton | None:
        """Take a place in line: None if the device is free (it is now this caller's), else
        the baton :meth:`wait` blocks on until every earlier caller has left."""
        with self._lock:
            if not self._busy:
                self._busy = True
                return None
            baton = Baton()
            self._waiters.append(baton)
            return baton

    @staticmethod
    def wait(place: Baton | None) -> None:
        """Block until the device is this caller's (``place`` from :meth:`queue`)."""
        if place is not None:
            place.acquire()

    def leave(self) -> None:
        """Done with the device: it goes to the oldest waiter, if any."""
        with self._lock:
            if self._waiters:
                self._waiters.popleft().release()
            else:
                self._busy = False


P = TypeVar("P")


class Task(Generic[P]):
    """One unit of work run by a worker: a forward request, a backward segment, a step.

    ``fn(task)`` runs it; ``payload`` is what it works on (a request message, a call record
    and its response, ...), typed by the task's creator.
    """

    __slots__ = (
        "context", "device", "fn", "gave_back", "in_segment", "mb", "module", "payload", "phase",
        "step", "worker",
    )  # fmt: skip

    def __init__(
        self,
        fn: Callable[[Task[P]], None],
        mb: int,
        module: str,
        phase: Phase,
        context: Context | None,
        step: int,
        payload: P,
    ) -> None:
        self.fn = fn
        self.mb = mb
        self.module = module
        self.phase = phase
        self.context = context
        self.step = step
        self.payload = payload
        self.worker: Worker | None = None
        self.in_segment = False  # inside torch.autograd.backward: remote calls are refused
        # It gave the token back before finishing (a wait, a yield, device work): such a task
        # is not served inline by static mode next time (see Executor.run_inline).
        self.gave_back = False
        self.device = False  # it ran device work (static mode's replay leaves it to a worker)

    def describe(self) -> str:
        return f"{self.phase} of module '{self.module or '<root>'}' (microbatch {self.mb})"


class WorkerHost(Protocol):
    """What a worker needs from the thing that runs it (the executor)."""

    shutting_down: bool

    def token_returned(self) -> None:
        """The worker gave the execution token back."""

    def register_wait(self, key: Any, worker: Worker) -> None:
        """``worker`` goes PENDING until the value for ``key`` arrives."""

    def worker_yielded(self, worker: Worker) -> None:
        """``worker`` gave the token back mid-task at a yield point."""

    def worker_idle(self, worker: Worker) -> None:
        """``worker`` finished its task."""

    def report_failure(self, task: Task[Any], exc: BaseException, tb: str) -> None:
        """``task`` raised ``exc`` (``tb``: the formatted traceback)."""

    def raise_if_aborted(self) -> None:
        """Raise if the step was aborted (checked whenever a worker resumes)."""

    def device_work(self) -> contextlib.AbstractContextManager[None]:
        """Run a block as device work (see :func:`smp_pipeline.device_work`)."""


class Worker:
    """A thread that runs tasks when it holds the token."""

    def __init__(self, host: WorkerHost, index: int) -> None:
        self.host = host
        self.index = index
        self.state = IDLE
        self.task: Task[Any] | None = None
        self.value: Any = None  # what the main loop hands over when resuming a PENDING worker
        self.grant_kind = "task"  # how the next token grant is announced to TP followers
        self._sem = Baton()
        self._thread = threading.Thread(
            target=self._loop, name=f"smp-pipeline-worker-{index}", daemon=True
        )
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The thread this worker runs tasks on (checked at process exit)."""
        return self._thread

    # called by the main loop ------------------------------------------------------------
    def give_token(self) -> None:
        self.state = EXECUTING
        self._sem.release()

    # called on the worker's own thread -------------------------------------------------
    def _loop(self) -> None:
        _local.worker = self
        while True:
            self._sem.acquire()
            if self.host.shutting_down:
                self.host.token_returned()
                return
            task = self.task
            assert task is not None
            try:
                task.fn(task)
            except BaseException as exc:  # reported to the main loop, which aborts every rank
                self.host.report_failure(task, exc, traceback.format_exc())
            # An idle worker must not keep its last task alive: a caller segment's payload
            # holds the sent inputs and so the microbatch's graph (and what it saved, e.g.
            # offloaded tensors) until this thread's next task, whenever that comes.
            del task
            self.task = None
            self.state = IDLE
            if not self.host.shutting_down:
                self.host.worker_idle(self)
            self.host.token_returned()
            # Closed while this task ran (resumed to raise, or stuck in user code until now):
            # end here, as close() may have looked at the idle workers before this one.
            if self.host.shutting_down:
                return

    def wait_resume(self) -> None:
        """Block until the main loop hands us the token again (after device work)."""
        self._sem.acquire()
        self.state = EXECUTING
        self.host.raise_if_aborted()

    def yield_token(self) -> None:
        """Give the token back mid-task; the main loop resumes us (see yield_point)."""
        self.host.worker_yielded(self)
        self._park()

    def wait(self, key: Any) -> Any:
        """Go PENDING until the main loop resumes us with the value for ``key``."""
        self.host.register_wait(key, self)
        self._park()
        value, self.value = self.value, None
        return value

    def _park(self) -> None:
        """PENDING: give the token back and block until the main loop hands it over again
        (``give_token`` sets EXECUTING); raise if the step was aborted meanwhile."""
        self.state = PENDING
        if self.task is not None:
            self.task.gave_back = True
        self.host.token_returned()
        self._sem.acquire()
        self.host.raise_if_aborted()
