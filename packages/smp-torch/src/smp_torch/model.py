"""``smp.DistributedModel``: the wrapped model — partitioned, tensor-parallel, data-parallel.

Wrapping does, in order:

1. materialise ``meta`` parameters (delayed initialisation) or broadcast rank 0's weights to
   every rank, so all replicas start identical;
2. with ``pipeline_parallel_degree > 1``: trace and partition the module tree across the
   pipeline (auto, or the ``smp.partition`` marks) and hand it to smp-pipeline's runtime;
3. with ``tensor_parallel_degree > 1``: replace the modules marked for tensor parallelism with
   smp-tp's distributed modules (they hold slices of the original weights);
4. register the data-parallel gradient reducer on the parameters this rank owns.

``model.parameters()`` yields only the parameters this rank owns (its pipeline stage, its
tensor-parallel shards): build the optimizer from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from smp_tp import checkpoint_context as tp_checkpoint_context
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from smp_torch import tp_glue
from smp_torch.annotations import get_checkpoint_mark
from smp_torch.errors import SMPError
from smp_torch.grads import GradReducer, GradSpec
from smp_torch.precision import autocast_context
from smp_torch.state import state

__all__ = ["DistributedModel", "current_model"]

_CURRENT: DistributedModel | None = None


def current_model() -> DistributedModel:
    """The most recently created :class:`DistributedModel` (the one ``@smp.step`` drives)."""
    if _CURRENT is None:
        raise SMPError("create an smp.DistributedModel before calling an @smp.step function")
    return _CURRENT


def _broadcast_tensors(tensors: list[torch.Tensor], src: int, group: Any) -> None:
    """Broadcast tensors from global rank ``src``, one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for _, ts in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad():
            for t in ts:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def _module_tensors(module: nn.Module) -> list[torch.Tensor]:
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen and not t.is_meta:
            seen.add(id(t))
            out.append(t)
    return out


def materialize_meta(module: nn.Module, device: torch.device, seed: int) -> None:
    """Give every ``meta`` parameter real storage and initialise it with ``reset_parameters``.

    Runs with a private RNG seeded by ``seed`` so every rank initialises identically.
    """
    metas = [
        m
        for m in module.modules()
        if any(t.is_meta for t in m._parameters.values() if t is not None)
        or any(t.is_meta for t in m._buffers.values() if t is not None)
    ]
    if not metas:
        return
    for m in metas:
        has_direct = any(p is not None for p in m._parameters.values())
        if has_direct and not hasattr(m, "reset_parameters"):
            raise SMPError(
                f"module {type(m).__name__} was created under delay_param_initialization but "
                "has no reset_parameters() to initialise its parameters after materialisation"
            )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in metas:
            m.to_empty(device=device, recurse=False)
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()


def _checkpoint_groups(children: list[nn.Module], strategy: str) -> list[list[nn.Module]]:
    if strategy == "each":
        return [[c] for c in children]
    if strategy == "contiguous":
        return [children] if children else []
    n = int(strategy.split("_", 1)[1])
    return [children[i : i + n] for i in range(0, len(children), n)]


def _rng_context(preserve_rng_state: bool) -> Any:
    """Recomputation replays smp-tp's tensor-parallel dropout streams too (torch restores
    only its default generators), unless the user asked not to preserve RNG state."""
    return tp_checkpoint_context if preserve_rng_state else noop_context_fn


