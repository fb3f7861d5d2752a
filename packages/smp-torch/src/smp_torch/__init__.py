"""smp: model parallelism for PyTorch — pipeline, tensor and data parallel.

``import smp_torch as smp``; see the package README for the tour.
"""

from __future__ import annotations

from typing import Any

import smp_tp

from smp_torch import nn
from smp_torch.__about__ import __version__
from smp_torch.annotations import (
    delay_param_initialization,
    partition,
    set_activation_checkpointing,
    set_partition,
)
from smp_torch.checkpoint import CheckpointError, resume_from_checkpoint, save_checkpoint
from smp_torch.comm import CommGroup, RankType, allgather, barrier, broadcast, recv_from, send
from smp_torch.config import SMPConfig
from smp_torch.context_parallel import saved_activation_bytes, sequence_mean, sequence_share
from smp_torch.errors import ConfigError, NotInitializedError, PeerFailedError, SMPError, StallError
from smp_torch.inert import InertSettingWarning
from smp_torch.model import DistributedModel
from smp_torch.optimizer import DistributedOptimizer
from smp_torch.plan import plan
from smp_torch.report import ModelReport, ModuleReport, TPFallbackWarning
from smp_torch.state import (
    cp_rank,
    cp_size,
    dp_rank,
    dp_size,
    ep_rank,
    ep_size,
    get_cp_group,
    get_cp_process_group,
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_group,
    get_world_process_group,
    init,
    is_initialized,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    size,
    tp_rank,
    tp_size,
)
from smp_torch.step import StepOutput, step

WORLD = CommGroup.WORLD
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
DP_GROUP = CommGroup.DP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
MP_GROUP = CommGroup.MP_GROUP

# Re-exported from smp_tp, looked up on use (always what the installed smp_tp provides).
_FROM_TP = (
    "tensor_parallelism",
    "set_tensor_parallelism",
    "tp_register",
    "tp_register_with_module",
    "tp_register_block",
    "tp_register_vocab_parallel",
    "is_tensor_parallel_enabled",
)


def __getattr__(name: str) -> Any:
    if name in _FROM_TP:
        return getattr(smp_tp, name)
    raise AttributeError(f"module 'smp_torch' has no attribute {name!r}")


__all__ = [
    "__version__",
    "init",
    "is_initialized",
    "SMPConfig",
    "ConfigError",
    "SMPError",
    "NotInitializedError",
    "PeerFailedError",
    "StallError",
    "CheckpointError",
    "InertSettingWarning",
    "TPFallbackWarning",
    "ModelReport",
    "ModuleReport",
    "DistributedModel",
    "DistributedOptimizer",
    "plan",
    "step",
    "StepOutput",
    "nn",
    "partition",
    "set_partition",
    "set_activation_checkpointing",
    "delay_param_initialization",
    "save_checkpoint",
    "resume_from_checkpoint",
    "CommGroup",
    "RankType",
    "WORLD",
    "PP_GROUP",
    "TP_GROUP",
    "DP_GROUP",
    "RDP_GROUP",
    "MP_GROUP",
    "barrier",
    "broadcast",
    "send",
    "recv_from",
    "allgather",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "pp_rank",
    "pp_size",
    "tp_rank",
    "tp_size",
    "dp_rank",
    "dp_size",
    "rdp_rank",
    "rdp_size",
    "cp_rank",
    "cp_size",
    "ep_rank",
    "ep_size",
    "mp_rank",
    "mp_size",
    "get_world_group",
    "get_pp_group",
    "get_tp_group",
    "get_cp_group",
    "get_cp_process_group",
    "get_dp_group",
    "get_rdp_group",
    "get_mp_group",
    "get_world_process_group",
    "get_pp_process_group",
    "get_tp_process_group",
    "get_dp_process_group",
    "get_rdp_process_group",
    "get_mp_process_group",
    *_FROM_TP,
    "saved_activation_bytes",
    "sequence_mean",
    "sequence_share",
]
