"""The base class of every distributed (tensor-parallel) module."""

from __future__ import annotations

from typing import Any

from torch import nn

from smp_tp.group import ProcessGroup, tp_rank, tp_size
from smp_tp.state import check_optimize, current_config


class DistributedModule(nn.Module):
    """Base of all tensor-parallel modules.

    Holds the tensor-parallel group and the two mode switches; anything not given falls
    back to :func:`smp_tp.state.current_config` (what ``parallelize`` or the umbrella set):

    * ``prescaled_batch`` — False (default): every TP rank feeds its own samples and the
      module exchanges them (TP across data-parallel ranks). True: every TP rank feeds the
      same input (Megatron mode).
    * ``optimize`` — ``"speed"`` or ``"memory"`` (only the transformer modules differ).
    """

    def __init__(
        self,
        *,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
        optimize: str | None = None,
    ) -> None:
        super().__init__()
        cfg = current_config()
        self.tp_group = tp_group if tp_group is not None else cfg.tp_group
        self.prescaled_batch = bool(cfg.prescaled_batch if prescaled_batch is None else prescaled_batch)
        self.optimize = check_optimize(cfg.optimize if optimize is None else optimize)
        self.tp_size = tp_size(self.tp_group)
        self.tp_rank = tp_rank(self.tp_group)

    @property
    def scaled_batch(self) -> bool:
        """True when every TP rank feeds its own samples."""
        return not self.prescaled_batch

    def _require_divisible(self, **sizes: int) -> None:
        """Raise a clear error when a size cannot be split evenly over the TP group."""
        for name, value in sizes.items():
            if value % self.tp_size:
                raise ValueError(
                    f"{type(self).__name__}: {name}={value} is not divisible by the "
                    f"tensor-parallel degree {self.tp_size}; choose sizes that are multiples "
                    f"of the degree, or leave this module unreplaced"
                )

    def extra_repr(self) -> str:
        mode = "prescaled" if self.prescaled_batch else "scaled_batch"
        return f"tp={self.tp_rank}/{self.tp_size}, {mode}, optimize={self.optimize}"

    # Subclasses built by ``parallelize`` get these two set: functions translating between
    # the state-dict keys of the module they replaced and their own full (unsharded) keys.
    _smp_tp_to_full: Any = None
    _smp_tp_from_full: Any = None
