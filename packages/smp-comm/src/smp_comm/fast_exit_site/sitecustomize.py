"""Put on ``PYTHONPATH`` by :func:`smp_comm.testing.run_mpi` (``fast_exit=True``) only.

At the end of interpreter finalization CPython collects every generation of the cyclic
garbage collector, which walks every object still alive: with torch (and transformers)
imported that is 0.5 s of CPU per process, over 3 s for a process that built a 369 M
parameter model, measured on the 2-core CI machine, and a test job pays it once per rank.
Freezing the collector's objects as the last exit handler (registered first, run last)
makes those collections skip them; reference counting still frees everything that is not
in a cycle. A test job whose exit is its subject (a failed step's shutdown, an abort)
launches without this, so it exits as a user's process does.
"""

import atexit
import gc

atexit.register(gc.freeze)
