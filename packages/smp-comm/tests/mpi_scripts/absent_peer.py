"""A peer that never joins a collective of an ``smp`` group, and a group aborted by one rank:
the waiting ranks raise ``PeerFailedError`` naming that peer by its job-wide rank (within the
group's timeout, or at once for an abort) instead of hanging. 3 ranks."""

from __future__ import annotations

import time
from datetime import timedelta

import smp_comm.torch_backend  # noqa: F401
import torch
import torch.distributed as dist
from mpi4py import MPI
from payloads import case_ok, init_smp_world, main_guard
from smp_comm.collectives.shm import PeerFailedError

WORLD = MPI.COMM_WORLD
RANK = WORLD.rank
TIMEOUT_S = 3
HANG_BOUND_S = 60  # a bound on a hang, not a latency target


def expect_failure(run, names: str, what: str) -> None:
    start = time.monotonic()
    try:
        run()
    except PeerFailedError as exc:
        assert names in str(exc), (what, str(exc))
        print(f"rank {RANK} [{what}] raised after {time.monotonic() - start:.2f} s: {exc}",
              flush=True)
    else:
        raise AssertionError(f"{what}: a collective a peer never joined returned")
    assert time.monotonic() - start < HANG_BOUND_S, what


def absent(group: dist.ProcessGroup, members: list[int], numel: int, what: str, label: str) -> None:
    """Every member but the last calls an all-reduce the last never joins."""
    if RANK in members[:-1]:
        expect_failure(lambda: dist.all_reduce(torch.ones(numel), group=group), label, what)
    WORLD.Barrier()
    case_ok(what)


def main() -> None:
    init_smp_world(600)
    short = timedelta(seconds=TIMEOUT_S)
    # One group per case: a group whose collective failed refuses later ones.
    small = dist.new_group(backend="smp", timeout=short)
    large = dist.new_group(backend="smp", timeout=short)
    pair = dist.new_group([1, 2], backend="smp", timeout=short)
    aborted = dist.new_group(backend="smp")  # 600 s: only the abort can end the wait
    # 64 B: started on the caller's thread, finished by the group's; 1 MiB: the group's.
    # (a rank may learn it from a peer that timed out first: "rank 1 timed out waiting for
    # rank 2 ...")
    absent(small, [0, 1, 2], 16, "absent-small", "waiting for rank 2")
    absent(large, [0, 1, 2], 1 << 18, "absent-large", "waiting for rank 2")
    absent(pair, [1, 2], 16, "absent-subgroup", "rank 2 (group rank 1)")
    if RANK == 0:
        time.sleep(1)  # the others are waiting in the all-reduce by now
        aborted.abort()
        expect_failure(lambda: dist.all_reduce(torch.ones(4), group=aborted), "rank 0",
                       "abort-after")
    else:
        expect_failure(lambda: dist.all_reduce(torch.ones(4), group=aborted), "rank 0", "abort")
    WORLD.Barrier()
    case_ok("abort")
    dist.destroy_process_group()


if __name__ == "__main__":
    main_guard(main)
