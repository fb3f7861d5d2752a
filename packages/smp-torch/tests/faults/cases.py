"""The fault matrix: which rank fails how, in which configuration. One list, shared by the
fault suite (``test_faults.py``, which asserts how each job ends and what each rank says) and
the fault benchmark (``benchmarks/bench_faults.py``, which times the same jobs: the seconds
from the fault to the end of the last rank's process). No pytest here.

Configurations and faults are ``inject.py``'s; each case is one job.
"""

from __future__ import annotations

from dataclasses import dataclass

BY_TIMEOUT = ("stall", "sigstop")  # faults only a timeout can find
# The role of each rank in a configuration (named in the printed tables).
ROLES = {
    "pp2": ["driver", "server"],
    "tp2": ["tp peer", "tp peer"],
    "dp2": ["dp peer", "dp peer"],
    "pp2dp2": ["driver", "server", "driver", "server"],
    "dp2smp": ["dp peer", "dp peer"],
}


@dataclass(frozen=True)
class Case:
    fault: str
    config: str
    victim: int
    launcher: str = "hydra"  # "hydra": plain mpiexec; "shell": ranks under a waiting shell
    env: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        extra = "-heartbeat" if self.env else ""
        return f"{self.fault}-{self.config}-rank{self.victim}-{self.launcher}{extra}"


CASES = [
    Case("before_step", "pp2", 1),
    Case("before_step", "tp2", 0),
    Case("forward", "dp2", 1),
    Case("forward", "pp2dp2", 1),
    Case("backward", "pp2", 0),
    Case("backward", "pp2dp2", 3),
    Case("after_step", "dp2", 0),
    Case("after_step", "pp2dp2", 2),
    Case("optimizer", "tp2", 1),
    Case("optimizer", "pp2", 1),
    Case("thread", "dp2", 1),
    Case("forward", "dp2smp", 1),
    # A peer fails while the other waits in an smp-backend all-reduce of gradients: the
    # failed step marks the smp groups failed, so the waiter raises and exits at once (a
    # fresh-clone run before that: 18 s, each rank's exit waiting for the other).
    Case("backward", "dp2smp", 1),
    Case("thread", "dp2smp", 1),
    Case("raw_collective", "dp2", 1),
    Case("kill", "pp2", 0, "shell"),
    Case("kill", "pp2dp2", 3, "shell"),
    Case("kill", "tp2", 1, "shell"),
    Case("kill", "dp2", 0, "shell"),
    Case("kill", "dp2smp", 1, "shell"),
    Case("kill", "dp2", 1, "shell", (("SMP_FAILURE_PROC_CHECK", "0"),)),
    Case("kill", "pp2", 1, "hydra"),
    Case("truncate", "pp2", 0),
    Case("flip", "tp2", 1),
    Case("no_manifest", "dp2", 0),
    Case("pickle", "pp2", 1),
    Case("save_kill", "pp2", 1, "shell"),
    Case("save_kill", "dp2", 0, "shell"),
    Case("save_error", "pp2", 1),
    Case("save_gather", "pp2dp2", 3),
    Case("microbatches", "dp2", 1),
    Case("bad_config", "dp2", 1),
    Case("bad_config", "pp2dp2", 3),
    Case("batch", "dp2", 1),
    Case("batch", "pp2dp2", 2),
    Case("batch", "tp2", 0),
]


# Issue 49: faults that used to hang a job or blame the wrong rank. A frozen rank (SIGSTOP,
# alive in /proc) and a stall in user code (a module's forward that never returns) on
# stage 0 or at pp = 1: every rank must end (within timeout_s + HANG_S of the fault), and
# every rank that can still speak must name the culprit (and, for a stall, its module).
NO_HANG_CASES = [
    Case("sigstop", "pp2", 1, "shell"),
    Case("sigstop", "dp2", 1, "shell"),
    Case("stall", "pp2", 0),
    Case("stall", "tp2", 0),
    Case("stall", "dp2", 1),
]

# The stalled module: at pp = 2 a module's forward on rank 1 never returns; the pipeline's
# request timeout ends the job (``test_faults.py::test_stalled_module``).
STALLED_MODULE = Case("stall", "pp2", 1)

# Every job of the suite, in its order (the benchmark times these).
ALL = [*CASES, STALLED_MODULE, *NO_HANG_CASES]
