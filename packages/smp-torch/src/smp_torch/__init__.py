"""smp: model parallelism for PyTorch (pipeline, tensor and data parallel), the umbrella package."""

from smp_torch.__about__ import __version__

__all__ = ["__version__"]
