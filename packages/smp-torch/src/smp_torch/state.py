"""``smp.init`` and the public rank helpers: they read the current context.

The context itself (configuration, topology, groups, the step agreement) is
:class:`smp_torch.context.SMPContext`; internals receive it instead of reading it here.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from typing import Any

import smp_tp
import torch.distributed as dist
from mpi4py import MPI
from smp_pipeline import shutdown_runtimes

from smp_torch import group_cache
from smp_torch.bootstrap import init_torch_distributed
from smp_torch.config import SMPConfig, parse_config
from smp_torch.config_agree import agree_on_config
from smp_torch.context import SMPContext, create_context
from smp_torch.errors import ConfigError, NotInitializedError
from smp_torch.waits import wait_for_step_threads

__all__ = [
    "init",
    "is_initialized",
    "state",
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
    "cp_rank",
    "cp_size",
    "ep_rank",
    "ep_size",
    "rdp_size",
    "mp_rank",
    "mp_size",
    "get_pp_group",
    "get_tp_group",
    "get_cp_group",
    "get_cp_process_group",
    "get_dp_group",
    "get_rdp_group",
    "get_mp_group",
    "get_world_group",
    "get_pp_process_group",
    "get_tp_process_group",
    "get_dp_process_group",
    "get_rdp_process_group",
    "get_mp_process_group",
    "get_world_process_group",
]

_STATE: SMPContext | None = None


def is_initialized() -> bool:
    """Whether :func:`init` has run in this process."""
    return _STATE is not None


def state() -> SMPContext:
    """The current :class:`~smp_torch.context.SMPContext`; raises
    :class:`NotInitializedError` before :func:`init`."""
    if _STATE is None:
        raise NotInitializedError("call smp.init(config) first")
    return _STATE


def _close_previous(world: Any) -> None:
    """Collective over ``world``: close the previous context; after a failure anywhere under
    it, no rank reuses its process groups (:mod:`smp_torch.group_cache`)."""
    global _STATE
    if _STATE is None:
        return
    failed = world.allreduce(_STATE.failed(), op=MPI.LOR)
    _STATE.close()
    _STATE.release(failed)
    _STATE = None
    smp_tp.set_default_config(**vars(smp_tp.TPConfig()))  # smp-tp's own defaults again


_EXIT_REGISTERED = False


def _register_exit() -> None:
    # Registered after every smp import, so it runs before their own exit handlers (LIFO).
    global _EXIT_REGISTERED
    _EXIT_REGISTERED = True
    atexit.register(_shutdown)


def _shutdown() -> None:
    """At exit: end smp's threads, then release the process groups smp created.

    The groups are destroyed while the interpreter is fully alive, once no smp thread is
    inside one of their collectives (see :mod:`smp_comm.shutdown`)."""
    shutdown_runtimes()
    wait_for_step_threads()
    if dist.is_initialized():
        dist.destroy_process_group()
        group_cache.forget_all()


def init(config: Mapping[str, Any] | str | os.PathLike[str] | None = None) -> SMPConfig:
    """Initialise smp: validate ``config``, start ``torch.distributed``, build the groups.

    ``config`` is a dict, a path to a JSON file, or ``None`` to read the ``SMP_CONFIG``
    environment variable (JSON text or a path). Each rank validates its configuration
    locally, then the ranks compare their results (:mod:`smp_torch.config_agree`): a
    configuration invalid on any rank, or different between ranks (but for ``timeline``,
    ``timeout_s`` and ``trace_device``), raises :class:`smp.ConfigError` on every rank,
    naming the key and the ranks, before anything else is set up. A rank that does not reach
    ``init`` within ``timeout_s`` makes the others raise :class:`smp.SMPError` naming it
    (rank 0 names every missing rank). Calling ``init`` again replaces the configuration
    (every rank must do so, in the same order).
    """
    global _STATE
    world = MPI.COMM_WORLD
    # Local validation first, its error kept rather than raised: a rank raising here alone
    # would leave the others waiting for it in the exchange below.
    parsed: SMPConfig | ConfigError
    try:
        parsed = parse_config(config, world.Get_size())
    except ConfigError as exc:
        parsed = exc
    # Every rank learns whether every rank's configuration is valid and the same (bounded by
    # timeout_s), and raises if not: nothing below runs on any rank then.
    cfg = agree_on_config(parsed, world)
    _close_previous(world)
    if init_torch_distributed(world, cfg.timeout_s) and not _EXIT_REGISTERED:
        _register_exit()
    _STATE = create_context(cfg)
    # smp.nn layers the user builds outside smp.tensor_parallelism() (the SageMaker way:
    # smp.nn.DistributedLinear(...) in the model's own __init__) split over this job's
    # tensor-parallel group with its settings; smp_tp's own default is the world group.
    smp_tp.set_default_config(
        tp_group=_STATE.process_groups["tp"], prescaled_batch=cfg.prescaled_batch,
        optimize=cfg.optimize,
    )
    return cfg


def rank() -> int:
    """Global rank of this process."""
    return state().rank


def size() -> int:
    """Number of processes in the job."""
    return state().size


def local_rank() -> int:
    """Rank of this process among the processes on its node."""
    return state().local_rank


def local_size() -> int:
    """Number of processes on this node."""
    return state().local_size


def _index(kind: str) -> int:
    return state().index(kind)


def pp_rank() -> int:
    """Index of this rank in its pipeline (its pipeline stage)."""
    return _index("pp")


def pp_size() -> int:
    return state().config.pp


def tp_rank() -> int:
    """Index of this rank in its tensor-parallel group."""
    return _index("tp")


def tp_size() -> int:
    return state().config.tp


def dp_rank() -> int:
    """Index of this rank in its data-parallel group (TP peers included)."""
    return _index("dp")


def dp_size() -> int:
    return state().config.tp * state().config.rdp


def rdp_rank() -> int:
    """Index of this rank among the replicas holding identical parameters."""
    return _index("rdp")


def rdp_size() -> int:
    return state().config.rdp


def ep_rank() -> int:
    """Index of this rank in its expert-parallel group (0 with ``expert_parallel_degree`` 1)."""
    return _index("ep") if state().config.ep > 1 else 0


def ep_size() -> int:
    return state().config.ep


def cp_rank() -> int:
    """Index of this rank in its context-parallel group: which share of every sequence it
    keeps (0 with ``context_parallel_degree`` 1)."""
    return _index("cp")


def cp_size() -> int:
    return state().config.cp


def mp_rank() -> int:
    """Index of this rank in its model-parallel group (one whole model replica)."""
    return _index("mp")


def mp_size() -> int:
    return state().config.pp * state().config.tp


def get_world_group() -> list[int]:
    return list(state().groups["world"])


def get_pp_group() -> list[int]:
    """Global ranks of this rank's pipeline group."""
    return list(state().groups["pp"])


def get_tp_group() -> list[int]:
    return list(state().groups["tp"])


def get_dp_group() -> list[int]:
    return list(state().groups["dp"])


def get_rdp_group() -> list[int]:
    return list(state().groups["rdp"])


def get_cp_group() -> list[int]:
    """Global ranks that split this rank's sequences (this rank alone with cp 1)."""
    return list(state().groups["cp"])


def get_mp_group() -> list[int]:
    return list(state().groups["mp"])


def get_world_process_group() -> Any:
    return state().process_groups["world"]


def get_pp_process_group() -> Any:
    """The ``torch.distributed`` group of this rank's pipeline."""
    return state().process_groups["pp"]


def get_tp_process_group() -> Any:
    return state().process_groups["tp"]


def get_dp_process_group() -> Any:
    return state().process_groups["dp"]


def get_rdp_process_group() -> Any:
    return state().process_groups["rdp"]


def get_cp_process_group() -> Any:
    """The ``torch.distributed`` group of :func:`get_cp_group` (None with cp 1)."""
    return state().process_groups["cp"]


def get_mp_process_group() -> Any:
    return state().process_groups["mp"]
