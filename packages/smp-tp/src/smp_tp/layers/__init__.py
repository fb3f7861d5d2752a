"""Built-in distributed modules."""

from smp_tp.layers.experts import (
    ExpertParallelExperts,
    all_to_all_rows,
    distribute_experts,
    expert_parallelize,
    full_expert_grads,
    full_expert_state,
)
from smp_tp.layers.ulysses import ulysses_attention

__all__ = [
    "ExpertParallelExperts", "all_to_all_rows", "distribute_experts", "expert_parallelize",
    "full_expert_grads", "full_expert_state", "ulysses_attention",
]
