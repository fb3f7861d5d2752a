"""The execution server of one pipeline rank (paper §4.2, Figures 3–4).

The main thread receives messages from the communicator itself (no receiver thread: one
thread hand-off less per message) into an inbox, and serves it together with a local "ready"
queue of wake-ups; worker threads execute tasks, one at a time, by holding the execution
token (see :mod:`smp_pipeline.worker`). Everything that touches the server's state runs
while holding the token, so no locks are needed besides the hand-off primitives.

Serving order: workers whose device work ended, then local wake-ups, then the driver's
schedule (new top-level work, bounded by ``active_microbatches``), then arrived messages by
kind (responses that resume a caller, then backward work, then new forward requests) and,
within a kind, older microbatches first.

Failures never hang: an exception in a task, or a request outstanding longer than
``timeout_s``, broadcasts an ABORT message and raises on every pipeline rank.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from smp_comm import ANY_SOURCE, CommTimeoutError

from smp_pipeline import calls
from smp_pipeline import messages as M
from smp_pipeline.boundary import (
    CallKey,
    IncomingCall,
    OutgoingCall,
    RootContext,
)
from smp_pipeline.errors import PipelineError, PipelineRemoteError, PipelineTimeoutError
from smp_pipeline.execution_state import execution_state
from smp_pipeline.messages import pack, unflatten
from smp_pipeline.order import OrderChannel
from smp_pipeline.schedule import Scheduler
from smp_pipeline.worker import DEVICE, Baton, Task, Worker, current_worker

# Idle main loop: drive the communicator for at most this long before sleeping on the
# receive. While device work is under way it sleeps until a message or the device's end.
_SPIN_S = 2e-4

# (pp rank, microbatch, module, phase, start, end): one EXECUTING span of a task.
TimelineEvent = tuple[int, int, str, str, float, float]


class ExecutionServer:
    """Serves pipeline requests for the modules one rank owns."""

    def __init__(
        self,
        comm: Any,
        pp_rank: int,
        pp_size: int,
        comm_ranks: list[int],
        tag: int,
        timeout_s: float,
        execute: Callable[..., Any],
        record_timeline: bool = False,
        order: OrderChannel | None = None,
        abort_ranks: list[int] | None = None,
        backward_mode: str = "auto",
    ) -> None:
        if backward_mode not in ("auto", "joined", "segments"):
            raise PipelineError(
                f"backward_mode must be 'auto', 'joined' or 'segments', got {backward_mode!r}"
            )
        # Cross-rank autograd (boundary.py): "auto" joins where gradients are CPU tensors.
        self.backward_mode = backward_mode
        self.comm = comm
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.comm_ranks = comm_ranks
        self._comm_rank = comm_ranks[pp_rank]
        # Further communicator ranks told about an abort (e.g. the other pipelines' ranks,
        # whose tensor-parallel peers would otherwise wait in a collective forever).
        self.abort_ranks = list(abort_ranks or [])
        self.tag = tag
        self.timeout_s = timeout_s
        # Runs an owned module: (path, args, kwargs, checkpoint, span) -> outputs, where
        # span=(i, j) asks for children i..j-1 of an nn.Sequential (Appendix B).
        self.execute = execute
        self.record_timeline = record_timeline
        self.events: list[TimelineEvent] = []

        # Messages taken from the communicator but not handled yet (see _poll_abort).
        self.inbox: collections.deque[dict[str, Any]] = collections.deque()
        self._recv: Any = None  # the posted receive for the next message
        self.ready: collections.deque[tuple[Worker, Any]] = collections.deque()
        self._main_sem = Baton()
        self.workers: list[Worker] = []
        self.idle: list[Worker] = []
        self.waiting: dict[Any, Worker] = {}
        self.current: Task | None = None

        self._calls = itertools.count()
        self._bwd_reqs = itertools.count()
        self.outgoing: dict[CallKey, OutgoingCall] = {}
        self.incoming: dict[CallKey, IncomingCall] = {}
        self.roots: dict[tuple[int, int], RootContext] = {}
        # Requests this rank sent and still waits for: key -> (time sent, description).
        self.outstanding: dict[Any, tuple[float, str]] = {}

        self.step = 0
        self.step_ends: dict[int, dict[str, Any]] = {}
        self.scheduler: Scheduler | None = None
        self._sends: list[Any] = []
        self.abort_msg: dict[str, Any] | None = None
        self.failure: tuple[Task, BaseException, str] | None = None
        self.shutting_down = False
        self._last_progress = time.monotonic()
        self._next_timeout_check = self._last_progress + 0.2
        self.requests_served = 0
        # device_work(): workers whose device work ended, waiting to get the token back.
        self._returning: queue.SimpleQueue[tuple[Worker, Task, float, float]] = queue.SimpleQueue()
        self._device_active = 0
        self._device_lock = threading.Lock()
        # Wakes the main loop: set when device work ends or a message arrives (a callback on
        # the posted receive), so the loop sleeps instead of polling for either.
        self._wakeup = Baton()  # released = set
        # Tensor-parallel ordering: grants per (step, microbatch), and the channel (whose
        # announcements also wake a sleeping follower).
        self.order = order
        if order is not None:
            order.on_arrival = self._wake_main
        # Preemption at yield points (see yield_point): set when a message that unblocks
        # other work arrives while a forward task runs; workers that gave the token back.
        # Off under tensor-parallel ordering (followers could not yield at the same points),
        # and on a single stage (no other rank waits).
        self.preemption = order is None and self.pp_size > 1
        self._preempt = False
        self.yields = 0  # forwards that gave the token back at a yield point
        self.yielded: collections.deque[Worker] = collections.deque()
        self._grants: dict[tuple[int, int], int] = {}
        self.follower_start: Callable[[int, str], None] | None = None

    # ------------------------------------------------------------------ transport
    def _next_message(self, timeout: float, spin: float | None = None) -> dict[str, Any] | None:
        """The next message (waiting up to ``timeout`` seconds), or None.

        The main thread receives directly (no receiver thread: one thread hop less per
        message); while a worker runs, :meth:`_poll_abort` peeks for abort messages.
        """
        if self.inbox:
            return self.inbox.popleft()
        handle = self._posted_receive()
        try:
            if timeout <= 0:
                if not handle.test():
                    return None
                obj, _, _ = handle.wait()
            else:
                obj, _, _ = handle.wait(timeout=timeout, spin=spin)
        except CommTimeoutError:
            return None
        except Exception as exc:  # the communicator broke: fail every rank we can reach
            self._recv = None
            self.abort("error", f"pp rank {self.pp_rank}: receiving failed: {exc!r}")
            raise
        self._recv = None
        if obj.get("kind") == M.ABORT and self.abort_msg is None:
            self.abort_msg = obj
        # The next receive goes up at once: the task this message starts can then be
        # preempted by what arrives while it runs (the receive's callback flags it).
        self._posted_receive()
        return obj

    def _wait_message(self) -> dict[str, Any] | None:
        """Idle: wait for a message, or for device work to end (whichever comes first).

        Without device work under way, one blocking receive of up to 50 ms: this thread drives
        the communicator's progress for a short spin (0.2 ms, not the communicator's default),
        then sleeps while its tracker thread polls (no thread here wakes every tick: with more
        ranks than cores, an idle rank's polling takes CPU from the rank that would answer).
        With device work under way, it sleeps (up to 50 ms) until a message arrives or the
        device work ends, whichever comes first.
        """
        if not self._device_active:
            return self._next_message(0.05, spin=_SPIN_S)
        return self._sleep_for_message(0.05)

    def _sleep_for_message(self, timeout: float) -> dict[str, Any] | None:
        """Sleep until a message arrives or device work ends (or ``timeout``); the message
        if one did."""
        msg = self._next_message(0)
        if msg is not None or not self._returning.empty():
            return msg
        # Set by an arrival or a device end since the last sleep: then one quick turn more.
        self._wakeup.acquire(timeout=timeout)  # taking it clears it
        return self._next_message(0)

    def _wake_main(self, handle: Any) -> None:
        self._wakeup.release()
        task = self.current
        if self.preemption and task is not None and task.phase == "forward":
            try:
                obj = handle.wait(0)[0]  # done: returns at once (a failed receive raises)
            except Exception:  # noqa: BLE001 - the main loop reports it when it takes it
                return
            if isinstance(obj, dict) and obj.get("kind") in _PREEMPTING:
                self._preempt = True

    def yield_point(self) -> None:
        """Called before each block of a forward (children of owned sequential containers):
        if a message arrived that another rank's work waits on (see ``_PREEMPTING``), the
        running forward gives the token back, the main loop serves such messages, and the
        forward resumes right after (before any other work). A flag test otherwise."""
        if not self._preempt:
            return
        self._preempt = False
        worker = current_worker()
        task = self.current
        if (
            worker is None
            or worker.server is not self
            or task is None
            or task.worker is not worker
            or task.phase != "forward"
            or task.in_segment
        ):
            return
        self.yields += 1
        worker.yield_token()

    def _posted_receive(self) -> Any:
        """The receive for the next message, posted if need be; its arrival wakes the loop."""
        if self._recv is None:
            self._recv = self.comm.irecv(source=ANY_SOURCE, tag=self.tag)
            self._recv.add_done_callback(self._wake_main)
        return self._recv

    def _pick_message(self, only: frozenset[str] | None = None) -> dict[str, Any] | None:
        """The arrived message to serve first (see :func:`_priority`), or None. With
        ``only``: among messages of those kinds and control messages only."""
        self._poll_abort()
        if not self.inbox:
            return None
        candidates: Sequence[int] = range(len(self.inbox))
        if only is not None:
            candidates = [
                i for i, m in enumerate(self.inbox) if m["kind"] in only or _CLASS.get(m["kind"], 0) == 0
            ]
            if not candidates:
                return None
        best = min(candidates, key=lambda i: _priority(self.inbox[i]))
        msg = self.inbox[best]
        del self.inbox[best]
        return msg

    def _poll_abort(self) -> None:
        """Move every arrived message into the inbox, noting an abort."""
        while True:
            handle = self._posted_receive()
            if not handle.test():
                return
            try:
                obj, _, _ = handle.wait()
            except Exception as exc:
                self._recv = None
                self.abort("error", f"pp rank {self.pp_rank}: receiving failed: {exc!r}")
                raise
            self._recv = None
            if obj.get("kind") == M.ABORT and self.abort_msg is None:
                self.abort_msg = obj
            self.inbox.append(obj)

    def send(self, pp_dest: int, msg: dict[str, Any], wake: bool = True) -> None:
        """Send ``msg`` to pipeline rank ``pp_dest``. ``wake=False`` for a note nobody waits
        on (see smp-comm's ``isend``): it does not interrupt the receiver's compute."""
        msg["src"] = self.pp_rank
        dest = self.comm_ranks[pp_dest]
        if wake:  # (the keyword only when needed: any communicator with isend() works)
            handle = self.comm.isend(msg, dest=dest, tag=self.tag)
        else:
            handle = self.comm.isend(msg, dest=dest, tag=self.tag, wake=False)
        self._sends.append(handle)
        if len(self._sends) > 512:  # long steps: forget completed sends as we go
            self._sends = [h for h in self._sends if not h.test()]

    def send_all(self, msg: dict[str, Any], wake: bool = True) -> None:
        for r in range(self.pp_size):
            if r != self.pp_rank:
                self.send(r, dict(msg), wake)

    def flush_sends(self) -> None:
        handles, self._sends = self._sends, []
        for h in handles:
            h.wait(timeout=self.timeout_s)

    # ------------------------------------------------------------------ token handling
    def token_returned(self) -> None:
        self._main_sem.release()

    def register_wait(self, key: Any, worker: Worker) -> None:
        self.waiting[key] = worker

    def worker_idle(self, worker: Worker) -> None:
        self.idle.append(worker)

    def report_failure(self, task: Task, exc: BaseException, tb: str) -> None:
        self.failure = (task, exc, tb)

    def _wake(self, key: Any, value: Any) -> None:
        worker = self.waiting.pop(key)
        self.ready.append((worker, value))

    def _start(self, task: Task, kind: str = "task") -> None:
        worker = self.idle.pop() if self.idle else self._new_worker()
        worker.task = task
        task.worker = worker
        worker.grant_kind = kind
        self._switch(worker)

    def _new_worker(self) -> Worker:
        w = Worker(self, len(self.workers))
        self.workers.append(w)
        return w

    def _switch(self, worker: Worker) -> None:
        """Hand the token to ``worker`` and wait until it comes back."""
        task = worker.task
        assert task is not None
        key = (task.step, task.mb)
        index = self._grants.get(key, 0)
        self._grants[key] = index + 1
        if self.order is not None and self.order.is_leader:
            self.order.publish((task.step, task.mb, worker.grant_kind, index))
        worker.grant_kind = "task"
        self.current = task
        start = time.time()
        worker.give_token()
        while not self._main_sem.acquire(timeout=0.1):
            self._poll_abort()
            if self.abort_msg is not None:  # a stalled task here: others gave up on us
                self.raise_if_aborted()
        self.current = None
        # A flag the task did not act on (it set no yield point after the arrival) is stale:
        # this loop serves the message now; left set, it would stop the next forward for nothing.
        self._preempt = False
        if self.record_timeline:
            self.events.append((self.pp_rank, task.mb, task.module, task.phase, start, time.time()))
        self._last_progress = time.monotonic()
        if self.failure is not None:
            self._fail()

    @contextlib.contextmanager
    def device_work(self) -> Iterator[None]:
        """Run the block as *device* work: the token goes back to the main loop meanwhile.

        The block must not touch the runtime (no module calls, no messages). Device work of a
        rank is serialised by a lock (one device), while the main loop keeps serving other
        tasks' CPU work, as with asynchronous GPU kernels. Outside a worker it just runs.
        """
        worker = current_worker()
        task = self.current
        if worker is None or worker.server is not self or task is None or task.worker is not worker:
            yield
            return
        worker.state = DEVICE
        start = end = time.time()
        self._device_active += 1
        self.current = None
        self.token_returned()
        try:
            with self._device_lock:
                start = time.time()
                yield
                end = time.time()
        finally:
            self._returning.put((worker, task, start, end))
            self._wakeup.release()
            worker.wait_resume()

    # ------------------------------------------------------------------ failures
    def raise_if_aborted(self) -> None:
        msg = self.abort_msg
        if msg is None:
            return
        text = msg["text"]
        if msg.get("comm_rank") != self._comm_rank:
            text = (
                f"{text} [reported by pp rank {msg['src']} (communicator rank "
                f"{msg.get('comm_rank')}), raised on pp rank {self.pp_rank}]"
            )
        if msg["error"] == "timeout":
            raise PipelineTimeoutError(text)
        raise PipelineRemoteError(text)

    def abort(self, error: str, text: str) -> None:
        """Tell every pipeline rank (and ``abort_ranks``) to raise, then raise here."""
        if self.abort_msg is None:
            msg = self._abort_message(error, text)
            self.abort_msg = msg
            targets = [self.comm_ranks[r] for r in range(self.pp_size) if r != self.pp_rank]
            targets += [r for r in self.abort_ranks if r not in targets and r != self._comm_rank]
            handles = []
            for dest in targets:
                try:
                    handles.append(self.comm.isend(dict(msg), dest=dest, tag=self.tag))
                except Exception:  # best effort: the transport itself may be broken
                    pass
            for h in handles:  # make sure the news leaves before this rank raises (and exits)
                try:
                    h.wait(timeout=5.0)
                except Exception:
                    pass
        self.raise_if_aborted()

    def _abort_message(self, error: str, text: str) -> dict[str, Any]:
        return {
            "kind": M.ABORT,
            "error": error,
            "text": text,
            "src": self.pp_rank,
            "comm_rank": self._comm_rank,
        }

    def _fail(self) -> None:
        assert self.failure is not None
        task, exc, tb = self.failure
        if isinstance(exc, PipelineError) and self.abort_msg is not None:
            self.raise_if_aborted()
        text = f"pp rank {self.pp_rank}: {type(exc).__name__}: {exc} during {task.describe()}\n{tb}"
        try:
            self.abort("error", text)
        except PipelineRemoteError as err:
            raise err from exc

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for t0, desc in self.outstanding.values():
            if now - t0 > self.timeout_s:
                self.abort(
                    "timeout",
                    f"pp rank {self.pp_rank} waited more than {self.timeout_s:g}s for {desc}",
                )
        if now - self._last_progress > self.timeout_s:
            waits = ", ".join(desc for _, desc in self.outstanding.values()) or (
                "a request from another rank"
            )
            self.abort(
                "timeout",
                f"pp rank {self.pp_rank} made no progress for {self.timeout_s:g}s in step "
                f"{self.step}; it waits for {waits}",
            )

    # ------------------------------------------------------------------ serving
    def serve(self, until: Callable[[], bool], hook: Callable[[bool], bool] | None = None) -> None:
        """Run the main loop until ``until()``; ``hook(urgent)`` starts scheduled work
        (driver): True if it started a task. ``urgent``: only a backward, which may go before
        a preempted forward resumes.

        Any unexpected error of the loop itself is broadcast as an abort, so the other ranks
        raise too instead of waiting for this one.
        """
        try:
            self._serve(until, hook)
        except PipelineError:
            raise
        except BaseException as exc:
            if self.abort_msg is None:
                try:
                    self.abort("error", f"pp rank {self.pp_rank}: internal error: {exc!r}")
                except PipelineError as err:
                    raise err from exc
            raise

    def _serve(self, until: Callable[[], bool], hook: Callable[[bool], bool] | None) -> None:
        if self.order is not None and not self.order.is_leader:
            self._serve_follower(until)
            return
        self._start_loop()
        while not until():
            self._loop_housekeeping()
            if self.ready:
                worker, value = self.ready.popleft()
                worker.value = value
                self._switch(worker)
                continue
            if self.yielded:
                # A forward gave the token back at a yield point: serve the arrived messages
                # that unblock work (not new forward requests), then resume it.
                msg = self._pick_message(only=_PREEMPTING)
                if msg is not None:
                    self._handle(msg)
                elif hook is None or not hook(True):
                    # (A backward the schedule would start now goes first too: it sends the
                    # next stage the backward request it waits for.)
                    self._switch(self.yielded.popleft())
                continue
            # Scheduled top-level work before queued requests: the schedule's own bound
            # (active microbatches) keeps the pipeline full without flooding it. Except the
            # messages a new forward would yield to at its first block anyway.
            if self.preemption and hook is not None:
                msg = self._pick_message(only=_PREEMPTING)
                if msg is not None:
                    self._handle(msg)
                    continue
            if hook is not None and hook(False):
                continue
            msg = self._pick_message()
            if msg is not None:
                self._handle(msg)
                continue
            msg = self._wait_message()
            if msg is not None:
                self._handle(msg)

    def _start_loop(self) -> None:
        self._last_progress = time.monotonic()
        self._next_timeout_check = self._last_progress + 0.2

    def _loop_housekeeping(self) -> None:
        """Each main-loop turn: fail fast on an abort, check timeouts every 0.2 s, and resume
        workers whose device work finished."""
        self.raise_if_aborted()
        now = time.monotonic()
        if now > self._next_timeout_check:
            self._check_timeouts()
            self._next_timeout_check = now + 0.2
        self._take_returning()

    def _take_returning(self) -> None:
        while not self._returning.empty():  # device work finished: resume first
            worker, task, start, end = self._returning.get()
            self._device_active -= 1
            if self.record_timeline:
                self.events.append((self.pp_rank, task.mb, task.module, task.phase, start, end))
            self.ready.appendleft((worker, None))

    def _serve_follower(self, until: Callable[[], bool]) -> None:
        """Main loop of a tensor-parallel follower: start tasks in the leader's order."""
        assert self.order is not None
        self._start_loop()
        while not until():
            self._loop_housekeeping()
            self._poll_abort()
            for msg in [m for m in self.inbox if not self._starts_task(m)]:
                self.inbox.remove(msg)
                self._handle(msg)  # responses become ready wake-ups; no grant yet
            if until():
                return
            want = self.order.peek()
            if want is not None and self._grant_follower(want):
                self.order.pop()
                continue
            arrived = self._sleep_for_message(0.05)
            if arrived is not None:
                self.inbox.append(arrived)

    def _grant_follower(self, want: tuple[int, int, str, int]) -> bool:
        """Start the task the leader announced, if it is ready here."""
        step, mb, kind, index = want
        mine = self._grants.get((step, mb), 0)
        if index != mine:
            self.abort(
                "error",
                f"pp rank {self.pp_rank}: tensor-parallel order diverged: the leader started "
                f"task {index} of microbatch {mb} (step {step}), this rank is at task {mine}",
            )
        if kind == "start":
            if self.follower_start is None:
                return False
            self.follower_start(mb, "forward")
            return True
        if kind == "admit":
            if ("admit", step, mb) not in self.waiting or self.follower_start is None:
                return False
            self.follower_start(mb, "backward")  # wakes the microbatch's step task
        for i, (worker, value) in enumerate(self.ready):
            t = worker.task
            if t is not None and t.step == step and t.mb == mb:
                del self.ready[i]
                worker.value = value
                self._switch(worker)
                return True
        for msg in self.inbox:
            if self._starts_task(msg) and msg.get("step") == step and msg.get("mb") == mb:
                self.inbox.remove(msg)
                self._handle(msg)
                return True
        return False

    def _starts_task(self, msg: dict[str, Any]) -> bool:
        """Whether handling ``msg`` starts a task (else it only wakes a waiting worker)."""
        if msg["kind"] == M.BWD_RESP:
            return _backward_wait_key(msg) not in self.waiting
        return msg["kind"] in _TASK_KINDS

    def _handle(self, msg: dict[str, Any]) -> None:
        self._last_progress = time.monotonic()
        kind = msg["kind"]
        if kind == M.FWD_REQ:
            self.requests_served += 1
            label = msg["path"]
            if msg.get("span"):
                label = "{}[{}:{}]".format(label or "<root>", *msg["span"])
            task = Task(self._run_forward_request, msg["mb"], label, "forward", None, msg["step"])
            task.payload = msg  # type: ignore[attr-defined]
            self._start(task)
        elif kind == M.FWD_RESP:
            key = tuple(msg["key"])
            self.outstanding.pop(("fwd", key), None)
            self._wake(("fwd", key), msg)
        elif kind == M.BWD_REQ:
            self.requests_served += 1
            key = tuple(msg["key"])
            rec = self.incoming.get(key)  # type: ignore[arg-type]
            if rec is None:
                self.abort(
                    "error",
                    f"pp rank {self.pp_rank}: backward request for call {key} of module "
                    f"'{msg['path']}' (microbatch {msg['mb']}) has no saved forward record",
                )
                return
            rec.open.append(msg["req"])
            task = Task(self._run_callee_segment, rec.mb, rec.path, "backward", rec, rec.step)
            task.payload = msg  # type: ignore[attr-defined]
            self._start(task)
        elif kind == M.BWD_RESP:
            key = tuple(msg["key"])
            wait_key = _backward_wait_key(msg)
            self.outstanding.pop(wait_key, None)
            if wait_key in self.waiting:  # joined mode: resume the waiting backward
                self._wake(wait_key, msg)
                return
            call = self.outgoing[key]  # type: ignore[index]
            label = call.parent.path if isinstance(call.parent, IncomingCall) else "<step>"
            task = Task(
                self._run_caller_segment, call.mb, label, "backward", call.parent, call.step
            )
            task.payload = (call, msg)  # type: ignore[attr-defined]
            self._start(task)
        elif kind == M.MB_DONE:
            self.drop_microbatch(msg["step"], msg["mb"])
        elif kind == M.STEP_END:
            self.step_ends[msg["step"]] = msg
        elif kind == M.ABORT:
            self.raise_if_aborted()
        else:
            raise PipelineError(f"pp rank {self.pp_rank}: unknown message kind {kind!r}")

    def drop_microbatch(self, step: int, mb: int) -> None:
        """Forget every record of a finished microbatch (frees its retained graphs)."""
        for d in (self.incoming, self.outgoing):
            for k in [k for k, r in d.items() if r.step == step and r.mb == mb]:
                del d[k]
        self.roots.pop((step, mb), None)

    def drop_step(self, step: int) -> None:
        for d in (self.incoming, self.outgoing):
            for k in [k for k, r in d.items() if r.step <= step]:
                del d[k]
        for k in [k for k in self.roots if k[0] <= step]:
            del self.roots[k]
        for g in [g for g in self._grants if g[0] <= step]:
            del self._grants[g]

    # Cross-rank calls and backward segments live in calls.py (one idea per module).
    call_remote = calls.call_remote
    _run_forward_request = calls.run_forward_request
    send_backward_request = calls.send_backward_request
    backward_through = calls.backward_through
    segment = calls.segment
    _run_callee_segment = calls.run_callee_segment
    _run_caller_segment = calls.run_caller_segment
    maybe_complete = calls.maybe_complete

    # ------------------------------------------------------------------ steps
    def backward(self, tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """``backward(loss)`` inside the step function (driver rank)."""
        task = self.current
        if task is None or not isinstance(task.context, RootContext) or task.worker is None:
            raise PipelineError(
                "backward() must be called inside the step function passed to run_step(), "
                "on the driver (pp rank 0)"
            )
        root = task.context
        if not root.admitted:
            assert self.scheduler is not None
            self.scheduler.ready_for_backward(root.mb)
            task.worker.wait(("admit", root.step, root.mb))
        self.segment(tensors, grads, retain=root.segment_calls)
        if root.pending:
            task.worker.wait(("bwd_done", root.step, root.mb))

    def drive_step(
        self,
        step_fn: Callable[..., Any],
        microbatches: list[tuple[tuple[Any, ...], dict[str, Any]]],
        scheduler: Scheduler,
        state: dict[str, Any],
        outputs_to_all: bool = True,
    ) -> list[Any]:
        """Run a step on the driver: start tasks as the schedule says, serve until done."""
        self.step += 1
        step = self.step
        self.scheduler = scheduler
        outputs: list[Any] = [None] * len(microbatches)

        def run_microbatch(task: Task) -> None:
            args, kwargs = microbatches[task.mb]
            with execution_state(state["grad"], state["autocast"]):
                out = step_fn(*args, **kwargs)
            outputs[task.mb] = M.detach_all(out)
            scheduler.completed_microbatch(task.mb)
            # A clean-up note (the records it frees go at the step's end anyway): the
            # other ranks take it with their next message, not mid-compute.
            self.send_all({"kind": M.MB_DONE, "step": step, "mb": task.mb}, wake=False)
            self.drop_microbatch(step, task.mb)

        def start(mb: int, phase: str) -> None:
            if phase == "forward":
                root = RootContext(step, mb)
                self.roots[(step, mb)] = root
                self._start(Task(run_microbatch, mb, "<step>", "forward", root, step), "start")
            else:
                root = self.roots[(step, mb)]
                root.admitted = True
                worker = self.waiting[("admit", step, mb)]
                assert worker.task is not None
                worker.task.phase = "backward"
                worker.grant_kind = "admit"
                self._wake(("admit", step, mb), None)

        def start_next(urgent: bool) -> bool:
            action = scheduler.next_backward() if urgent else scheduler.next_action()
            if action is None:
                return False
            start(*action)
            return True

        def follower_start(mb: int, phase: str) -> None:
            scheduler.take(mb, phase)  # type: ignore[arg-type]
            start(mb, phase)

        self.follower_start = follower_start
        ok = False
        try:
            self.serve(scheduler.done, start_next)
            self.drop_step(step)
            shared = outputs if outputs_to_all else [None] * len(outputs)
            self.send_all({"kind": M.STEP_END, "step": step, "outputs": pack(shared, False)})
            self.flush_sends()
            ok = True
        finally:
            self.scheduler = None
            self.follower_start = None
            if self.order is not None and self.order.is_leader:
                if ok:
                    self.order.flush(self.timeout_s)
                else:
                    # A failed step: a follower that already raised may have closed its
                    # communicator, failing our last announcements to it; that must not
                    # replace the step's own error.
                    with contextlib.suppress(Exception):
                        self.order.flush(self.timeout_s)
        return outputs

    def follow_step(self) -> list[Any]:
        """Serve requests until the driver says the step ended; returns the step's outputs."""
        self.step += 1
        step = self.step
        self.serve(lambda: step in self.step_ends)
        msg = self.step_ends.pop(step)
        self.drop_step(step)
        if self.order is not None and self.order.is_leader:
            self.order.flush(self.timeout_s)
        self.flush_sends()
        return unflatten(msg["outputs"]["skeleton"], msg["outputs"]["tensors"])

    # ------------------------------------------------------------------ shutdown
    def threads(self) -> list[threading.Thread]:
        """The worker threads this server started (alive or not)."""
        return [w.thread for w in self.workers]

    def close(self) -> None:
        if self.shutting_down:
            return
        self.shutting_down = True
        if self._recv is not None:
            try:
                self._recv.cancel()
            except Exception:
                pass
            self._recv = None
        # Workers still blocked after an aborted step (a remote call or a joined backward
        # waiting for an answer) hold their tasks' graphs: resume them so they raise, end
        # their task and go idle, rather than block for the life of the process.
        stuck = list(self.waiting.values()) + [w for w, _ in self.ready] + list(self.yielded)
        if stuck and self.abort_msg is None:
            self.abort_msg = self._abort_message(
                "error", f"pp rank {self.pp_rank}: the runtime was closed during a step"
            )
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


_TASK_KINDS = (M.FWD_REQ, M.BWD_REQ, M.BWD_RESP)  # messages that start a task
_CLASS = {
    M.ABORT: 0,
    M.STEP_END: 0,
    M.MB_DONE: 0,
    M.FWD_RESP: 1,  # resumes a pending caller: cheap, and unblocks the microbatch
    M.BWD_RESP: 2,
    M.BWD_REQ: 2,  # backward before new forward work, as in 1F1B
    M.FWD_REQ: 3,
}


# Arrivals that make a running forward yield (see ExecutionServer.yield_point): work another
# rank waits for. A forward response resumes a pending caller (on the driver: the loss, then
# the backward request the next stage waits for); a backward request's answer goes back to
# the rank that sent it. (A backward response is not: on the first stage it only continues
# local backward, while the forward it would delay feeds the next stage.)
_PREEMPTING = frozenset((M.FWD_RESP, M.BWD_REQ))


def _backward_wait_key(msg: dict[str, Any]) -> tuple[Any, ...]:
    """The key a backward response is awaited (and tracked as outstanding) under; the same
    one :func:`smp_pipeline.calls._post_backward_request` registers."""
    return ("bwd", tuple(msg["key"]), msg["req"])


def _priority(msg: dict[str, Any]) -> tuple[int, int, int]:
    """Serve order among arrived messages: by kind, then older microbatches first."""
    return (_CLASS.get(msg["kind"], 0), msg.get("step", 0), msg.get("mb", 0))


@contextlib.contextmanager
def device_work() -> Iterator[None]:
    """Mark a block as device work (see :meth:`ExecutionServer.device_work`).

    Usable anywhere, e.g. in a module's forward or in an autograd Function: inside a pipeline
    worker the rank keeps serving other requests meanwhile; elsewhere it simply runs the
    block. Do not use it inside autograd functions on CUDA (there, backward runs on a shared
    device thread, and kernels are asynchronous anyway).
    """
    worker = current_worker()
    if worker is None:
        yield
        return
    with worker.server.device_work():
        yield
