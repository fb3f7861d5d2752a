"""Tensor-parallel drop-in layers for PyTorch, across data-parallel ranks or Megatron-style; torch only."""

from smp_tp.__about__ import __version__

__all__ = ["__version__"]
