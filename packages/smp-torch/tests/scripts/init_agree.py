"""``smp.init`` when the ranks' configurations differ in validity or value, or a rank comes
late: every rank must raise the same kind of error, quickly, and none may wait for good.

Runs on 2 ranks. For each case prints ``RANK r CASE name <seconds> <ExceptionType>: <message>``
(or ``... OK``); ``--uncaught NAME`` runs only case NAME and lets its error escape (the job
must then exit non-zero, every rank having said why).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import smp_torch as smp
from mpi4py import MPI

RANK = MPI.COMM_WORLD.Get_rank()
VALID = {"microbatches": 2}

# name -> (rank 0's config, rank 1's config, seconds rank 0 / rank 1 sleeps before smp.init)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], float, float]] = {
    # A misspelt key on rank 1 only: rank 0 used to wait for it in an allgather for good.
    "typo": (VALID, {"microbatchs": 2}, 0.0, 0.0),
    # An impossible value on rank 0 only.
    "value0": ({"microbatches": 0}, VALID, 0.0, 0.0),
    # Both invalid, differently: each rank leads with its own key.
    "two_keys": ({"bogus": 1}, {"microbatches": "2"}, 0.0, 0.0),
    # Both invalid alike.
    "both": ({"bogus": 1}, {"bogus": 1}, 0.0, 0.0),
    # Valid but different: the existing "ranks disagree" error.
    "disagree": (VALID, {"microbatches": 4}, 0.0, 0.0),
    # Rank 1 arrives after rank 0's timeout_s: both must name rank 1.
    "late1": ({**VALID, "timeout_s": 1.0}, {**VALID, "timeout_s": 1.0}, 0.0, 2.5),
    # Rank 0 arrives after rank 1's timeout_s: rank 1 names rank 0, and rank 0 must not go
    # on alone (rank 1 gave up) but say that rank 1 gave up.
    "late0": ({**VALID, "timeout_s": 30.0}, {**VALID, "timeout_s": 1.0}, 2.5, 0.0),
    # Per-rank keys may differ; the ranks agree.
    "ok": ({**VALID, "timeout_s": 60.0}, {**VALID, "timeout_s": 61.0}, 0.0, 0.0),
}


def _say(line: str) -> None:
    # One write per line: print() writes the text and its newline apart, and the launcher
    # can put the other rank's output in between (seen: "... OKRANK 0 CASE ok ...").
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run(name: str, uncaught: bool) -> None:
    config0, config1, sleep0, sleep1 = CASES[name]
    # Start every case together (a timed-out case leaves the ranks apart), so that the sleeps
    # alone decide which rank is late, by 1.5 s more than a timeout_s.
    MPI.COMM_WORLD.Barrier()
    time.sleep(sleep0 if RANK == 0 else sleep1)
    start = time.monotonic()
    try:
        smp.init(config0 if RANK == 0 else config1)
    except smp.SMPError as exc:
        took = time.monotonic() - start
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else "-"
        _say(f"RANK {RANK} CASE {name} {took:.2f} {type(exc).__name__}: {exc} [cause {cause}]")
        if uncaught:
            raise
    else:
        took = time.monotonic() - start
        _say(f"RANK {RANK} CASE {name} {took:.2f} OK")


def main() -> None:
    if "--uncaught" in sys.argv:
        run(sys.argv[sys.argv.index("--uncaught") + 1], uncaught=True)
        return
    for name in CASES:
        run(name, uncaught=False)
    _say(f"RANK {RANK} DONE initialized={smp.is_initialized()}")


if __name__ == "__main__":
    main()
