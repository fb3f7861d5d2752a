"""On ``PYTHONPATH`` for the torchrun jobs of :func:`launch.torchrun` (not the failure cases):
freezes the garbage collector's objects as the last exit handler, so interpreter
finalization skips walking them (0.5 s of CPU per process with torch and transformers
imported, on the 2-core CI machine). smp-comm's ``run_mpi(fast_exit=True)`` does the same
for MPI jobs; smp-tp's tests cannot import smp-comm."""

import atexit
import gc

atexit.register(gc.freeze)
