"""Launching one fault job and reading how it ended: shared by the fault suite
(``test_faults.py``, which asserts behaviour) and the fault benchmark
(``benchmarks/bench_faults.py``, which times it). No pytest here, so that the benchmark can
import it as a plain module.

A job is ``mpiexec -prepend-rank -n N python inject.py FAULT CONFIG VICTIM [DIR]``. Every rank
prints ``RANK r PID p`` first; a thread here polls each pid in ``/proc`` to see when that rank's
process ended (a rank may end by ``os._exit`` or be killed, where it can print nothing more).
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

from smp_comm.testing import mpiexec_path

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inject.py")
RANKS = {"pp2": 2, "tp2": 2, "dp2": 2, "pp2dp2": 4, "dp2smp": 2}
HUNG = -999  # Job.rc of a job still running at its timeout (killed here)
# Each rank under a shell that waits for it: hydra sees the shell exit (normally), not the
# rank's death, so it does not end the other ranks itself and smp's own detection must. The
# shell survives hydra's SIGUSR1 failure notice (MPICH's own handler takes it in the rank) and
# reports the rank's status.
_SHELL = 'trap : USR1; "$@"; s=$?; echo "RANK-STATUS $PMI_RANK $s"; exit $s'


@dataclass
class Job:
    """What one launch printed and when each rank's process ended."""

    rc: int  # mpiexec's status; HUNG: still running at the job timeout
    out: str
    pids: dict[int, int]
    ended: dict[int, float]  # rank -> when its process ended by itself
    killed: list[int]  # ranks still alive after the job and its grace: SIGKILLed here
    by_rank: dict[int, list[str]] = field(default_factory=dict)

    @property
    def hung(self) -> bool:
        return self.rc == HUNG

    def text(self, rank: int) -> str:
        return "\n".join(self.by_rank.get(rank, []))


def state(pid: int) -> str | None:
    """The process's state letter from ``/proc`` (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()[0]


def gone(pid: int) -> bool:
    return state(pid) in (None, "Z", "X")


def launch(
    fault: str,
    config: str,
    victim: int,
    *,
    shell: bool = False,
    root: str = "",
    env: dict[str, str] | None = None,
    job_timeout_s: float = 120.0,
    grace_s: float = 10.0,
) -> Job:
    """Run one job to its end. ``shell``: each rank under the waiting shell (``_SHELL``);
    ``grace_s``: how long a rank may outlive ``mpiexec`` (hydra's proxies end ranks a moment
    after it) before it counts as not ended and is SIGKILLed, so nothing of the job outlives
    this call."""
    n = RANKS[config]
    argv = [sys.executable, SCRIPT, fault, config, str(victim), root]
    launcher = [mpiexec_path(), "-prepend-rank"]
    if shell:
        launcher += ["-disable-auto-cleanup", "-n", str(n), "sh", "-c", _SHELL, "sh", *argv]
    else:
        launcher += ["-n", str(n), *argv]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", SMP_CONFIG="", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    proc = subprocess.Popen(
        launcher, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    pids: dict[int, int] = {}
    ended: dict[int, float] = {}
    stop = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            # (-prepend-rank may glue the next line's prefix on: "... PID 12[1] RANK 1 PID 13")
            for rank, pid in re.findall(r"RANK (\d+) PID (\d+)", line):
                pids[int(rank)] = int(pid)

    def poll() -> None:
        while not stop.is_set():
            for rank, pid in list(pids.items()):
                if rank not in ended and gone(pid):
                    ended[rank] = time.time()
            time.sleep(0.01)

    reader = threading.Thread(target=read, daemon=True)
    poller = threading.Thread(target=poll, daemon=True)
    reader.start()
    poller.start()
    try:
        rc = proc.wait(timeout=job_timeout_s)
    except subprocess.TimeoutExpired:
        rc = HUNG
    # A hung job gets no grace: its ranks are what hangs.
    deadline = time.time() + (0.0 if rc == HUNG else grace_s)
    while time.time() < deadline and any(not gone(p) for r, p in pids.items() if r not in ended):
        time.sleep(0.01)
    stop.set()
    poller.join(5)
    now = time.time()
    for rank, pid in pids.items():  # (ended between the poller's last turn and now)
        if rank not in ended and gone(pid):
            ended[rank] = now
    killed = sorted(r for r in pids if r not in ended)
    for rank in killed:  # (a SIGSTOPped process dies of SIGKILL too)
        try:
            os.kill(pids[rank], signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(10)
    job = Job(rc, "\n".join(lines), pids, ended, killed)
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


def fault_time(job: Job, victim: int) -> tuple[float, float | None] | None:
    """``(t, timeout_s)`` from the victim's ``FAULT`` line (``timeout_s`` None where the line
    gives none: faults other ranks notice without waiting for it), or None if the fault never
    happened."""
    found = re.search(rf"FAULT {victim} \w+ t=([\d.]+)(?: timeout_s=([\d.]+))?", job.out)
    if not found:
        return None
    return float(found.group(1)), float(found.group(2)) if found.group(2) else None


def statuses(job: Job, config: str, fault: str, victim: int) -> dict[int, str]:
    """Each rank's exit status as far as the output tells: a number, ``"killed"`` (by a
    signal) or ``"not ended"`` (alive after the job: SIGKILLed by :func:`launch`)."""
    out: dict[int, str] = {}
    for rank in range(RANKS[config]):
        text = job.text(rank)
        shell = re.search(rf"RANK-STATUS {rank} (\d+)", job.out)
        # (smp's failure channel, or smp-pipeline's exit with a worker stuck in user code)
        forced = re.search(rf"(?:smp rank {rank}|smp-pipeline): .*leaving with status (\d+)", text)
        clean = re.search(rf"RANK {rank} EXIT status (\d+)", text)
        if rank in job.killed or rank not in job.pids:
            out[rank] = "not ended"
        elif shell:
            s = int(shell.group(1))
            out[rank] = "killed" if s > 128 else str(s)
        elif fault in ("kill", "save_kill") and rank == victim:
            out[rank] = "killed"
        elif forced:
            out[rank] = forced.group(1)
        elif clean:
            out[rank] = clean.group(1)
        else:
            out[rank] = "killed"  # ended with no word: a signal (the launcher's)
    return out


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def shm_left(job: Job, before: set[str]) -> list[str]:
    """What the job left in /dev/shm: the files its ranks mapped, and any name with their
    pids (``before``: the entries there before it started)."""
    left = []
    for paths in re.findall(r"RANK \d+ SHM (\S+)", job.out):
        left += [p for p in paths.split(",") if p != "-" and os.path.exists(p)]
    pids = {str(p) for p in job.pids.values()}
    left += [e for e in shm_entries() - before if any(p in e for p in pids)]
    return left


def remove_shm(job: Job) -> None:
    """Remove what the job mapped in /dev/shm and left there (killed ranks leave files)."""
    for paths in re.findall(r"RANK \d+ SHM (\S+)", job.out):
        for path in paths.split(","):
            if path.startswith("/dev/shm/") and os.path.exists(path):
                try:
                    os.remove(path)
                except OSError:
                    pass
