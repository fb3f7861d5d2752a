"""The public surface of ``import smp_torch as smp`` (no MPI job needed)."""

from __future__ import annotations

import pytest
import smp_torch as smp
import smp_tp
import torch
from torch import nn


def test_tensor_parallel_api_is_smp_tp() -> None:
    assert smp.nn.DistributedLinear is smp_tp.DistributedLinear
    assert smp.nn.DistributedTransformerLMHead is smp_tp.DistributedTransformerLMHead
    assert smp.nn.DistributedModule is smp_tp.DistributedModule
    assert smp.tensor_parallelism is smp_tp.tensor_parallelism
    assert smp.set_tensor_parallelism is smp_tp.set_tensor_parallelism
    assert smp.tp_register is smp_tp.tp_register
    assert smp.tp_register_with_module is smp_tp.tp_register_with_module
    for name in ("parameter_creation_scope", "initialize_with_input_partition",
                 "fused_allgather_for_tp", "reduce_scatter_for_tp", "scatter_and_merge_for_tp"):  # fmt: skip
        assert callable(getattr(smp.nn.utils, name)), name
    with pytest.raises(AttributeError, match="smp.nn has no attribute"):
        _ = smp.nn.NoSuchLayer


def test_partition_marks_and_checkpointing_marks() -> None:
    from smp_torch.annotations import get_checkpoint_mark, get_partition_mark

    with smp.partition(1):
        inner = nn.Linear(2, 2)
        with smp.partition(0):
            innermost = nn.Linear(2, 2)
    outside = nn.Linear(2, 2)
    assert get_partition_mark(inner) == 1 and get_partition_mark(innermost) == 0
    assert get_partition_mark(outside) is None
    smp.set_partition(outside, 3)
    assert get_partition_mark(outside) == 3
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    smp.set_activation_checkpointing(seq, strategy="group_2")
    assert get_checkpoint_mark(seq) == {"preserve_rng_state": True, "pack_args_as_tuple": False, "strategy": "group_2"}
    with pytest.raises(ValueError, match="only to nn.Sequential"):
        smp.set_activation_checkpointing(nn.Linear(2, 2), strategy="contiguous")
    with pytest.raises(ValueError, match="strategy"):
        smp.set_activation_checkpointing(seq, strategy="groups_2")


def test_partition_and_tensor_parallelism_nest_and_interleave() -> None:
    from smp_torch.annotations import get_partition_mark

    plain = nn.Module.__init__
    with smp.partition(1):
        with smp.tensor_parallelism():
            both = nn.Linear(2, 2)
        after_tp = nn.Linear(2, 2)  # tensor_parallelism() ended inside: stage marks stay on
    with smp.tensor_parallelism():
        with smp.partition(0):
            both_again = nn.Linear(2, 2)
        after_stage = nn.Linear(2, 2)  # and the reverse
    assert get_partition_mark(both) == 1 and smp_tp.is_tensor_parallel_enabled(both)
    assert get_partition_mark(after_tp) == 1 and not smp_tp.is_tensor_parallel_enabled(after_tp)
    assert get_partition_mark(both_again) == 0 and smp_tp.is_tensor_parallel_enabled(both_again)
    assert get_partition_mark(after_stage) is None and smp_tp.is_tensor_parallel_enabled(after_stage)
    stage, tp = smp.partition(2), smp.tensor_parallelism()
    stage.__enter__()
    tp.__enter__()
    stage.__exit__(None, None, None)  # leaves before the block entered after it
    only_tp = nn.Linear(2, 2)
    tp.__exit__(None, None, None)
    assert get_partition_mark(only_tp) is None and smp_tp.is_tensor_parallel_enabled(only_tp)
    assert nn.Module.__init__ is plain


def test_delay_param_initialization_creates_meta_parameters() -> None:
    with smp.delay_param_initialization():
        m = nn.Linear(1000, 1000)
    assert m.weight.is_meta and m.weight.numel() == 10**6
    assert not torch.empty(1).is_meta


def test_calls_before_init_say_so() -> None:
    if smp.is_initialized():
        pytest.skip("initialised by another test in this process")
    with pytest.raises(smp.NotInitializedError, match="smp.init"):
        smp.rank()
    with pytest.raises(smp.NotInitializedError):
        smp.DistributedModel(nn.Linear(2, 2))


def test_unknown_keyword_arguments_raise_type_error() -> None:
    # Checked before anything else (also before smp.init): a typo must not be ignored.
    with pytest.raises(TypeError, match="overlap_grad_reductoin"):
        smp.DistributedModel(nn.Linear(2, 2), overlap_grad_reductoin=False)
    with pytest.raises(TypeError, match="average_grads_across_microbatches"):
        smp.DistributedModel(nn.Linear(2, 2), average_grads_across_microbatches=True)
    with pytest.raises(TypeError):
        smp.DistributedOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), clip=1.0)
    with pytest.raises(TypeError):
        smp.step(non_split_input=["x"])
