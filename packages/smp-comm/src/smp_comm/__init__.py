"""On-demand tensor message backend over MPI with shared-memory, RMA and CUDA-IPC direct paths."""

from smp_comm.__about__ import __version__

__all__ = ["__version__"]
