"""Pipeline parallelism: binds a DistributedModel to smp-pipeline's runtime (pp > 1)."""

from __future__ import annotations

from typing import Any

from smp_torch.errors import SMPError

__all__ = ["PipelineBinding"]


class PipelineBinding:
    """Placeholder until smp-pipeline's lower-level API lands."""

    def __init__(self, model: Any, module: Any, broadcast_weights: bool) -> None:
        raise SMPError("pipeline_parallel_degree > 1 needs smp-pipeline's runtime (not yet wired)")
