"""The fault table of issue 49 ("no hang of any kind"): the fault suite's own jobs, each timed
from the fault to the end of the last rank's process, once on a quiet machine and once beside
busy processes.

Run: python benchmarks/bench_faults.py   (every case of ``tests/faults/cases.py``: 42 jobs x 2
columns, ~15-30 minutes on 2 cores; a case that hangs costs its full job timeout, 60 s)

The cases are the fault suite's (``packages/smp-torch/tests/faults/cases.py``: ``ALL``, the
same list ``test_faults.py`` runs), launched the same way (``jobs.py``): ``inject.py FAULT
CONFIG VICTIM`` is a small training job on which rank VICTIM fails on purpose at its third
step (an exception in a phase of the step, a thread, a raw collective; SIGKILL, SIGSTOP; a
stall in a module's forward; a damaged checkpoint; a save that fails; a mismatched or bad
configuration; different batches), with ``timeout_s`` as ``inject.py`` sets it (8 s for a
stall or a frozen rank; ``BENCH_FAULTS_TIMEOUT_S`` overrides it for every case). The suite
asserts what each rank says; this benchmark measures how long the job takes to end.

Printed: a markdown table, one row per case: the seconds from the fault (the victim's
``FAULT`` line) to the end of the last rank's process (each rank's pid polled in ``/proc``),
and ``pass`` or ``FAIL`` with why, for each column, and the first line in which a rank named
the culprit (or, for a checkpoint or configuration fault, the problem). A case passes when
every rank's process ended by itself with a non-zero status (a SIGKILLed victim counts as
non-zero), and the last one ended within the goal: 10 s of the fault for a fault the other
ranks learn of without waiting, ``timeout_s`` + 5 s for one only a timeout can find
(SIGSTOP, a stall). The "busy" column runs the same case beside ``BENCH_FAULTS_BUSY_PROCS``
(2) processes spinning on the CPU, started just before that job and stopped after it.

Knobs: ``BENCH_FAULTS_CASES`` (comma-separated case ids as the suite names them, e.g.
``stall-pp2-rank0-hydra,kill-dp2-rank1-shell``), ``BENCH_FAULTS_BUSY=0`` (no busy column),
``BENCH_FAULTS_BUSY_PROCS``, ``BENCH_FAULTS_TIMEOUT_S``, ``BENCH_FAULTS_JOB_TIMEOUT_S`` (60),
``BENCH_FAULTS_JSON`` (a path: every result written there as JSON).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# The launcher is the fault suite's (a plain module beside it, no pytest).
sys.path.insert(0, os.path.join(HERE, "..", "packages", "smp-torch", "tests", "faults"))
import jobs  # noqa: E402
from cases import ALL, BY_TIMEOUT, ROLES, Case  # noqa: E402

# (unset: inject.py's timeout_s per fault)
TIMEOUT_OVERRIDE = os.environ.get("BENCH_FAULTS_TIMEOUT_S", "")
GOAL_S = 10.0  # every rank must have ended this long after a fault found without a timeout
SLACK_S = 5.0  # every rank must have ended timeout_s + this after a fault found by a timeout
# A job still running this long after its launch is killed: "hung".
JOB_TIMEOUT_S = float(os.environ.get("BENCH_FAULTS_JOB_TIMEOUT_S", "60"))
RANKS = jobs.RANKS
# A line that names the culprit (or the problem every rank found itself).
NAMING = re.compile(
    r"(PeerFailedError|CheckpointPeerError|CheckpointError|ConfigError|SMPError|StallError"
    r"|FrozenRankError|PipelineTimeoutError): |chain of waits ends at"
)


def _bound(case: Case, timeout_s: float | None) -> float:
    return (timeout_s or 0.0) + SLACK_S if case.fault in BY_TIMEOUT else GOAL_S


def _launch(case: Case) -> jobs.Job:
    # Ranks can outlive mpiexec by a moment (hydra's proxies end them): 1 s, then they count
    # as not ended.
    env = dict(case.env)
    if TIMEOUT_OVERRIDE:
        env["SMP_FAULT_TIMEOUT_S"] = TIMEOUT_OVERRIDE
    with tempfile.TemporaryDirectory(prefix="bench_faults_") as root:
        job = jobs.launch(
            case.fault, case.config, case.victim, shell=case.launcher == "shell", root=root,
            env=env, job_timeout_s=JOB_TIMEOUT_S, grace_s=1.0,
        )  # fmt: skip
    jobs.remove_shm(job)
    return job


def _measure(case: Case) -> dict:
    t0 = time.time()
    job = _launch(case)
    n = RANKS[case.config]
    res: dict = {"rc": job.rc, "wall_s": round(time.time() - t0, 2), "hung": job.hung}
    why: list[str] = []
    fault = jobs.fault_time(job, case.victim)
    statuses = jobs.statuses(job, case.config, case.fault, case.victim)
    res["statuses"] = statuses
    res["not_ended"] = [r for r, s in statuses.items() if s == "not ended"]
    if not fault:
        res.update(seconds=None, passed=False, why="the fault never happened")
        res["tail"] = job.out[-3000:]
        return res
    t_fault, timeout_s = fault
    ends = [job.ended[r] for r in range(n) if r in job.ended]
    last = max(ends) - t_fault if ends else None
    res["seconds"] = None if last is None else round(last, 2)
    if res["hung"]:
        why.append(f"hung (> {JOB_TIMEOUT_S:g} s)")
    if res["not_ended"]:
        why.append(f"not ended: rank {','.join(map(str, res['not_ended']))}")
    zero = [r for r, s in statuses.items() if s == "0"]
    if zero:
        why.append(f"exit 0: rank {','.join(map(str, zero))}")
    bound = res["bound_s"] = _bound(case, timeout_s)
    if last is not None and last > bound and not res["hung"]:
        why.append(f"{last:.1f} s > {bound:g} s")
    res["passed"] = not why
    res["why"] = "; ".join(why)
    # What a surviving rank said (the suite checks the words; this is for the table).
    said = [
        re.sub(r"^\[rank\d+\]: ", "", ln.strip())
        for rank in sorted(range(n), key=lambda r: r == case.victim)
        for ln in job.by_rank.get(rank, [])
        if NAMING.search(ln)
    ]
    res["example"] = said[0] if said else ""
    if why:
        res["tail"] = job.out[-3000:]
    return res


_SPIN = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    for _ in range(10**6): pass\n"


def _busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning on the CPU (each ends by itself if this process dies)."""
    return [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(n)]


