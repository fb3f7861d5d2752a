"""Pipeline parallelism (``pipeline_parallel_degree > 1``) through smp-pipeline's runtime.

Each pipeline (the ranks of one ``PP_GROUP``) gets an ``smp_comm.Communicator`` and an
``smp_pipeline.PipelineRuntime`` over the *whole* model; pp rank 0 of every pipeline drives
the step function, the other stages serve requests.

Partitioning happens on the first ``@smp.step`` call (``auto_partition``, the default): the
first microbatch of the step is traced on world rank 0 (every pp-rank-0 rank traces together
when tensor-parallel layers need their peers), ``smp_partition`` splits the traced module
tree with ``memory_weight`` as its alpha, and rank 0's assignment is broadcast to every rank,
so every replica and every tensor-parallel peer partitions identically. With
``auto_partition=False`` the ``smp.partition`` / ``smp.set_partition`` marks (unmarked modules
follow their parent, the root ``default_partition``) are applied when the model is wrapped.
A model created under ``smp.delay_param_initialization()`` is partitioned at wrap time from
its parameter counts alone (no trace: there is nothing to run), then only the modules this
rank owns are materialised.

After partitioning, the parameters of modules owned by other stages are freed;
``model.parameters()`` then yields only this stage's, and any ``smp.DistributedOptimizer``
already built over the full list is trimmed to them.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from smp_torch import tp_glue
from smp_torch.annotations import get_checkpoint_mark, get_partition_mark
from smp_torch.errors import SMPError
from smp_torch.precision import autocast_context
from smp_torch.state import state

__all__ = ["PipelineBinding", "static_assignment"]


def _marks(module: nn.Module, default: int) -> dict[str, int]:
    root = get_partition_mark(module)
    marks: dict[str, int] = {"": root if root is not None else default}
    for name, m in module.named_modules():
        mark = get_partition_mark(m)
        if name and mark is not None:
            marks[name] = mark
    return marks


def static_assignment(module: nn.Module, pp: int, alpha: float) -> tuple[dict[str, int], Any]:
    """Partition from parameter counts only (definition order, no times): no forward needed."""
    from smp_partition import ModuleGraph, partition
    from smp_pipeline.assignment import BALANCE_SLACK

    first_name = {id(p): n for n, p in module.named_parameters()}
    paths = {id(m): n for n, m in module.named_modules()}
    modules = []
    for name, m in module.named_modules():
        children: list[str] = []
        for c in m._modules.values():
            if c is not None and paths[id(c)] not in children:
                children.append(paths[id(c)])
        params = {first_name[id(p)]: p.numel() for p in m._parameters.values() if p is not None}
        modules.append(
            {
                "name": name,
                "type": type(m).__name__,
                "children": children,
                "params": params,
                "activation_bytes": 0,
                "forward_ms": None,
            }
        )
    graph = ModuleGraph.from_dict({"schema": "smp-partition/module-graph@1", "modules": modules})
    result = partition(graph, num_devices=pp, alpha=alpha, balance_slack=BALANCE_SLACK)
    return {str(k): int(v) for k, v in result.assignment.items()}, (graph, result)


_ORDER_TAG = 7401


def _runtime_accepts(name: str) -> bool:
    import inspect

    from smp_pipeline import PipelineRuntime

    return name in inspect.signature(PipelineRuntime.__init__).parameters


def _order_channel_class() -> Any:
    """smp-pipeline's tensor-parallel ``OrderChannel``, or None when this version lacks it."""
    try:
        from smp_pipeline.order import OrderChannel
    except ImportError:
        return None
    return OrderChannel


