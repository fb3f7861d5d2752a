"""``smp.DistributedOptimizer``: the user's optimizer over this rank's parameters, plus
optimizer-state sharding, fp16 loss scaling and full / local state dicts.

**State sharding** (``shard_optimizer_state``): every parameter gets one owner among the
ranks that hold an identical copy of it — its data-parallel group for replicated parameters,
its reduced data-parallel group for tensor-parallel shards — chosen greedily so that owners
hold about the same number of elements. ``step()`` hides the gradients of parameters this
rank does not own (so the wrapped optimizer creates no state for them and leaves them alone),
steps, restores the gradients, and each owner broadcasts its updated parameters to the group.
Gradients are still all-reduced (not reduced to the owner only), which keeps the update exactly
the single-process one at the price of some bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from smp_torch import reshard, sharded, tp_glue
from smp_torch.errors import SMPError
from smp_torch.model import DistributedModel, current_model
from smp_torch.precision import LossScaler

__all__ = ["DistributedOptimizer", "current_optimizer"]

_CURRENT: DistributedOptimizer | None = None
FULL_FORMAT = "smp-optimizer-full@1"


def current_optimizer() -> DistributedOptimizer | None:
    """The most recently created :class:`DistributedOptimizer`, if any."""
    return _CURRENT


class DistributedOptimizer:
    """Wrap an optimizer built over ``model.parameters()`` of a :class:`DistributedModel`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: DistributedModel | None = None,
        static_loss_scale: float | None = None,
        dynamic_loss_scale: bool = True,
        dynamic_loss_args: dict[str, Any] | None = None,
    ) -> None:
        global _CURRENT
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.model = model if model is not None else current_model()
        self.context = self.model.context
        cfg = self.context.config
        self._cfg = cfg
        self._names = {id(p): n for n, p in self.model.named_parameters()}
        self._check_params()
        self.scaler: LossScaler | None = None
        if cfg.fp16:
            args = dict(dynamic_loss_args or {})
            if static_loss_scale is not None:
                args.update(init_scale=static_loss_scale, dynamic=False)
            else:
                args.setdefault("dynamic", dynamic_loss_scale)
            self.scaler = LossScaler(**args)
            scaler = self.scaler
            self.model.set_loss_scale(lambda: scaler.scale)
        self._owner: dict[int, tuple[str, int]] = {}  # id(param) -> (group kind, owner rank)
        self._experts: set[int] = set()  # id of each expert share (expert_parallel_degree > 1)
        # Now with pp=1 (or a partition known at wrap time), else after the first step's.
        self.model.on_partitioned(self._after_partition)
        _CURRENT = self

    def _check_params(self) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self._names:
                    raise SMPError(
                        "the optimizer holds a parameter that is not one of this rank's model "
                        "parameters: build it from model.parameters() after smp.DistributedModel"
                    )

    def _after_partition(self) -> None:
        """Drop parameters now owned by other pipeline stages, follow the ones sharded data
        parallelism replaced (by name); assign state-sharding owners."""
        local = dict(self.model.named_parameters())
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            kept = []
            for p in group["params"]:
                q = local.get(self._names.get(id(p), ""))
                if q is None:
                    state.pop(p, None)
                    continue
                if q is not p and p in state:  # (state loaded before partitioning)
                    state[q] = {
                        k: sharded.shard_like(v, q) if _whole_of(v, q) else v  # type: ignore[arg-type]
                        for k, v in state.pop(p).items()
                    }
                kept.append(q)
            group["params"] = kept
        self._names = {id(p): n for n, p in self.model.named_parameters()}
        cfg = self._cfg
        if cfg.shard_optimizer_state and cfg.rdp * cfg.tp > 1:
            self._assign_owners()

    # -- sharding ----------------------------------------------------------------------------

    def _kind(self, p: torch.Tensor) -> str:
        """The group whose members hold the same values of ``p``: its state is sharded over it."""
        if id(p) in self._experts:
            return "edp"  # an expert share: the ranks holding the same experts
        return "rdp" if self._cfg.tp > 1 and tp_glue.is_distributed(p) else "dp"

    def _assign_owners(self) -> None:
        s = self.context
        self._experts = {id(p) for p in self.model.expert_parameters()}
        kinds = ("dp", "rdp", "edp") if self._cfg.ep > 1 else ("dp", "rdp")
        loads = {kind: [0] * len(s.groups[kind]) for kind in kinds}
        for _, p in self.model.named_parameters():
            kind = self._kind(p)
            members = s.groups[kind]
            i = min(range(len(members)), key=lambda j: (loads[kind][j], j))
            loads[kind][i] += p.numel()
            self._owner[id(p)] = (kind, members[i])

    def _owns(self, p: torch.Tensor) -> bool:
        owner = self._owner.get(id(p))
        return owner is None or owner[1] == self.context.rank

    def _broadcast_owned(self) -> None:
        s = self.context
        # Fixed order on every rank: by group kind, then owner, then parameter order.
        batches: dict[tuple[str, int], list[torch.nn.Parameter]] = {}
        for _, p in self.model.named_parameters():
            if id(p) in self._owner:
                batches.setdefault(self._owner[id(p)], []).append(p)
        for (kind, owner), params in sorted(batches.items()):
            if len(s.groups[kind]) == 1:
                continue
            by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(p)
            for _, ps in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
                flat = torch.cat([p.detach().reshape(-1) for p in ps])
                work = dist.broadcast(flat, src=owner, group=s.process_groups[kind], async_op=True)
                self._wait(work)
                offset = 0
                with torch.no_grad():
                    for p in ps:
                        p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()

    # -- the optimizer interface -------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _wait(self, work: Any) -> None:
        # Raises PeerFailedError if another rank failed meanwhile (smp_torch.watch).
        self.context.watch.wait_work(work, self.context.device.type == "cuda")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale (fp16), step the wrapped optimizer on owned parameters, share updates.

        Raises :class:`~smp_torch.errors.PeerFailedError` if another rank failed (and this
        step's collectives would wait for it)."""
        watch = self.context.watch
        watch.check()
        with watch.waiting(f"in the optimizer step after step {watch.step}"):
            return self._step(closure)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.scaler is not None:
            finite = self.scaler.unscale_and_check(
                params, self.context.process_groups["world"], self._wait, self.context.device
            )
            self.scaler.update(finite)
            if not finite:
                return None
        if self._cfg.sdp_gradient_clipping > 0:
            # After unscaling: the norm of the true gradient, over every shard and stage.
            self.model.clip_grad_norm_(self._cfg.sdp_gradient_clipping)
        if not self._owner:
            return self.optimizer.step(closure)
        hidden: dict[int, torch.Tensor] = {}
        for p in params:
            if p.grad is not None and not self._owns(p):
                hidden[id(p)] = p.grad
                p.grad = None
        try:
            result = self.optimizer.step(closure)
        finally:
            for p in params:
                if id(p) in hidden:
                    p.grad = hidden[id(p)]
        self._broadcast_owned()
        return result

    # -- state dicts -------------------------------------------------------------------------

    def _plain_parameters(self) -> AbstractContextManager[None]:
        """With sharded data × tensor parallelism, the resharding below swaps ``param.data``
        to run smp-tp's gathering on state tensors: it needs whole, plain parameters (see
        :func:`smp_torch.sharded.gathered`; its state tensors are gathered alike)."""
        if self._cfg.sdp > 1 and self._cfg.tp > 1:
            return sharded.gathered(self.model.module)
        return nullcontext()

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (as the wrapped optimizer stores it) and its names."""
        order = [self._names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        sd: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "param_names": order}
        if self.scaler is not None:
            sd["loss_scaler"] = self.scaler.state_dict()
        return sd

    def _named_state(self) -> dict[str, dict[str, Any]]:
        """Optimizer state by parameter name, sharded state gathered from its owners."""
        # Parameter order (the same on every rank): sharded state is gathered collectively.
        named = {
            self._names[id(p)]: {k: _gathered(v) for k, v in self.optimizer.state[p].items()}
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p in self.optimizer.state
        }
        if not self._owner:
            return named
        s = self.context
        tp_rank = s.index("tp")
        pieces = s.mpi_comms["dp"].allgather((tp_rank, named))
        merged: dict[str, dict[str, Any]] = {}
        same_experts = set(s.groups.get("edp", ()))
        for _, p in self.model.named_parameters():
            name = self._names[id(p)]
            kind = self._kind(p)
            for peer, (peer_tp, peer_state) in zip(s.groups["dp"], pieces):
                if kind == "rdp" and peer_tp != tp_rank:
                    continue  # another TP rank's shard
                if kind == "edp" and peer not in same_experts:
                    continue  # another ep rank's experts under the same name
                if name in peer_state:
                    merged[name] = peer_state[name]
                    break
        return merged

    def _gather_expert_state(self, full: dict[str, dict[str, Any]]) -> None:
        """Collective over the ep groups: each expert parameter's per-element state (its
        share's rows) gathered along the expert axis, in place in the full-key state
        ``full`` (after the tensor-parallel gather, which leaves the experts' shares as
        they are: they are replicated over TP)."""
        group = self.context.process_groups["ep"]
        ep = self._cfg.ep
        for key, share in self.model.expert_shares().items():
            for k, v in sorted(full.get(key, {}).items()):
                if share.is_share(v):
                    mine = v.to(self.context.device).contiguous()
                    parts = [torch.empty_like(mine) for _ in range(ep)]
                    self._wait(dist.all_gather(parts, mine, group=group, async_op=True))
                    full[key][k] = torch.cat(parts).cpu()

    def _slice_expert_state(self, full: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """A full state's expert entries cut to this rank's experts (the inverse of
        :meth:`_gather_expert_state`; entries already of the share's size stay)."""
        out = dict(full)
        for key, share in self.model.expert_shares().items():
            if key in out:
                out[key] = {k: share.rows(v) for k, v in out[key].items()}
        return out

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state in the unwrapped model's naming; see :meth:`_full_state`."""
        return self._full_state(merge_stages=True)

    def state_dict_stage(self) -> dict[str, Any]:
        """Like :meth:`state_dict` but only this pipeline stage's parameters."""
        return self._full_state(merge_stages=False)

    def _full_state(self, merge_stages: bool) -> dict[str, Any]:
        """The optimizer state in the unwrapped model's naming (layout independent).

        Tensor-parallel shards of per-parameter state are gathered like the parameters, and
        pipeline stages are merged; every rank receives the whole dict (on CPU).
        """
        named = self._named_state()
        groups = []
        for g in self.optimizer.param_groups:
            hyper = {k: v for k, v in g.items() if k != "params"}
            hyper["params"] = [self._names[id(p)] for p in g["params"]]
            groups.append(hyper)
        with self._plain_parameters():
            full_state, full_groups = reshard.optimizer_state_to_full(
                self.model, named, groups, merge_stages
            )
        if self._cfg.ep > 1:
            self._gather_expert_state(full_state)
        sd: dict[str, Any] = {
            "format": FULL_FORMAT,
            "state": full_state,
            "param_groups": full_groups,
        }
        if self.scaler is not None:
            sd["loss_scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a full (:meth:`state_dict`) or local (:meth:`local_state_dict`) state."""
        if sd.get("format") == FULL_FORMAT:
            state = self._slice_expert_state(sd["state"]) if self._cfg.ep > 1 else sd["state"]
            with self._plain_parameters():
                named, hyper = reshard.optimizer_state_from_full(self.model, state, sd["param_groups"])
            self._load_named(named, hyper)
        elif "optimizer" in sd and "param_names" in sd:
            order = [self._names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
            if order != list(sd["param_names"]):
                raise SMPError(
                    "local optimizer state was saved for different parameters; load a full "
                    "optimizer state_dict() to change layout"
                )
            self.optimizer.load_state_dict(sd["optimizer"])
        else:
            raise SMPError("not an smp optimizer state dict (full or local)")
        if self.scaler is not None and "loss_scaler" in sd:
            self.scaler.load_state_dict(sd["loss_scaler"])

    def _load_named(
        self, named: dict[str, dict[str, Any]], hyper: dict[str, dict[str, Any]]
    ) -> None:
        by_name = {n: p for n, p in self.model.named_parameters()}
        self.optimizer.state.clear()
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                name = self._names[id(p)]
                if name in hyper:
                    for k, v in hyper[name].items():
                        g[k] = v
                if name not in named or not self._owns(p):
                    continue
                st: dict[str, Any] = {}
                for k, v in named[name].items():
                    if _whole_of(v, p):
                        st[k] = sharded.shard_like(v, p)  # type: ignore[arg-type]
                    elif torch.is_tensor(v) and v.dim() > 0:
                        st[k] = v.to(
                            device=p.device, dtype=p.dtype if v.is_floating_point() else v.dtype
                        ).clone()
                    elif torch.is_tensor(v):
                        st[k] = v.clone()
                    else:
                        st[k] = v
                self.optimizer.state[by_name[name]] = st


def _whole_of(v: Any, param: torch.Tensor) -> bool:
    """Whether ``v`` is a whole (unsharded) state tensor of the sharded ``param``."""
    return sharded.is_sharded(param) and torch.is_tensor(v) and not sharded.is_sharded(v) and v.shape == param.shape


def _gathered(v: Any) -> Any:
    """A state value on CPU, whole: sharded (DTensor) state is all-gathered (collective)."""
    if not torch.is_tensor(v):
        return v
    if sharded.is_sharded(v):
        v = v.full_tensor()  # type: ignore[attr-defined]  # (a DTensor)
    return v.detach().cpu()
