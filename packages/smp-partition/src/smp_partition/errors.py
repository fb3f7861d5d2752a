"""Exceptions raised by smp-partition.

Both derive from :class:`ValueError`, so callers that only want "bad input" can catch that.
Every message is a single line that names the module (or argument) at fault.
"""

from __future__ import annotations


class GraphError(ValueError):
    """A module graph is malformed: bad schema, unknown child, cycle, negative cost, ..."""


class PartitionError(ValueError):
    """The arguments of :func:`smp_partition.partition` are invalid (devices, alpha, method)."""