class PipelineBinding:
    """Connects a :class:`~smp_torch.model.DistributedModel` to one ``PipelineRuntime``."""

    def __init__(self, model: Any, module: nn.Module, broadcast_weights: bool) -> None:
        from smp_comm import Communicator
        from smp_pipeline import PipelineRuntime

        from smp_torch.model import _broadcast_tensors, _module_tensors, materialize_meta

        s = state()
        cfg = s.config
        self.model = model
        self.cfg = cfg
        self.pp_rank = s.groups["pp"].index(s.rank)
        # (ModuleGraph, PartitionResult) on world rank 0 once partitioned automatically.
        self.partition_report: Any = None
        self.tracing = False
        self._alias_owner: dict[str, int] | None = None
        has_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])

        assignment: dict[str, int] | None = None
        if not cfg.auto_partition:
            assignment = _marks(module, cfg.default_partition)
        elif has_meta:
            if s.rank == 0:
                found, self.partition_report = static_assignment(module, cfg.pp, cfg.memory_weight)
            else:
                found = None
            assignment = s.mpi_comms["world"].bcast(found, root=0)
        if has_meta:
            assert assignment is not None
            self._materialize_owned(module, assignment, model._init_seed(), materialize_meta)
        else:
            module.to(s.device)
            if broadcast_weights and s.size > 1:
                _broadcast_tensors(_module_tensors(module), 0, s.process_groups["world"])
        if cfg.tp > 1:
            module = tp_glue.parallelize(
                module, s.process_groups["tp"], cfg.prescaled_batch, cfg.optimize
            )
            module.to(s.device)
            model.module = module
        self.module = module
        checkpointing = {}
        for name, m in module.named_modules():
            opts = get_checkpoint_mark(m)
            if opts is not None:
                strategy = opts["strategy"] if isinstance(m, nn.Sequential) else None
                checkpointing[name] = strategy
        # One communicator over the whole job, shared by every pipeline: each runtime talks to
        # its own stages (comm_ranks), and an abort reaches every rank (abort_ranks), so a
        # tensor-parallel peer or replica in another pipeline raises instead of waiting in a
        # collective forever.
        self.comm = Communicator(s.mpi_comms["world"].Dup())
        extra: dict[str, Any] = {}
        if _runtime_accepts("abort_ranks"):
            extra["abort_ranks"] = [r for r in range(s.size) if r not in s.groups["pp"]]
        active = cfg.active_microbatches
        self.ordering = "none"
        if cfg.tp > 1:
            # TP peers of a stage sit in different pipelines and run collectives inside module
            # executions, so they must start tasks in the same order.
            channel_cls = _order_channel_class()
            if channel_cls is not None:
                tp_group = s.groups["tp"]
                extra["order_channel"] = channel_cls(
                    self.comm, tp_group[0], tp_group[1:], _ORDER_TAG
                )
                self.ordering = "leader"
            else:
                # Deterministic fallback: one microbatch in flight makes every rank's task
                # order the program order (correct, but without pipelining overlap).
                active = 1
                self.ordering = "serial"
        # Recomputations on every stage replay smp-tp's dropout streams too (torch restores
        # only its own generators).
        from smp_pipeline import add_checkpoint_context
        from smp_tp import checkpoint_context as tp_checkpoint_context

        add_checkpoint_context(tp_checkpoint_context)
        self.runtime = PipelineRuntime(
            module,
            self.comm,
            self.pp_rank,
            cfg.pp,
            comm_ranks=s.groups["pp"],
            alpha=cfg.memory_weight,
            schedule=cfg.pipeline,
            active_microbatches=active,
            timeout_s=cfg.timeout_s,
            checkpointing=checkpointing,
            timeline=bool(cfg.timeline),
            trace_device=None,
            **extra,
        )
        s.closers.append(self.close)
        self._pending = assignment

    def start(self) -> None:
        """Apply an assignment known at wrap time (manual or delayed-init partitioning)."""
        if self._pending is not None:
            self._apply(self._pending)
            self._pending = None

    # -- partitioning ------------------------------------------------------------------------

    def _materialize_owned(
        self,
        module: nn.Module,
        assignment: dict[str, int],
        seed: int,
        materialize: Callable[..., None],
    ) -> None:
        from smp_pipeline.assignment import resolve_assignment

        full = resolve_assignment(module, assignment, self.cfg.pp)
        device = state().device
        for name, m in module.named_modules():
            if full.get(name) == self.pp_rank:
                materialize_one = any(t.is_meta for t in m._parameters.values() if t is not None)
                materialize_one = materialize_one or any(
                    t.is_meta for t in m._buffers.values() if t is not None
                )
                if materialize_one:
                    # crc32, not hash(): str hashes differ between processes.
                    materialize(_Shallow(m), device, seed + zlib.crc32(name.encode()) % 100003)

    @property
    def partitioned(self) -> bool:
        return self.runtime.assignment is not None

    def _apply(self, assignment: dict[str, int]) -> None:
        from smp_pipeline.assignment import resolve_assignment

        # Names given before tensor parallelism replaced modules may no longer exist inside
        # the replacements; the replacements themselves keep their paths.
        names = {n for n, _ in self.module.named_modules(remove_duplicate=False)}
        kept = {k: v for k, v in assignment.items() if k in names}
        full = resolve_assignment(self.module, kept, self.cfg.pp)
        self.runtime.set_assignment(self._keep_whole(full))
        self.model._on_partitioned()

    def ensure_partitioned(self, fn: Callable[..., Any], microbatches: list[Any]) -> None:
        """Trace (world rank 0) and partition on the first step; identical on every rank."""
        if self.partitioned:
            return
        from smp_pipeline import trace_dict

        s, cfg = state(), self.cfg
        graph: dict[str, Any] | None = None
        error: str | None = None
        must_trace = s.rank == 0 or (cfg.tp > 1 and self.pp_rank == 0)
        if must_trace:
            args, kwargs = microbatches[0]
            self.tracing = True
            try:
                with autocast_context(cfg.fp16, cfg.bf16, s.device):
                    # A warm-up run first: first calls are slow (lazy initialisation) and would
                    # distort the timed trace. The trace itself orders children by execution
                    # and gives never-called containers (nn.ModuleList) their members' time.
                    with torch.no_grad():
                        fn(*args, **kwargs)
                    graph = trace_dict(self.module, run=lambda: fn(*args, **kwargs))
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"tracing the model on rank {s.rank} failed: {exc!r}"
            finally:
                self.tracing = False
        payload: Any = None
        if s.rank == 0:
            if error is None:
                from smp_partition import ModuleGraph, partition
                from smp_pipeline.assignment import BALANCE_SLACK

                try:
                    mgraph = ModuleGraph.from_dict(graph or {"modules": []})
                    result = partition(
                        mgraph, num_devices=cfg.pp, alpha=cfg.memory_weight,
                        balance_slack=BALANCE_SLACK,
                    )
                    self.partition_report = (mgraph, result)
                    found = {str(k): int(v) for k, v in result.assignment.items()}
                    payload = {"assignment": found}
                except Exception as exc:  # noqa: BLE001
                    payload = {"error": f"partitioning failed: {exc!r}"}
            else:
                payload = {"error": error}
        payload = s.mpi_comms["world"].bcast(payload, root=0)
        if "error" in payload:
            raise SMPError(payload["error"])
        self._apply(payload["assignment"])

    def _keep_whole(self, assignment: dict[str, int]) -> dict[str, int]:
        """Keep some subtrees on one stage: move descendants the partitioner put elsewhere.

        - a checkpointed (non-Sequential) module is recomputed on its owner;
        - an smp-tp distributed module uses its submodules' parameters directly (not by
          calling them), so they must live where it runs.
        """
        try:
            from smp_tp import DistributedModule
        except ImportError:  # pragma: no cover - smp-tp is a dependency
            DistributedModule = ()  # type: ignore[assignment,misc]  # noqa: N806
        out = dict(assignment)
        for name, m in self.module.named_modules():
            checkpointed = get_checkpoint_mark(m) is not None and not isinstance(m, nn.Sequential)
            if not (checkpointed or isinstance(m, DistributedModule)) or name not in out:
                continue
            for sub, _ in m.named_modules(prefix=name):
                if sub in out:
                    out[sub] = out[name]
        return out

    # -- execution ---------------------------------------------------------------------------

    def run_step(
        self, fn: Callable[..., Any], microbatches: list[tuple[tuple[Any, ...], dict[str, Any]]]
    ) -> list[Any]:
        self.ensure_partitioned(fn, microbatches)
        cfg, s = self.cfg, state()
        m = len(microbatches)

        def one_microbatch(index: torch.Tensor) -> Any:
            args, kwargs = microbatches[int(index.item())]
            return fn(*args, **kwargs)

        error: BaseException | None = None
        out: list[Any] = []
        try:
            with autocast_context(cfg.fp16, cfg.bf16, s.device):
                out = self.runtime.run_step(one_microbatch, (torch.arange(m),), num_microbatches=m)
        except BaseException as exc:  # noqa: BLE001 - shared with every rank below
            error = exc
        # Every rank of the job agrees on the step's outcome before anyone goes on (to the
        # data-parallel all-reduce, or to exit and close its communicator). The runtime makes
        # a failure raise on every rank, but a rank that had already finished the step when
        # the abort arrived would otherwise wait for a peer that never comes.
        report = None if error is None else f"rank {s.rank}: {type(error).__name__}: {error}"
        failures = [r for r in s.mpi_comms["world"].allgather(report) if r]
        if error is not None:
            raise error
        if failures:
            raise SMPError(f"the step failed on another rank: {failures[0]}")
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, tensors: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]) -> None:
        if self.tracing:
            return
        # The runtime applies 1/microbatches itself; undo the model's copy of that factor.
        m = self.cfg.microbatches
        self.runtime.backward(list(tensors), [g * m for g in grads])

    # -- ownership ---------------------------------------------------------------------------

    def owned_parameter_names(self) -> set[str] | None:
        if not self.partitioned:
            return None
        return {n for n, _ in self.runtime.named_local_parameters()}

    def owned_state_names(self) -> set[str]:
        if not self.partitioned:
            return set(self.module.state_dict())
        return set(self.runtime.local_state_dict())

    def owns_full_key(self, key: str) -> bool:
        """Whether the unwrapped model's state-dict entry ``key`` lives on this stage."""
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

    def load_full_state(self, sd: dict[str, torch.Tensor], strict: bool) -> Any:
        """Load a full state dict: this stage's entries only once partitioned."""
        if not self.partitioned:
            tp_glue.load_full_state_dict(self.module, dict(sd), self.cfg.tp, strict)
            return None
        mine = {k: v for k, v in sd.items() if self.owns_full_key(k)}
        target = self.module.state_dict()
        if self.cfg.tp == 1:
            missing = [k for k in target if self.owns_full_key(k) and k not in mine]
            if strict and missing:
                raise SMPError(f"state dict lacks keys of pipeline stage {self.pp_rank}: {missing}")
            with torch.no_grad():
                for k, v in mine.items():
                    if k in target:
                        target[k].copy_(v)
            return None
        # TP: smp-tp slices the full entries; foreign stages' parameters are empty stand-ins.
        tp_glue.load_full_state_dict(self.module, mine, self.cfg.tp, strict=False)
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


class _Shallow(nn.Module):
    """Presents one module without its children to :func:`materialize_meta`."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_target", m)

    def modules(self):  # type: ignore[no-untyped-def,override]
        yield self._target
