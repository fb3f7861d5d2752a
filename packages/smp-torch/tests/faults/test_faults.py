"""The fault suite: one MPI job per (fault, configuration), each checked for how it ends.

Every case runs ``inject.py`` (one rank fails on purpose at its third step) and checks:

- the job's exit status (``mpiexec``'s) and every rank's are non-zero;
- every other rank says which rank failed (a ``PeerFailedError`` naming it);
- every rank's process ended within :data:`LIMIT_S` of the fault: the fault's time is printed
  by the script, and each rank's end is seen here, polling its pid in ``/proc`` (a rank may
  end by ``os._exit`` or be killed, where it can print nothing more);
- nothing the job mapped in ``/dev/shm`` is left there.

Checkpoint faults (``inject.py``'s docstring): a damaged checkpoint must be refused on every
rank (each names the file and itself), never loaded; a save that fails or is killed half-way
must fail on every rank and leave the previous checkpoint loadable (a second job resumes
from it), and a pickle that would run code must not run (its marker file must not exist).
Mismatch faults: every rank must raise an error naming the ranks and their values (a
configuration invalid on one rank only: naming that rank and the key).

Launchers: the exception faults run under plain ``mpiexec`` (MPICH's hydra). Hydra ends
every rank within milliseconds of one dying by a signal, before any process can notice (the
``kill`` case under plain ``hydra`` shows it; with ``-disable-auto-cleanup`` MPICH ends
them as fast). So the other SIGKILL faults run each rank under a shell that waits for it
(with ``-disable-auto-cleanup``): hydra sees the shell's normal exit, not the death, which
is how a launcher that leaves the other ranks running behaves, and smp's own detection is
what ends them. The table of the measured times is
printed in the terminal summary (``tests/conftest.py``).

A stalled module (``test_stalled_module``) fails nothing: the pipeline's request timeout ends
the job, and every rank's output must hold the chain of waits down to the stalled module.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import FAULT_TABLE
from smp_comm.testing import mpiexec_path, run_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "inject.py")
LIMIT_S = 10.0  # every rank must have ended this long after the fault
JOB_TIMEOUT_S = 120.0  # a hung job is killed (and the case fails) after this long

RANKS = {"pp2": 2, "tp2": 2, "dp2": 2, "pp2dp2": 4, "dp2smp": 2}
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

LOAD_FAULTS = {  # what every rank must say: the damaged file and what is wrong with it
    "truncate": r"ckpt/model_pp0\.pt has \d+ bytes where the manifest records \d+",
    "flip": r"checksum mismatch for \S*ckpt/model_pp0\.pt",
    "no_manifest": r"ckpt/manifest\.json is missing",
    "pickle": r"refused to load \S*ckpt/model_pp0\.pt.*GLOBAL posix\.mknod",
}
SAVE_FAULTS = ("save_kill", "save_error", "save_gather")
# What every rank must say after a mismatch ({victim}: the rank that differs).
MISMATCH = {
    "microbatches": r"ConfigError: smp config key 'microbatches': ranks disagree: "
    r"(?=.*4 on rank \[{victim}\])(?=.*2 on ranks? \[\d).*",
    # Issue 49: a typo on one rank only (that rank used to raise while the others waited
    # in smp.init forever).
    "bad_config": r"ConfigError: smp config key 'microbatchs': invalid on rank \[{victim}\]: "
    r"unknown key.*",
    "batch": r"SMPError: step 3: the (?:tensor-parallel )?ranks passed (?:batches of different "
    r"sizes|different inputs) to the step function \((?=.*2 on rank \[{victim}\]|.*rank "
    r"{victim}: x\(2, 4\)).*",
}



@dataclass
class Job:
    """What one launch printed and when each rank's process ended."""

    rc: int
    lines: list[str]
    pids: dict[int, int]
    ended: dict[int, float]
    finished: float
    out: str = ""
    by_rank: dict[int, list[str]] = field(default_factory=dict)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()[0]


