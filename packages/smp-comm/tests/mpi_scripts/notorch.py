"""smp-comm without torch: block ``import torch`` first, then move numpy arrays (shm + mpi)."""

from __future__ import annotations

import sys
import warnings

sys.modules["torch"] = None  # makes every `import torch` raise ImportError

import numpy as np  # noqa: E402
import smp_comm  # noqa: E402
from mpi4py import MPI  # noqa: E402
from payloads import case_ok, check, main_guard, make  # noqa: E402
from smp_comm import serialize  # noqa: E402


def main() -> None:
    assert serialize.torch is None, "torch must be blocked in this test"
    world = MPI.COMM_WORLD
    rank, peer = world.rank, 1 - world.rank
    configs = (
        ("shm", {}, "shm"),
        ("shm-disabled", {"disable": "shm"}, "mpi"),
        # More than /dev/shm holds: a warning, then the MPI path (never SIGBUS later).
        ("shm-too-big", {"buffer_bytes": "100000G"}, "mpi"),
    )
    for case, kwargs, path in configs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comm = smp_comm.Communicator(world, **kwargs)
        big = "buffer_bytes" in kwargs
        assert any("cannot reserve" in str(w.message) for w in caught) == big, caught
        handles = [comm.isend(make(rank, peer, t), dest=peer, tag=t) for t in range(4)]
        for t in reversed(range(4)):
            obj, src, tag = comm.irecv(peer, t).wait(timeout=60)
            check(obj, peer, rank, t)
            assert "f32_grad" not in obj and isinstance(obj["np_big"], np.ndarray)
        for h in handles:
            h.wait(timeout=60)
        assert comm.stats()[path]["messages_received"] == 4, comm.stats()
        comm.close()
        case_ok(case)
    assert "torch" not in sys.modules or sys.modules["torch"] is None
    print(f"rank {rank} OK notorch")


main_guard(main)
