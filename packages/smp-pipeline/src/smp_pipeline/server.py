"""The execution server of one pipeline rank (paper §4.2, Figures 3–4): its steps.

The server owns the objects below it and runs steps through its main loop
(:class:`~smp_pipeline.serving.ServingLoop`, which decides when each arrived message is
served):

- :class:`~smp_pipeline.transport.Transport`: the inbox, serve order, sending, aborts and
  request timeouts;
- :class:`~smp_pipeline.executor.Executor`: the worker threads, the execution token, tasks,
  device work (it knows nothing of messages);
- :class:`~smp_pipeline.autograd.CallRecords`: the cross-rank autograd records;
- :class:`~smp_pipeline.remote.RemoteCalls`: both sides of cross-rank calls;
- :class:`~smp_pipeline.handlers.MessageHandlers`: what serving each kind of message does.

Failures never hang: an exception in a task, or a request outstanding longer than
``timeout_s``, broadcasts an :class:`~smp_pipeline.protocol.Abort` and raises on every
pipeline rank; a timeout's message holds the chain of waits behind it, from every rank
(:class:`~smp_pipeline.diagnosis.StallDiagnosis`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Container
from typing import Any

import torch

from smp_pipeline.accumulation import GradAccumulator
from smp_pipeline.actions import BACKWARD, FORWARD, Action, ActionKind, Phase, ProgramRecorder
from smp_pipeline.autograd import BACKWARD_MODES, CallRecords, Context, RootContext
from smp_pipeline.diagnosis import StallDiagnosis
from smp_pipeline.errors import PipelineError
from smp_pipeline.execution_state import execution_state
from smp_pipeline.executor import Executor, TimelineEvent
from smp_pipeline.handlers import MessageHandlers
from smp_pipeline.messages import detach_all, pack
from smp_pipeline.order import OrderChannel
from smp_pipeline.protocol import PREEMPTING_CODES, MbDone, StepEnd
from smp_pipeline.remote import CallParams, Execute, RemoteCalls, RunsLocally
from smp_pipeline.replay import StepReplay
from smp_pipeline.schedule import Scheduler
from smp_pipeline.serving import ServingLoop
from smp_pipeline.transport import Transport
from smp_pipeline.worker import Baton, Task
from smp_pipeline.zerobubble import WeightGradWork

__all__ = ["STATIC_INLINE_MAX_S", "ExecutionServer", "TimelineEvent"]

_log = logging.getLogger("smp_pipeline")

# Static mode serves a task on the main loop only if it last held the token this briefly: a
# longer one stays on a worker, where it can yield to work other ranks wait for.
STATIC_INLINE_MAX_S = 0.002


class ExecutionServer:
    """Serves pipeline requests for the modules one rank owns.

    Args:
        comm: the communicator (smp-comm's ``isend``/``irecv`` API).
        pp_rank, pp_size: this rank's pipeline index and the pipeline degree.
        comm_ranks: the communicator rank of each pipeline rank.
        tag: the message tag.
        timeout_s: a request outstanding (or a rank idle) longer than this aborts the step.
        execute: runs an owned module (see :data:`smp_pipeline.remote.Execute`).
        record_timeline: keep every task span (:attr:`events`).
        order: the tensor-parallel order channel, if any.
        abort_ranks: further communicator ranks told about an abort.
        backward_mode: ``"auto"``, ``"joined"`` or ``"segments"`` (see
            :mod:`smp_pipeline.autograd`).
        static_mode: serve a request that runs only modules owned here, and ran straight
            through in under :data:`STATIC_INLINE_MAX_S` the last time, on the main loop's
            thread (:meth:`Executor.run_inline`); on a serving rank, replay the recorded
            step (:mod:`smp_pipeline.replay`).
        runs_locally, call_params: what the runtime's placement says of a request (see
            :class:`~smp_pipeline.remote.RemoteCalls`).
        offload_horizon: offload checkpointed activations with this loading horizon (None:
            no offloading; see :class:`~smp_pipeline.offload.ActivationOffloader`).
        record_program: record this rank's program of each step (:meth:`program`).
    """

    def __init__(
        self,
        comm: Any,
        pp_rank: int,
        pp_size: int,
        comm_ranks: list[int],
        tag: int,
        timeout_s: float,
        execute: Execute,
        record_timeline: bool = False,
        order: OrderChannel | None = None,
        abort_ranks: list[int] | None = None,
        backward_mode: str = "auto",
        deterministic_accumulation: bool = True,
        static_mode: bool = False,
        runs_locally: RunsLocally | None = None,
        call_params: CallParams | None = None,
        offload_horizon: int | None = None,
        record_program: bool = True,
    ) -> None:
        if backward_mode not in BACKWARD_MODES:
            raise PipelineError(
                f"backward_mode must be 'auto', 'joined' or 'segments', got {backward_mode!r}"
            )
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.timeout_s = timeout_s
        # Wakes the main loop: released when device work ends or a message arrives (a
        # callback on the posted receive), so the loop sleeps instead of polling for either.
        self._wakeup = Baton()
        # Preemption at yield points: off under tensor-parallel ordering (followers could
        # not yield at the same points), and on a single stage (no other rank waits).
        preemption = order is None and pp_size > 1
        # Each step's actions of this rank, in order (tasks started, tensor messages).
        self.recorder = ProgramRecorder(record_program)
        self.transport = Transport(
            comm, pp_rank, comm_ranks, tag, timeout_s, abort_ranks or [], self._wakeup.release,
            on_arrival=self._on_arrival if preemption else None,
            recorder=self.recorder,
        )
        # Static mode under tensor-parallel ordering: the leader decides (it serves inline,
        # or replays, and announces each inline task); followers run inline what it did.
        following = order is not None and not order.is_leader
        static = static_mode and not following
        self.executor = Executor(
            pp_rank,
            self.transport,
            self._wakeup,
            order=order,
            preemption=preemption,
            record_timeline=record_timeline,
            inline_max_s=STATIC_INLINE_MAX_S if static else 0.0,
            on_diverged=self._diverged if static else None,
            offload_horizon=offload_horizon,
            recorder=self.recorder,
        )
        self.records = CallRecords(pp_rank)
        # Gradients of this rank's parameters, summed in microbatch order (see accumulation).
        self.grads = GradAccumulator(
            self._current_mb, deterministic_accumulation, self._streamable
        )
        self.remote = RemoteCalls(
            pp_rank, self.transport, self.executor, self.records, execute, backward_mode,
            self.grads.complete_locally, runs_locally, call_params,
        )  # fmt: skip
        self.handlers = MessageHandlers(
            pp_rank, self.transport, self.executor, self.records, self.remote, self.grads
        )
        # Answers other ranks' stall queries; asks them all when a wait here times out.
        self.diagnosis = StallDiagnosis(
            pp_rank, pp_size, self.transport, self.executor, lambda: self.step
        )
        # The entry points the runtime calls on hot paths, bound once.
        self.call_remote = self.remote.call_remote
        self.yield_point = self.executor.yield_point
        self.device_work = self.executor.device_work
        self.raise_if_aborted = self.transport.raise_if_aborted
        self.order = order
        if order is not None:  # the leader's announcements wake a sleeping follower
            order.on_arrival = self._order_arrival
        self.step = 0
        self.scheduler: Scheduler | None = None
        # The main loop (serving.py): which arrived message is served when.
        self.loop = ServingLoop(
            pp_rank, self.transport, self.executor, self.handlers, order, self._wakeup,
            lambda: self.step,
        )
        # Zero-bubble (set by the runtime): deferred weight gradients (zerobubble.py).
        self.weight_grads: WeightGradWork | None = None
        # Static mode on a serving rank: later steps replay the recorded one (replay.py).
        self.replay: StepReplay | None = None
        if static and pp_rank != 0:
            self.replay = StepReplay(self.loop, self.remote.runs_locally)

    @property
    def preemption(self) -> bool:
        """Whether forwards yield at yield points (see :meth:`Executor.yield_point`)."""
        return self.executor.preemption

    @property
    def yields(self) -> int:
        """Forwards that gave the token back at a yield point."""
        return self.executor.yields

    @property
    def requests_served(self) -> int:
        """Forward and backward requests this rank has served."""
        return self.handlers.requests_served

    @property
    def events(self) -> list[TimelineEvent]:
        """The recorded task spans (with ``record_timeline``)."""
        return self.executor.events

    def _diverged(self, task: Task[Any]) -> None:
        _log.warning(
            "smp-pipeline static mode, pp rank %d: the %s did not run straight through as "
            "recorded (device work); it ran synchronously on the main loop, exact, and goes to "
            "a worker again from now on (said once)",
            self.pp_rank,
            task.describe(),
        )

    def _current_mb(self) -> int | None:
        """The microbatch of the task holding the execution token (None: the main loop)."""
        task = self.executor.current
        return None if task is None else task.mb

    def current_context(self) -> Context | None:
        """The context (a microbatch's step, or a served call) of the task holding the
        token; None on the main loop."""
        task = self.executor.current
        return None if task is None else task.context

    def _streamable(self) -> Container[int]:
        """The parameters whose only contribution of its microbatch here the task holding
        the token gives (see :meth:`CallRecords.streamable`)."""
        ctx = self.current_context()
        return frozenset() if ctx is None else self.records.streamable(ctx)

    def _order_arrival(self, _handle: Any) -> None:
        self._wakeup.release()

    def _on_arrival(self, handle: Any) -> None:
        """A message arrived (communicator thread): a running forward yields to work another
        rank waits for (``PREEMPTING``)."""
        if self.executor.running_forward() and Transport.arrived_code(handle) in PREEMPTING_CODES:
            self.executor.request_preemption()

    # ------------------------------------------------------------------ records
    def drop_microbatch(self, step: int, mb: int) -> None:
        """Forget every record of a finished microbatch (frees its retained graphs)."""
        self.records.drop_microbatch(step, mb)

    def drop_step(self, step: int) -> None:
        """Forget the records and task grant counts of ``step`` and earlier."""
        self.records.drop_step(step)
        self.executor.forget_step(step)

    # ------------------------------------------------------------------ steps
    def backward(self, tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """``backward(loss)`` inside the step function (driver rank)."""
        task = self.executor.current
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
        self.remote.segment(tensors, grads, retain=root.segment_calls)
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
        self.recorder.begin(step)
        self.scheduler = scheduler
        outputs: list[Any] = [None] * len(microbatches)
        executor, transport = self.executor, self.transport

        def run_microbatch(task: Task[None]) -> None:
            args, kwargs = microbatches[task.mb]
            with execution_state(state["grad"], state["autocast"]):
                out = step_fn(*args, **kwargs)
            outputs[task.mb] = detach_all(out)
            # Its backward (if any) returned: complete on every rank, so it may be folded.
            self.grads.complete(step, task.mb)
            scheduler.completed_microbatch(task.mb)
            # A clean-up note (the records it frees go at the step's end anyway): the
            # other ranks take it with their next message, not mid-compute.
            transport.send_all(MbDone(self.pp_rank, step, task.mb), wake=False)
            self.drop_microbatch(step, task.mb)

        def start(mb: int, phase: Phase) -> None:
            if phase == FORWARD:
                root = self.records.new_root(step, mb)
                task = Task(run_microbatch, mb, "<step>", FORWARD, root, step, None)
                executor.start(task, "start")
            else:
                # The step task goes on into its backward: one more action of the program.
                self.recorder.task(step, BACKWARD, mb, "<step>")
                self.records.roots[(step, mb)].admitted = True
                worker = executor.waiting[("admit", step, mb)]
                assert worker.task is not None
                worker.task.phase = BACKWARD
                worker.grant_kind = "admit"
                executor.wake(("admit", step, mb), None)

        def start_next(urgent: bool) -> bool:
            action = scheduler.next_backward() if urgent else scheduler.next_action()
            if action is None:
                return False
            start(*action)
            return True

        def follower_start(mb: int, phase: Phase) -> None:
            scheduler.take(mb, phase)
            start(mb, phase)

        self.loop.follower_start = follower_start
        ok = False
        self.grads.begin(step)
        try:
            with self._split_backwards():
                self.loop.serve(scheduler.done, start_next)
                self._drain_weight_grads()
            self.grads.end()
            self.drop_step(step)
            shared = outputs if outputs_to_all else [None] * len(outputs)
            transport.send_all(StepEnd(self.pp_rank, step, pack(shared, False)))
            transport.flush()
            ok = True
        finally:
            if not ok and self.weight_grads is not None:
                self.weight_grads.discard()
            self.grads.end()  # (a failed step: .grad back, with what was folded)
            self.scheduler = None
            self.loop.follower_start = None
            if self.order is not None and self.order.is_leader:
                if ok:
                    self.order.flush(self.timeout_s, self.transport.raise_if_aborted)
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
        self.recorder.begin(step)
        step_ends = self.handlers.step_ends
        self.grads.begin(step)
        ok = False
        try:
            with self._split_backwards():
                if self.replay is not None:
                    self.replay.follow(step, lambda: step in step_ends)
                else:
                    self.loop.serve(lambda: step in step_ends)
                self._drain_weight_grads()
            ok = True
        finally:
            if not ok and self.weight_grads is not None:
                self.weight_grads.discard()
            self.grads.end()  # every microbatch's backward is complete once the step ended
        msg = step_ends.pop(step)
        self.drop_step(step)
        if self.order is not None and self.order.is_leader:
            self.order.flush(self.timeout_s, self.transport.raise_if_aborted)
        self.transport.flush()
        return list(msg.outputs.unpack())

    def _split_backwards(self) -> contextlib.AbstractContextManager[None]:
        """Zero-bubble: the owned layers' backwards split for the step (forwards included:
        checkpointing recomputes inside the backward); otherwise nothing."""
        wg = self.weight_grads
        return contextlib.nullcontext() if wg is None else wg.step()

    def _drain_weight_grads(self) -> None:
        """Zero-bubble: the step's last weight-gradient tasks, before its gradients are final."""
        if self.weight_grads is not None:
            self.loop.guarded(self.weight_grads.drain)

    def note_weight_grad(self, mb: int, op: str) -> None:
        """Zero-bubble: a W task of microbatch ``mb`` (operator ``op``) starts: one more
        action of this rank's program."""
        self.recorder.task(self.step, ActionKind.WEIGHT_GRAD, mb, op)

    def program(self, step: int | None = None) -> tuple[Action, ...]:
        """This rank's recorded program of ``step`` (default: the last one run): the tasks
        it started and the tensor messages it sent and took, in order (see
        :mod:`smp_pipeline.actions`). Empty when recording is off or the step is forgotten
        (only the last two steps are kept)."""
        return self.recorder.program(self.step if step is None else step)

    def interrupt(self, reason: str) -> None:
        """From any thread: raise :class:`~smp_pipeline.errors.PipelineInterruptedError` on
        this rank at its next wait (see :meth:`Transport.interrupt`)."""
        self.transport.interrupt(reason)

    # ------------------------------------------------------------------ shutdown
    def threads(self) -> list[threading.Thread]:
        """The worker threads this server started (alive or not)."""
        return self.executor.threads()

    def close(self) -> None:
        """Stop the worker threads (idempotent). Workers still blocked after an aborted step
        are resumed so they raise (see :meth:`Executor.close`)."""
        if self.executor.shutting_down:
            return
        self.transport.close()
        if self.executor.has_stuck_workers() and self.transport.abort_msg is None:
            self.transport.abort_msg = self.transport.abort_message(
                "error", f"pp rank {self.pp_rank}: the runtime was closed during a step"
            )
        self.executor.close()