def _launch(case: Case, root: str = "") -> Job:
    n = RANKS[case.config]
    argv = [sys.executable, SCRIPT, case.fault, case.config, str(case.victim), root]
    launcher = [mpiexec_path(), "-prepend-rank"]
    if case.launcher == "shell":
        # Each rank under a shell that waits for it: hydra sees the shell exit (normally),
        # not the rank's death. The shell survives hydra's SIGUSR1 failure notice (MPICH's
        # own handler takes it in the rank) and reports the rank's status.
        wrapped = 'trap : USR1; "$@"; s=$?; echo "RANK-STATUS $PMI_RANK $s"; exit $s'
        launcher += ["-disable-auto-cleanup", "-n", str(n), "sh", "-c", wrapped, "sh", *argv]
    else:
        launcher += ["-n", str(n), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", SMP_CONFIG="", PYTHONUNBUFFERED="1")
    env.update(case.env)
    proc = subprocess.Popen(
        launcher, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    pids: dict[int, int] = {}
    ended: dict[int, float] = {}
    done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            # (-prepend-rank may glue the next line's prefix on: "... PID 12[1] RANK 1 PID 13")
            for rank, pid in re.findall(r"RANK (\d+) PID (\d+)", line):
                pids[int(rank)] = int(pid)

    def poll() -> None:
        while not done.is_set() or len(ended) < len(pids):
            for rank, pid in list(pids.items()):
                if rank not in ended and _state(pid) in (None, "Z", "X"):
                    ended[rank] = time.time()
            if done.is_set() and len(ended) < len(pids):
                time.sleep(0.005)
                if all(_state(p) in (None, "Z", "X") for p in pids.values()):
                    now = time.time()
                    for rank in pids:
                        ended.setdefault(rank, now)
                    return
            time.sleep(0.01)

    reader = threading.Thread(target=read, daemon=True)
    poller = threading.Thread(target=poll, daemon=True)
    reader.start()
    poller.start()
    try:
        rc = proc.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = -999
        for pid in [proc.pid, *pids.values()]:
            try:
                os.killpg(pid, signal.SIGKILL) if pid == proc.pid else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    finished = time.time()
    reader.join(10)
    done.set()
    poller.join(10)
    for pid in pids.values():  # nothing of the job may outlive it
        if _state(pid) not in (None, "Z", "X"):
            os.kill(pid, signal.SIGKILL)
    job = Job(rc, lines, pids, ended, finished, out="\n".join(lines))
    # Hydra labels every *write* of rank r with "[r] ", not every line: a line a rank writes
    # in pieces (Python prints a traceback's last line that way) arrives with labels inside
    # it, possibly with another rank's writes in between. Splitting the whole output at the
    # labels gives back each rank's own stream (content never holds "[digits] ").
    streams: dict[int, list[str]] = {}
    pieces = re.split(r"\[(\d+)\] ", job.out)
    for label, text in zip(pieces[1::2], pieces[2::2]):
        streams.setdefault(int(label), []).append(text)
    for rank, texts in streams.items():
        job.by_rank[rank] = "".join(texts).splitlines()
    return job


def _statuses(case: Case, job: Job) -> dict[int, str]:
    """Each rank's exit status as far as the output tells (``"killed"``: by a signal)."""
    out: dict[int, str] = {}
    for rank in range(RANKS[case.config]):
        text = "\n".join(job.by_rank.get(rank, []))
        shell = re.search(rf"RANK-STATUS {rank} (\d+)", job.out)
        # (smp's failure channel, or smp-pipeline's exit with a worker stuck in user code)
        forced = re.search(rf"(?:smp rank {rank}|smp-pipeline): .*leaving with status (\d+)", text)
        clean = re.search(rf"RANK {rank} EXIT status (\d+)", text)
        if shell:
            s = int(shell.group(1))
            out[rank] = "killed" if s > 128 else str(s)
        elif case.fault in ("kill", "save_kill") and rank == case.victim:
            out[rank] = "killed"
        elif forced:
            out[rank] = forced.group(1)
        elif clean:
            out[rank] = clean.group(1)
        else:
            out[rank] = "killed"  # ended with no word: a signal (the launcher's)
    return out


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    before = _shm_entries()
    root = str(tmp_path)
    job = _launch(case, root)
    out = job.out
    n = RANKS[case.config]
    assert job.rc != -999, f"the job hung past {JOB_TIMEOUT_S:g} s:\n{out}"
    assert job.rc != 0, f"mpiexec exited 0:\n{out}"
    assert sorted(job.pids) == list(range(n)), out
    fault = re.search(rf"FAULT {case.victim} \w+ t=([\d.]+)", out)
    assert fault, f"the fault never happened:\n{out}"
    t_fault = float(fault.group(1))

    statuses = _statuses(case, job)
    assert all(s != "0" for s in statuses.values()), (statuses, out)

    survivors = [r for r in range(n) if r != case.victim]
    message = ""
    if case.fault == "kill" and case.launcher == "hydra":
        # Documented behaviour: hydra kills every rank at once; it names the dead pid.
        assert "BAD TERMINATION" in out and "signal 9" in out.lower() or "Killed" in out, out
        message = "(the launcher killed every rank; no rank could say anything)"
    elif case.fault in LOAD_FAULTS or case.fault in MISMATCH:
        # Every rank finds the problem itself: each names the file (the values) and itself.
        for rank in range(n):
            text = "\n".join(job.by_rank.get(rank, []))
            if case.fault in LOAD_FAULTS:
                pattern = rf"CheckpointError: (rank {rank}: .*{LOAD_FAULTS[case.fault]}.*)"
            else:
                pattern = "(" + MISMATCH[case.fault].format(victim=case.victim) + ")"
            said = re.search(pattern, text)
            assert said, f"rank {rank} did not say {pattern!r}:\n{out}"
            message = message or said.group(1)
            assert "RESUMED" not in text and "NO ERROR" not in text, out
        assert not os.path.exists(os.path.join(root, "PWNED")), "the pickle ran code on load"
    else:
        for rank in survivors:
            text = "\n".join(job.by_rank.get(rank, []))
            named = re.search(
                rf"(?:PeerFailedError|CheckpointPeerError): (rank {case.victim} failed.*)", text
            )
            assert named, f"rank {rank} did not name rank {case.victim}:\n{out}"
            message = message or named.group(1)
        if case.fault not in ("kill", "save_kill"):
            victim_text = "\n".join(job.by_rank.get(case.victim, []))
            assert "Injected" in victim_text, out
    last = max(job.ended.values()) - t_fault
    request.config.stash[FAULT_TABLE].append(
        (case.fault, case.config, f"rank {case.victim} ({ROLES[case.config][case.victim]})",
         case.launcher + (" (heartbeat)" if case.env else ""), last, message[:150])
    )  # fmt: skip
    assert last <= LIMIT_S, f"last rank ended {last:.2f} s after the fault:\n{out}"

    left = _left_in_shm(job, before)
    assert not left, f"left in /dev/shm: {left}\n{out}"

    if case.fault in SAVE_FAULTS:
        _check_previous_checkpoint(case, root)


def _left_in_shm(job: Job, before: set[str]) -> list[str]:
    """What the job left in /dev/shm: the files its ranks mapped, and any name with their
    pids (``before``: the entries there before it started)."""
    left = []
    for line in re.findall(r"RANK \d+ SHM (\S+)", job.out):
        left += [p for p in line.split(",") if p != "-" and os.path.exists(p)]
    pids = {str(p) for p in job.pids.values()}
    new = _shm_entries() - before
    left += [e for e in new if any(p in e for p in pids)]
    return left


def test_stalled_module(request: pytest.FixtureRequest) -> None:
    """pp = 2, ``timeout_s`` = 8: at step 2 a module's forward on rank 1 never returns (its
    forward hook waits forever). Rank 0's request times out; the stall diagnosis asks rank 1
    (whose worker is stuck, its main thread answers) for its pending work. Every rank exits
    non-zero within :data:`LIMIT_S` of the timeout (``timeout_s`` after the stall: the stall
    is a failure only once the request times out; rank 1's exit waits for its stuck worker
    only until rank 0's process has ended), its output holding
    the chain: rank 0's step function waits for the module on pp rank 1, whose forward has
    held the execution token since, in ``inject.py``'s hook."""
    case = Case("stall", "pp2", 1)
    before = _shm_entries()
    job = _launch(case)
    out = job.out
    assert job.rc not in (-999, 0), f"the job hung or exited 0 (rc {job.rc}):\n{out}"
    assert sorted(job.pids) == [0, 1], out
    fault = re.search(r"FAULT 1 stall t=([\d.]+) timeout_s=([\d.]+)", out)
    assert fault, f"the module never stalled:\n{out}"
    t_fault, timeout_s = float(fault.group(1)), float(fault.group(2))
    statuses = _statuses(case, job)
    assert all(s != "0" for s in statuses.values()), (statuses, out)
    module = r"the forward of module '([\w.]+)' \(microbatch (\d+)\)"
    first = ""
    for rank in (0, 1):
        text = "\n".join(job.by_rank.get(rank, []))
        ends = re.search(rf"the chain of waits ends at pp rank 1: {module} runs for [\d.]+ s", text)
        assert ends, f"rank {rank} did not say where the chain of waits ends:\n{out}"
        path, mb = ends.group(1), ends.group(2)
        waits = f"pp rank 0: the step function's forward (microbatch {mb}) waits ("
        held = f"pp rank 1: the forward of module '{path}' (microbatch {mb}) has held the execution token"
        for part in (waits, held, "in user code", "forward_hook (inject.py:"):
            assert part in text, f"rank {rank}: {part!r} missing from the chain:\n{out}"
        first = first or text[ends.start() : ends.end()]
    last = max(job.ended.values()) - t_fault
    request.config.stash[FAULT_TABLE].append(
        ("stall", "pp2", "rank 1 (server)", "hydra", last, first[:150])
    )
    bound = timeout_s + LIMIT_S
    assert last <= bound, f"last rank ended {last:.2f} s after the stall:\n{out}"
    left = _left_in_shm(job, before)
    assert not left, f"left in /dev/shm: {left}\n{out}"


# Issue 49: faults that used to hang a job or blame the wrong rank. A frozen rank (SIGSTOP,
# alive in /proc) and a stall in user code (a module's forward that never returns) on
# stage 0 or at pp = 1: every rank must end within timeout_s + LIMIT_S of the fault, and
# every rank that can still speak must name the culprit (and, for a stall, its module).
NO_HANG_CASES = [
    Case("sigstop", "pp2", 1, "shell"),
    Case("sigstop", "dp2", 1, "shell"),
    Case("stall", "pp2", 0),
    Case("stall", "tp2", 0),
    Case("stall", "dp2", 1),
]
# What names the culprit: smp's stall verdict, a frozen rank's, or the pipeline's chain.
_VERDICT = re.compile(r"(?:StallError|FrozenRankError): ")


def _naming_line(text: str, victim: int) -> str | None:
    """The first line of ``text`` that names ``victim`` as the culprit, or None."""
    for line in text.splitlines():
        if re.search(rf"chain of waits ends at pp rank {victim}\b", line) or (
            _VERDICT.search(line) and re.search(rf"\brank {victim}\b", line)
        ):
            return line
    return None


@pytest.mark.parametrize("case", NO_HANG_CASES, ids=[c.id for c in NO_HANG_CASES])
def test_no_hang(case: Case, request: pytest.FixtureRequest) -> None:
    before = _shm_entries()
    job = _launch(case)
    out = job.out
    n = RANKS[case.config]
    assert job.rc != -999, f"the job hung past {JOB_TIMEOUT_S:g} s:\n{out}"
    assert job.rc != 0 and sorted(job.pids) == list(range(n)), out
    fault = re.search(rf"FAULT {case.victim} \w+ t=([\d.]+) timeout_s=([\d.]+)", out)
    assert fault, f"the fault never happened:\n{out}"
    t_fault, timeout_s = float(fault.group(1)), float(fault.group(2))
    statuses = _statuses(case, job)
    assert all(s != "0" for s in statuses.values()), (statuses, out)
    message = ""
    for rank in range(n):
        if case.fault == "sigstop" and rank == case.victim:
            continue  # frozen, then killed: it can say nothing
        text = "\n".join(job.by_rank.get(rank, []))
        line = _naming_line(text, case.victim)
        assert line, f"rank {rank} did not name rank {case.victim}:\n{out}"
        if case.fault == "stall":
            assert re.search(r"module '[\w.]+'", line), f"rank {rank}: no module in {line!r}"
        message = message or line.strip()
    last = max(job.ended.values()) - t_fault
    request.config.stash[FAULT_TABLE].append(
        (case.fault, case.config, f"rank {case.victim} ({ROLES[case.config][case.victim]})",
         case.launcher, last, message[:150])
    )  # fmt: skip
    assert last <= timeout_s + LIMIT_S, f"last rank ended {last:.2f} s after the fault:\n{out}"
    left = _left_in_shm(job, before)
    assert not left, f"left in /dev/shm: {left}\n{out}"


def _check_previous_checkpoint(case: Case, root: str) -> None:
    """After a failed save: nothing half-written looks like a checkpoint, and a new job
    resumes from the previous one (saved after step 1)."""
    manifests = [
        os.path.relpath(os.path.join(d, f), root)
        for d, _, files in os.walk(root)
        for f in files
        if f == "manifest.json"
    ]
    assert manifests == [os.path.join("ckpt", "manifest.json")], manifests
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "ckpt"
    job = _launch(Case("resume", case.config, -1), root)
    assert job.rc == 0, f"resuming after the failed save failed:\n{job.out}"
    for rank in range(RANKS[case.config]):
        text = "\n".join(job.by_rank.get(rank, []))
        assert "RESUMED {'step': 1}" in text and "NO ERROR" in text, job.out


def test_a_rank_whose_watcher_cannot_run_is_not_taken_for_frozen() -> None:
    """``scripts/gil_hold.py``: rank 1 holds the GIL for ~7 s (``timeout_s`` = 3), so its
    watcher sends no heartbeat while its process runs. Silence alone must not make rank 0
    kill it (seen in the fault benchmark: a rank busy in the pipeline's first step, silent
    for 10 s, was killed): a silent peer that used CPU time since its last heartbeat is not
    frozen. Without that check the job fails (rank 1 killed with SIGKILL)."""
    script = os.path.join(os.path.dirname(HERE), "scripts", "gil_hold.py")
    out = run_mpi([script], 2, timeout=90, env={"OMP_NUM_THREADS": "1", "SMP_CONFIG": ""})
    assert "RANK 0 DONE" in out and "RANK 1 DONE" in out, out
    assert "rank 1 sent no heartbeat for 3 s but its process runs" in out, out
