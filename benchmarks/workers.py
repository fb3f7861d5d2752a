"""How a benchmark runs its contenders: each kind is a fresh worker process (one, or ``N``
under ``mpiexec``, each bound to a core unless told otherwise) that prints one ``RESULT
{json}`` line from its rank 0; the parent launches them in turn and reads that line.

Used by ``bench_sequential.py``, ``bench_gpt.py``, ``bench_hf.py`` and ``bench_moe.py``; :func:`run_self` and
:func:`peak_rss` (a job whose workers print their own lines) by ``bench_sdp.py`` and
``bench_moe.py``; :func:`main_as_job` (a benchmark that is one job printing its own table)
by ``bench_pipeline.py``, ``bench_zero_bubble.py`` and ``profile_requests.py``.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TimedSteps:
    """What :func:`timed_steps` measured over the timed (post-warm-up) ``run()`` calls."""

    times: list[float]  # seconds each call took
    cpu_s: float  # CPU seconds of all this process's threads (``time.process_time``)
    switches: float  # context switches of all its threads (``getrusage``: both kinds)
    faults: float = 0.0  # minor page faults of the process (``getrusage``)
    # CPU seconds per thread name (numbers stripped: one entry for all pipeline workers), from
    # /proc/self/task/*/schedstat (ns), so a periodic thread's share shows (docs/performance.md)
    threads: dict[str, float] = field(default_factory=dict)


def serve_worker(kinds: Mapping[str, Callable[[], dict]]) -> bool:
    """In a worker process (``--worker KIND`` on the command line): run ``kinds[KIND]``,
    print its result from rank 0 (one line per run: ranks' lines could interleave), and
    return True; in the parent, return False."""
    if "--worker" not in sys.argv:
        return False
    kind = sys.argv[sys.argv.index("--worker") + 1]
    result = kinds[kind]()
    if result.get("rank", 0) == 0:
        print("RESULT " + json.dumps(result), flush=True)
    return True


def main_as_job(script: str, nprocs: int, worker: Callable[[], None], timeout: float = 600) -> None:
    """The ``main`` of a benchmark that is one MPI job printing its own lines: with
    ``--worker`` on the command line run ``worker`` (a rank of the job); else run
    ``mpiexec -n nprocs python script --worker`` (one thread per rank) and exit with its
    status."""
    if "--worker" in sys.argv:
        worker()
        return
    from smp_comm.testing import mpiexec_path

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, os.path.abspath(script), "--worker"]
    sys.exit(subprocess.run(cmd, env=env, timeout=timeout).returncode)


def launch(
    script: str, kind: str, nprocs: int, env: Mapping[str, str], bind: str, timeout: float = 600
) -> dict:
    """Run worker ``kind`` of ``script`` on ``nprocs`` processes; its result. ``bind``: MPICH's
    ``-bind-to`` value (each process on a core of its own, the usual HPC launch, for every
    contender alike), "" for none."""
    if nprocs == 1:
        cmd = [sys.executable, script, "--worker", kind]
    else:
        from smp_comm.testing import mpiexec_path

        binding = ["-bind-to", bind] if bind else []
        cmd = [mpiexec_path(), *binding, "-n", str(nprocs), sys.executable, script, "--worker", kind]
    out = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout)
    name = script.rsplit("/", 1)[-1]
    if out.returncode != 0:
        raise SystemExit(f"{name}: {kind} failed:\n{out.stdout}\n{out.stderr}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{name}: {kind} printed no result:\n{out.stdout}\n{out.stderr}")
    return json.loads(lines[0][7:])


def run_self(script: str, nprocs: int, args: list[str], timeout: float = 900) -> str:
    """``mpiexec -n nprocs python script --worker *args`` (one thread per rank, no
    ``SMP_CONFIG``); its standard output. Raises if it fails."""
    from smp_comm.testing import mpiexec_path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "SMP_CONFIG": "", "PYTHONWARNINGS": "ignore"}
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, os.path.abspath(script), "--worker", *args]
    out = subprocess.run(cmd, env=env, check=True, timeout=timeout, capture_output=True, text=True)
    return out.stdout


def peak_rss(script: str, nprocs: int, jobs: list[list[str]]) -> dict[str, tuple[int, int]]:
    """One job per entry of ``jobs`` (peak RSS only grows, so each contender needs fresh
    processes); each prints ``MEM <label> <peak KiB> <growth KiB>`` from rank 0. ``{label:
    (peak, growth)}``."""
    mem: dict[str, tuple[int, int]] = {}
    for args in jobs:
        for line in run_self(script, nprocs, args).splitlines():
            if line.startswith("MEM "):
                _, label, peak, grown = line.split()
                mem[label] = (int(peak), int(grown))
    return mem


def rss_summary(mem: dict[str, tuple[int, int]], labels: Sequence[str]) -> str:
    """One line of :func:`peak_rss`'s figures for ``labels`` (MiB), for a benchmark to end
    with its own ratios."""
    return "  rank 0 peak RSS (growth over the RSS before the model): " + ", ".join(
        f"{m} {mem[m][0] / 1024:.0f} MiB (+{mem[m][1] / 1024:.0f})" for m in labels
    )


def timed_steps(
    run: Callable[[], object], warmup: int, steps: int, sync: Callable[[], object] | None = None
) -> TimedSteps:
    """``run()`` ``warmup + steps`` times; the seconds each of the last ``steps`` took, and
    their CPU and context switches. ``sync()`` (a barrier across the processes) runs before
    each, untimed (its CPU is left out too). A full garbage collection runs once after the
    warm-up, untimed: warm-up leaves long-lived objects (the runtime's plans, the optimizer
    state) whose full collection otherwise lands in a timed step (measured, bench_plan's
    gpt2-small at pp = 4: collections of 95-143 ms made its first timed step 0.30-0.37 s
    against 0.16-0.20 s for the others; with the collector off every step was 0.15-0.17 s)."""
    times = []
    cpu = switches = faults = 0.0
    threads: dict[str, float] = {}
    for step in range(warmup + steps):
        if step == warmup:
            gc.collect()
        if sync is not None:
            sync()
        before = thread_cpu() if step >= warmup else {}
        c0, (s0, f0) = time.process_time(), _switches_faults()
        t0 = time.perf_counter()
        run()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            s1, f1 = _switches_faults()
            switches, faults = switches + s1 - s0, faults + f1 - f0
            for tid, (name, ns) in thread_cpu().items():
                threads[name] = threads.get(name, 0.0) + (ns - before.get(tid, (name, 0))[1]) / 1e9
    return TimedSteps(times, cpu, switches, faults, threads)


def _switches_faults() -> tuple[int, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw, usage.ru_minflt


def thread_cpu() -> dict[int, tuple[str, int]]:
    """Each live thread's name (the Python name, else the OS one; digits dropped) and CPU
    nanoseconds so far; empty where /proc has no schedstat."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in map(int, tids):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            name = names.get(tid)
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        out[tid] = (name.rstrip("0123456789").rstrip("-_"), ns)
    return out
