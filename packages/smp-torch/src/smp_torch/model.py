"""``smp.DistributedModel``: the wrapped model — partitioned, tensor-parallel, data-parallel.

Wrapping chooses one engine (:mod:`smp_torch.engine`) for the whole life of the model:
:class:`~smp_torch.engine.LocalEngine` with ``pipeline_parallel_degree == 1``,
:class:`~smp_torch.pipeline.PipelineEngine` otherwise. The engine

1. materialises ``meta`` parameters (delayed initialisation) or broadcasts rank 0's weights
   to every rank, so all replicas start identical;
2. with ``pipeline_parallel_degree > 1``: partitions the module tree across the pipeline
   (auto, or the ``smp.partition`` marks) and hands it to smp-pipeline's runtime;
3. with ``tensor_parallel_degree > 1``: replaces the modules marked for tensor parallelism
   with smp-tp's distributed modules (they hold slices of the original weights);
4. applies activation checkpointing (smp-pipeline's implementation, at every degree).

Once parameters are assigned to stages the model builds the data-parallel gradient reducer
(:mod:`smp_torch.grads`) over the parameters this rank owns. A step (:meth:`DistributedModel.run_step`)
is: reducer armed → the engine runs the microbatches → every rank agrees on the outcome
(:meth:`smp_torch.context.SMPContext.agree`) → the data-parallel phase finishes.

``model.parameters()`` yields only the parameters this rank owns (its pipeline stage, its
tensor-parallel shards): build the optimizer from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import smp_tp
import torch
import torch.distributed as dist
from smp_partition.render import svg, table
from torch import nn

from smp_torch import sharded, tp_glue
from smp_torch.config import TRACE_DEVICES
from smp_torch.consistency import StepInputs, check_tp_inputs
from smp_torch.context import SMPContext, StepOutcome
from smp_torch.context_parallel import SequenceSplit, full_sequence_loss
from smp_torch.context_parallel import install as install_context_parallel
from smp_torch.context_parallel import route_layers as route_attention_layers
from smp_torch.context_parallel import splitter as sequence_splitter
from smp_torch.engine import Engine, LocalEngine, Microbatches
from smp_torch.errors import ConfigError, SMPError
from smp_torch.grads import GradReducer, GradSpec
from smp_torch.inert import has_checkpointed_module, inert_settings, warn_inert
from smp_torch.pipeline import PipelineEngine
from smp_torch.report import ModelReport, build_report, tell
from smp_torch.sharded_tp import TPShardedGrads
from smp_torch.stall_report import register_model
from smp_torch.state import state
from smp_torch.weights import has_meta

__all__ = ["DistributedModel", "current_model"]

_CURRENT: DistributedModel | None = None


def current_model() -> DistributedModel:
    """The most recently created :class:`DistributedModel` (the one ``@smp.step`` drives)."""
    if _CURRENT is None:
        raise SMPError("create an smp.DistributedModel before calling an @smp.step function")
    return _CURRENT


class DistributedModel(nn.Module):
    """Wrap ``module`` for pipeline, tensor and data parallelism (see the module docstring).

    Args:
        module: the model, built identically on every rank (or under
            ``smp.delay_param_initialization()``).
        trace_device: ``"cpu"``, ``"meta"`` or ``"cuda"``: where the partitioner's trace runs
            (defaults to the config's ``trace_device``; rank 0's value is used on every rank).
            ``"cpu"``: the first step's trace runs on the host and only this rank's modules move
            to its device afterwards; ``"meta"``: nothing is traced, the model is partitioned at
            wrap time from its parameter counts; ``"cuda"``: the whole model moves to the
            device for the trace (a model that fits one device).
        broadcast_weights: start every replica from rank 0's weights (default True).
        bucket_bytes: size of the data-parallel gradient buckets.
        overlap_grad_reduction: start each data-parallel bucket's all-reduce as soon as its
            gradients are final (default); False reduces everything after the step.
        sequence_inputs: with ``context_parallel_degree`` > 1, more call arguments to split
            along the sequence (``{name: axis}``), beside the defaults of
            :data:`smp_torch.context_parallel.SEQUENCE_INPUTS` (labels and position ids
            are always handled); an error without context parallelism.

    Any other keyword raises ``TypeError`` (a misspelt option is never silently ignored);
    job-wide settings belong in the ``smp.init`` configuration.
    """

    def __init__(
        self,
        module: nn.Module,
        trace_device: str | None = None,
        broadcast_weights: bool = True,
        bucket_bytes: int = 4 << 20,
        overlap_grad_reduction: bool = True,
        sequence_inputs: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        global _CURRENT
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedModel wraps an nn.Module, got {type(module).__name__}")
        ctx = state()
        cfg = ctx.config
        self.context: SMPContext = ctx
        self._cfg = cfg
        self._trace_device = trace_device or cfg.trace_device
        if self._trace_device not in TRACE_DEVICES:
            raise ConfigError("trace_device", f"must be one of {TRACE_DEVICES}, got {self._trace_device!r}")
        self._in_step = False
        self._backward_calls = 0
        self._loss_scale: Callable[[], float] | None = None
        self._owned_names: set[str] | None = None  # None: every parameter is local
        self._bucket_bytes = bucket_bytes
        self._overlap = overlap_grad_reduction
        self._reducer: GradReducer | None = None
        self._tp_sharded: TPShardedGrads | None = None
        self._report: ModelReport | None = None
        self._orig_param_names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
        if has_meta(module) and not cfg.delayed_parameter_initialization:
            raise SMPError(
                "the module has meta-device parameters; set "
                "'delayed_parameter_initialization': True in the smp config"
            )
        self._sequence: SequenceSplit | None = None
        routed = 0
        if cfg.cp > 1:
            # (Before the engine: the pipeline's trace already runs the split model.)
            routed = install_context_parallel(
                module, ctx.process_groups["cp"], cfg.cp, cfg.context_parallel_attention, cfg.tp
            )
        elif sequence_inputs:
            raise ConfigError("context_parallel_degree", "sequence_inputs needs context_parallel_degree > 1")
        # Read before the engine rewraps modules; told after it accepted the configuration.
        inert = inert_settings(cfg, ctx.device.type, has_checkpointed_module(module))
        engine_cls = PipelineEngine if cfg.pp > 1 else LocalEngine
        # (The engines start with collectives: wait for the ranks still building theirs.)
        ctx.watch.arrive("in smp.DistributedModel(), waiting for the other ranks' models")
        self.engine: Engine = engine_cls(ctx, module, broadcast_weights, self._trace_device)
        self.module = self.engine.module
        if cfg.cp > 1:  # (the attention layers and the loss as tensor parallelism left them)
            route_attention_layers(self.module, ctx.process_groups["cp"], cfg.cp, routed)
            causal_lm = full_sequence_loss(self.module, ctx.process_groups["cp"])
            self._sequence = sequence_splitter(self.module, ctx.index("cp"), cfg.cp, causal_lm, sequence_inputs)
        register_model(self.module)  # (stall reports name its modules)
        self.engine.on_partitioned(self._after_partition)
        self.engine.start()
        warn_inert(inert, ctx.rank)
        _CURRENT = self

    def _after_partition(self) -> None:
        """Keep only this stage's parameters; build the data-parallel reducer over them;
        report what smp did to the model (collective: every rank is here)."""
        self._owned_names = self.engine.owned_parameter_names()
        self._reducer = self._build_reducer()
        self._make_report()
        if self._cfg.sdp > 1 and self._cfg.tp > 1:
            ctx = self.context
            cuda = ctx.device.type == "cuda"
            self._tp_sharded = TPShardedGrads(
                [p for p in self.parameters() if p.requires_grad],
                ctx.process_groups["tp"],
                self._cfg.tp,
                wait=lambda work: ctx.watch.wait_work(work, cuda),
            )

    def _make_report(self) -> None:
        ctx, cfg = self.context, self._cfg
        runtime = getattr(self.engine, "runtime", None)
        stages = dict(runtime.assignment) if runtime is not None and runtime.assignment else None
        plan = getattr(self.engine, "shard_plan", None)
        world = ctx.mpi_comms["world"]
        self._report = build_report(
            self.module, self.engine.tp_decisions, stages, list(plan.units) if plan is not None else None,
            (cfg.pp, cfg.tp, cfg.sdp, cfg.rdp), world.allgather,
        )
        tell(self._report, ctx.rank, cfg.print_report, cfg.timeline)

    def report(self) -> ModelReport:
        """What smp did to the model: per module, its pipeline stage, tensor-parallel
        treatment (with the reason), sharded data-parallel unit and parameter bytes per rank.

        The same on every rank. Available once parameters are assigned to stages: at once
        with ``pipeline_parallel_degree`` 1 (or a partition known at wrap time), after the
        first step otherwise. ``str(model.report())`` is a table; rank 0 prints it once when
        the ``print_report`` config key is set, and writes it next to the timeline
        (``<timeline>.report.txt`` and ``.report.json``) when ``timeline`` is.

        Raises:
            SMPError: before the model is partitioned (the first step partitions it).
        """
        if self._report is None:
            raise SMPError("the model is partitioned on its first step: call report() after it")
        return self._report

    def on_partitioned(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once parameters are assigned to pipeline stages (at once if they
        already are, as always with pp=1): ``parameters()`` then yields this stage's only."""
        self.engine.on_partitioned(callback)

    def set_loss_scale(self, scale: Callable[[], float] | float | None) -> None:
        """Multiply every ``backward`` by ``scale`` (a number, or a function read at each
        backward, e.g. a dynamic fp16 loss scaler's); None removes it."""
        if scale is None or callable(scale):
            self._loss_scale = scale
        else:
            value = float(scale)
            self._loss_scale = lambda: value

    @property
    def partitioned(self) -> bool:
        """Whether parameters have been assigned to pipeline stages (always, with pp=1)."""
        return self.engine.partitioned

    @property
    def grad_reducer(self) -> GradReducer | None:
        """The data-parallel gradient reducer (None without data parallelism)."""
        return self._reducer

    def partition_table(self) -> str | None:
        """smp-partition's per-stage table of the automatic partition (world rank 0; else
        ``None``, as with pp=1 or manual partitioning)."""
        report = self.engine.partition_report
        if report is None:
            return None
        return table(report[1], title=f"smp: {type(self.module).__name__} on {self._cfg.pp} pipeline stages")

    def write_partition_svg(self, path: str) -> bool:
        """Draw the automatic partition (the module tree coloured by stage) as SVG; world
        rank 0 only. Returns whether a file was written."""
        report = self.engine.partition_report
        if report is None:
            return False
        with open(path, "w", encoding="utf-8") as f:
            f.write(svg(report[0], report[1], title=type(self.module).__name__))
        return True

    def offload_stats(self) -> dict[str, int] | None:
        """This rank's activation-offloading counters (``offload_activations``; see
        ``smp_pipeline.OffloadStats``), or None without offloading."""
        offloader = self.engine.offloader
        return None if offloader is None else offloader.stats.as_dict()

    def reset_timeline(self) -> None:
        """Forget the timeline recorded so far on this rank (e.g. to keep only late steps)."""
        self.engine.reset_timeline()

    def write_timeline(self, json_path: str | None = None, png_path: str | None = None) -> Any:
        """Collective over the pipeline: gather the recorded request timeline on pp rank 0
        and return its events there (None on the other pp ranks).

        Needs the ``timeline`` config key; paths default to ``<timeline>.json`` / ``.png``.
        Every data-, tensor- and context-parallel replica runs a pipeline of its own; only the
        first one (the pipeline of world rank 0) writes the default paths, since they would
        all write the same files. The others write only paths given to them (e.g. one per
        ``smp.dp_rank()``) and return their events.
        """
        if self._cfg.pp == 1:
            raise SMPError("the request timeline exists only with pipeline parallelism")
        if not self._cfg.timeline:
            raise SMPError("set the 'timeline' config key to record a timeline")
        if 0 not in self.context.groups["pp"]:
            # Not world rank 0's pipeline: at pp = 2 x dp = 2 both pipelines wrote the
            # default <timeline>.json at once and the file came out as neither's JSON.
            return self.engine.write_timeline(json_path, png_path)
        base = self._cfg.timeline
        base = base[:-5] if base.endswith(".json") else base
        return self.engine.write_timeline(json_path or base + ".json", png_path or base + ".png")

    def _build_reducer(self) -> GradReducer | None:
        ctx, cfg = self.context, self._cfg
        if not cfg.ddp or (cfg.rdp == 1 and cfg.tp == 1 and cfg.cp == 1):
            return None
        if cfg.sdp > 1:
            return None  # FSDP2 reduce-scatters (and all-reduces across sharding groups)
        # ddp=False with tp > 1 is rejected by the config, so TP scaling always happens here.
        specs: list[GradSpec] = []
        experts = _expert_param_ids(self.module)
        for _, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if id(p) in experts:
                # Expert parallelism: this slice already holds the sum over its ep group's
                # ranks of their losses' gradients (smp_tp.layers.experts). Summed over the
                # ranks holding the same experts (one per ep group and TP rank: TP peers feed
                # their own samples to the replicated experts) it is the sum over every
                # data-parallel rank's loss, and smp's loss is their mean: divide by dp.
                dp = cfg.rdp * cfg.tp
                specs.append(GradSpec(p, ctx.process_groups["edp"], dp // cfg.ep, float(dp)))
            # Context parallelism: each cp rank's gradient is its tokens' share of the
            # full-sequence gradient (smp_torch.context_parallel), so the groups span cp
            # and the divisors do not: summed over cp, averaged over data parallelism.
            elif cfg.tp > 1 and tp_glue.is_distributed(p):
                divisor = cfg.rdp / tp_glue.grad_scale(p)
                specs.append(GradSpec(p, ctx.process_groups["rdp_cp"], cfg.rdp * cfg.cp, float(divisor)))
            else:
                dp = cfg.rdp * cfg.tp
                specs.append(GradSpec(p, ctx.process_groups["dp_cp"], dp * cfg.cp, float(dp)))
        cuda = ctx.device.type == "cuda"
        return GradReducer(
            specs,
            ctx.process_groups["dp_cp"],
            bucket_bytes=self._bucket_bytes,
            overlap=self._overlap,
            register_hook=self.engine.register_grad_hook,
            wait=lambda work: ctx.watch.wait_work(work, cuda),
            device=ctx.device,
        )

    # -- parameters ----------------------------------------------------------------------

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in the wrapped module (no ``module.`` prefix)."""
        for name, p in self.module.named_parameters(
            prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate
        ):
            if self._owned_names is None or name in self._owned_names:
                yield name, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        """This rank's parameters (its pipeline stage, its tensor-parallel shards)."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's shares of the routed experts (``expert_parallel_degree`` > 1; else
        empty): split over the ep group, each rank holding different values."""
        ids = _expert_param_ids(self.module)
        return [p for p in self.parameters() if id(p) in ids]

    def full_param_names(self) -> list[str]:
        """Parameter names of the original, unwrapped module (tied aliases included)."""
        return list(self._orig_param_names)

    def owns_full_key(self, key: str) -> bool:
        """Whether this rank's pipeline stage holds the unwrapped model's entry ``key``."""
        return self.engine.owns_full_key(key)

    def local_parameters(self) -> list[nn.Parameter]:
        return list(self.parameters())

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__["_modules"].get("module")
            if module is None:
                raise
            return getattr(module, name)

    # -- forward / backward / step -------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._cfg.pp > 1 and not self._in_step:
            raise SMPError("with pipeline parallelism, call the model inside an @smp.step")
        if self._sequence is not None:
            args, kwargs = self._sequence.split(args, kwargs)
        return self.module(*args, **kwargs)

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Backward from ``tensors`` (the loss) for the current microbatch.

        Replaces ``loss.backward()`` inside an ``@smp.step`` function. The gradient is scaled
        by ``1/microbatches`` (so the step's gradient is that of the mean over the batch) and
        by the fp16 loss scale.
        """
        if not self._in_step:
            raise SMPError("model.backward must be called inside an @smp.step function")
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
            if grad_tensors is not None and isinstance(grad_tensors, torch.Tensor):
                grad_tensors = (grad_tensors,)
        tensors = tuple(tensors)
        if grad_tensors is None:
            grad_tensors = tuple(torch.ones_like(t) for t in tensors)
        scale = self._loss_scale() if self._loss_scale is not None else 1.0
        self._backward_calls += 1
        self.engine.backward(tensors, tuple(grad_tensors), scale)

    def run_step(
        self, fn: Callable[..., Any], microbatches: Microbatches, inputs: StepInputs | None = None
    ) -> list[Any]:
        """Run ``fn`` once per microbatch (through the engine), agree on the outcome with
        every rank, then finish the data-parallel reduction. What ``@smp.step`` calls.

        ``inputs``: what the ranks' arguments must agree on (:mod:`smp_torch.consistency`):
        checked before the step over the tensor-parallel group, and by the agreement across
        data-parallel ranks.

        Raises :class:`~smp_torch.errors.PeerFailedError` at once if another rank failed
        (before or during the step), naming it (see :mod:`smp_torch.watch`)."""
        if self._in_step:
            raise SMPError("@smp.step functions cannot be nested")
        watch = self.context.watch
        n = watch.begin_step()
        label = f"in step {n}, {self.engine.step_label}"
        self._in_step = True
        self._backward_calls = 0
        error: BaseException | None = None
        results: list[Any] = []
        # Only the ranks that run the step function (pipeline stage 0) use their arguments.
        runs_fn = inputs is not None and self.context.index("pp") == 0
        try:
            with watch.waiting(label):
                if runs_fn and self._cfg.tp > 1:
                    assert inputs is not None
                    check_tp_inputs(watch, self.context.mpi_comms["tp"], inputs, n)
                self.engine.prepare_step(fn, microbatches)
                if self._reducer is not None:
                    self._reducer.begin()
                results = self.engine.run_microbatches(fn, microbatches)
        except BaseException as exc:  # noqa: BLE001 - shared with every rank below
            error = exc
        finally:
            self._in_step = False
        outcome = StepOutcome(
            error, self._backward_calls, self.engine.watched, label, inputs if runs_fn else None
        )
        try:
            backward_ran = self.context.agree(outcome)
            with watch.waiting(f"in step {n}, reducing sharded gradients over data-parallel ranks"):
                self.engine.finish_step(backward_ran)
            if self._reducer is not None and backward_ran:
                with watch.waiting(f"in step {n}, reducing gradients over data-parallel ranks"):
                    self._reducer.finish()
            if self._tp_sharded is not None and backward_ran:
                with watch.waiting(f"in step {n}, averaging gradient shards over tensor-parallel ranks"):
                    self._tp_sharded.finish()
        except BaseException:
            if self._reducer is not None:
                self._reducer.disarm()
            raise
        if self._reducer is not None and not backward_ran:
            self._reducer.disarm()
        return results

    # -- state -----------------------------------------------------------------------------

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers (its stage, its TP shards), wrapped names."""
        sd = self.module.state_dict()
        keys = set(self.local_state_dict_keys())
        # Sharded data parallelism: this rank's shards (plain tensors).
        return {k: sharded.local_tensor(v).detach().clone() for k, v in sd.items() if k in keys}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The full model's state dict, gathered over pipeline and tensor-parallel ranks.

        Its keys and shapes are those of the original, unwrapped module, so it loads into it
        with ``strict=True``. Every rank receives the whole dict (on CPU).
        """
        if args or kwargs:
            raise TypeError("DistributedModel.state_dict() takes no arguments")
        return self.engine.merge_stages(self.stage_full_state())

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's gradients, gathered: ``{key: gradient}`` in the unwrapped
        module's layout, like :meth:`state_dict` for weights.

        The keys are those of the original module's parameters (tied parameters under each of
        their keys, as in its ``state_dict()``), the shapes its parameters' shapes: each
        pipeline stage contributes the parameters it owns, tensor-parallel shards are
        concatenated and sharded data-parallel shards gathered. Call it after a step (and
        before ``optimizer.zero_grad()``): the values are what ``.grad`` holds then — already
        averaged over data-parallel ranks, so equal to one process's gradient on the global
        batch, and still multiplied by the loss scale under ``fp16`` until the optimizer
        step unscales them. Parameters without a gradient are left out. Every rank receives
        the whole dict (on CPU); a collective over the job, so every rank must call it. The
        counterpart of DeepSpeed's ``safe_get_full_grad`` for the whole model at once.

        Raises:
            NotImplementedError: with both sharded data parallelism and tensor parallelism.
        """
        cfg = self._cfg
        if cfg.sdp > 1 and cfg.tp > 1:
            raise NotImplementedError(
                "full_grad_dict() with sharded_data_parallel_degree > 1 and "
                "tensor_parallel_degree > 1 is not supported yet"
            )
        if cfg.tp > 1:
            grads = smp_tp.full_grad_dict(self.module)
        else:
            grads = {}
            # Same order on every rank of a stage: the sharded gathers below match.
            for key, p in self.module.named_parameters(remove_duplicate=False):
                if p.grad is not None and self.owns_full_key(key):
                    g = p.grad
                    grads[key] = g.full_tensor() if sharded.is_sharded(g) else g
        if cfg.ep > 1:
            grads = {**grads, **self._full_experts(grads=True)}  # (zeros for none)
        part = {k: g.detach().to("cpu").clone() for k, g in grads.items() if self.owns_full_key(k)}
        return self.engine.merge_stages(part)

    def stage_full_state(self) -> dict[str, torch.Tensor]:
        """This pipeline stage's entries of the full state dict (TP shards gathered)."""
        if self._cfg.sdp > 1 and self._cfg.tp == 1:
            return sharded.full_state(self.module, self.owns_full_key)
        if self._cfg.sdp > 1:
            # Gather FSDP2's shards into plain parameters, then smp-tp's slices over TP.
            with sharded.gathered(self.module):
                full = tp_glue.full_state_dict(self.module, self._cfg.tp)
                return {k: v.detach().to("cpu").clone() for k, v in full.items() if self.owns_full_key(k)}
        full = tp_glue.full_state_dict(self.module, self._cfg.tp)
        if self._cfg.ep > 1:
            # The experts' shares gathered over the ep group, under the unwrapped keys.
            full = {**full, **self._full_experts(grads=False)}
        return {k: v.detach().to("cpu").clone() for k, v in full.items() if self.owns_full_key(k)}

    def _full_experts(self, grads: bool) -> dict[str, torch.Tensor]:
        """Collective over the ep groups: this stage's experts (or their gradients) gathered
        to the full ``[E, ...]`` tensors under the unwrapped keys. Only the experts this
        pipeline stage owns: the other stages' are empty stand-ins here (the ranks of an ep
        group share a stage, so they gather the same modules in the same order)."""
        out: dict[str, torch.Tensor] = {}
        gather = smp_tp.full_expert_grads if grads else smp_tp.full_expert_state
        for name, m in self.module.named_modules():
            if isinstance(m, smp_tp.ExpertParallelExperts) and self.owns_full_key(f"{name}.gate_up_proj"):
                out.update({f"{name}.{k}": v for k, v in gather(m).items()})
        return out

    def expert_shares(self) -> dict[str, ExpertShare]:
        """Full (unwrapped) key → this rank's share of every expert parameter
        (``expert_parallel_degree`` > 1; else empty), in the same order on every rank."""
        out = {}
        for name, m in self.module.named_modules():
            if isinstance(m, smp_tp.ExpertParallelExperts):
                share = ExpertShare(m.first_expert, m.num_local_experts, m.num_experts)
                for pname in ("gate_up_proj", "down_proj"):
                    out[f"{name}.{pname}" if name else pname] = share
        return out

    def _slice_experts(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full state dict's expert entries cut to this rank's share (entries already of
        the share's shape, a local dict's, stay)."""
        out = dict(sd)
        for key, share in self.expert_shares().items():
            if key in out:
                out[key] = share.rows(out[key])
        return out

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> Any:
        """Load either a full (unwrapped-model) or a local (this rank's) state dict."""
        if self._cfg.ep > 1:
            state_dict = self._slice_experts(state_dict)
        local_keys = set(self.local_state_dict_keys())
        keys = set(state_dict)
        if self._cfg.sdp > 1 and keys == local_keys and self._is_shard_form(state_dict):
            with torch.no_grad():
                mine = self.module.state_dict()
                for k, v in state_dict.items():
                    sharded.local_tensor(mine[k]).copy_(v)
            return None
        if self._cfg.sdp > 1:
            return self.engine.load_full_state(dict(state_dict), strict)
        if keys == local_keys and self._is_local_form(state_dict):
            return self.module.load_state_dict(state_dict, strict=False)
        return self.engine.load_full_state(dict(state_dict), strict)

    def local_state_dict_keys(self) -> list[str]:
        sd = self.module.state_dict()
        owned = self.engine.owned_state_names()
        return [k for k in sd if owned is None or k in owned]

    def _is_shard_form(self, sd: dict[str, torch.Tensor]) -> bool:
        # This rank's shards: every entry has its local shard's shape, and some shard is
        # smaller than its parameter. (A full form's entry may differ from both: with tensor
        # parallelism its shape is the unwrapped model's, larger than the TP slice.)
        mine = self.module.state_dict()
        common = [(v, mine[k]) for k, v in sd.items() if k in mine]
        return all(
            tuple(v.shape) == tuple(sharded.local_tensor(t).shape) for v, t in common
        ) and any(
            sharded.is_sharded(t) and tuple(sharded.local_tensor(t).shape) != tuple(t.shape)
            for _, t in common
        )

    def _is_local_form(self, sd: dict[str, torch.Tensor]) -> bool:
        mine = self.module.state_dict()
        return all(tuple(mine[k].shape) == tuple(v.shape) for k, v in sd.items() if k in mine)

    # -- misc --------------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the norm of the *whole* model's gradient (all stages and shards).

        Call after the step, before ``optimizer.step()``. Returns the total norm (float32, on
        ``ctx.device``). Like ``torch.nn.utils.clip_grad_norm_``, the sums, the norm and the
        coefficient ``min(1, max_norm / (norm + 1e-6))`` stay on the device (the collectives
        need them there: NCCL takes no host tensor) and every gradient is multiplied by it:
        no device-to-host sync.
        """
        ctx, cfg = self.context, self._cfg
        plan = getattr(self.engine, "shard_plan", None)
        if plan is not None:
            return sharded.clip_grad_norm(
                list(self.parameters()),
                max_norm,
                plan.shard_group,
                norm_type,
                tp_group=ctx.process_groups["tp"] if cfg.tp > 1 else None,
                tp_shard=tp_glue.is_shard,
                pp_group=ctx.process_groups["pp"] if cfg.pp > 1 else None,
                device=ctx.device,
            )
        local = torch.zeros((), dtype=torch.float64, device=ctx.device)
        distributed = torch.zeros((), dtype=torch.float64, device=ctx.device)
        expert = torch.zeros((), dtype=torch.float64, device=ctx.device)
        experts = _expert_param_ids(self.module)
        for p in self.parameters():
            if p.grad is None:
                continue
            value = p.grad.detach().double().norm(norm_type) ** norm_type
            if id(p) in experts:
                expert += value
            elif cfg.tp > 1 and tp_glue.is_shard(p):
                distributed += value
            else:
                local += value
        # Shards add up over the TP group; replicated params are counted once (TP rank 0's copy).
        if cfg.tp > 1:
            dist.all_reduce(distributed, group=ctx.process_groups["tp"])
        if cfg.ep > 1:
            # Each expert is held by one rank of the ep group: its shares add up over it.
            dist.all_reduce(expert, group=ctx.process_groups["ep"])
        total = local + distributed + expert
        if cfg.pp > 1:
            dist.all_reduce(total, group=ctx.process_groups["pp"])
        norm = total ** (1.0 / norm_type)
        sharded.scale_grads([p.grad for p in self.parameters() if p.grad is not None], max_norm, norm)
        return norm.float()


@dataclass(frozen=True)
class ExpertShare:
    """The experts ``first .. first + count - 1`` of ``experts``, held by this rank."""

    first: int
    count: int
    experts: int

    def is_share(self, value: Any) -> bool:
        """Whether ``value`` holds this share's rows (a per-element tensor of the share)."""
        return torch.is_tensor(value) and value.dim() == 3 and value.shape[0] == self.count != self.experts

    def rows(self, value: Any) -> Any:
        """This share's rows of a full ``[experts, ...]`` per-element tensor; anything else
        (a share already, a scalar) unchanged."""
        full = torch.is_tensor(value) and value.dim() == 3 and value.shape[0] == self.experts != self.count
        return value[self.first : self.first + self.count] if full else value


def _expert_param_ids(module: nn.Module) -> set[int]:
    """The ``id`` of every parameter of ``module``'s expert-parallel experts (their shares)."""
    return {
        id(p)
        for m in module.modules()
        if isinstance(m, smp_tp.ExpertParallelExperts)
        for p in m.parameters()
    }

