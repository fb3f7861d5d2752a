"""``PipelineRuntime``: the lower-level API the umbrella (smp-torch) builds on.

Every pipeline rank builds the same full model, creates a runtime over a communicator that
reaches the other pipeline ranks, and calls :meth:`PipelineRuntime.run_step` with the same
step function. pp rank 0 is the *driver*: it splits the batch into microbatches and runs the
step function for each, as the schedule says; every other rank serves requests until the
driver announces the end of the step.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from smp_comm.shutdown import wait_for_threads_at_exit
from torch import nn

from smp_pipeline.accumulation import GradAccumulator
from smp_pipeline.actions import Action
from smp_pipeline.checkpointing import (
    CheckpointPlan,
    plan_checkpointing,
)
from smp_pipeline.dispatch import ModuleDispatch
from smp_pipeline.errors import PipelineConfigError
from smp_pipeline.execution_state import capture
from smp_pipeline.microbatch import split_microbatches
from smp_pipeline.offload import ActivationOffloader, OffloadStats
from smp_pipeline.order import OrderChannel
from smp_pipeline.ownership import Ownership
from smp_pipeline.partition import COSTS, partition_model, resolve_assignment
from smp_pipeline.replay import ReplayStats
from smp_pipeline.runtime_state import LocalState
from smp_pipeline.schedule import Scheduler, ScheduleSpec
from smp_pipeline.server import ExecutionServer, TimelineEvent
from smp_pipeline.setup_channel import SetupChannel
from smp_pipeline.timeline import plot_timeline, write_chrome_trace
from smp_pipeline.zerobubble import WeightGradStats, WeightGradWork

DEFAULT_TAG = 7301  # the runtime uses this tag and the next one on the communicator


class PipelineRuntime(LocalState):
    """Module-server pipeline execution of ``module`` over ``pp_size`` ranks.

    Args:
        module: the full model (every rank builds it identically; after partitioning each
            rank keeps only the parameters of the modules it owns).
        comm: an ``smp_comm.Communicator`` (anything with its ``isend``/``irecv`` API).
        pp_rank, pp_size: this rank's pipeline index and the pipeline degree.
        comm_ranks: the communicator rank of each pipeline rank (default ``range(pp_size)``).
        assignment: ``{module path: pp rank}`` (unassigned modules inherit their parent's), or
            None to trace the first step on pp rank 0 and partition with ``smp_partition``.
        alpha: the partitioner's memory weight (auto partition only).
        schedule: ``"interleaved"``, ``"simple"``, ``"zero_bubble"`` or a sequence of
            ``(mb, phase)`` pairs. ``"zero_bubble"`` starts tasks as ``"interleaved"`` and,
            on every rank, splits the backward of the owned ``nn.Linear``/``LayerNorm``/
            ``RMSNorm``/``Embedding`` layers into input-grad (now) and weight-grad tasks run
            in the rank's idle time (:mod:`smp_pipeline.zerobubble`): bitwise equal to
            ``"interleaved"``; needs ``deterministic_accumulation``. Every rank must agree.
        active_microbatches: at most this many microbatches in flight (default pp_size + 2).
        timeout_s: a request outstanding longer than this raises on every rank.
        checkpointing: ``{module path: strategy}`` (see :mod:`smp_pipeline.checkpointing`).
        timeline: record every task span for :meth:`write_timeline`.
        tag: the message tag (the runtime also uses ``tag + 1`` for setup collectives).
        trace_device: device for the automatic-partition trace. ``"meta"``: nothing is run
            (a step function uses the real model); the graph has definition order and
            parameter sizes only, no times or activations.
        order_channel: tensor-parallel ordering (see :mod:`smp_pipeline.order`): on the
            leader, every task start is published; followers start tasks in that order.
        abort_ranks: further communicator ranks to notify when this runtime aborts (e.g.
            every rank of the other pipelines, which must use the same ``tag``); they raise too.
        backward_mode: cross-rank autograd (see :mod:`smp_pipeline.autograd`). ``"auto"``:
            *joined* where a remote call's gradients are CPU tensors (one engine run per
            microbatch context, each local node once), *segments* where they are CUDA
            tensors; ``"joined"`` / ``"segments"`` force one (every rank must agree).
        deterministic_accumulation: sum each parameter's microbatch gradients in microbatch
            order whatever the timing (bit-identical runs; see
            :mod:`smp_pipeline.accumulation`). A stage still folds its last microbatch as soon
            as its own backward of it is done (joined mode), so a data-parallel reduction
            hooked on folds overlaps the earlier stages' backward. False leaves the order to
            autograd: the last bits may differ run to run.
        fast_mode: an ``nn.Sequential``'s consecutive children owned by one other rank run
            as one request per microbatch (and one backward request), nested plain
            Sequentials flattened in, instead of one request per child (see
            :mod:`smp_pipeline.seqruns`: exact, with the fallbacks listed there); and a loop
            over an ``nn.ModuleList`` in the model's own forward chains the blocks one rank
            owns into one request, from the step after it saw the loop follow the chaining
            rule (:mod:`smp_pipeline.chains`). Every rank must agree. False: one request per
            child or block (the paper's baseline).
        offload_activations: what checkpointed modules keep for backward (their inputs)
            moves to host memory after their forward and comes back ahead of their backward
            (see :mod:`smp_pipeline.offload`; :attr:`offload_stats` counts it). Needs
            ``checkpointing`` to do anything; results are unchanged bit for bit.
        activation_loading_horizon: with offloading, at most this many microbatches' saved
            tensors are loaded ahead of their backward (>= 1).
        static_mode: on a serving rank, record each step's requests (module, arguments'
            structure, shapes, dtypes) and replay the next step on the main thread: a request
            that repeats the recording and runs only modules owned here is served at once,
            with no worker thread or hand-off; the first that differs (or would wait on
            another rank, or whose kind ran device work) sends the rest of the step back to
            dynamic mode, exactly, counted in :attr:`replay_stats`, and is recorded anew
            (:mod:`smp_pipeline.replay`). During recorded steps, a request that ran straight
            through before (no device work, no yield, under 2 ms) is served on the main loop.
            Bitwise equal to dynamic mode. Under tensor-parallel ordering the stage's leader
            decides (it records and replays) and its followers run inline each task it
            announces it ran inline.
        partition_costs: how the partitioning trace measures forward costs
            (:data:`smp_pipeline.partition.COSTS`): ``"flops"`` (counted: the same partition
            for the same model and inputs on every run) or ``"measured"`` (timed).
        record_program: record, on every rank, the ordered actions of each step (tasks
            started, tensor messages sent and received): :meth:`program`. Cheap (a tuple
            appended per task and per message); False turns it off.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Any,
        pp_rank: int,
        pp_size: int,
        *,
        comm_ranks: Sequence[int] | None = None,
        assignment: Mapping[str, int] | None = None,
        alpha: float = 0.8,
        schedule: ScheduleSpec = "interleaved",
        active_microbatches: int | None = None,
        timeout_s: float = 300.0,
        checkpointing: Mapping[str, str | None] | None = None,
        timeline: bool = False,
        tag: int = DEFAULT_TAG,
        trace_device: str | None = None,
        order_channel: OrderChannel | None = None,
        abort_ranks: Sequence[int] | None = None,
        backward_mode: str = "auto",
        deterministic_accumulation: bool = True,
        fast_mode: bool = True,
        offload_activations: bool = False,
        activation_loading_horizon: int = 4,
        static_mode: bool = False,
        partition_costs: str = "flops",
        record_program: bool = True,
    ) -> None:
        if not 0 <= pp_rank < pp_size:
            raise PipelineConfigError(f"pp_rank {pp_rank} outside 0..{pp_size - 1}")
        self.module = module
        self.comm = comm
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.comm_ranks = list(comm_ranks) if comm_ranks is not None else list(range(pp_size))
        if len(self.comm_ranks) != pp_size:
            raise PipelineConfigError(
                f"comm_ranks has {len(self.comm_ranks)} entries, pp_size is {pp_size}"
            )
        self.alpha = alpha
        if partition_costs not in COSTS:
            raise PipelineConfigError(f"partition_costs must be one of {COSTS}, got {partition_costs!r}")
        self.partition_costs = partition_costs
        self.schedule = schedule
        self.active_microbatches = active_microbatches or pp_size + 2
        self.timeout_s = timeout_s
        self.tag = tag
        self._setup = SetupChannel(comm, self.comm_ranks, pp_rank, tag + 1, timeout_s)
        self.trace_device = trace_device
        self._ckpt_config: dict[str, str | None] = dict(checkpointing or {})
        self._ownership = Ownership(module, pp_rank)
        self.plan = CheckpointPlan()
        if not isinstance(static_mode, bool):
            raise PipelineConfigError(f"static_mode must be a bool, got {static_mode!r}")
        self.static_mode = static_mode
        if not isinstance(fast_mode, bool):
            raise PipelineConfigError(f"fast_mode must be a bool, got {fast_mode!r}")
        self.fast_mode = fast_mode
        self._dispatch = ModuleDispatch(module, pp_rank, self.fast_mode)
        self._tracing = False
        self._num_microbatches = 1
        self._local_params: list[nn.Parameter] = []
        if not isinstance(offload_activations, bool):
            raise PipelineConfigError(f"offload_activations must be a bool, got {offload_activations!r}")
        self.server = ExecutionServer(
            comm,
            pp_rank,
            pp_size,
            self.comm_ranks,
            tag,
            timeout_s,
            self._dispatch.execute_owned,
            record_timeline=timeline,
            order=order_channel,
            abort_ranks=list(abort_ranks or []),
            backward_mode=backward_mode,
            deterministic_accumulation=deterministic_accumulation,
            static_mode=static_mode,
            runs_locally=self._dispatch.runs_locally,
            call_params=self._dispatch.call_params,
            offload_horizon=activation_loading_horizon if offload_activations else None,
            record_program=record_program,
        )
        self.weight_grads: WeightGradWork | None = None
        if isinstance(schedule, str) and schedule == "zero_bubble":
            if not deterministic_accumulation:
                raise PipelineConfigError(
                    "schedule 'zero_bubble' needs deterministic_accumulation=True (its weight "
                    "gradients are folded in microbatch order by the accumulator)"
                )
            self.weight_grads = WeightGradWork(
                pp_rank, self.server.grads, self.server._current_mb, self.active_microbatches,
                record_timeline=timeline, note_action=self.server.note_weight_grad,
                rests=order_channel is None,
            )  # fmt: skip
            self.server.weight_grads = self.server.loop.weight_grads = self.weight_grads
            if order_channel is not None and not order_channel.is_leader:
                # A tensor-parallel follower starts tasks in its leader's order: its W tasks
                # wait for the step's end, but past the memory bound they run before the
                # next task starts, as on a leader (W tasks need no collective).
                self.server.executor.before_grant = self.weight_grads.keep_bound
        self.server.diagnosis.name_modules(module)
        self.order_channel = order_channel
        self.offloader: ActivationOffloader | None = self.server.executor.offloader
        _LIVE.add(self)  # closed at exit, and its threads checked (even once closed)
        if assignment is not None:
            self.set_assignment(assignment)

    @property
    def _grads(self) -> GradAccumulator:
        return self.server.grads

    @property
    def offload_stats(self) -> OffloadStats | None:
        """This rank's activation-offloading counters (None without offloading)."""
        return None if self.offloader is None else self.offloader.stats

    # ------------------------------------------------------------------ partitioning
    @property
    def is_driver(self) -> bool:
        """pp rank 0 runs the step function; the others serve requests."""
        return self.pp_rank == 0

    def set_activation_checkpointing(self, path: str, strategy: str | None = None) -> None:
        """Checkpoint module ``path`` (call on every rank, before partitioning)."""
        if self.assignment is not None:
            raise PipelineConfigError("set_activation_checkpointing must precede partitioning")
        self._ckpt_config[path] = strategy

    def set_assignment(self, assignment: Mapping[str, int]) -> None:
        """Apply a module placement (the same on every rank; no communication)."""
        if self.assignment is not None:
            raise PipelineConfigError("the model is already partitioned")
        full = resolve_assignment(self.module, assignment, self.pp_size)
        self.plan = plan_checkpointing(self.module, self._ckpt_config, full)
        self._ownership.assignment = full
        self._dispatch.install(full, self.plan, self.server)
        self._local_params = self.local_parameters()
        self.server.grads.track(self._local_params)
        if self.weight_grads is not None:
            mods = dict(self.module.named_modules())
            self.weight_grads.set_modules(self.module, [(p, mods[p]) for p in self.owned_modules()])

    def partition(
        self,
        step_fn: Callable[..., Any] | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, int]:
        """Collective: trace on pp rank 0, partition with smp_partition, apply everywhere.

        Without ``step_fn`` the model itself is traced as ``module(*args, **kwargs)``
        (on ``trace_device`` if set). See :func:`smp_pipeline.partition.partition_model`.
        """
        kw = dict(kwargs or {})
        run = None
        if step_fn is not None:
            fn = step_fn

            def run() -> Any:
                return fn(*args, **kw)

        self._tracing = True
        try:
            outcome = partition_model(
                self.module,
                self.pp_size,
                self._setup.bcast,
                root=self.is_driver,
                run=run,
                args=args,
                kwargs=kw,
                # The step function uses the real model: with a meta trace, run nothing.
                static=self.trace_device == "meta" and step_fn is not None,
                trace_device=self.trace_device,
                alpha=self.alpha,
                costs=self.partition_costs,
            )
        finally:
            self._tracing = False
        self.set_assignment(outcome.assignment)
        return dict(self.assignment or {})

    def device_work(self) -> Any:
        """Context manager: run the block as device work (see :func:`smp_pipeline.device_work`)."""
        return self.server.device_work()

    # ------------------------------------------------------------------ steps
    def run_step(
        self,
        step_fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        num_microbatches: int = 1,
        non_split_inputs: Iterable[str | int] = (),
        input_split_axes: Mapping[str | int, int] | None = None,
        schedule: ScheduleSpec | None = None,
        active_microbatches: int | None = None,
        outputs_to_all: bool = True,
    ) -> list[Any]:
        """Collective over the pipeline ranks: run one training (or evaluation) step.

        On pp rank 0, ``step_fn(*mb_args, **mb_kwargs)`` runs once per microbatch (arguments
        split on their batch axis); inside it call the model as usual and
        :meth:`backward` on the loss. Returns the list of per-microbatch outputs (tensors
        detached) on every rank (pp rank 0 sends them to the others at the end of the step;
        with ``outputs_to_all=False`` the other ranks get a list of None instead).
        Other ranks may pass any arguments (they are ignored except during the first,
        partitioning, step where only pp rank 0's are used).
        """
        self.server.raise_if_aborted()
        mbs: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        if self.is_driver:
            mbs = split_microbatches(
                step_fn, tuple(args), kwargs, num_microbatches, non_split_inputs, input_split_axes
            )
        return self.run_microbatches(
            step_fn,
            mbs,
            schedule=schedule,
            active_microbatches=active_microbatches,
            outputs_to_all=outputs_to_all,
        )

    def run_microbatches(
        self,
        step_fn: Callable[..., Any],
        microbatches: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]],
        *,
        schedule: ScheduleSpec | None = None,
        active_microbatches: int | None = None,
        outputs_to_all: bool = True,
    ) -> list[Any]:
        """Collective over the pipeline ranks: one step over microbatches the caller split.

        On pp rank 0, ``step_fn(*args, **kwargs)`` runs once per ``(args, kwargs)`` entry of
        ``microbatches``, in the order the schedule gives; inside it call the model as usual
        and :meth:`backward` on the loss. The other ranks serve requests; their
        ``microbatches`` are ignored (pass ``[]``), except that before the model is
        partitioned pp rank 0 traces ``step_fn`` on its first microbatch.

        The runtime is the only place the 1/m gradient factor is applied: :meth:`backward`
        scales gradients by ``1 / len(microbatches)`` (m as given on pp rank 0), so a caller
        must not scale its loss by the number of microbatches itself.

        Returns the per-microbatch outputs (tensors detached) on every rank, or on the other
        ranks a list of None with ``outputs_to_all=False``. :meth:`run_step` is this after
        splitting a batch with :func:`smp_pipeline.split_microbatches`.
        """
        self.server.raise_if_aborted()
        mbs = [(tuple(a), dict(k)) for a, k in microbatches]
        if self.is_driver and not mbs:
            raise PipelineConfigError("run_microbatches needs at least one microbatch")
        if self.assignment is None:
            if self.is_driver:
                self.partition(step_fn, *mbs[0])
            else:
                self.partition()
        # (A parameter made trainable since the last step joins the in-order accumulation.)
        self.server.grads.track(self._local_params)
        self._dispatch.begin_step()
        if not self.is_driver:
            return self.server.follow_step()
        m = len(mbs)
        self._num_microbatches = m
        if schedule == "zero_bubble" and self.weight_grads is None:
            raise PipelineConfigError(
                "schedule 'zero_bubble' must be given when the runtime is built (every pp "
                "rank splits its backwards), not per step"
            )
        scheduler = Scheduler(
            schedule if schedule is not None else self.schedule,
            m,
            active_microbatches or self.active_microbatches,
        )
        return self.server.drive_step(step_fn, mbs, scheduler, capture(), outputs_to_all)

    def backward(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        grad_tensors: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Backward of a microbatch's loss, inside the step function.

        Gradients are scaled by ``1 / m`` (m: the step's number of microbatches; the runtime
        is the only owner of this factor) so that, with a mean loss per
        microbatch (equal microbatch sizes), the accumulated gradient equals one process's
        gradient of the mean loss over the whole batch. Returns once every rank has finished
        this microbatch's backward. During the tracing pass it does nothing.
        """
        if self._tracing:
            return
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if grad_tensors is None:
            gs: list[torch.Tensor | None] = [None] * len(ts)
        elif isinstance(grad_tensors, torch.Tensor):
            gs = [grad_tensors]
        else:
            gs = list(grad_tensors)
        scale = 1.0 / self._num_microbatches
        grads = [torch.full_like(t, scale) if g is None else g * scale for t, g in zip(ts, gs)]
        self.server.backward(ts, grads)

    # ------------------------------------------------------------------ timeline
    def timeline_events(self) -> list[TimelineEvent]:
        """This rank's recorded spans ``(rank, mb, module, phase, start, end)``."""
        wg = [] if self.weight_grads is None else self.weight_grads.events
        return list(self.server.events) + list(wg)

    @property
    def weight_grad_stats(self) -> WeightGradStats | None:
        """With ``schedule="zero_bubble"``: this rank's weight-gradient tasks (how many ran in
        idle time, eagerly, at steps' ends; their time; the layers split). None otherwise."""
        return None if self.weight_grads is None else self.weight_grads.stats

    def write_timeline(
        self, json_path: str | None = None, png_path: str | None = None
    ) -> list[Any] | None:
        """Collective: gather every rank's events to pp rank 0 and write JSON and/or PNG."""
        parts = self._setup.gather(self.timeline_events(), 0)
        if parts is None:
            return None
        events = [e for part in parts for e in part]
        if json_path:
            write_chrome_trace(events, json_path)
        if png_path:
            plot_timeline(events, png_path)
        return events

    def program(self, step: int | None = None) -> tuple[Action, ...]:
        """This rank's recorded program of its last step (or of ``step``, counted from 1;
        only the last two are kept): the forward and backward tasks it started and the
        tensor-carrying messages it sent and took, in order, as
        :class:`~smp_pipeline.actions.Action` records. Gather every rank's and check them
        with :func:`~smp_pipeline.actions.validate_programs`. Empty with
        ``record_program=False``."""
        return self.server.program(step)

    @property
    def replay_stats(self) -> ReplayStats | None:
        """With ``static_mode`` on a serving rank: how its steps ran (replayed, fell back to
        dynamic mode and why, recorded; see :mod:`smp_pipeline.replay`). None elsewhere."""
        replay = self.server.replay
        return None if replay is None else replay.stats

    @property
    def requests_served(self) -> int:
        """Forward and backward requests this rank has served (for overhead measurements)."""
        return self.server.requests_served

    def interrupt(self, reason: str) -> None:
        """From any thread: make this rank's runtime raise
        :class:`~smp_pipeline.PipelineInterruptedError` (message ``reason``) at its next wait,
        and at every later step. For failures learnt outside the pipeline (smp-torch calls it
        when another rank of the job failed): nothing is sent to the other ranks. After it,
        the runtime is unusable, as after an abort."""
        self.server.interrupt(reason)

    def close(self) -> None:
        """Stop the server's threads (idempotent). Does not close the communicator."""
        self.server.close()
        if self.order_channel is not None:
            self.order_channel.close()

    def threads(self) -> list[threading.Thread]:
        """The server's worker threads (for an orderly process exit)."""
        return self.server.threads()


_LIVE: weakref.WeakSet[PipelineRuntime] = weakref.WeakSet()


@atexit.register
def shutdown_runtimes() -> None:
    """Close every runtime of this process and check that their workers ended.

    Runs at exit, before the communicators close (atexit runs LIFO and this module imports
    smp_comm first). A worker still blocked in a collective after a failed step would abort
    the process during interpreter finalization: it is waited for first (see
    :mod:`smp_comm.shutdown`).
    """
    threads = []
    for runtime in list(_LIVE):
        try:
            runtime.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        threads += runtime.threads()
    wait_for_threads_at_exit(threads, "smp-pipeline")
