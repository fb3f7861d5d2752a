"""``smp.nn``: smp-tp's distributed modules (``smp.nn.DistributedLinear``, ...).

Every attribute is looked up in :mod:`smp_tp`, so ``smp.nn`` always offers exactly what the
installed smp-tp provides. ``smp.nn.utils`` holds the primitives for custom distributed modules
(paper Appendix I.6).
"""

from __future__ import annotations

from typing import Any

import smp_tp

from smp_torch import nn_utils


def __getattr__(name: str) -> Any:
    if name == "utils":
        return nn_utils
    try:
        return getattr(smp_tp, name)
    except AttributeError:
        raise AttributeError(f"smp.nn has no attribute {name!r} (not provided by smp_tp)") from None


def __dir__() -> list[str]:
    return sorted(set(getattr(smp_tp, "__all__", dir(smp_tp))) | {"utils"})
