"""Pipeline parallelism (``pipeline_parallel_degree > 1``): the engine over smp-pipeline.

Each pipeline (the ranks of one ``PP_GROUP``) gets an ``smp_pipeline.PipelineRuntime`` over the
*whole* model; pp rank 0 of every pipeline drives the step function, the other stages serve
requests. The umbrella splits the batch once (``@smp.step``) and hands the microbatches to
``PipelineRuntime.run_microbatches``; the runtime's ``backward`` owns the ``1/microbatches``
factor.

Partitioning happens on the first ``@smp.step`` call (``auto_partition``, the default):
``smp_pipeline.partition.partition_model`` traces the first microbatch of the step on world
rank 0 (every pp-rank-0 rank traces together when tensor-parallel layers need their peers),
partitions the traced module tree with ``memory_weight`` as its alpha, and rank 0's
assignment is broadcast to every rank, so every replica and every tensor-parallel peer
partitions identically. With ``auto_partition=False`` the ``smp.partition`` /
``smp.set_partition`` marks (unmarked modules follow their parent, the root
``default_partition``) are applied when the model is wrapped. A model created under
``smp.delay_param_initialization()`` is partitioned at wrap time from its static graph
(parameter counts alone: there is nothing to run), then only the modules this rank owns are
materialised.

After partitioning, the parameters of modules owned by other stages are freed, and the
engine's ``on_partitioned`` subscribers (the model, then its optimizers) trim their
parameter lists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from smp_comm import Communicator
from smp_partition import GraphError, PartitionResult
from smp_pipeline import OrderChannel, PipelineRuntime
from smp_pipeline.partition import partition_model, resolve_assignment
from smp_pipeline.wsplit import register_linear
from smp_tp import ColumnParallelLinear, DistributedModule, RowParallelLinear
from torch import nn
from torch.utils._pytree import tree_map

from smp_torch import sharded, tp_glue
from smp_torch.annotations import checkpoint_options, get_checkpoint_mark, get_partition_mark
from smp_torch.context import SMPContext
from smp_torch.engine import Engine, Microbatches, delayed_init
from smp_torch.errors import SMPError
from smp_torch.precision import autocast_context
from smp_torch.sharded_pp import StageShards
from smp_torch.weights import materialize_named, owned_tensor_names

__all__ = ["PipelineEngine"]

_ORDER_TAG = 7401

# pipeline="zero_bubble" splits tensor parallelism's shards of nn.Linear like nn.Linear: each
# forward is F.linear on this rank's shard alone (the collectives sit in other modules), and
# its weight gradient needs no collective. A row-parallel bias is added after the reduction,
# outside the layer: it keeps torch's backward.
register_linear(ColumnParallelLinear, bias=True)
register_linear(RowParallelLinear, bias=False)


def _to_host(x: Any) -> Any:
    return x.to("cpu") if isinstance(x, torch.Tensor) else x


def _read_partition_file(path: str, pp: int) -> dict[str, Any] | None:
    """Rank 0's reading of ``partition_file``: ``{"assignment": ...}``, ``{"error": ...}``
    (broadcast, so every rank raises the same error), or None when there is no file yet."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            result = PartitionResult.from_dict(json.load(f))
    except (OSError, ValueError, GraphError) as exc:
        return {"error": f"partition_file {path!r} cannot be read: {exc}"}
    if result.num_devices != pp:
        return {"error": f"partition_file {path!r} splits the model into {result.num_devices} "
                         f"stages, but pipeline_parallel_degree is {pp}"}
    return {"assignment": result.assignment}


