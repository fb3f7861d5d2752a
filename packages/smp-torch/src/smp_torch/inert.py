"""Settings that are accepted but change nothing in this job: each warns once, saying why.

A key such as ``static_mode`` is valid in every configuration, but only some configurations
act on it; a user who sets it and sees no effect should not have to read the source to find
out. :func:`inert_settings` decides (pure: a configuration and a few facts about the job in,
``(key, reason)`` pairs out); :func:`warn_inert` tells, once per key and process, on rank 0
only (every rank reaches the same verdict, one line is enough).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings

from torch import nn

from smp_torch.annotations import get_checkpoint_mark
from smp_torch.config import SMPConfig

__all__ = ["InertSettingWarning", "inert_settings", "warn_inert", "has_checkpointed_module"]


class InertSettingWarning(UserWarning):
    """A configuration key was set but has no effect in this job (the message says why)."""


_lock = threading.Lock()
_warned: set[str] = set()


def _default(key: str) -> object:
    return next(f.default for f in dataclasses.fields(SMPConfig) if f.name == key)


def has_checkpointed_module(module: nn.Module) -> bool:
    """Whether ``smp.set_activation_checkpointing`` marked any module under ``module``."""
    return any(get_checkpoint_mark(m) is not None for m in module.modules())


def inert_settings(cfg: SMPConfig, device_type: str, checkpointed: bool) -> list[tuple[str, str]]:
    """The keys ``cfg`` sets that will do nothing, each with the reason, for a job on
    ``device_type`` devices whose model has (``checkpointed``) or lacks activation
    checkpointing marks."""
    inert: list[tuple[str, str]] = []
    if cfg.static_mode and cfg.pp == 1:
        inert.append(("static_mode", "it replays recorded pipeline programs, and "
                      "pipeline_parallel_degree is 1 (there is no pipeline)"))
    if cfg.offload_activations and not checkpointed:
        inert.append(("offload_activations", "it moves the inputs that checkpointed modules keep "
                      "for backward to the host, and no module is marked with "
                      "smp.set_activation_checkpointing"))
    if (cfg.sdp > 1 and device_type == "cpu"
            and cfg.sdp_max_live_parameters != _default("sdp_max_live_parameters")):
        inert.append(("sdp_max_live_parameters", "it bounds FSDP2's prefetching, and on CPU "
                      "all-gathers block (nothing to overlap), so smp does not prefetch"))
    return inert


def warn_inert(inert: list[tuple[str, str]], rank: int) -> None:
    """Warn (:class:`InertSettingWarning`) about each key of ``inert`` not yet warned about in
    this process, on rank 0 only."""
    if rank != 0:
        return
    for key, why in inert:
        with _lock:
            if key in _warned:
                continue
            _warned.add(key)
        warnings.warn(f"smp: '{key}' has no effect here: {why}", InertSettingWarning, stacklevel=3)
