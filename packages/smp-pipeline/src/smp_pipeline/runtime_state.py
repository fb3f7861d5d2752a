"""What a pipeline rank owns and its state: the parameter and state-dict half of
:class:`~smp_pipeline.runtime.PipelineRuntime`.

What a rank owns follows from the placement (:mod:`smp_pipeline.ownership`); gradients of
what it owns are summed in microbatch order by the server's accumulator
(:mod:`smp_pipeline.accumulation`). :class:`LocalState` is mixed into ``PipelineRuntime``
and needs only these of it: the ownership record, the accumulator and the setup channel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from smp_pipeline.accumulation import GradAccumulator
from smp_pipeline.ownership import Ownership, merge_state_dicts
from smp_pipeline.setup_channel import SetupChannel

__all__ = ["LocalState"]


class LocalState:
    """The parameters and state of the modules a pipeline rank owns (see module doc)."""

    module: nn.Module
    _ownership: Ownership
    _setup: SetupChannel

    @property
    def _grads(self) -> GradAccumulator:
        """The accumulator summing the local gradients (the runtime's server's)."""
        raise NotImplementedError

    @property
    def assignment(self) -> dict[str, int] | None:
        """The placement ``{canonical module path: pp rank}`` (None before partitioning)."""
        return self._ownership.assignment

    def owned_modules(self) -> list[str]:
        """Canonical paths of the modules this rank owns (all, before partitioning)."""
        return self._ownership.owned_modules()

    def owner(self, path: str) -> int:
        """The pp rank owning module ``path`` (any alias path works)."""
        return self._ownership.owner(path)

    def named_local_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` for the parameters of owned modules (tied ones once)."""
        return self._ownership.named_local_parameters()

    def local_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank trains (give these to the optimizer / DP all-reduce)."""
        return [p for _, p in self.named_local_parameters()]

    def track_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Sum these tensors' gradients in microbatch order too, like the local parameters
        (:mod:`smp_pipeline.accumulation`; tensors already tracked are skipped): for tensors
        that stand in for local parameters during steps, such as FSDP2's gathered ones."""
        self._grads.track(params)

    def register_grad_hook(self, param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
        """``hook(param)`` runs each time a microbatch's gradient of local parameter ``param``
        is added to ``param.grad``: once per microbatch that reached it, in microbatch order
        (see :mod:`smp_pipeline.accumulation`). Returns a handle with ``remove()``.

        Use it instead of ``register_post_accumulate_grad_hook``: during a step, autograd's
        contributions go to per-microbatch buffers, and ``.grad`` changes only when they are
        folded in order."""
        return self._grads.register_fold_hook(param, hook)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """The entries of ``module.state_dict()`` that belong to owned modules."""
        return self._ownership.local_state_dict()

    def load_state_dict_local(self, state_dict: Mapping[str, torch.Tensor]) -> list[str]:
        """Copy the owned entries of a full (or local) state dict into this rank's modules
        (entries of modules owned elsewhere are ignored); returns the keys loaded here."""
        return self._ownership.load_state_dict_local(state_dict)

    def full_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """Collective: gather the full ``state_dict`` (loadable into the unwrapped model).

        Returns it on pp rank ``dst`` and None elsewhere.
        """
        local = {k: v.detach().cpu() for k, v in self.local_state_dict().items()}
        parts = self._setup.gather(local, dst)
        return None if parts is None else merge_state_dicts(self.module, parts)