def _write_partition_file(path: str, result: PartitionResult) -> None:
    """Save the automatic partition where ``partition_file`` says (atomically: a run that
    dies while writing leaves no half file for the next one to read)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    result.to_json(tmp, indent=1)
    os.replace(tmp, path)


def _marks(module: nn.Module, default: int) -> dict[str, int]:
    root = get_partition_mark(module)
    marks: dict[str, int] = {"": root if root is not None else default}
    for name, m in module.named_modules():
        mark = get_partition_mark(m)
        if name and mark is not None:
            marks[name] = mark
    return marks


def keep_whole(module: nn.Module, assignment: dict[str, int]) -> dict[str, int]:
    """Keep some subtrees on one stage: move descendants the partitioner put elsewhere.

    - a checkpointed (non-Sequential) module is recomputed on its owner;
    - an smp-tp distributed module uses its submodules' parameters directly (not by
      calling them), so they must live where it runs.
    """
    out = dict(assignment)
    for name, m in module.named_modules():
        checkpointed = get_checkpoint_mark(m) is not None and not isinstance(m, nn.Sequential)
        if not (checkpointed or isinstance(m, DistributedModule)) or name not in out:
            continue
        for sub, _ in m.named_modules(prefix=name):
            if sub in out:
                out[sub] = out[name]
    return out


class PipelineEngine(Engine):
    """pp > 1: one ``PipelineRuntime`` per pipeline (see the module docstring)."""

    def __init__(
        self, ctx: SMPContext, module: nn.Module, broadcast_weights: bool, trace_device: str = "cpu"
    ) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.pp_rank = ctx.index("pp")
        self.tracing = False
        self._alias_owner: dict[str, int] | None = None
        # Sharded data parallelism: FSDP2 units over this stage, made once it is known.
        self.stage_shards: StageShards | None = None
        self.shard_plan: sharded.ShardPlan | None = None
        world = ctx.mpi_comms["world"]
        # Where the trace runs decides when partitioning happens, a collective: rank 0's word.
        self.trace_device = str(world.bcast(trace_device, root=0))
        delayed = delayed_init(ctx, module)

        assignment: dict[str, int] | None = None
        pinned = None
        if cfg.auto_partition and cfg.partition_file:
            mine = _read_partition_file(cfg.partition_file, cfg.pp) if ctx.rank == 0 else None
            pinned = world.bcast(mine, root=0)
            if pinned is not None and "error" in pinned:
                raise SMPError(pinned["error"])
        if not cfg.auto_partition:
            assignment = _marks(module, cfg.default_partition)
        elif pinned is not None:
            assignment = dict(pinned["assignment"])
        elif delayed is not None or self.trace_device == "meta":
            # Nothing to run (or running is not wanted): the static graph's parameter counts.
            outcome = self._partition(module, static=True)
            assignment = outcome.assignment
        if delayed is not None:
            assert assignment is not None
            full = keep_whole(module, resolve_assignment(module, assignment, cfg.pp))
            owned = [name for name, stage in full.items() if stage == self.pp_rank]
            materialize_named(module, ctx.device, owned_tensor_names(module, owned), delayed[1])
        else:
            # Only a device trace needs the whole model on the device; otherwise what this
            # rank owns moves there once the assignment is applied (_apply).
            whole = assignment is None and self.trace_device not in ("cpu", "meta")
            self._prepare_weights(module, broadcast_weights, to_device=whole)
        # The experts split over the ep group before anything is partitioned: the partition
        # weighs each rank's share.
        self._distribute_experts(module)
        # Tensor-parallel layers run collectives on this rank's device (in the trace too):
        # they are built and placed there whatever the trace device.
        self.module = module = self._parallelize(module)
        checkpointing, _options = checkpoint_options(module)
        # One communicator over the whole job, shared by every pipeline: each runtime talks to
        # its own stages (comm_ranks), and an abort reaches every rank (abort_ranks), so a
        # tensor-parallel peer or replica in another pipeline raises instead of waiting in a
        # collective forever.
        self.comm = Communicator(world.Dup())
        order: OrderChannel | None = None
        self.ordering = "none"
        if cfg.tp > 1 or cfg.ep > 1 or cfg.cp > 1:
            # TP peers of a stage sit in different pipelines and run collectives inside module
            # executions, so they must start tasks in the same order; so must the replicas of
            # an expert-parallel group (the experts' all-to-alls) and the ranks of a
            # context-parallel group (ring attention), and with several, every rank of the
            # stage's TP x EP x CP block, one leader for all.
            peers = _order_group(ctx)
            order = OrderChannel(self.comm, peers[0], peers[1:], _ORDER_TAG)
            self.ordering = "leader"
        self.runtime = PipelineRuntime(
            module,
            self.comm,
            self.pp_rank,
            cfg.pp,
            comm_ranks=ctx.groups["pp"],
            alpha=cfg.memory_weight,
            schedule=cfg.pipeline,
            active_microbatches=cfg.active_microbatches,
            deterministic_accumulation=cfg.deterministic_accumulation,
            fast_mode=cfg.fast_mode,
            static_mode=cfg.static_mode,
            offload_activations=cfg.offload_activations,
            activation_loading_horizon=cfg.activation_loading_horizon,
            timeout_s=cfg.timeout_s,
            checkpointing=checkpointing,
            timeline=bool(cfg.timeline),
            trace_device=None,  # (smp partitions itself: _partition, prepare_step)
            order_channel=order,
            abort_ranks=[r for r in range(ctx.size) if r not in ctx.groups["pp"]],
        )
        self.offloader = self.runtime.offloader
        ctx.closers.append(self.close)
        # Another rank's failure (smp_torch.watch) ends this rank's pipeline waits at once.
        ctx.watch.on_failure(self.runtime.interrupt)
        self._pending = assignment

    def start(self) -> None:
        """Apply an assignment known at wrap time (manual or delayed-init partitioning)."""
        if self._pending is not None:
            self._apply(self._pending)
            self._pending = None

    @property
    def step_label(self) -> str:
        return "driving the pipeline" if self.pp_rank == 0 else "serving the pipeline"

    # -- partitioning ------------------------------------------------------------------------

    def _share_partition(self, obj: Any) -> Any:
        """Rank 0's partition on every rank (the other ranks wait for its trace without
        spinning: :meth:`FailureWatch.arrive`)."""
        self.ctx.watch.arrive("partitioning the model, waiting for rank 0")
        return self.ctx.mpi_comms["world"].bcast(obj, root=0)

    def _partition(self, module: nn.Module, static: bool = False, **trace: Any) -> Any:
        """Collective over the job: partition on world rank 0, share the assignment."""
        ctx, cfg = self.ctx, self.ctx.config
        try:
            outcome = partition_model(
                module,
                cfg.pp,
                self._share_partition,
                root=ctx.rank == 0,
                static=static,
                alpha=cfg.memory_weight,
                costs=cfg.partition_costs,
                **trace,
            )
        except Exception as exc:  # noqa: BLE001 - the same error type on every rank
            raise SMPError(f"partitioning the model on rank {ctx.rank} failed: {exc!r}") from exc
        if outcome.result is not None:
            self.partition_report = (outcome.graph, outcome.result)
            if cfg.partition_file:  # (only reached when the file did not exist: pinned next time)
                _write_partition_file(cfg.partition_file, outcome.result)
        return outcome

    @property
    def partitioned(self) -> bool:
        return self.runtime.assignment is not None

    def _apply(self, assignment: dict[str, int]) -> None:
        # Names given before tensor parallelism replaced modules may no longer exist inside
        # the replacements; the replacements themselves keep their paths.
        names = {n for n, _ in self.module.named_modules(remove_duplicate=False)}
        kept = {k: v for k, v in assignment.items() if k in names}
        full = resolve_assignment(self.module, kept, self.ctx.config.pp)
        self.runtime.set_assignment(keep_whole(self.module, full))  # (frees the other stages' parameters)
        self._owned_to_device()
        if self.ctx.config.sdp > 1:  # collective: every rank partitions at the same time
            self.stage_shards = StageShards(
                self.module, self.runtime.owned_modules(), self.runtime.named_local_parameters(), self.ctx
            )
            self.shard_plan = self.stage_shards.plan
        self._notify_partitioned()

    def _owned_to_device(self) -> None:
        """Move this stage's modules (their own parameters and buffers) to the rank's device;
        the other stages' modules stay where they are (empty stand-ins, host or meta)."""
        device = self.ctx.device
        assert self.runtime.assignment is not None
        modules = dict(self.module.named_modules())
        for path, stage in self.runtime.assignment.items():
            if stage == self.pp_rank and path in modules:
                modules[path]._apply(lambda t: t.to(device), recurse=False)

    def prepare_step(self, fn: Callable[..., Any], microbatches: Microbatches) -> None:
        """Trace (world rank 0) and partition on the first step; identical on every rank."""
        if self.partitioned:
            return
        ctx, cfg = self.ctx, self.ctx.config
        args, kwargs = microbatches[0]
        if self.trace_device == "cpu" and self.ctx.device.type != "cpu":
            # A host trace: the model is still on the host, so its inputs go there too.
            args, kwargs = tree_map(_to_host, (args, kwargs))
        self.tracing = True
        try:
            with autocast_context(cfg.fp16, cfg.bf16, ctx.device):
                outcome = self._partition(
                    self.module,
                    run=lambda: fn(*args, **kwargs),
                    # Tensor-parallel layers, split experts and ring attention need their
                    # peers to run the trace with them.
                    trace_here=ctx.rank == 0 or ((cfg.tp > 1 or cfg.ep > 1 or cfg.cp > 1) and self.pp_rank == 0),
                )
        finally:
            self.tracing = False
        self._apply(outcome.assignment)

    # -- execution ---------------------------------------------------------------------------

    def run_microbatches(self, fn: Callable[..., Any], microbatches: Microbatches) -> list[Any]:
        cfg = self.ctx.config
        # Only pp rank 0 runs the step function; the other stages serve its requests.
        mine = microbatches if self.pp_rank == 0 else []
        if self.stage_shards is not None:
            self.stage_shards.begin()
            # During the step the gathered parameters are the modules': sum into them in order.
            self.runtime.track_parameters(self.stage_shards.gathered_parameters())
        with autocast_context(cfg.fp16, cfg.bf16, self.ctx.device):
            return self.runtime.run_microbatches(fn, mine)

    def finish_step(self, backward_ran: bool) -> None:
        if self.stage_shards is not None:
            self.stage_shards.finish(reduce=backward_ran)

    def backward(
        self, tensors: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], loss_scale: float
    ) -> None:
        if self.tracing:
            return
        # The runtime applies 1/microbatches itself (its only owner under pipelining).
        scaled = list(grads) if loss_scale == 1.0 else [g * loss_scale for g in grads]
        self.runtime.backward(list(tensors), scaled)

    def register_grad_hook(self, param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
        # The runtime sums each parameter's gradient in microbatch order: .grad changes only
        # when a microbatch's sum is folded in, once per microbatch that reached it.
        return self.runtime.register_grad_hook(param, hook)

    # -- ownership ---------------------------------------------------------------------------

    def owned_parameter_names(self) -> set[str] | None:
        if not self.partitioned:
            return None
        return {n for n, _ in self.runtime.named_local_parameters()}

    def owned_state_names(self) -> set[str] | None:
        if not self.partitioned:
            return None
        return set(self.runtime.local_state_dict())

    def owns_full_key(self, key: str) -> bool:
        if not self.partitioned:
            return True
        if self._alias_owner is None:
            canon = {id(m): n for n, m in self.module.named_modules()}
            assert self.runtime.assignment is not None
            self._alias_owner = {
                n: self.runtime.assignment[canon[id(m)]]
                for n, m in self.module.named_modules(remove_duplicate=False)
            }
        path = key
        while True:
            path = path.rsplit(".", 1)[0] if "." in path else ""
            if path in self._alias_owner:
                return self._alias_owner[path] == self.pp_rank
            if path == "":
                return self._alias_owner.get("", 0) == self.pp_rank

    def merge_stages(self, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        pp = self.ctx.mpi_comms["pp"]
        self.ctx.watch.arrive("gathering the stages' state", pp)
        for piece in pp.allgather(part):
            merged.update(piece)
        return merged

    def load_full_state(self, sd: dict[str, torch.Tensor], strict: bool) -> Any:
        """Load a full state dict: this stage's entries only once partitioned."""
        cfg = self.ctx.config
        if not self.partitioned:
            return super().load_full_state(sd, strict)
        mine = {k: v for k, v in sd.items() if self.owns_full_key(k)}
        if self.stage_shards is not None and cfg.tp == 1:
            sharded.load_full(self.module, mine, strict=False)  # slices locally
            return None
        if self.stage_shards is not None:
            # smp-tp slices its shards out of plain parameters; FSDP2 slices those again
            # (collective over the stage's sharding mesh: every rank loads).
            with sharded.gathered(self.module, write_back=True):
                tp_glue.load_full_state_dict(self.module, mine, cfg.tp, strict=False)
            return None
        target = self.module.state_dict()
        if cfg.tp == 1:
            missing = [k for k in target if self.owns_full_key(k) and k not in mine]
            if strict and missing:
                raise SMPError(f"state dict lacks keys of pipeline stage {self.pp_rank}: {missing}")
            with torch.no_grad():
                for k, v in mine.items():
                    if k in target:
                        target[k].copy_(v)
            return None
        # TP: smp-tp slices the full entries; foreign stages' parameters are empty stand-ins.
        tp_glue.load_full_state_dict(self.module, mine, cfg.tp, strict=False)
        return None

    # -- timeline ----------------------------------------------------------------------------

    def reset_timeline(self) -> None:
        # smp-pipeline keeps the spans in its server's ``events`` list; it has no reset call.
        events = getattr(self.runtime.server, "events", None)
        if isinstance(events, list):
            events.clear()

    def write_timeline(self, json_path: str | None, png_path: str | None) -> Any:
        return self.runtime.write_timeline(json_path, png_path)

    def close(self) -> None:
        try:
            self.runtime.close()
        finally:
            self.comm.close()


def _order_group(ctx: SMPContext) -> list[int]:
    """The ranks that must start tasks in one order (see :class:`OrderChannel`): this
    rank's TP group, joined over its expert-parallel group (the same stage in ``ep``
    replicas) and its context-parallel group; sorted, so the leader is the same on every
    member."""
    topo = ctx.topology
    block = set(topo.tp_group(ctx.rank))
    for joined in (topo.ep_group, topo.cp_group):
        block = {r for b in block for r in joined(b)}
    return sorted(block)
