"""How a :class:`~smp_torch.model.DistributedModel` executes: one engine, chosen once.

:class:`Engine` is the interface; :class:`LocalEngine` runs the whole model in this process
(``pipeline_parallel_degree == 1``), :class:`smp_torch.pipeline.PipelineEngine` runs it through
smp-pipeline's runtime. An engine prepares the module (starting weights, tensor parallelism,
activation checkpointing), knows which parameters and state entries this rank owns, runs a
step's microbatches and a microbatch's backward, and tells subscribers once parameters are
assigned to stages (:meth:`Engine.on_partitioned`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import smp_tp
import torch
from smp_pipeline import add_checkpoint_context
from smp_pipeline.checkpointing import checkpoint_in_place
from smp_pipeline.offload import ActivationOffloader, offloading
from smp_tp import checkpoint_context as tp_checkpoint_context
from torch import nn

from smp_torch import sharded, tp_glue
from smp_torch.annotations import checkpoint_options
from smp_torch.context import SMPContext
from smp_torch.deferred import DeferredInit
from smp_torch.errors import ConfigError, SMPError
from smp_torch.precision import autocast_context
from smp_torch.sharded_agree import END
from smp_torch.weights import (
    broadcast_on_host,
    broadcast_tensors,
    fill_shards,
    has_meta,
    materialize_named,
    module_tensors,
    shared_rng_state,
)

__all__ = ["Engine", "LocalEngine", "Microbatches", "delayed_init"]

Microbatches = list[tuple[tuple[Any, ...], dict[str, Any]]]


def delayed_init(ctx: SMPContext, module: nn.Module) -> tuple[DeferredInit, torch.Tensor] | None:
    """Collective when ``module`` was built under ``smp.delay_param_initialization()``: its
    recording and the generator state every rank replays (rank 0's); None for a model built
    normally (decided by rank 0, so every rank takes the same path)."""
    metas = [bool(m) for m in ctx.mpi_comms["world"].allgather(has_meta(module))]
    if not any(metas):
        return None
    if not all(metas):
        normal = [r for r, m in enumerate(metas) if not m]
        raise SMPError(
            f"the model has meta-device tensors on some ranks only (built normally on ranks "
            f"{normal}): build it under smp.delay_param_initialization() on every rank or on none"
        )
    init = DeferredInit.of(module)
    return init, shared_rng_state(init, ctx.mpi_comms["world"])


class Engine(ABC):
    """What a :class:`~smp_torch.model.DistributedModel` needs from its execution strategy."""

    #: The module the engine runs (tensor-parallel replacements applied).
    module: nn.Module
    #: ``(ModuleGraph, PartitionResult)`` of an automatic partition, on world rank 0.
    partition_report: Any = None
    #: This rank's activation offloader (``offload_activations``), None without it.
    offloader: ActivationOffloader | None = None
    #: smp-tp's decision per module (tensor parallelism), empty with tp = 1.
    tp_decisions: list[smp_tp.TPDecision]

    def __init__(self, ctx: SMPContext) -> None:
        self.ctx = ctx
        self._subscribers: list[Callable[[], None]] = []
        self.tp_decisions = []
        # Recomputations replay smp-tp's dropout streams too (torch restores only its own
        # generators), at every pipeline degree.
        add_checkpoint_context(tp_checkpoint_context)

    def on_partitioned(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once parameters are assigned to stages (now, if they are)."""
        self._subscribers.append(callback)
        if self.partitioned:
            callback()

    def _notify_partitioned(self) -> None:
        for callback in list(self._subscribers):
            callback()

    def _prepare_weights(self, module: nn.Module, broadcast_weights: bool, to_device: bool = True) -> None:
        """Give every replica rank 0's weights; move them to this rank's device unless the
        caller moves only what the rank owns later (``to_device=False``).

        A model on the host is broadcast there (MPI), before it moves: whatever smp's groups
        serve, and without the whole model on any device. One built on a device is broadcast
        over the world group, on this rank's device."""
        ctx = self.ctx
        tensors = module_tensors(module)
        on_host = all(t.device.type == "cpu" for t in tensors)
        if broadcast_weights and ctx.size > 1 and on_host:
            broadcast_on_host(tensors, ctx.mpi_comms["world"])
        if to_device or not on_host:
            module.to(ctx.device)
        if broadcast_weights and ctx.size > 1 and not on_host:
            broadcast_tensors(module_tensors(module), 0, ctx.process_groups["world"])

    def _distribute_experts(self, module: nn.Module) -> None:
        """``expert_parallel_degree`` > 1: replace every fused experts module of ``module``
        with this rank's share (``smp_tp.expert_parallelize`` over the ep group). Run once
        every rank holds the same weights (after the broadcast or the replay) and before
        anything reads the parameters (reducer, report, optimizer). Raises
        :class:`ConfigError` on every rank alike (same model everywhere) when the model has
        no fused experts or the degree does not divide a layer's number of experts."""
        ep = self.ctx.config.ep
        if ep == 1:
            return
        found = [(name, m) for name, m in module.named_modules() if name and _looks_fused_experts(m)]
        if not found:
            raise ConfigError(
                "expert_parallel_degree",
                f"is {ep} but {type(module).__name__} has no fused experts module "
                "(transformers-5 MoE experts: 3-D gate_up_proj and down_proj, num_experts)",
            )
        for name, m in found:
            fused: Any = m  # (num_experts is an int: checked by _looks_fused_experts)
            experts = int(fused.num_experts)
            if experts % ep:
                raise ConfigError(
                    "expert_parallel_degree",
                    f"{ep} does not divide the {experts} experts of module {name!r} ({type(m).__name__})",
                )
        # The local experts' compute follows the model's own choice: one grouped matmul over
        # the received rows when it was built with experts_implementation="grouped_mm" (and
        # torch has it), else a loop over experts as transformers' eager one.
        impl = {getattr(getattr(m, "config", None), "_experts_implementation", None) for _, m in found}
        grouped = impl == {"grouped_mm"} and hasattr(torch.nn.functional, "grouped_mm")
        try:
            replaced = smp_tp.expert_parallelize(
                module, self.ctx.process_groups["ep"], grouped_mm=grouped,
                capacity_factor=self.ctx.config.expert_capacity_factor,
            )
        except ValueError as exc:
            raise ConfigError("expert_parallel_degree", f"cannot split the experts: {exc}") from None
        if replaced != len(found):  # (e.g. an experts module without act_fn: not left whole silently)
            raise ConfigError(
                "expert_parallel_degree",
                f"split {replaced} of the {len(found)} experts modules {[n for n, _ in found]}: "
                "smp_tp.expert_parallelize needs 3-D gate_up_proj/down_proj, num_experts and act_fn",
            )

    def _parallelize(self, module: nn.Module) -> nn.Module:
        cfg = self.ctx.config
        if cfg.tp == 1:
            return module
        out = tp_glue.parallelize(
            module,
            self.ctx.process_groups["tp"],
            cfg.prescaled_batch,
            cfg.optimize,
            cfg.tensor_parallel_seed,
            record=self.tp_decisions,
        )
        device = self.ctx.device
        # (Under delayed initialisation the other stages' tensors stay on the meta device.)
        out._apply(lambda t: t if t.is_meta else t.to(device))
        return out

    @property
    @abstractmethod
    def partitioned(self) -> bool:
        """Whether parameters are assigned to stages (always, with pp=1)."""

    @property
    def watched(self) -> bool:
        """Whether steps run on a helper thread watched for peers' failures."""
        return False

    @property
    def step_label(self) -> str:
        """What this rank does during a step, in words (for failure messages)."""
        return "running the step function"

    def start(self) -> None:
        """Finish construction once the model subscribed (apply a known assignment)."""
        return None

    def prepare_step(self, fn: Callable[..., Any], microbatches: Microbatches) -> None:
        """Before a step: partition on the first one when that needs a trace."""
        return None

    @abstractmethod
    def run_microbatches(self, fn: Callable[..., Any], microbatches: Microbatches) -> list[Any]:
        """Run ``fn`` once per microbatch; return its outputs in microbatch order."""

    def finish_step(self, backward_ran: bool) -> None:
        """Collective, after every rank agreed on a step's outcome: what the engine does with
        the step's gradients before the optimizer sees them (nothing by default)."""
        return None

    @abstractmethod
    def backward(
        self, tensors: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], loss_scale: float
    ) -> None:
        """Backward of one microbatch from ``grads`` times ``loss_scale``; the engine (or its
        runtime) applies the ``1/microbatches`` factor, the only place it is applied."""

    def register_grad_hook(self, param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
        """``hook(param)`` after each accumulation into ``param.grad`` (a handle with
        ``remove()``): autograd's post-accumulate-grad hook, where autograd accumulates."""
        return param.register_post_accumulate_grad_hook(hook)

    def owned_parameter_names(self) -> set[str] | None:
        """Names of this rank's parameters, or None when it holds every parameter."""
        return None

    def owned_state_names(self) -> set[str] | None:
        """Names of this rank's ``module.state_dict()`` entries, or None for all."""
        return None

    def owns_full_key(self, key: str) -> bool:
        """Whether this rank's stage holds the unwrapped model's state-dict entry ``key``."""
        return True

    def merge_stages(self, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Collective over the pipeline: every stage's part of the full state dict."""
        return part

    def load_full_state(self, sd: dict[str, torch.Tensor], strict: bool) -> Any:
        """Load an unwrapped model's state dict (this stage's entries)."""
        tp_glue.load_full_state_dict(self.module, dict(sd), self.ctx.config.tp, strict)
        return None

    def reset_timeline(self) -> None:
        """Forget the recorded request timeline (nothing without a pipeline)."""
        return None

    def write_timeline(self, json_path: str | None, png_path: str | None) -> Any:
        raise SMPError("the request timeline exists only with pipeline parallelism")


def _looks_fused_experts(module: nn.Module) -> bool:
    """A transformers-5 fused experts module (what ``smp_tp.expert_parallelize`` replaces),
    not yet distributed."""
    if isinstance(module, smp_tp.ExpertParallelExperts):
        return False
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3 and down.dim() == 3
        and isinstance(getattr(module, "num_experts", None), int)
    )


class LocalEngine(Engine):
    """pp = 1: the whole model in this process; microbatches run one after the other."""

    def __init__(
        self, ctx: SMPContext, module: nn.Module, broadcast_weights: bool, trace_device: str = "cpu"
    ) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        # (trace_device: nothing is traced without a pipeline; the whole model is this rank's.)
        delayed = delayed_init(ctx, module)
        # Sharded without tensor parallelism: a delayed model is sharded while still on the
        # meta device and each shard is filled as its tensor is replayed (fill_shards), so no
        # rank ever holds the whole model. Otherwise the whole model is materialised here.
        shard_delayed = delayed is not None and cfg.sdp > 1 and cfg.tp == 1
        targets = delayed[0].targets(module) if delayed is not None and shard_delayed else None
        if delayed is not None and not shard_delayed:
            materialize_named(module, ctx.device, None, delayed[1])
        if delayed is None:
            self._prepare_weights(module, broadcast_weights)
        self._distribute_experts(module)
        self.module = self._parallelize(module)
        config, options = checkpoint_options(self.module)
        checkpoint_in_place(self.module, config, options)
        self._microbatches = cfg.microbatches
        # Activation offloading without a pipeline: the checkpoints' inputs of the running
        # microbatch wait on the host until its backward (which follows its forward here).
        self._forward: tuple[int, int] | None = None  # (step, microbatch) while forwarding
        self._steps = 0
        self.offloader = (
            ActivationOffloader(cfg.activation_loading_horizon, lambda: self._forward)
            if cfg.offload_activations
            else None
        )
        # Sharded data parallelism: FSDP2 units over this rank's sharding mesh (collective).
        self.shard_plan = (
            sharded.shard_module(self.module, ctx, tp_glue.is_distributed_module)
            if cfg.sdp > 1
            else None
        )
        if shard_delayed:
            assert delayed is not None and targets is not None
            fill_shards(self.module, targets, delayed[0], ctx.device, delayed[1])

    @property
    def partitioned(self) -> bool:
        return True

    @property
    def watched(self) -> bool:
        # With tensor parallelism (or FSDP2's gathers, the experts' all-to-alls, the ring
        # attention's exchanges) a failing rank could leave peers inside a collective of the step.
        cfg = self.ctx.config
        return (cfg.tp > 1 or cfg.sdp > 1 or cfg.ep > 1 or cfg.cp > 1) and self.ctx.size > 1

    def load_full_state(self, sd: dict[str, torch.Tensor], strict: bool) -> Any:
        if self.shard_plan is not None and self.ctx.config.tp == 1:
            sharded.load_full(self.module, dict(sd), strict)  # slices locally: no communication
            return None
        if self.shard_plan is not None:
            # smp-tp slices its shards out of plain parameters; FSDP2 slices those again.
            with sharded.gathered(self.module, write_back=True):
                return super().load_full_state(sd, strict)
        return super().load_full_state(sd, strict)

    def run_microbatches(self, fn: Callable[..., Any], microbatches: Microbatches) -> list[Any]:
        cfg = self.ctx.config
        results: list[Any] = []

        self._steps += 1

        def run() -> None:
            with offloading(self.offloader):  # (thread-local: the watch may use a helper)
                for mb, (args, kwargs) in enumerate(microbatches):
                    self._forward = (self._steps, mb)
                    try:
                        with autocast_context(cfg.fp16, cfg.bf16, self.ctx.device):
                            results.append(fn(*args, **kwargs))
                    finally:
                        self._forward = None
                if self.shard_plan is not None and self.shard_plan.agreement is not None:
                    # A rank whose data skipped a unit its peers still gather must not leave
                    # them waiting: the step's end is agreed on too (smp_torch.sharded_agree).
                    self.shard_plan.agreement.exchange(END, -1)

        if self.watched:
            self.ctx.watch.run(run)
        else:
            run()
        return results

    def backward(
        self, tensors: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], loss_scale: float
    ) -> None:
        scale = 1.0 / self._microbatches
        scale *= loss_scale
        if self.offloader is not None and self._forward is not None:
            self.offloader.backward_started(*self._forward)  # its tensors come back now
            self._forward = None  # recomputation keeps its tensors
        torch.autograd.backward(tensors, tuple(g * scale for g in grads))
