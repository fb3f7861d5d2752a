"""Module-server pipeline runtime for arbitrary PyTorch module hierarchies."""

from smp_pipeline.__about__ import __version__

__all__ = ["__version__"]