def apply_activation_checkpointing(root: nn.Module) -> int:
    """Wrap the forward of every module marked by ``set_activation_checkpointing``.

    Returns the number of modules wrapped. (With pipeline parallelism smp-pipeline does this
    per stage instead; ``contiguous`` then groups the layers that share a stage.)
    """
    count = 0
    for module in root.modules():
        opts = get_checkpoint_mark(module)
        # Wrapped once (a marker, not "forward in __dict__": smp-tp's Hugging Face adapters
        # give replaced layers an instance-level forward, which must be wrapped too).
        if opts is None or module.__dict__.get("_smp_checkpointed", False):
            continue
        keep_rng = bool(opts["preserve_rng_state"])
        if isinstance(module, nn.Sequential):
            groups = _checkpoint_groups(list(module), opts["strategy"])
            pack = bool(opts["pack_args_as_tuple"])

            def seq_forward(
                x: Any, _groups: Any = groups, _pack: bool = pack, _rng: bool = keep_rng
            ) -> Any:
                for g in _groups:

                    def run(*args: Any, _g: Any = g) -> Any:
                        out: Any = tuple(args) if _pack else args[0]
                        for layer in _g:
                            out = layer(out)
                        return out

                    inputs = tuple(x) if _pack else (x,)
                    x = checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=_rng,
                                   context_fn=_rng_context(_rng))
                return x

            module.forward = seq_forward  # type: ignore[method-assign]
            module.__dict__["_smp_checkpointed"] = True
        else:
            original = module.forward

            def forward(
                *args: Any, _orig: Any = original, _rng: bool = keep_rng, **kwargs: Any
            ) -> Any:
                return checkpoint(
                    _orig, *args, use_reentrant=False, preserve_rng_state=_rng,
                    context_fn=_rng_context(_rng), **kwargs,
                )

            module.forward = forward  # type: ignore[method-assign]
            module.__dict__["_smp_checkpointed"] = True
        count += 1
    return count


