"""Routing module calls: owned modules run here, the others become remote requests.

Once a placement is known, every module's ``_call_impl`` is replaced: a module owned by
another rank becomes a request to it, a checkpointed one runs under checkpointing, and a
sequential container owned here sends each run of consecutive children living on one other
rank as one request (Appendix B; ``fast_mode``, see :mod:`smp_pipeline.seqruns`). The owner
side (:meth:`ModuleDispatch.execute_owned`) runs what requests ask for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from smp_pipeline.chains import ModuleListChains, chain_links
from smp_pipeline.checkpointing import CheckpointPlan, grouped_sequential_forward, run_checkpointed
from smp_pipeline.errors import PipelineError
from smp_pipeline.execution_state import autocast_state
from smp_pipeline.partition import canonical_modules
from smp_pipeline.seqruns import (
    Relay,
    SequentialPlan,
    global_hooks,
    has_own_hooks,
    is_plain_sequential,
    plan_sequential,
)

if TYPE_CHECKING:  # pragma: no cover
    from smp_pipeline.server import ExecutionServer


def local_subtrees(module: nn.Module, assignment: dict[str, int], pp_rank: int) -> set[str]:
    """Paths of the modules whose whole subtree (shared submodules included) pipeline rank
    ``pp_rank`` owns: a call to one never leaves the rank (static mode may run it inline)."""
    canon = canonical_modules(module)
    whole: dict[int, bool] = {}  # id(module) -> its whole subtree is owned here

    def owned(m: nn.Module) -> bool:  # memoized: linear in the modules, not quadratic
        key = id(m)
        if key not in whole:
            whole[key] = assignment[canon[key]] == pp_rank and all(owned(c) for c in m.children())
        return whole[key]

    return {path for path, m in module.named_modules() if owned(m)}


class ModuleDispatch:
    """The module-call routing of one rank's copy of the model."""

    def __init__(self, module: nn.Module, pp_rank: int, fast_mode: bool = True) -> None:
        self.module = module
        self.pp_rank = pp_rank
        self.fast_mode = fast_mode
        self._fast_forwards: set[nn.Module] = set()  # containers whose forward is a plan
        self.modules = {name: m for name, m in module.named_modules()}
        self.assignment: dict[str, int] | None = None
        self.plan = CheckpointPlan()
        self.server: ExecutionServer | None = None
        self._yield_hooks: list[Any] = []
        self._yield_ids: set[int] = set()  # handle ids of the yield hooks (not user hooks)
        self._local_subtrees: set[str] = set()  # modules whose whole subtree is owned here
        # fast_mode: the ModuleList blocks owned elsewhere whose calls chain (chains.py).
        self.chains: ModuleListChains | None = None
        # (path, span) -> ids of the parameters a request for it runs (call_params).
        self._call_params: dict[tuple[str, tuple[str, ...] | None], frozenset[int]] = {}

    def install(
        self, assignment: dict[str, int], plan: CheckpointPlan, server: ExecutionServer
    ) -> None:
        """Route every module call for this (complete) placement."""
        self.assignment = assignment
        self.plan = plan
        self.server = server
        self.free_remote_parameters()
        self._local_subtrees = local_subtrees(self.module, assignment, self.pp_rank)
        self._call_params.clear()
        self.chains = None
        if self.fast_mode:
            links = chain_links(
                self.module, assignment, self.pp_rank,
                lambda r: local_subtrees(self.module, assignment, r),
            )  # fmt: skip
            self.chains = ModuleListChains(links) if links else None
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
        self._yield_ids = set()
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
        self._yield_ids = {h.id for h in self._yield_hooks}

    def _yield_hook(self, _module: nn.Module, _args: Any) -> None:
        assert self.server is not None
        self.server.yield_point()

    def _install_calls(self) -> None:
        assert self.assignment is not None and self.server is not None
        self._install_yield_points()
        for m in self._fast_forwards:  # a second placement: plan again from the plain forward
            m.__dict__.pop("forward", None)
        self._fast_forwards = set()
        canon = canonical_modules(self.module)
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
                self.fast_mode
                and owner == self.pp_rank
                and isinstance(m, nn.Sequential)
                and is_plain_sequential(m, self._is_fast)
            ):
                plan = plan_sequential(m, canon, self.assignment, self.pp_rank, self._expandable)
                if plan.useful:
                    m.forward = self._sequential_forward(path, plan)  # type: ignore[method-assign]
                    self._fast_forwards.add(m)

    def _is_fast(self, m: nn.Module) -> bool:
        return m in self._fast_forwards

    def _expandable(self, child: nn.Module, path: str) -> bool:
        """A nested container that may be flattened into its parent's plan (statically; hooks
        are checked at every call)."""
        return (
            is_plain_sequential(child, self._is_fast)
            and path not in self.plan.modules
            and path not in self.plan.groups
        )

    def _sequential_forward(self, path: str, plan: SequentialPlan) -> Callable[[Any], Any]:
        """``seq.forward`` under ``fast_mode``: each run of children living on one other rank
        is one request (Appendix B), instead of one request per child (see
        :mod:`smp_pipeline.seqruns`)."""
        server = self.server
        assert server is not None
        yield_ids = self._yield_ids

        def forward(x: Any) -> Any:
            items = plan.flat
            if plan.expanded and (
                global_hooks() or any(has_own_hooks(c, yield_ids) for c in plan.expanded)
            ):
                items = plan.shallow  # a flattened container's call would be skipped
            for item in items:
                if isinstance(item, tuple):
                    owner, paths = item
                    x = server.call_remote(path, owner, (x,), {}, False, paths)
                elif isinstance(item, Relay):
                    (owner, paths), *further = item.hops
                    x = server.call_remote(path, owner, (x,), {}, False, paths, tuple(further))
                else:
                    x = item(x)
            return x

        return forward

    def _call_remote(self, path: str, owner: int, *args: Any, **kwargs: Any) -> Any:
        server, chains = self.server, self.chains
        assert server is not None
        ctx = None if chains is None else server.current_context()
        if chains is None or ctx is None:  # (no context: call_remote says why it fails)
            return server.call_remote(path, owner, args, kwargs, path in self.plan.modules)
        # fast_mode's ModuleList chains (chains.py): a call the last request predicted
        # returns its output from there; else a request, with the blocks after it chained.
        state = (torch.is_grad_enabled(), autocast_state())
        hit, out = chains.take(ctx.chain, path, args, kwargs, state)
        if hit:
            return out
        after = chains.chain_after(path)
        plan = self.plan.modules
        chain = tuple((p, p in plan) for p in after)
        out = server.call_remote(path, owner, args, kwargs, path in plan, chain=chain)
        outputs = list(out) if chain else [out]
        ctx.chain = chains.after_request(ctx.chain, path, outputs, args, kwargs, state)
        return outputs[0]

    def _call_checkpointed(self, path: str, *args: Any, **kwargs: Any) -> Any:
        m = self.modules[path]
        return run_checkpointed(functools.partial(type(m)._call_impl, m), args, kwargs)

    def execute_owned(
        self,
        path: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        checkpoint: bool,
        span: tuple[str, ...] | None = None,
    ) -> Any:
        """Run owned module ``path`` for a request; ``span``: the module paths of a run of a
        Sequential's (possibly flattened) children, all owned here, called in order."""
        if span is not None:
            (x,) = args
            for p in span:
                x = self._owned(p)(x)  # its own __call__: hooks, checkpointing, yield points
            return x
        m = self._owned(path)
        call = functools.partial(type(m)._call_impl, m)
        if checkpoint:
            return run_checkpointed(call, args, kwargs)
        return call(*args, **kwargs)

    def runs_locally(self, path: str, span: tuple[str, ...] | None) -> bool:
        """Whether a request for ``path`` (or its run ``span``) runs only modules owned here, so
        it can never wait on another rank (static mode may serve it on the main loop)."""
        local = self._local_subtrees
        if span is not None:
            return all(p in local for p in span)
        return path in local

    def begin_step(self) -> None:
        """A step starts (every rank): what chains saw in the last one takes effect."""
        if self.chains is not None:
            self.chains.begin_step()

    def call_params(self, path: str, span: tuple[str, ...] | None) -> frozenset[int]:
        """``id()`` of the parameters in the subtrees a request for ``path`` (or its run
        ``span``) runs, tied ones under every module that holds them: all a request may give
        gradients to here, short of a module using a parameter it does not hold (see
        :mod:`smp_pipeline.accumulation`, per-parameter streaming)."""
        key = (path, span)
        ids = self._call_params.get(key)
        if ids is None:
            mods = [self.modules[p] for p in span] if span is not None else [self.modules[path]]
            ids = frozenset(
                id(p) for m in mods for _, p in m.named_parameters(remove_duplicate=False)
            )
            self._call_params[key] = ids
        return ids

    def _owned(self, path: str) -> nn.Module:
        m = self.modules.get(path)
        if m is None or self.assignment is None or self.assignment[path] != self.pp_rank:
            raise PipelineError(
                f"pp rank {self.pp_rank} was asked to run module '{path}', which it does not own"
            )
        return m
