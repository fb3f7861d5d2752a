"""``smp.plan``: choose pipeline, tensor, data and sharded-data degrees, microbatches and
activation checkpointing before launching a job, from a one-process profile.

>>> plan = smp.plan(build_model, sample_batch, world_size=4, memory_per_rank="2GiB")
>>> print(plan.table())
>>> smp.init(plan.best.config)                      # doctest: +SKIP

The search itself is :mod:`smp_partition.plan` (pure Python); this module measures the
profile (:mod:`smp_torch.plan.profiling`). ``python -m smp_torch.plan`` is the CLI.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from smp_partition.plan import CommModel, Estimate, Plan, Profile, search
from torch import nn

from smp_torch.plan.profiling import StepFn, profile_model

__all__ = ["CommModel", "Estimate", "Plan", "Profile", "parse_bytes", "plan", "profile_model"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}  # fmt: skip


def parse_bytes(value: str | int | float) -> int:
    """``"2GiB"``, ``"512 MiB"``, ``"1.5G"`` or a number of bytes → bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"memory must be > 0 bytes, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"memory must look like '2GiB', '512MiB' or a byte count, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def plan(
    model_fn: Callable[[], nn.Module],
    sample_batch: Any,
    world_size: int,
    memory_per_rank: str | int | float,
    step_fn: StepFn | None = None,
    *,
    pinned: Mapping[str, Any] | None = None,
    microbatch_options: Iterable[int] | None = None,
    profile: Profile | None = None,
    **profile_options: Any,
) -> Plan:
    """Rank every configuration of ``world_size`` ranks with ``memory_per_rank`` each.

    ``model_fn()`` builds the model (as the job would, before ``smp.DistributedModel``);
    ``sample_batch`` is one step's global batch; ``step_fn(model, batch) -> loss`` the
    step's forward (default: ``model(batch)`` summed). Nothing is launched: the model is
    profiled on this process (:func:`profile_model`, options passed through), then searched.
    ``pinned`` fixes any of ``pipeline_parallel_degree``, ``tensor_parallel_degree``,
    ``sharded_data_parallel_degree``, ``microbatches``, ``activation_checkpointing``.
    A ready ``profile`` skips the measurement.

    Returns a :class:`~smp_partition.plan.Plan`: ``plan.best.config`` is a dict ``smp.init``
    accepts (with ``plan.best.candidate.checkpointing`` telling whether to call
    ``smp.set_activation_checkpointing`` on ``plan.profile.checkpoint_units``),
    ``plan.table()`` prints the ranking, ``plan.why_not(config)`` explains a configuration.
    """
    budget = parse_bytes(memory_per_rank)
    if profile is None:
        profile = profile_model(model_fn, sample_batch, step_fn, **profile_options)
    return search(profile, world_size, budget, pinned=pinned, microbatch_options=microbatch_options)
