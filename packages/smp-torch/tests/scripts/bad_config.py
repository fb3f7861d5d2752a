"""Each bad configuration must raise smp.ConfigError on every rank, naming the key.

Prints ``RANK <r> CONFIGERROR <key>`` for every case; ``--uncaught N`` lets case N escape
instead (the job must then fail quickly with the error in every rank's output).
"""

from __future__ import annotations

import sys
import time

import smp_torch as smp

CASES = [
    ({"pipeline_parallel_degree": 3}, "pipeline_parallel_degree"),
    ({"tensor_parallel_degree": 3}, "tensor_parallel_degree"),
    ({"no_such_key": 1}, "no_such_key"),
    ({"microbatches": "4"}, "microbatches"),
    ({"ddp": 1}, "ddp"),
    ({"placement_strategy": "DPX"}, "placement_strategy"),
    ({"pipeline": "fancy"}, "pipeline"),
    ({"memory_weight": 1.5}, "memory_weight"),
    ({"tensor_parallel_degree": 2, "ddp": False}, "ddp"),
]


def main() -> None:
    uncaught = int(sys.argv[sys.argv.index("--uncaught") + 1]) if "--uncaught" in sys.argv else -1
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    for i, (config, key) in enumerate(CASES):
        if i == uncaught:
            # When the error starts (wall clock): the test bounds the time from here to the
            # end of the job, not the imports before it, which a busy machine stretches.
            print(f"RANK {rank} RAISING AT {time.time():.3f}", flush=True)
            smp.init(config)
        try:
            smp.init(config)
        except smp.ConfigError as exc:
            assert exc.key == key, (exc.key, key)
            assert key in str(exc)
            print(f"RANK {rank} CONFIGERROR {key}", flush=True)
        else:
            raise AssertionError(f"config {config} was accepted")
    assert not smp.is_initialized()


if __name__ == "__main__":
    main()
