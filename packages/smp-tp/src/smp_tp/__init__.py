"""Tensor-parallel drop-in layers for PyTorch, across data-parallel ranks or Megatron-style.

Torch only (no MPI): works under ``torchrun`` with any ``torch.distributed`` process group.
"""

from smp_tp.__about__ import __version__
from smp_tp.architectures import tp_register_block, tp_register_vocab_parallel
from smp_tp.checkpoint import full_grad_dict, full_state_dict, load_full_state_dict
from smp_tp.decisions import Cause, TPDecision, Treatment
from smp_tp.grads import sync_gradients
from smp_tp.group import tp_rank, tp_size
from smp_tp.layers.attention import DistributedAttentionLayer
from smp_tp.layers.block import ColumnParallelLinear, DistributedBlock, RowParallelLinear
from smp_tp.layers.config import TransformerConfig
from smp_tp.layers.context import (
    ContextParallelAttention,
    context_parallel_attention,
    gather_sequence,
    split_sequence,
)
from smp_tp.layers.embedding import DistributedEmbedding
from smp_tp.layers.experts import (
    ExpertParallelExperts,
    all_to_all_rows,
    distribute_experts,
    expert_parallelize,
    full_expert_grads,
    full_expert_state,
)
from smp_tp.layers.layernorm import DistributedLayerNorm
from smp_tp.layers.linear import DistributedLinear
from smp_tp.layers.output import DistributedTransformerOutputLayer
from smp_tp.layers.transformer import (
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
)
from smp_tp.layers.ulysses import ulysses_attention
from smp_tp.layers.vocab import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    gather_vocab_parallel_logits,
    sharded_logits,
)
from smp_tp.loss import VocabParallelCausalLMLoss, vocab_parallel_cross_entropy
from smp_tp.mappings import (
    CollectiveCounts,
    all_to_all_for_tp,
    allreduce_for_tp,
    bwd_allreduce_for_tp,
    collective_counts,
    fused_allgather_for_tp,
    fwd_allreduce_for_tp,
    gather_replicated_for_tp,
    reduce_scatter_for_tp,
    scatter_and_merge_for_tp,
    set_shape_checks,
    split_for_tp,
)
from smp_tp.module import DistributedModule
from smp_tp.parallelize import parallelize
from smp_tp.params import (
    ParamSpec,
    initialize_with_input_partition,
    initialize_with_output_partition,
    is_distributed_parameter,
    param_spec,
    parameter_creation_scope,
)
from smp_tp.random import (
    checkpoint_context,
    get_generator,
    get_rng_state,
    set_rng_state,
    set_tensor_parallel_seed,
    tp_dropout,
)
from smp_tp.registry import (
    is_tensor_parallel_enabled,
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
)
from smp_tp.state import TPConfig, current_config, set_default_config, tp_config

__all__ = [
    "__version__",
    # modules
    "DistributedModule", "DistributedLinear", "DistributedEmbedding", "DistributedLayerNorm",
    "DistributedAttentionLayer", "DistributedTransformerOutputLayer",
    "DistributedTransformerLayer", "DistributedTransformer", "DistributedTransformerLMHead",
    "TransformerConfig", "VocabParallelEmbedding", "VocabParallelLMHead", "DistributedBlock", "ColumnParallelLinear",
    "RowParallelLinear",
    # expert parallelism (routed experts of transformers-5 MoE blocks)
    "ExpertParallelExperts", "distribute_experts", "expert_parallelize", "full_expert_state",
    "full_expert_grads", "all_to_all_rows",
    # context parallelism (ring attention over a sequence split across ranks; all-to-all
    # over heads as the alternative)
    "ContextParallelAttention", "context_parallel_attention", "split_sequence", "gather_sequence",
    "ulysses_attention",
    # vocabulary-parallel loss
    "vocab_parallel_cross_entropy", "gather_vocab_parallel_logits", "sharded_logits",
    "VocabParallelCausalLMLoss",
    # replacement
    "tensor_parallelism", "set_tensor_parallelism", "is_tensor_parallel_enabled",
    "tp_register", "tp_register_with_module", "tp_register_block", "tp_register_vocab_parallel",
    "parallelize", "TPDecision", "Treatment", "Cause",
    # state and gradients
    "full_state_dict", "load_full_state_dict", "full_grad_dict", "sync_gradients",
    "ParamSpec", "param_spec", "is_distributed_parameter",
    # primitives for custom modules (paper I.6)
    "parameter_creation_scope", "initialize_with_input_partition",
    "initialize_with_output_partition", "fused_allgather_for_tp", "fwd_allreduce_for_tp",
    "bwd_allreduce_for_tp", "allreduce_for_tp", "scatter_and_merge_for_tp", "all_to_all_for_tp",
    "reduce_scatter_for_tp", "gather_replicated_for_tp", "split_for_tp",
    "collective_counts", "CollectiveCounts", "set_shape_checks",
    # settings and randomness
    "TPConfig", "tp_config", "current_config", "set_default_config",
    "set_tensor_parallel_seed", "get_generator", "tp_dropout", "tp_rank", "tp_size",
    "get_rng_state", "set_rng_state", "checkpoint_context",
]
