"""``smp.nn.utils``: smp-tp's primitives for writing custom distributed modules."""

from __future__ import annotations

from typing import Any

import smp_tp


def __getattr__(name: str) -> Any:
    for owner in (smp_tp, getattr(smp_tp, "primitives", None), getattr(smp_tp, "utils", None)):
        if owner is not None and hasattr(owner, name):
            return getattr(owner, name)
    raise AttributeError(f"smp.nn.utils has no attribute {name!r} (not provided by smp_tp)")