def _stop(spinners: list[subprocess.Popen]) -> None:
    for p in spinners:
        p.kill()
    for p in spinners:
        p.wait()


def _cell(res: dict | None) -> str:
    if res is None:
        return "-"
    secs = "hung" if res["hung"] else ("-" if res["seconds"] is None else f"{res['seconds']:.1f} s")
    return f"{secs}, pass" if res["passed"] else f"{secs}, FAIL ({res['why']})"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def main() -> None:
    only = [c for c in os.environ.get("BENCH_FAULTS_CASES", "").split(",") if c]
    cases = [c for c in ALL if not only or c.id in only]
    unknown = set(only) - {c.id for c in ALL}
    if unknown:
        sys.exit(f"bench_faults: unknown cases {sorted(unknown)}; known: {[c.id for c in ALL]}")
    busy = os.environ.get("BENCH_FAULTS_BUSY", "1") != "0"
    nbusy = int(os.environ.get("BENCH_FAULTS_BUSY_PROCS", "2"))
    print(
        f"bench_faults: {len(cases)} cases, timeout_s={TIMEOUT_OVERRIDE or 'inject.py s'}, "
        f"goal: every rank ended "
        f"{GOAL_S:g} s after the fault (timeout_s + {SLACK_S:g} s for SIGSTOP and stalls), job timeout {JOB_TIMEOUT_S:g} s, busy column: "
        f"{f'{nbusy} spinning processes' if busy else 'off'}",
        flush=True,
    )
    results = []
    for case in cases:
        victim = f"{case.victim} ({ROLES[case.config][case.victim]})"
        row: dict = {"id": case.id, "fault": case.fault, "config": case.config,
                     "victim": victim, "launcher": case.launcher}  # fmt: skip
        row["quiet"] = _measure(case)
        print(f"  {case.id} quiet: {_cell(row['quiet'])}", flush=True)
        row["busy"] = None
        if busy:
            spinners = _busy(nbusy)
            try:
                row["busy"] = _measure(case)
            finally:
                _stop(spinners)
            print(f"  {case.id} busy: {_cell(row['busy'])}", flush=True)
        results.append(row)

    print()
    print("| fault | config | victim | launcher | quiet | busy | what a rank said |")
    print("|---|---|---|---|---|---|---|")
    for row in results:
        example = row["quiet"].get("example") or (row["busy"] or {}).get("example") or ""
        if len(example) > 160:
            example = example[:157] + "..."
        print(
            f"| {row['fault']} | {row['config']} | {row['victim']} | {row['launcher']} "
            f"| {_md(_cell(row['quiet']))} "
            f"| {_md(_cell(row['busy']))} | {_md(example)} |"
        )
    cells = [row[c] for row in results for c in ("quiet", "busy") if row[c] is not None]
    print(f"\n{sum(c['passed'] for c in cells)} of {len(cells)} runs passed")
    for row in results:
        for col in ("quiet", "busy"):
            res = row[col]
            if res is not None and not res["passed"] and "tail" in res:
                print(f"\n--- {row['id']} {col}: the job's output, last lines ---")
                print("\n".join(res["tail"].splitlines()[-25:]))
    path = os.environ.get("BENCH_FAULTS_JSON")
    if path:
        with open(path, "w") as f:
            json.dump({"timeout_s": TIMEOUT_OVERRIDE or None, "goal_s": GOAL_S,
                       "slack_s": SLACK_S, "cases": results}, f, indent=1, default=str)  # fmt: skip
        print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
