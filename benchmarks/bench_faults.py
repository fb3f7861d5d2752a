"""The fault table of issue 49 ("no hang of any kind"): one MPI job per (fault, configuration),
each timed from the fault to the end of the last rank's process, once on a quiet machine and
once beside busy processes.

Run: python benchmarks/bench_faults.py   (22 cases x 2 columns, ~15-40 minutes on 2 cores;
a case that hangs costs its full job timeout, 60 s)

Each case runs ``packages/smp-torch/tests/faults/inject.py FAULT CONFIG VICTIM`` (a small
training job on which rank VICTIM fails on purpose at step 2) with ``SMP_FAULT_TIMEOUT_S`` =
``timeout_s`` (10). Faults: ``exception`` (a module's forward raises on the victim), ``SIGKILL``
and ``SIGSTOP`` (the victim kills / stops itself inside a forward), ``stall`` (a module's
forward on the victim never returns: on pipeline stage 0 or 1, or in the step function at
pp = 1), ``bad config`` (the victim passes a misspelt key to ``smp.init``); configurations
``pp2``, ``pp2dp2`` (4 ranks), ``tp2``, ``dp2``. SIGKILL and SIGSTOP run each rank under a
shell that waits for it (``mpiexec -disable-auto-cleanup``), so that the launcher does not
end the job itself on a rank's death and smp's own detection must; the others run under
plain ``mpiexec``. A rank still alive when its job ends (a frozen victim) is SIGKILLed here
and counted as not ended; a job still running 60 s after its launch is killed ("hung").

Printed: a markdown table, one row per case: the seconds from the fault (the victim's
``FAULT`` line) to the end of the last rank's process (each rank's pid polled in ``/proc``),
and ``pass`` or ``FAIL`` with why, for each column, and an example of what a rank said to
name the culprit. A case passes when every rank's process ended by itself, with a non-zero
status (a SIGKILLed victim counts as non-zero); every rank's output names the culprit
(``rank VICTIM`` in a ``PeerFailedError`` / ``ConfigError`` / ``SMPError`` /
``PipelineTimeoutError`` line; the victim's own error line for itself, except a SIGKILLed or
SIGSTOPped victim, which cannot speak); for a stall, that line also names a ``module '...'``;
and the last rank ended within the goal: 10 s of the fault for a fault the other ranks learn
of without waiting (an exception, SIGKILL, a bad config), ``timeout_s`` + 5 s for one only a
timeout can find (SIGSTOP, a stall). The fault suite (``tests/faults``) checks the same
behaviour but bounds only a hang; these seconds are where the goal is measured. The "busy"
column runs the same case beside ``BENCH_FAULTS_BUSY_PROCS`` (2) processes spinning on the
CPU, started just before that job and stopped after it.

Knobs: ``BENCH_FAULTS_CASES`` (comma-separated case ids ``FAULT-CONFIG-VICTIM``, e.g.
``stall-pp2-0,kill-dp2-1``; FAULT as ``inject.py`` spells it: ``forward``, ``kill``,
``sigstop``, ``stall``, ``bad_config``), ``BENCH_FAULTS_BUSY=0`` (no busy column),
``BENCH_FAULTS_BUSY_PROCS``, ``BENCH_FAULTS_TIMEOUT_S`` (``timeout_s``, 10),
``BENCH_FAULTS_JOB_TIMEOUT_S`` (60),
``BENCH_FAULTS_JSON`` (a path: every result written there as JSON).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
# The launcher is the fault suite's (a plain module beside it, no pytest).
sys.path.insert(0, os.path.join(HERE, "..", "packages", "smp-torch", "tests", "faults"))
import jobs  # noqa: E402

TIMEOUT_S = float(os.environ.get("BENCH_FAULTS_TIMEOUT_S", "10"))
GOAL_S = 10.0  # every rank must have ended this long after a fault found without a timeout
SLACK_S = 5.0  # every rank must have ended timeout_s + this after a fault found by a timeout
# A job still running this long after its launch is killed: "hung".
JOB_TIMEOUT_S = float(os.environ.get("BENCH_FAULTS_JOB_TIMEOUT_S", "60"))
RANKS = jobs.RANKS
LABELS = {  # (fault, how the table names it) per row kind
    "forward": "exception",
    "kill": "SIGKILL",
    "sigstop": "SIGSTOP",
    "bad_config": "bad config",
}
SIGNALLED = ("kill", "sigstop")  # the victim cannot speak; ranks run under the shell launcher
BY_TIMEOUT = ("sigstop", "stall")  # faults only a timeout can find
# A line that names the culprit: one of smp's errors (or, on the victim, the injected one).
ERROR_LINE = re.compile(r"(PeerFailedError|ConfigError|SMPError|StallError|PipelineTimeoutError)\b")
VICTIM_LINE = re.compile(
    r"(PeerFailedError|ConfigError|SMPError|StallError|PipelineTimeoutError|Injected)\b"
)
MODULE = re.compile(r"module '([^']*)'")
CHAIN_END = "the chain of waits ends at"  # (a timeout's message: the module after it stalled)


@dataclass(frozen=True)
class Case:
    fault: str
    config: str
    victim: int
    label: str

    @property
    def id(self) -> str:
        return f"{self.fault}-{self.config}-{self.victim}"


def _cases() -> list[Case]:
    cases = []
    for fault in ("forward", "kill", "sigstop"):
        for config, victim in (("pp2", 1), ("pp2dp2", 3), ("tp2", 1), ("dp2", 1)):
            cases.append(Case(fault, config, victim, LABELS[fault]))
    for config, victim in (("pp2", 0), ("pp2dp2", 0)):
        cases.append(Case("stall", config, victim, "stall, stage 0"))
    for config, victim in (("pp2", 1), ("pp2dp2", 1)):
        cases.append(Case("stall", config, victim, "stall, stage 1"))
    for config, victim in (("tp2", 0), ("dp2", 1)):
        cases.append(Case("stall", config, victim, "stall, step fn (pp=1)"))
    for config in ("pp2", "pp2dp2", "tp2", "dp2"):
        cases.append(Case("bad_config", config, 1, LABELS["bad_config"]))
    return cases


def _bound(case: Case) -> float:
    return TIMEOUT_S + SLACK_S if case.fault in BY_TIMEOUT else GOAL_S


def _launch(case: Case) -> jobs.Job:
    # Ranks can outlive mpiexec by a moment (hydra's proxies end them): 1 s, then they count
    # as not ended.
    job = jobs.launch(
        case.fault, case.config, case.victim, shell=case.fault in SIGNALLED,
        env={"SMP_FAULT_TIMEOUT_S": f"{TIMEOUT_S:g}"}, job_timeout_s=JOB_TIMEOUT_S, grace_s=1.0,
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
    t_fault = fault[0]
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
    # Who named the culprit, with what words.
    named: dict[int, str] = {}
    modules: dict[int, str] = {}
    for rank in range(n):
        pattern = VICTIM_LINE if rank == case.victim else ERROR_LINE
        said = [
            ln for ln in job.by_rank.get(rank, [])
            if pattern.search(ln) and re.search(rf"rank \[?{case.victim}\b", ln)
        ]  # fmt: skip
        if said:
            with_module = [ln for ln in said if MODULE.search(ln)]
            named[rank] = (with_module or said)[0].strip()
            if with_module:
                line = with_module[0]
                end = line.find(CHAIN_END)
                found = (end >= 0 and MODULE.search(line, end)) or MODULE.search(line)
                modules[rank] = found.group(1)  # type: ignore[union-attr]
    silent_ok = {case.victim} if case.fault in SIGNALLED else set()
    unnamed = [r for r in range(n) if r not in named and r not in silent_ok]
    if unnamed:
        why.append(f"rank {','.join(map(str, unnamed))} did not name rank {case.victim}")
    if case.fault == "stall":
        no_module = [r for r in named if r not in modules]
        if no_module:
            why.append(f"rank {','.join(map(str, no_module))} named no module")
    res["named"] = named
    res["modules"] = modules
    bound = res["bound_s"] = _bound(case)
    if last is not None and last > bound and not res["hung"]:
        why.append(f"{last:.1f} s > {bound:g} s")
    res["passed"] = not why
    res["why"] = "; ".join(why)
    others = [named[r] for r in sorted(named) if r != case.victim]
    res["example"] = (others or list(named.values()) or [""])[0]
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
    cases = [c for c in _cases() if not only or c.id in only]
    unknown = set(only) - {c.id for c in _cases()}
    if unknown:
        sys.exit(
            f"bench_faults: unknown cases {sorted(unknown)}; known: {[c.id for c in _cases()]}"
        )
    busy = os.environ.get("BENCH_FAULTS_BUSY", "1") != "0"
    nbusy = int(os.environ.get("BENCH_FAULTS_BUSY_PROCS", "2"))
    print(
        f"bench_faults: {len(cases)} cases, timeout_s={TIMEOUT_S:g}, goal: every rank ended "
        f"{GOAL_S:g} s after the fault (timeout_s + {SLACK_S:g} s for SIGSTOP and stalls), job timeout {JOB_TIMEOUT_S:g} s, busy column: "
        f"{f'{nbusy} spinning processes' if busy else 'off'}",
        flush=True,
    )
    results = []
    for case in cases:
        row: dict = {"id": case.id, "fault": case.label, "inject": case.fault,
                     "config": case.config, "victim": case.victim}  # fmt: skip
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
    print("| fault | config | victim | quiet | busy | what a rank said |")
    print("|---|---|---|---|---|---|")
    for row in results:
        example = row["quiet"].get("example") or (row["busy"] or {}).get("example") or ""
        if len(example) > 160:
            example = example[:157] + "..."
        print(
            f"| {row['fault']} | {row['config']} | {row['victim']} | {_md(_cell(row['quiet']))} "
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
            json.dump({"timeout_s": TIMEOUT_S, "goal_s": GOAL_S,
                       "timeout_bound_s": TIMEOUT_S + SLACK_S, "cases": results}, f, indent=1, default=str)  # fmt: skip
        print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