class DistributedModel(nn.Module):
    """Wrap ``module`` for pipeline, tensor and data parallelism (see the module docstring).

    Args:
        module: the model, built identically on every rank (or under
            ``smp.delay_param_initialization()``).
        trace_device: ``"cpu"`` or ``"cuda"``: where the partitioner's trace runs (defaults to
            the config's ``trace_device``).
        broadcast_weights: start every replica from rank 0's weights (default True).
        bucket_bytes: size of the data-parallel gradient buckets.
    """

    def __init__(
        self,
        module: nn.Module,
        trace_device: str | None = None,
        broadcast_weights: bool = True,
        bucket_bytes: int = 4 << 20,
        **unused: Any,
    ) -> None:
        super().__init__()
        global _CURRENT
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedModel wraps an nn.Module, got {type(module).__name__}")
        s = state()
        cfg = s.config
        self.module = module
        self._cfg = cfg
        self._device = s.device
        self._trace_device = trace_device or cfg.trace_device
        self._in_step = False
        self._backward_calls = 0
        self._microbatch = 0
        self._loss_scale: Callable[[], float] | None = None
        self._pipeline: Any = None
        self._owned_names: set[str] | None = None  # None: every parameter is local
        self._optimizers: list[Any] = []
        self._bucket_bytes = bucket_bytes
        self._reducer: GradReducer | None = None
        # pp = 1 with tensor parallelism: failure notices between ranks (smp_torch.watch).
        self._watch: Any = None

        self._orig_param_names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
        has_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
        if has_meta and not cfg.delayed_parameter_initialization:
            raise SMPError(
                "the module has meta-device parameters; set "
                "'delayed_parameter_initialization': True in the smp config"
            )
        if cfg.pp > 1:
            from smp_torch.pipeline import PipelineBinding

            self._pipeline = PipelineBinding(self, module, broadcast_weights)
        else:
            if has_meta:
                materialize_meta(module, self._device, self._init_seed())
            module.to(self._device)
            if broadcast_weights and s.size > 1:
                _broadcast_tensors(_module_tensors(module), 0, s.process_groups["world"])
            if cfg.tp > 1:
                self.module = tp_glue.parallelize(
                    module, s.process_groups["tp"], cfg.prescaled_batch, cfg.optimize
                )
                self.module.to(self._device)
            apply_activation_checkpointing(self.module)
            if cfg.tp > 1:
                from smp_torch.watch import StepWatch

                self._watch = StepWatch(s.mpi_comms["world"])
        if self._pipeline is None:
            self._reducer = self._build_reducer(bucket_bytes)
        else:
            self._pipeline.start()
        _CURRENT = self

    def _on_partitioned(self) -> None:
        """Called once the pipeline assignment is applied: keep only this stage's parameters."""
        assert self._pipeline is not None
        self._owned_names = self._pipeline.owned_parameter_names()
        self._reducer = self._build_reducer(self._bucket_bytes)
        for opt in self._optimizers:
            opt._after_partition()

    @property
    def partitioned(self) -> bool:
        """Whether parameters have been assigned to pipeline stages (always, with pp=1)."""
        return self._pipeline is None or self._pipeline.partitioned

    def partition_table(self) -> str | None:
        """smp-partition's per-stage table of the automatic partition (world rank 0; else
        ``None``, as with pp=1 or manual partitioning)."""
        report = self._pipeline.partition_report if self._pipeline is not None else None
        if report is None:
            return None
        from smp_partition.render import table

        return table(report[1], title=f"smp: {type(self.module).__name__} on {self._cfg.pp} pipeline stages")

    def write_partition_svg(self, path: str) -> bool:
        """Draw the automatic partition (the module tree coloured by stage) as SVG; world
        rank 0 only. Returns whether a file was written."""
        report = self._pipeline.partition_report if self._pipeline is not None else None
        if report is None:
            return False
        from smp_partition.render import svg

        with open(path, "w", encoding="utf-8") as f:
            f.write(svg(report[0], report[1], title=type(self.module).__name__))
        return True

    def reset_timeline(self) -> None:
        """Forget the timeline recorded so far on this rank (e.g. to keep only late steps)."""
        if self._pipeline is not None:
            self._pipeline.reset_timeline()

    def write_timeline(self, json_path: str | None = None, png_path: str | None = None) -> Any:
        """Collective over the pipeline: write the recorded request timeline (pp rank 0).

        Needs the ``timeline`` config key; paths default to ``<timeline>.json`` / ``.png``.
        """
        if self._pipeline is None:
            raise SMPError("the request timeline exists only with pipeline parallelism")
        if not self._cfg.timeline:
            raise SMPError("set the 'timeline' config key to record a timeline")
        base = self._cfg.timeline
        base = base[:-5] if base.endswith(".json") else base
        return self._pipeline.write_timeline(json_path or base + ".json", png_path or base + ".png")

    # -- construction helpers ------------------------------------------------------------

    def _init_seed(self) -> int:
        s = state()
        seed = torch.initial_seed() % (2**31)
        return int(s.mpi_comms["world"].bcast(seed, root=0))

    def _build_reducer(self, bucket_bytes: int) -> GradReducer | None:
        s, cfg = state(), self._cfg
        if not cfg.ddp or (cfg.rdp == 1 and cfg.tp == 1):
            return None
        # ddp=False with tp > 1 is rejected by the config, so TP scaling always happens here.
        specs: list[GradSpec] = []
        for _, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if cfg.tp > 1 and tp_glue.is_distributed(p):
                divisor = cfg.rdp / tp_glue.grad_scale(p)
                specs.append(GradSpec(p, s.process_groups["rdp"], cfg.rdp, float(divisor)))
            else:
                dp = cfg.rdp * cfg.tp
                specs.append(GradSpec(p, s.process_groups["dp"], dp, float(dp)))
        return GradReducer(specs, bucket_bytes=bucket_bytes)

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

    def _full_param_names(self) -> list[str]:
        """Parameter names of the original, unwrapped module (tied aliases included)."""
        return list(self._orig_param_names)

    def _owns_full_key(self, key: str) -> bool:
        """Whether this rank's pipeline stage holds the unwrapped model's entry ``key``."""
        return self._pipeline is None or self._pipeline.owns_full_key(key)

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

    # -- forward / backward --------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            if not self._in_step:
                raise SMPError("with pipeline parallelism, call the model inside an @smp.step")
            return self._pipeline.forward(*args, **kwargs)
        return self.module(*args, **kwargs)

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Backward from ``tensors`` (the loss) for the current microbatch.

        Replaces ``loss.backward()`` inside an ``@smp.step`` function. The gradient is scaled
        by ``1/microbatches`` (so the step's gradient is that of the mean over the batch) and
        by the fp16 loss scale.
        """
        if not self._in_step:
            raise SMPError("model.backward must be called inside an @smp.step function")
        scale = 1.0 / self._cfg.microbatches
        if self._loss_scale is not None:
            scale *= self._loss_scale()
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
            if grad_tensors is not None and isinstance(grad_tensors, torch.Tensor):
                grad_tensors = (grad_tensors,)
        tensors = tuple(tensors)
        if grad_tensors is None:
            grad_tensors = tuple(torch.ones_like(t) for t in tensors)
        grads = tuple(g * scale for g in grad_tensors)
        self._backward_calls += 1
        if self._pipeline is not None:
            self._pipeline.backward(tensors, grads)
        else:
            torch.autograd.backward(tensors, grads)

    def _run_step(
        self, fn: Callable[..., Any], microbatches: list[tuple[tuple[Any, ...], dict[str, Any]]]
    ) -> list[Any]:
        """Run ``fn`` once per microbatch; then reduce gradients over data-parallel ranks."""
        if self._in_step:
            raise SMPError("@smp.step functions cannot be nested")
        self._in_step = True
        self._backward_calls = 0
        if self._pipeline is not None:
            try:
                outputs: list[Any] = self._pipeline.run_step(fn, microbatches)
            finally:
                self._in_step = False
            if self._reducer is not None:
                # Only pp rank 0 sees model.backward calls with a pipeline: always reduce.
                self._reducer.finish()
            return outputs
        if self._watch is not None:
            return self._run_watched_step(fn, microbatches)
        results: list[Any] = []
        error: BaseException | None = None
        try:
            self._run_microbatches(fn, microbatches, results)
        except BaseException as exc:  # noqa: BLE001 - shared with the other ranks below
            error = exc
        finally:
            self._in_step = False
        if self._reducer is None:
            if error is not None:
                raise error
            return results
        # The ranks agree on the outcome (and on whether a backward ran) before waiting for
        # the gradient all-reduce, so an exception on one rank raises on all of them instead
        # of leaving the others waiting for its gradients.
        report = None if error is None else f"rank {state().rank}: {type(error).__name__}: {error}"
        views = state().mpi_comms["world"].allgather((report, self._backward_calls))
        failures = [r for r, _ in views if r]
        if error is not None or failures:
            self._reducer.disarm()
            if error is not None:
                raise error
            raise SMPError(f"the step failed on another rank: {failures[0]}")
        if any(calls for _, calls in views):
            self._reducer.finish()
        else:
            self._reducer.disarm()
        return results

    def _run_microbatches(
        self,
        fn: Callable[..., Any],
        microbatches: list[tuple[tuple[Any, ...], dict[str, Any]]],
        results: list[Any],
    ) -> None:
        """Run ``fn`` per microbatch into ``results``, arming the gradient reduction for the
        last one (pp = 1)."""
        cfg = self._cfg
        for i, (args, kwargs) in enumerate(microbatches):
            self._microbatch = i
            if i == len(microbatches) - 1 and self._reducer is not None:
                self._reducer.arm()
            with autocast_context(cfg.fp16, cfg.bf16, self._device):
                results.append(fn(*args, **kwargs))

    def _run_watched_step(
        self, fn: Callable[..., Any], microbatches: list[tuple[tuple[Any, ...], dict[str, Any]]]
    ) -> list[Any]:
        """pp = 1 with tensor parallelism: the step runs on a helper thread while this thread
        watches for another rank's failure (see :mod:`smp_torch.watch`), so an exception on
        one rank raises on every rank instead of leaving its peers in a collective."""
        from smp_torch.watch import StepFailedElsewhere

        assert self._watch is not None
        results: list[Any] = []
        try:
            self._watch.run(lambda: self._run_microbatches(fn, microbatches, results))
            backward_ran = self._watch.agree(self._backward_calls)
        except StepFailedElsewhere:
            if self._reducer is not None:
                self._reducer.disarm()
            raise
        except BaseException as exc:
            if self._reducer is not None:
                self._reducer.disarm()
            self._watch.notify(exc)
            raise
        finally:
            self._in_step = False
        if self._reducer is not None:
            if backward_ran:
                self._reducer.finish()
            else:
                self._reducer.disarm()
        return results

    # -- state -----------------------------------------------------------------------------

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers (its stage, its TP shards), wrapped names."""
        sd = self.module.state_dict()
        if self._pipeline is None:
            return {k: v.detach().clone() for k, v in sd.items()}
        owned = self._pipeline.owned_state_names()
        return {k: v.detach().clone() for k, v in sd.items() if k in owned}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The full model's state dict, gathered over pipeline and tensor-parallel ranks.

        Its keys and shapes are those of the original, unwrapped module, so it loads into it
        with ``strict=True``. Every rank receives the whole dict (on CPU).
        """
        if args or kwargs:
            raise TypeError("DistributedModel.state_dict() takes no arguments")
        part = self._stage_full_state()
        if self._pipeline is None:
            return part
        from smp_torch.comm import CommGroup, allgather

        merged: dict[str, torch.Tensor] = {}
        for piece in allgather(part, CommGroup.PP_GROUP):
            merged.update(piece)
        return merged

    def _stage_full_state(self) -> dict[str, torch.Tensor]:
        """This pipeline stage's entries of the full state dict (TP shards gathered)."""
        full = tp_glue.full_state_dict(self.module, self._cfg.tp)
        return {k: v.detach().to("cpu").clone() for k, v in full.items() if self._owns_full_key(k)}

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> Any:
        """Load either a full (unwrapped-model) or a local (this rank's) state dict."""
        local_keys = set(self.local_state_dict_keys())
        keys = set(state_dict)
        if keys == local_keys and self._is_local_form(state_dict):
            missing = self.module.load_state_dict(state_dict, strict=False)
            return missing
        if self._pipeline is not None:
            return self._pipeline.load_full_state(state_dict, strict)
        tp_glue.load_full_state_dict(self.module, dict(state_dict), self._cfg.tp, strict)
        return None

    def local_state_dict_keys(self) -> list[str]:
        sd = self.module.state_dict()
        if self._pipeline is None:
            return list(sd)
        owned = self._pipeline.owned_state_names()
        return [k for k in sd if k in owned]

    def _is_local_form(self, sd: dict[str, torch.Tensor]) -> bool:
        mine = self.module.state_dict()
        return all(tuple(mine[k].shape) == tuple(v.shape) for k, v in sd.items() if k in mine)

    # -- misc --------------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the norm of the *whole* model's gradient (all stages and shards).

        Call after the step, before ``optimizer.step()``. Returns the total norm.
        """
        return _clip_grad_norm(self, max_norm, norm_type)


def _clip_grad_norm(model: DistributedModel, max_norm: float, norm_type: float) -> torch.Tensor:
    s, cfg = state(), model._cfg
    local = torch.zeros((), dtype=torch.float64)
    distributed = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        value = p.grad.detach().double().norm(norm_type) ** norm_type
        if cfg.tp > 1 and tp_glue.is_shard(p):
            distributed += value
        else:
            local += value
    # Shards add up over the TP group; replicated params are counted once (TP rank 0's copy).
    if cfg.tp > 1:
        dist.all_reduce(distributed, group=s.process_groups["tp"])
    total = local + distributed
    if cfg.pp > 1:
        dist.all_reduce(total, group=s.process_groups["pp"])
    norm = total ** (1.0 / norm_type)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm.float()
