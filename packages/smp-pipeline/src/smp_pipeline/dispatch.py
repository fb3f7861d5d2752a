"""Routing module calls: owned modules run here, the others become remote requests.

Once a placement is known, every module's ``_call_impl`` is replaced: a module owned by
another rank becomes a request to it, a checkpointed one runs under checkpointing, and a
sequential container owned here sends each run of consecutive children living on one other
rank as one request (Appendix B). The owner side (:meth:`ModuleDispatch.execute_owned`) runs
what requests ask for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from smp_pipeline.checkpointing import CheckpointPlan, grouped_sequential_forward, run_checkpointed
from smp_pipeline.errors import PipelineError
from smp_pipeline.partition import canonical_modules

if TYPE_CHECKING:  # pragma: no cover
    from smp_pipeline.server import ExecutionServer


class ModuleDispatch:
    """The module-call routing of one rank's copy of the model."""

    def __init__(self, module: nn.Module, pp_rank: int) -> None:
        self.module = module
        self.pp_rank = pp_rank
        self.modules = {name: m for name, m in module.named_modules()}
        self.assignment: dict[str, int] | None = None
        self.plan = CheckpointPlan()
        self.server: ExecutionServer | None = None
        self._yield_hooks: list[Any] = []

    def install(
        self, assignment: dict[str, int], plan: CheckpointPlan, server: ExecutionServer
    ) -> None:
        """Route every module call for this (complete) placement."""
        self.assignment = assignment
        self.plan = plan
        self.server = server
        self.free_remote_parameters()
        self._install_calls()

    def free_remote_parameters(self) -> None:
        """Replace the parameters of modules owned elsewhere by empty tensors."""
        assert self.assignment is not None
        for path, m in self.modules.items():
            if self.assignment[path] == self.pp_rank:
                continue
            for name, p in list(m._parameters.items()):
                if p is None:
                    continue
                empty = torch.empty(0, dtype=p.dtype, device=p.device)
                m._parameters[name] = nn.Parameter(empty, requires_grad=p.requires_grad)

    def _install_yield_points(self) -> None:
        """A forward pre-hook on each owned child of a sequential container (a transformer
        block, say): the server's yield point, where a long forward lets a newly arrived
        response or backward request go first (see :meth:`Executor.yield_point`)."""
        for handle in self._yield_hooks:
            handle.remove()
        self._yield_hooks = []
        assert self.server is not None
        if not self.server.preemption:
            return
        assert self.assignment is not None
        hook = self._yield_hook
        for path, m in self.modules.items():
            if not isinstance(m, (nn.Sequential, nn.ModuleList)):
                continue
            for name, child in m.named_children():
                child_path = f"{path}.{name}" if path else name
                if self.assignment.get(child_path) == self.pp_rank:
                    self._yield_hooks.append(child.register_forward_pre_hook(hook))

    def _yield_hook(self, _module: nn.Module, _args: Any) -> None:
        assert self.server is not None
        self.server.yield_point()

    def _install_calls(self) -> None:
        assert self.assignment is not None and self.server is not None
        self._install_yield_points()
        for path, m in self.modules.items():
            owner = self.assignment[path]
            if owner != self.pp_rank:
                m._call_impl = functools.partial(self._call_remote, path, owner)
            elif path in self.plan.modules:
                m._call_impl = functools.partial(self._call_checkpointed, path)
            groups = self.plan.groups.get(path)
            if groups and owner == self.pp_rank:
                assert isinstance(m, nn.Sequential)
                m.forward = grouped_sequential_forward(m, groups)  # type: ignore[method-assign]
            elif (
                owner == self.pp_rank
                and isinstance(m, nn.Sequential)
                and type(m).forward is nn.Sequential.forward
            ):
                runs = self._remote_runs(m)
                if runs:
                    m.forward = self._sequential_forward(path, m, runs)  # type: ignore[method-assign]

    def _remote_runs(self, seq: nn.Sequential) -> dict[int, tuple[int, int]]:
        """Runs of >= 2 consecutive children owned by one other rank: ``start -> (end, rank)``."""
        assert self.assignment is not None
        canon = canonical_modules(self.module)
        owners = [self.assignment[canon[id(c)]] for c in seq]
        runs: dict[int, tuple[int, int]] = {}
        i = 0
        while i < len(owners):
            j = i + 1
            while j < len(owners) and owners[j] == owners[i]:
                j += 1
            if owners[i] != self.pp_rank and j - i >= 2:
                runs[i] = (j, owners[i])
            i = j
        return runs

    def _sequential_forward(
        self, path: str, seq: nn.Sequential, runs: dict[int, tuple[int, int]]
    ) -> Callable[[Any], Any]:
        """``seq.forward`` sending each run of children living on one other rank as one
        request (Appendix B), instead of one request per child."""
        children = list(seq)
        server = self.server
        assert server is not None

        def forward(x: Any) -> Any:
            i = 0
            while i < len(children):
                run = runs.get(i)
                if run is not None:
                    end, owner = run
                    x = server.call_remote(path, owner, (x,), {}, False, (i, end))
                    i = end
                else:
                    x = children[i](x)
                    i += 1
            return x

        return forward

    def _call_remote(self, path: str, owner: int, *args: Any, **kwargs: Any) -> Any:
        assert self.server is not None
        return self.server.call_remote(path, owner, args, kwargs, path in self.plan.modules)

    def _call_checkpointed(self, path: str, *args: Any, **kwargs: Any) -> Any:
        m = self.modules[path]
        return run_checkpointed(functools.partial(type(m)._call_impl, m), args, kwargs)

    def execute_owned(
        self,
        path: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        checkpoint: bool,
        span: tuple[int, int] | None = None,
    ) -> Any:
        """Run owned module ``path`` for a request (``span``: children i..j-1 of a Sequential)."""
        if span is not None:  # consecutive children of a Sequential, all owned here
            seq = self.modules.get(path)
            if not isinstance(seq, nn.Sequential):
                raise PipelineError(f"pp rank {self.pp_rank}: '{path}' is not an nn.Sequential")
            (x,) = args
            for child in list(seq)[span[0] : span[1]]:
                x = child(x)
            return x
        m = self.modules.get(path)
        if m is None or self.assignment is None or self.assignment[path] != self.pp_rank:
            raise PipelineError(
                f"pp rank {self.pp_rank} was asked to run module '{path}', which it does not own"
            )
        call = functools.partial(type(m)._call_impl, m)
        if checkpoint:
            return run_checkpointed(call, args, kwargs)
        return call(*args, **kwargs)

