"""Tensor-parallel group helpers that also work without an initialised process group.

``tp_group=None`` means the default (world) group; when ``torch.distributed`` is not
initialised the degree is 1 and every collective is the identity, so the layers can be
used (and unit-tested) in a single process.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the world group


def is_distributed() -> bool:
    """True when torch.distributed is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def tp_size(group: ProcessGroup = None) -> int:
    """Number of ranks in the tensor-parallel group (1 without a process group)."""
    return dist.get_world_size(group) if is_distributed() else 1


def tp_rank(group: ProcessGroup = None) -> int:
    """This process's rank inside the tensor-parallel group (0 without a process group)."""
    return dist.get_rank(group) if is_distributed() else 0
