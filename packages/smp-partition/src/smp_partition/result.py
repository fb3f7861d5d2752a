"""The partition result and its JSON form (schema ``smp-partition/assignment@1``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from smp_partition.errors import GraphError

ASSIGNMENT_SCHEMA = "smp-partition/assignment@1"


@dataclass(frozen=True)
class PartitionResult:
    """Which device runs each module, and how balanced that is.

    ``loads[d]`` is the sum of normalised module costs on device ``d`` (the loads sum to 1);
    ``lower_bound`` is ``max(1/D, largest node cost)``, a bound no partition can beat since a
    node's modules share parameters and so stay together; ``cut_edges`` are the
    parent→child module edges whose ends run on different devices (each costs a request
    round in the module-server runtime).
    """

    num_devices: int
    alpha: float
    method: str
    assignment: dict[str, int]
    loads: list[float]
    max_load: float
    lower_bound: float
    cut_edges: list[tuple[str, str]]
    parameters: list[int] = field(default_factory=list)
    """Parameter elements per device (shared parameters counted once)."""
    module_counts: list[int] = field(default_factory=list)
    """Modules per device."""

    @property
    def gap(self) -> float:
        """Relative excess of ``max_load`` over ``lower_bound`` (0.02 means 2 %)."""
        return self.max_load / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0

    def device_of(self, module: str) -> int:
        """The device of one module."""
        return self.assignment[module]

    def modules_on(self, device: int) -> list[str]:
        """Names of the modules assigned to ``device``, in graph order."""
        return [m for m, d in self.assignment.items() if d == device]

    def to_dict(self) -> dict[str, Any]:
        """The ``smp-partition/assignment@1`` dict."""
        return {
            "schema": ASSIGNMENT_SCHEMA,
            "num_devices": self.num_devices,
            "alpha": self.alpha,
            "method": self.method,
            "assignment": dict(self.assignment),
            "loads": list(self.loads),
            "max_load": self.max_load,
            "lower_bound": self.lower_bound,
            "cut_edges": [[p, c] for p, c in self.cut_edges],
        }

    def to_json(self, path: str | os.PathLike[str] | None = None, indent: int | None = None) -> str:
        """The assignment as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PartitionResult:
        """Read back a ``smp-partition/assignment@1`` dict (parameters/module counts empty)."""
        if not isinstance(data, Mapping) or data.get("schema") != ASSIGNMENT_SCHEMA:
            got = data.get("schema") if isinstance(data, Mapping) else type(data).__name__
            raise GraphError(f"unknown schema {got!r} (expected {ASSIGNMENT_SCHEMA!r})")
        try:
            return cls(
                num_devices=int(data["num_devices"]),
                alpha=float(data["alpha"]),
                method=str(data["method"]),
                assignment={str(k): int(v) for k, v in data["assignment"].items()},
                loads=[float(x) for x in data["loads"]],
                max_load=float(data["max_load"]),
                lower_bound=float(data["lower_bound"]),
                cut_edges=[(str(p), str(c)) for p, c in data["cut_edges"]],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise GraphError(f"malformed assignment: {e!r}") from None
