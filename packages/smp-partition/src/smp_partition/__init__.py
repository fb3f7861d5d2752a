"""Pure-Python tree partitioner: splits a module hierarchy across pipeline devices (no torch, no numpy).

>>> from smp_partition import ModuleGraph, Module, partition
>>> g = ModuleGraph([Module("", children=("a", "b")),
...                  Module("a", params={"a.w": 10}), Module("b", params={"b.w": 10})])
>>> partition(g, num_devices=2).assignment
{'': 0, 'a': 0, 'b': 1}
"""

from smp_partition.__about__ import __version__
from smp_partition.api import METHODS, partition
from smp_partition.errors import GraphError, PartitionError
from smp_partition.graph import SCHEMA, Module, ModuleGraph
from smp_partition.result import ASSIGNMENT_SCHEMA, PartitionResult

__all__ = [
    "ASSIGNMENT_SCHEMA",
    "METHODS",
    "SCHEMA",
    "GraphError",
    "Module",
    "ModuleGraph",
    "PartitionError",
    "PartitionResult",
    "__version__",
    "partition",
]
