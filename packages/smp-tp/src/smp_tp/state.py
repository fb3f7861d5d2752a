"""Default tensor-parallel settings used by distributed modules built without explicit ones.

``parallelize`` and the umbrella set these through :func:`tp_config`; a module constructed
directly by the user picks them up unless it is given ``tp_group=``/``prescaled_batch=``/
``optimize=`` itself. The override is a :mod:`contextvars` variable, so a pipeline worker
thread that builds modules inside its own ``tp_config`` block does not affect other threads.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

OPTIMIZE_CHOICES = ("speed", "memory")


@dataclass(frozen=True)
class TPConfig:
    """Settings a :class:`~smp_tp.DistributedModule` falls back to."""

    tp_group: Any = None
    prescaled_batch: bool = False
    optimize: str = "speed"


_global = TPConfig()
_override: contextvars.ContextVar[TPConfig | None] = contextvars.ContextVar(
    "smp_tp_config", default=None
)


def check_optimize(optimize: str) -> str:
    """Validate an ``optimize`` value."""
    if optimize not in OPTIMIZE_CHOICES:
        raise ValueError(f"optimize must be one of {OPTIMIZE_CHOICES}, got {optimize!r}")
    return optimize


def current_config() -> TPConfig:
    """The settings in force here (innermost :func:`tp_config`, else the global default)."""
    cfg = _override.get()
    return cfg if cfg is not None else _global


def set_default_config(**changes: Any) -> TPConfig:
    """Change the process-wide defaults (``tp_group``, ``prescaled_batch``, ``optimize``)."""
    global _global
    if "optimize" in changes:
        check_optimize(changes["optimize"])
    _global = replace(_global, **changes)
    return _global


@contextmanager
def tp_config(**changes: Any) -> Iterator[TPConfig]:
    """Temporarily override the defaults for modules constructed inside the block."""
    if "optimize" in changes:
        check_optimize(changes["optimize"])
    token = _override.set(replace(current_config(), **changes))
    try:
        yield current_config()
    finally:
        _override.reset(token)
