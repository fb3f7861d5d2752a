"""One pipeline rank's share of the model: the modules, parameters and state it owns.

Every rank holds the full module tree; a placement (``{canonical module path: pp rank}``,
see :mod:`smp_pipeline.partition`) says which modules each rank runs and trains.
:class:`Ownership` answers the questions that follow from it on one rank: which modules are
its own, who owns a module given by any of its alias paths, which parameters it trains, and
which entries of ``state_dict()`` it saves and loads. No communication: gathering the full
state dict is the runtime's (it owns the collectives), merging the parts is
:func:`merge_state_dicts`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from smp_pipeline.errors import PipelineConfigError, PipelineError
from smp_pipeline.partition import canonical_modules


class Ownership:
    """What pp rank ``pp_rank`` owns of ``module`` under :attr:`assignment`.

    Args:
        module: the full model (the same tree on every rank).
        pp_rank: this rank's pipeline index.
    """

    def __init__(self, module: nn.Module, pp_rank: int) -> None:
        self.module = module
        self.pp_rank = pp_rank
        # The complete placement (every canonical module path), None before partitioning.
        self.assignment: dict[str, int] | None = None
        self._by_alias: dict[str, str] | None = None  # alias path -> canonical path

    def owned_modules(self) -> list[str]:
        """Canonical paths of the modules this rank owns (all, before partitioning)."""
        if self.assignment is None:
            return [name for name, _ in self.module.named_modules()]
        return [p for p, r in self.assignment.items() if r == self.pp_rank]

    def owner(self, path: str) -> int:
        """The pp rank owning module ``path`` (any alias path works)."""
        if self.assignment is None:
            raise PipelineError("the model is not partitioned yet")
        by_alias = dict(self.module.named_modules(remove_duplicate=False))
        if path not in by_alias:
            raise PipelineConfigError(f"no module '{path}'")
        return self.assignment[canonical_modules(self.module)[id(by_alias[path])]]

    def canonical(self, alias: str) -> str:
        """The canonical path of the module at alias path ``alias``."""
        if self._by_alias is None:
            canon = canonical_modules(self.module)
            self._by_alias = {
                n: canon[id(m)] for n, m in self.module.named_modules(remove_duplicate=False)
            }
        return self._by_alias[alias]

    def _owns_entry(self, owned: set[str], name: str) -> bool:
        """Whether a parameter or state entry ``name`` belongs to an owned module."""
        mod = name.rsplit(".", 1)[0] if "." in name else ""
        return self.canonical(mod) in owned

    def named_local_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` for the parameters of owned modules (tied ones once)."""
        owned = set(self.owned_modules())
        return [(n, p) for n, p in self.module.named_parameters() if self._owns_entry(owned, n)]

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """The entries of ``module.state_dict()`` that belong to owned modules."""
        owned = set(self.owned_modules())
        return {k: v for k, v in self.module.state_dict().items() if self._owns_entry(owned, k)}

    def load_state_dict_local(self, state_dict: Mapping[str, torch.Tensor]) -> list[str]:
        """Copy the owned entries of a full (or local) state dict into this rank's modules.

        Entries of modules owned elsewhere are ignored. Returns the keys loaded here.
        """
        own = self.local_state_dict()
        live = self.module.state_dict(keep_vars=True)
        loaded = []
        with torch.no_grad():
            for key, value in state_dict.items():
                if key in own:
                    target = live[key]
                    if target.shape != value.shape:
                        raise PipelineConfigError(
                            f"state dict entry '{key}' has shape {tuple(value.shape)}, the model "
                            f"has {tuple(target.shape)}"
                        )
                    target.copy_(value)
                    loaded.append(key)
        return loaded


def merge_state_dicts(
    module: nn.Module, parts: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Every rank's local state dict merged, in ``module.state_dict()``'s key order."""
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return {k: merged[k] for k in module.state_dict() if k in merged}
