"""Usage: gil_hold.py. Two ranks, ``timeout_s`` = 3: rank 1 holds the GIL for about 7 s in one C
call (a regular expression that backtracks), so its failure watcher sends no heartbeat, while
its process runs. Rank 0 must not take it for frozen (it would kill it): the job must end
normally, both ranks printing ``RANK r DONE``; rank 0 says why it waited."""

from __future__ import annotations

import re
import time

import smp_torch as smp
from mpi4py import MPI

TIMEOUT_S = 3.0
HOLD_S = 7.0


def _hold_for(seconds: float) -> float:
    """One call that holds the GIL about ``seconds`` (calibrated here); returns its length."""
    pattern = re.compile(r"(a|aa)*c")  # ~1.6x slower per extra "a", all inside one C call
    n, took = 18, 0.0
    while took < 0.05:
        n += 1
        start = time.perf_counter()
        pattern.fullmatch("a" * n)
        took = time.perf_counter() - start
    while took < seconds:
        n += 1
        took *= 1.618
    start = time.perf_counter()
    pattern.fullmatch("a" * n)
    return time.perf_counter() - start


def main() -> None:
    smp.init({"timeout_s": TIMEOUT_S})
    rank = smp.rank()
    MPI.COMM_WORLD.Barrier()
    if rank == 1:
        held = _hold_for(HOLD_S)
        print(f"RANK 1 HELD {held:.1f}", flush=True)
    # (A raw barrier: smp's own waits are bounded by timeout_s, and rank 0 arrives first.)
    MPI.COMM_WORLD.Barrier()
    print(f"RANK {rank} DONE", flush=True)


if __name__ == "__main__":
    main()
