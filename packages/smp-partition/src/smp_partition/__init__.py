"""Pure-Python tree partitioner: splits a module hierarchy across pipeline devices (no torch, no numpy)."""

from smp_partition.__about__ import __version__

__all__ = ["__version__"]
