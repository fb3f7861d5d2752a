"""The planner (``smp.plan``) against the truth: a measured grid of every configuration.

Run: python benchmarks/bench_plan.py            (speed figures; then the stored grids in
                                                 benchmarks/data/plan/ against a fresh profile,
                                                 each model in its own process)
     python benchmarks/bench_plan.py --compare t5  (one model's comparison)
     python benchmarks/bench_plan.py --measure gpt2-small [--resume] [--any-load] [--retime]
                                                (measure that model's grid, one `mpiexec -n 4`
                                                 job per configuration; ~25-60 minutes;
                                                 --retime: also re-measure the points whose
                                                 timing only the load average vouched for)
     python benchmarks/bench_plan.py --measure t5 --only smoke --any-load [--points N]
                                                (a subset: the points matching --only's
                                                 filters, e.g. "pp=2,tp=1;pp=4,mb=8,ckpt=1",
                                                 "smoke" = SMOKE's six; at most N new ones;
                                                 --resume later completes the same file)
     python benchmarks/bench_plan.py --calibrate gpt2-small [--any-load] [--replace]
                                                (the machine calibration again: the constants
                                                 that model's file lacks, then the comparison)

Ground truth (``--measure``): for one model and world size 4, every (pp, tp, dp) with
pp*tp*dp = 4, sharded data parallelism off and on (sdp = dp) where dp > 1, microbatches
1, 2, 4, 8, activation checkpointing off and on (each block) — 72 configurations, each its
own job (peak RSS only grows, so each needs fresh processes): the median step time of the
timed steps (slowest rank) and every rank's peak RSS (``ru_maxrss``), stored as JSON under
benchmarks/data/plan/MODEL.json (committed: later changes compare against the same truth)
with what vouches for the time: the cores other processes kept busy during the job
(``others_cores``, from /proc/stat less the job's own CPU; a time counts only below
:data:`OTHERS_LIMIT`, and each job waits for that quiet first) and a fixed kernel's CPU time
then and after (``kernel_s``, ``kernel_after_s``: the core's speed; a time counts only if both
are within :data:`SAME_CORE` of the calibration's, since a virtual machine's core slows when
the host's other guests are busy, which no process here shows, and each job first waits for
that speed). A machine calibration job first (a one-layer model, the same
runtime) gives the memory an smp rank holds beyond what one plain process does, and the
collective latency and bandwidth; both are machine constants, not the model's.

Comparison (every run): the model is profiled on this process (``smp_torch.plan``), every
grid point predicted, and printed: median and p90 |step-time error|, Spearman rank
correlation of predicted and measured step times, the share of ranks whose predicted peak
lies in [measured, 1.10 x measured], and for three budgets (tight, medium, loose, set from
the measured peaks) whether the planner's top pick is within 5% / 10% of the best measured
feasible point, whether that point is in its top 3, and how many configurations it said fit
exceed the budget when run.

Speed: the search alone over >= 1,000 candidates (the measured model's profile, 64 ranks,
microbatches 1..64), and a synthetic 1,024-rank, 128-layer profile; and the profile time.
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import workers  # (this folder)
from plan_models import MODELS, blocks, build  # (this folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "benchmarks", "data", "plan")
WORLD = 4
#: Up to this many measured points (a smoke subset), the comparison prints every rank's peak.
SMALL_GRID = 12
MICROBATCHES = (1, 2, 4, 8)
WARMUP, STEPS = 2, 5
#: A grid's fixed kernel (``kernel_s``) within this fraction of the kernel's time now: the
#: same core (gpt2-small's 72 points of 1 Dec, one machine: 31.6-34.7 ms, median 31.8; that
#: machine against the one of 2 Dec: 0.73-0.77 of the time, its steps 10-30 % faster).
SAME_CORE = 0.10
#: Seconds a comparison waits for the core to run at its grid's calibration speed.
COMPARE_WAIT_S = 120.0


def load() -> float:
    return os.getloadavg()[0]


#: CPU seconds of one pipeline request, both ranks together, where a stored calibration
#: lacks it: bench_pipeline.py's zero-compute figure on this machine, 0.52-0.56 ms
#: (docs/performance.md, smp-pipeline, measured 2026-11-28). Not measured by the profile:
#: a one-process loopback pipeline (smp-comm's LoopbackWorld, ranks as threads) costs
#: 0.76-0.90 ms per request at load 6.5-14 where two real ranks cost 1.9-2.1 ms at the
#: same moments (and 0.45 ms when quiet): it has neither the transport's threads nor the
#: wake-ups of another process, which are what the request costs (performance.md).
REQUEST_S = 0.54e-3
#: The 1-minute load average below which a job's step time is trusted.
QUIET = 1.5


def timing_trusted(point: dict[str, Any]) -> bool:
    """Whether a stored point's step time counts as truth. A point measured with the
    interference record (``others_cores``: the cores other processes kept busy during its
    job) counts when that stayed below :data:`OTHERS_LIMIT`; an older one by the load
    average it was started at (``timing_trusted`` as stored, or the load below :data:`QUIET`).
    A point with the core's speed before and after its job (``kernel_after_s``) counts only
    if both were within :data:`SAME_CORE` of the calibration's (``core_at_speed``): on a
    virtual machine the host's other guests slow a core without any process here showing
    it (2 Dec: the fixed kernel took 37.8-62.4 ms over one hour at "quiet", and a point
    timed in the slow stretch at 0.174 s took 0.115-0.127 s in six jobs later)."""
    if "others_cores" in point:
        return bool(point["others_cores"] < OTHERS_LIMIT) and bool(point.get("core_at_speed", True))
    return bool(point.get("timing_trusted", point["load"][0] < QUIET))


def _machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot, steal included (time the
    hypervisor gave another machine: as much interference as a process here)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its waited-for descendants (a job's ranks: mpiexec
    waits its proxies, which wait their ranks, so their times reach us when it exits)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Interference:
    """The cores other processes kept busy while a block ran: the machine's busy CPU time
    less this process's and its children's, over the wall time. (The load average cannot
    tell: it lags by a minute and counts our own previous job. On this 2-core machine,
    shared with other sessions, gpt2-small's grid points started below load 1.5 took
    1.2-1.65x the step times the same points took on the quiet machine, 1 Dec.)"""

    cores = 0.0

    def __enter__(self) -> Interference:
        self._t, self._machine, self._own = time.perf_counter(), _machine_cpu_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t
        others = (_machine_cpu_s() - self._machine) - (_own_cpu_s() - self._own)
        self.cores = max(0.0, others) / max(wall, 1e-9)


#: A job's timing is truth only if other processes kept fewer cores than this busy during
#: it (the idle machine's own daemons: 0.001-0.02 over gpt2-small's 72 jobs; an editor's
#: short Python runs beside a job: 0.05-0.14).
OTHERS_LIMIT = 0.05


def quiet_machine(limit: float = OTHERS_LIMIT, window: float = 3.0) -> float:
    """Wait until other processes keep fewer than ``limit`` cores busy over ``window``
    seconds (timings are only meaningful then); the load average then."""
    while True:
        with Interference() as seen:
            time.sleep(window)
        if seen.cores < limit:
            return load()


def core_at_speed(reference: float, kernel: float) -> bool:
    """Whether a kernel time is within :data:`SAME_CORE` of the calibration's."""
    return abs(kernel / reference - 1) <= SAME_CORE


def wait_for_core_speed(reference: float, deadline: float, pause: float = 5.0) -> float:
    """Wait (until ``deadline``, a time.time(); ``measure`` has none unless BENCH_PLAN_UNTIL
    sets one, as :func:`quiet_machine` has none) for the core to run the fixed kernel within
    :data:`SAME_CORE` of ``reference``, faster or slower; the kernel's time last seen."""
    while True:
        speed = kernel_s()
        if core_at_speed(reference, speed) or time.time() > deadline:
            return speed
        time.sleep(pause)


def kernel_s() -> float:
    """CPU seconds of the calibration's fixed kernel in this process: a core's speed now,
    stored with each timed point, so that a grid measured on another machine (or the same
    one at another clock) can be told from a prediction's error."""
    import torch

    torch.set_num_threads(1)
    return _matmul_s(time.process_time)


def grid() -> list[dict[str, Any]]:
    """Every configuration of the measured grid (smp.init keys plus checkpointing)."""
    out = []
    for pp in (1, 2, 4):
        for tp in (1, 2, 4):
            if WORLD % (pp * tp):
                continue
            dp = WORLD // (pp * tp)
            for sdp in sorted({1, dp}):
                for mb in MICROBATCHES:
                    for ck in (False, True):
                        out.append({"pp": pp, "tp": tp, "dp": dp, "sdp": sdp, "mb": mb, "ckpt": ck})
    return out


# A smoke subset of the grid (``--only smoke``): six points spanning plain, sharded and
# tensor-parallel data parallelism, two- and four-stage pipelines, microbatches and
# checkpointing; the full grid later completes the same file (``--resume``).
SMOKE = "pp=1,tp=1,sdp=1,mb=1,ckpt=0;pp=1,tp=1,sdp=4,mb=2,ckpt=1;pp=2,tp=1,sdp=1,mb=4,ckpt=0;" \
    "pp=4,tp=1,mb=8,ckpt=1;pp=1,tp=2,sdp=2,mb=1,ckpt=0;pp=2,tp=2,mb=2,ckpt=1"


def parse_only(spec: str) -> list[dict[str, int]]:
    """``--only``'s filters: ``;``-separated, each ``key=value`` pairs over the grid's keys
    (pp, tp, dp, sdp, mb, ckpt as 0/1) joined by ``,``; ``smoke`` is :data:`SMOKE`. A grid
    point is selected when it matches every pair of one filter."""
    keys = ("pp", "tp", "dp", "sdp", "mb", "ckpt")
    out = []
    for part in (SMOKE if spec == "smoke" else spec).split(";"):
        filt = {}
        for pair in filter(None, part.split(",")):
            key, _, value = pair.partition("=")
            if key.strip() not in keys or not value.strip().isdigit():
                raise SystemExit(f"--only: {pair!r} is not key=number with key one of {', '.join(keys)}")
            filt[key.strip()] = int(value)
        out.append(filt)
    return out


def selected(cfg: dict[str, Any], only: list[dict[str, int]] | None) -> bool:
    """Whether grid point ``cfg`` matches one of the ``--only`` filters (all: no filters)."""
    return only is None or any(all(int(cfg[k]) == v for k, v in f.items()) for f in only)


def _matmul_s(clock: Any = time.perf_counter) -> float:
    """Seconds of a fixed compute kernel (the calibration's measure of a core's speed): wall
    time in a job; CPU time in the plain process, the clock the profile times on one thread
    (so ``compute_scale`` turns a profile's CPU seconds into a rank's wall seconds)."""
    import torch

    a = torch.randn(256, 256)
    a @ a
    t0 = clock()
    for _ in range(200):
        a @ a
    return clock() - t0


def _sync_s(collective: Any, barrier: Any, rounds: int = 20) -> float:
    """Seconds one small collective adds to a loop that computes between collectives (every
    rank at once, as a job's tensor-parallel or sharded step does): the loop of a ~1 ms
    kernel with the collective, less the loop without it. Beyond the collective's own
    latency this is the wait for peers, which is large where ranks outnumber cores."""
    import torch

    a = torch.randn(192, 192)

    def work() -> None:
        for _ in range(8):
            a @ a

    def loop(with_collective: bool) -> float:
        barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            work()
            if with_collective:
                collective()
        return (time.perf_counter() - t0) / rounds

    loop(True)  # warm-up
    return statistics.median(loop(True) - loop(False) for _ in range(3))


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _file_bytes() -> int:
    """This process's resident file-backed pages now (``RssFile``): the shared libraries'
    pages the kernel mapped, which the peak RSS includes and which depend on the page
    cache, not on the model (a process importing torch: 131 MB at 09:25, 77 MB at 11:25 on
    1 Dec, the same machine; its anonymous memory 153 MB both times)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------- workers


def _print_rows(smp: Any, row: dict[str, Any]) -> None:
    """Rank 0 prints every rank's row as one ``ROWS [json]`` line (ranks' own lines could
    interleave)."""
    rows = smp.allgather(row)
    if smp.rank() == 0:
        print("ROWS " + json.dumps(rows), flush=True)


def worker_run(name: str, cfg: dict[str, Any]) -> None:
    """One configuration on this job's ranks: rank 0 prints every rank's row."""
    import smp_torch as smp
    import torch

    torch.set_num_threads(1)
    model_fn, (x, y), step_fn = build(name)
    smp.init({
        "pipeline_parallel_degree": cfg["pp"],
        "tensor_parallel_degree": cfg["tp"],
        "sharded_data_parallel_degree": cfg["sdp"],
        "microbatches": cfg["mb"],
    })  # fmt: skip
    net = model_fn()
    if cfg["ckpt"]:
        for block in blocks(name, net):
            smp.set_activation_checkpointing(block)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
    share = x.shape[0] // smp.dp_size()
    lo = smp.dp_rank() * share
    xs, ys = x[lo : lo + share], y[lo : lo + share]

    @smp.step
    def train_step(a: Any, b: Any) -> Any:
        loss = step_fn(model, (a, b))
        model.backward(loss)
        return loss

    def step() -> None:
        opt.zero_grad()
        train_step(xs, ys)
        opt.step()

    times = workers.timed_steps(step, WARMUP, STEPS, sync=smp.barrier).times
    row = {"rank": smp.rank(), "pp_rank": smp.pp_rank(), "peak_bytes": _peak_bytes(), "times": times,
           "file_bytes": _file_bytes()}  # fmt: skip
    _print_rows(smp, row)


def worker_calibrate() -> None:
    """The machine's constants for an smp job: each rank's peak RSS running a one-layer
    model (against the same model in a plain process, what the runtime adds), and the
    all-reduce time of a small and a large tensor over the world."""
    import smp_torch as smp
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    smp.init({})
    model = smp.DistributedModel(torch.nn.Linear(8, 8))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(a: Any) -> Any:
        loss = model(a).sum()
        model.backward(loss)
        return loss

    for _ in range(3):
        opt.zero_grad()
        train_step(torch.ones(4, 8))
        opt.step()
    group = smp.get_world_process_group()
    smp.barrier()
    kernel = _matmul_s()  # all ranks at once, as in a job
    sync = _sync_s(lambda: dist.all_reduce(torch.ones(1), group=group), smp.barrier)
    res = {}
    for n in (1, 1 << 20):
        t = torch.ones(n // 4)
        for _ in range(3):
            dist.all_reduce(t, group=group)
        smp.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(t, group=group)
        res[n] = (time.perf_counter() - t0) / 10
    row = {"rank": smp.rank(), "peak_bytes": _peak_bytes(), "kernel_s": kernel, "sync_s": sync,
           "allreduce_s": {str(k): v for k, v in res.items()}}  # fmt: skip
    _print_rows(smp, row)


def worker_tp_call() -> None:
    """What each smp-tp collective costs beyond a bare one (``CommModel.tp_call_s``): on a
    tp = 2 job, a loop of ~1 ms kernels with smp-tp's all-gather of an activation and its
    backward reduce-scatter, less the same loop with a bare 4-byte all-reduce on the tp
    group, per collective (every rank at once, as a job's tensor-parallel step runs)."""
    import smp_torch as smp
    import torch
    import torch.distributed as dist
    from smp_tp import fused_allgather_for_tp

    torch.set_num_threads(1)
    smp.init({"tensor_parallel_degree": 2})
    group = smp.get_tp_process_group()
    a = torch.randn(192, 192)
    x = torch.randn(4, 32, 128, requires_grad=True)

    def bare() -> None:
        dist.all_reduce(torch.ones(1), group=group)

    def pair() -> None:
        fused_allgather_for_tp(x, 0, group).sum().backward()

    def loop(call: Any, rounds: int = 100) -> float:
        smp.barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            for _ in range(8):
                a @ a
            call()
        return (time.perf_counter() - t0) / rounds

    loop(bare, 10)  # warm-up
    loop(pair, 10)
    extra = statistics.median(loop(pair) - loop(bare) for _ in range(3)) / 2  # two collectives
    _print_rows(smp, {"rank": smp.rank(), "tp_call_s": max(0.0, extra)})


def _plain_peak() -> str:
    """Peak RSS of a plain process training the calibration model, and the kernel's time."""
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        opt.step()
    return f"{_matmul_s(time.process_time)} {_peak_bytes()}"


def _plain_run() -> tuple[float, int]:
    """(kernel CPU seconds, peak RSS) of a plain process training the calibration model, now."""
    kernel, peak = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", "plain"],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    ).stdout.split()[-2:]  # fmt: skip
    return float(kernel), int(peak)


def same_environment(point: dict[str, Any], machine: dict[str, Any]) -> bool:
    """Whether a point's peaks were measured under the grid's calibration (a process's
    file-backed pages, which its peak RSS counts, moved by 85 MiB between two hours of 1
    Dec: ``_file_bytes``). Points and calibrations from before the stamp match each other."""
    return point.get("calibrated_at") == machine.get("calibrated_at")


# --------------------------------------------------------------------------- launching


def _launch(args: list[str], timeout: float = 600) -> list[dict[str, Any]]:
    from smp_comm.testing import mpiexec_path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "SMP_CONFIG": "", "PYTHONWARNINGS": "ignore",
           "TRANSFORMERS_VERBOSITY": "error"}  # fmt: skip
    cmd = [mpiexec_path(), "-n", str(WORLD), sys.executable, os.path.abspath(__file__), "--worker", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    found = [json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("ROWS ")]
    rows = found[0] if found else []
    if out.returncode != 0 or len(rows) != WORLD:
        tail = (out.stdout + out.stderr).strip().splitlines()[-6:]
        raise RuntimeError(f"{' '.join(args)} failed (exit {out.returncode}): " + " | ".join(tail))
    return sorted(rows, key=lambda r: r["rank"])


def calibrate() -> dict[str, Any]:
    """Machine constants: smp runtime bytes per rank and collective latency/bandwidth."""
    rows = _launch(["calibrate"])
    kernel, plain = _plain_run()
    small = max(r["allreduce_s"]["1"] for r in rows)
    large = max(r["allreduce_s"][str(1 << 20)] for r in rows)
    # ring all-reduce: 2(n-1) latency steps; 2(n-1)/n of the bytes through each rank
    latency = small / (2 * (WORLD - 1))
    # what a collective costs in a computing job beyond its latency (the wait for peers)
    sync = max(0.0, statistics.median(r["sync_s"] for r in rows) - small)
    bandwidth = 2 * (WORLD - 1) / WORLD * (1 << 20) / max(large - small, 1e-9)
    return {
        "rank_peak_bytes": max(r["peak_bytes"] for r in rows),
        "runtime_bytes": max(0, max(r["peak_bytes"] for r in rows) - int(plain)),
        "plain_peak_bytes": int(plain),
        "compute_scale": statistics.median(r["kernel_s"] for r in rows) / float(kernel),
        # the core's speed at calibration: the points' timings count at this speed only
        "kernel_s": float(kernel),
        "latency_s": latency,
        "bandwidth": bandwidth,
        "sync_s": sync,
        "tp_call_s": statistics.median(r["tp_call_s"] for r in _launch(["tpcall"])),
        "load": load(),
        # which calibration a point was measured under (its peaks include the machine's
        # state then: the file-backed pages a process maps moved a plain process's peak by
        # 85 MiB between two hours of one day, 1 Dec: ``_file_bytes``)
        "calibrated_at": round(time.time()),
    }


def measure(
    name: str, resume: bool, any_load: bool = False, only: list[dict[str, int]] | None = None,
    points: int | None = None, retime: bool = False,
) -> None:
    """Measure ``name``'s grid into DATA/name.json (``resume``: keep the points already
    there). Each job waits for a load average below 1.5 unless ``any_load`` (then only its
    peak memory is trusted: the comparison leaves loaded points out of the timing figures).
    ``only`` (:func:`parse_only`) measures just the matching points, ``points`` at most that
    many new ones; the file stays the grid's, so a later ``resume`` completes it. ``retime``:
    also re-measure every point whose timing was trusted by the load average alone (no
    interference record), replacing it."""
    os.makedirs(DATA, exist_ok=True)
    path = os.path.join(DATA, f"{name}.json")
    data: dict[str, Any] = {"model": name, "shape": MODELS[name], "world": WORLD, "points": []}
    if resume and os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    # a retime whose plain process peaks elsewhere than the calibration's recalibrates (the
    # points it replaces are measured under the new calibration; the ones not yet replaced
    # leave the memory comparison)
    stale = retime and abs(data.get("machine", {}).get("plain_peak_bytes", 0) / _plain_run()[1] - 1) > 0.02
    # (a calibration without the core's speed cannot gate the points' timings: again)
    stale = stale or (retime and "kernel_s" not in data.get("machine", {}))
    if "machine" not in data or stale or (not any_load and data["machine"]["load"] >= QUIET):
        if not any_load:
            quiet_machine()
        data["machine"] = calibrate()
        print(f"calibration (load {data['machine']['load']:.2f}): {data['machine']}", flush=True)
    # A gated pass re-measures the points an --any-load pass took above load 1.5, each
    # replacing its old entry when done (so a pass cut short loses nothing); in a fixed
    # shuffled order, so a partial pass still covers every kind of configuration.
    def key(cfg: dict[str, Any]) -> str:
        return json.dumps(cfg, sort_keys=True)

    def finished(p: dict[str, Any]) -> bool:
        if any_load or "step_s" not in p:
            return True
        return timing_trusted(p) and (not retime or "kernel_after_s" in p)

    done = {key(p["config"]) for p in data["points"] if finished(p)}
    reference = data["machine"].get("kernel_s")  # the calibration's core speed, if it has one
    order = grid()
    random.Random(0).shuffle(order)
    order = [cfg for cfg in order if selected(cfg, only)]
    budget = len(order) if points is None else points
    deadline = float(os.environ.get("BENCH_PLAN_UNTIL", "inf"))  # a time.time() to stop at
    for cfg in order:
        if key(cfg) in done:
            continue
        if budget <= 0:
            break
        budget -= 1
        if time.time() > deadline:
            print("deadline reached: stopping", flush=True)
            break
        before = load() if any_load else quiet_machine()
        speed = kernel_s() if any_load or reference is None else wait_for_core_speed(reference, deadline)
        try:
            with Interference() as others:
                rows = _launch(["run", name, json.dumps(cfg)])
            after = kernel_s()
            at_speed = reference is None or (core_at_speed(reference, speed) and core_at_speed(reference, after))
            point = {
                "config": cfg,
                "step_s": max(statistics.median(r["times"]) for r in rows),
                "ranks": [{"pp_rank": r["pp_rank"], "peak_bytes": r["peak_bytes"], "file_bytes": r["file_bytes"]}
                          for r in rows],  # fmt: skip
                "load": [before, load()],
                # peak RSS does not depend on other processes; a time does: only a job
                # that ran alone on the machine is timing truth (the comparison uses no other)
                "others_cores": round(others.cores, 4),
                "kernel_s": round(speed, 5),
                "kernel_after_s": round(after, 5),
                "core_at_speed": at_speed,
                "timing_trusted": others.cores < OTHERS_LIMIT and at_speed,
                "calibrated_at": data["machine"].get("calibrated_at"),
            }
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            point = {"config": cfg, "error": str(e)[-400:], "load": [before, load()]}
        data["points"] = [p for p in data["points"] if key(p["config"]) != key(cfg)] + [point]
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        shown = f"{point['step_s']:.3f} s" if "step_s" in point else point["error"][:120]
        print(f"{name} {cfg}: {shown} (others {others.cores:.3f} cores, kernel {speed * 1e3:.1f}/"
              f"{point.get('kernel_after_s', 0) * 1e3:.1f} ms, "
              f"load {before:.2f} -> {load():.2f})", flush=True)  # fmt: skip


# --------------------------------------------------------------------------- comparison


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def margin_check(ranks: list[tuple[Any, float, float]], margin: float) -> str:
    """The memory margin against this grid: the one it would need (every rank at or under
    its prediction), and leave-one-family-out: the margin fitted on the other (pp, tp, sdp)
    families, scored on the held-out one (ranks in [measured, 1.10x], under)."""
    if not ranks:
        return "memory margin: no ranks"

    def need(rows: list[tuple[Any, float, float]]) -> float:
        return max(0.0, max(meas / pred - 1 for _, meas, pred in rows))

    ok = low = 0
    for fam in sorted({f for f, _, _ in ranks}):
        m = need([x for x in ranks if x[0] != fam])
        for _, meas, pred in (x for x in ranks if x[0] == fam):
            ok += meas <= pred * (1 + m) <= 1.10 * meas
            low += pred * (1 + m) < meas
    return (f"memory margin: used {margin:.3f}, this grid needs {need(ranks):.3f}; fitted leaving "
            f"each (pp, tp, sdp) family out: {ok}/{len(ranks)} ranks in [measured, 1.10x] "
            f"({ok / len(ranks):.0%}), {low} under")  # fmt: skip


def compare(name: str) -> None:
    import torch
    from smp_partition.plan import Candidate, CommModel
    from smp_partition.plan.search import _Planner
    from smp_torch.plan import profile_model

    with open(os.path.join(DATA, f"{name}.json")) as f:
        data = json.load(f)
    machine = data["machine"]
    model_fn, batch, step_fn = build(name)
    torch.set_num_threads(1)  # as each rank of the grid runs (and the calibration's kernel)
    # profile with the core at the grid's speed (a virtual machine's drifts: wait_for_core_speed)
    if "kernel_s" in machine:
        wait_for_core_speed(machine["kernel_s"], time.time() + COMPARE_WAIT_S)
    t0 = time.perf_counter()
    comm = CommModel(machine["latency_s"], machine["bandwidth"], machine.get("sync_s", 0.0),
                     machine.get("request_s", REQUEST_S), machine.get("tp_call_s", 0.0))  # fmt: skip
    prof = profile_model(
        model_fn, batch, step_fn, comm=comm,
        runtime_bytes=machine["rank_peak_bytes"], compute_scale=machine["compute_scale"],
    )  # fmt: skip
    profile_s = time.perf_counter() - t0
    planner = _Planner(prof)
    points = [p for p in data["points"] if "step_s" in p]
    failed = [p for p in data["points"] if "error" in p]
    preds = []
    for p in points:
        c = p["config"]
        e = planner.evaluate(Candidate(c["pp"], c["tp"], c["dp"], c["sdp"], c["mb"], c["ckpt"]), float("inf"))
        preds.append(e)
    quiet = [timing_trusted(p) for p in points]
    timed = [(e, p) for e, p, q in zip(preds, points, quiet) if q and e.stage_peak_bytes]
    errs = [abs(e.step_s / p["step_s"] - 1) for e, p in timed] or [float("nan")]
    mem_ok = mem_n = under = 0
    ranks: list[tuple[tuple[int, int, int], float, float]] = []  # (family, measured, predicted)
    # memory truth only from the points measured under the grid's calibration
    same = [same_environment(p, machine) for p in points]
    for e, p, ok in zip(preds, points, same):
        if not ok:
            continue
        for r in p["ranks"]:
            if not e.stage_peak_bytes:
                continue
            pred, meas = e.stage_peak_bytes[r["pp_rank"]], r["peak_bytes"]
            mem_n += 1
            mem_ok += meas <= pred <= 1.10 * meas
            under += pred < meas
            c = p["config"]
            ranks.append(((c["pp"], c["tp"], c["sdp"]), meas, pred / (1 + prof.memory_margin)))
    rho = spearman([e.step_s for e, _ in timed], [p["step_s"] for _, p in timed]) if timed else float("nan")
    checked = sum(1 for _, p in timed if "others_cores" in p)
    # the core's speed when the points were timed against now (a grid from another machine
    # compares another speed: its error is not the planner's)
    kernels = [p["kernel_s"] for _, p in timed if "kernel_s" in p]
    ratio = statistics.median(kernels) / kernel_s() if kernels else 1.0
    speed = f"; core speed then/now {ratio:.3f}" if kernels else ""
    if abs(ratio - 1) > SAME_CORE:
        speed += (" - ANOTHER MACHINE'S TIMES: the error below compares two machines, not the planner;"
                  f" re-measure (--measure {name}) here")
    print(
        f"bench_plan {name} (grid measured at load {statistics.fmean(p['load'][0] for p in points):.2f}; "
        f"compared now at load {load():.2f}): {len(points)} points ({len(failed)} failed to run); "
        f"profile {profile_s:.1f} s; timings from the {len(timed)} points measured quietly "
        f"({checked} of them checked for other processes' CPU{speed}): "
        f"step-time |error| median {statistics.median(errs):.1%}, "
        f"p90 {_pct(errs, 0.9):.1%} (targets 5%, 10%); Spearman {rho:.3f} (target 0.9); "
        f"predicted peak in [measured, 1.10x]: {mem_ok}/{mem_n} ranks ({mem_ok / max(mem_n, 1):.0%}, "
        f"target 95%), under-predicted {under}"
        + (f" (memory from the {sum(same)} points measured under the grid's calibration)" if not all(same) else ""),
        flush=True,
    )
    print("  " + margin_check(ranks, prof.memory_margin), flush=True)
    if len(points) <= SMALL_GRID:  # a smoke subset: every rank's figures
        for e, p in zip(preds, points):
            if not e.stage_peak_bytes:
                continue
            c = p["config"]
            shown = " ".join(
                f"{r['peak_bytes'] / 2**20:.0f}/{e.stage_peak_bytes[r['pp_rank']] / 2**20:.0f}" for r in p["ranks"]
            )  # fmt: skip
            print(f"    pp={c['pp']} tp={c['tp']} dp={c['dp']} sdp={c['sdp']} mb={c['mb']} "
                  f"{'ckpt' if c['ckpt'] else '-'}: peak MiB measured/predicted per rank {shown}")  # fmt: skip
    if len(timed) < len(points):
        print(f"  ({len(points) - len(timed)} points were measured on a busy machine: their memory "
              "counts, their times do not"
              + (f"; the picks below are among the {len(timed)} points measured quietly)"
                 if timed else ")"))  # fmt: skip
    for e, p in timed:
        c = p["config"]
        print(f"    pp={c['pp']} tp={c['tp']} dp={c['dp']} sdp={c['sdp']} mb={c['mb']} "
              f"{'ckpt' if c['ckpt'] else '-'}: predicted {e.step_s:.3f} s, measured {p['step_s']:.3f} s")  # fmt: skip
    peaks = sorted(max(r["peak_bytes"] for r in p["ranks"]) for p, ok in zip(points, same) if ok)
    budgets = {"tight": peaks[len(peaks) // 4], "medium": peaks[len(peaks) // 2], "loose": peaks[-1] * 1.05}
    # loaded timings are never truth: no quiet points, no pick figures
    pool = [(e, p) for e, p in timed if same_environment(p, machine)]
    for label, budget in budgets.items():
        # safety over every point; the pick among the points whose times count
        unsafe = sum(
            1 for e, p, ok in zip(preds, points, same)
            if ok and e.stage_peak_bytes and e.peak_bytes <= budget
            and max(r["peak_bytes"] for r in p["ranks"]) > budget
        )  # fmt: skip
        if not pool:
            said_fit = sum(1 for e in preds if e.stage_peak_bytes and e.peak_bytes <= budget)
            print(f"  {label} budget {budget / 2**20:.0f} MiB: said fit {said_fit}, of which exceeded "
                  f"the budget when run: {unsafe} (no timed points: no pick figures)")  # fmt: skip
            continue
        feasible = [p for _, p in pool if max(r["peak_bytes"] for r in p["ranks"]) <= budget]
        said = sorted(((e, p) for e, p in pool if e.peak_bytes <= budget), key=lambda ep: ep[0].step_s)
        if not feasible:
            print(f"  {label} budget {budget / 2**20:.0f} MiB: no measured point fits")
            continue
        best = min(feasible, key=lambda p: p["step_s"])
        if not said:
            print(f"  {label} budget {budget / 2**20:.0f} MiB: the planner says nothing fits "
                  f"({len(feasible)} measured feasible)")  # fmt: skip
            continue
        pick = said[0][1]
        top3 = [p is best for _, p in said[:3]]
        print(
            f"  {label} budget {budget / 2**20:.0f} MiB: pick {pick['config']} measured "
            f"{pick['step_s']:.3f} s vs best feasible {best['config']} {best['step_s']:.3f} s "
            f"({pick['step_s'] / best['step_s'] - 1:+.1%}; within 5%: {pick['step_s'] <= 1.05 * best['step_s']}, "
            f"10%: {pick['step_s'] <= 1.10 * best['step_s']}); best in top 3: {any(top3)}; "
            f"said fit but exceeded (all {sum(same)} points): {unsafe}",
            flush=True,
        )


def speed() -> None:
    from smp_partition.plan import search, synthetic_profile

    prof = synthetic_profile(24, width=512, heads=8, seq=256, batch_size=512)
    t0 = time.perf_counter()
    plan = search(prof, 64, 16 << 30, microbatch_options=range(1, 65))
    small = time.perf_counter() - t0
    t0 = time.perf_counter()
    big = search(synthetic_profile(128), 1024, 80 << 30, microbatch_options=range(1, 65))
    large = time.perf_counter() - t0
    print(
        f"bench_plan search (load {load():.2f} on {os.cpu_count()} cores): {len(plan.estimates):,} "
        f"candidates (64 ranks, 24 layers) in {small:.2f} s (target <= 5 s over >= 1,000); "
        f"synthetic 1,024 ranks x 128 layers: {len(big.estimates):,} candidates in {large:.2f} s "
        f"(target <= 60 s)",
        flush=True,
    )


def main() -> None:
    if "--worker" in sys.argv:
        kind = sys.argv[sys.argv.index("--worker") + 1]
        rest = sys.argv[sys.argv.index("--worker") + 2 :]
        if kind == "run":
            worker_run(rest[0], json.loads(rest[1]))
        elif kind == "calibrate":
            worker_calibrate()
        elif kind == "tpcall":
            worker_tp_call()
        else:
            print(_plain_peak())
        return
    if "--calibrate" in sys.argv:
        # constants the calibration gained after a grid was measured (e.g. sync_s), added to
        # the model's file with the load they were measured at; the grid's own constants stay
        # (--replace: all of them anew). On a quiet machine unless --any-load.
        name = sys.argv[sys.argv.index("--calibrate") + 1]
        path = os.path.join(DATA, f"{name}.json")
        with open(path) as f:
            data = json.load(f)
        if "--any-load" not in sys.argv:
            quiet_machine()
        fresh = calibrate()
        old = {} if "--replace" in sys.argv else data["machine"]
        # (not the stamp: the stored points were measured under the old calibration)
        added = {k: v for k, v in fresh.items() if k not in old and k != "calibrated_at"}
        if old:
            added["added_load"] = fresh["load"]
        data["machine"] = {**old, **added}
        print(f"calibration (load {fresh['load']:.2f}): {fresh}; now {data['machine']}", flush=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        compare(name)
        return
    if "--measure" in sys.argv:
        name = sys.argv[sys.argv.index("--measure") + 1]
        print(f"measuring {name} at load {load():.2f}", flush=True)
        only = parse_only(sys.argv[sys.argv.index("--only") + 1]) if "--only" in sys.argv else None
        count = int(sys.argv[sys.argv.index("--points") + 1]) if "--points" in sys.argv else None
        measure(name, "--resume" in sys.argv, "--any-load" in sys.argv, only, count, "--retime" in sys.argv)
        compare(name)
        return
    if "--compare" in sys.argv:
        compare(sys.argv[sys.argv.index("--compare") + 1])
        return
    speed()
    # Each model's comparison in a fresh process, as a user's profile runs: the profile counts
    # the bytes of the code its model_fn imports (transformers) in its fixed bytes only where
    # that code is not imported yet (measured: mixtral's fixed bytes 387 MiB in a fresh
    # process, 338 MiB after llama-tied's profile in the same one; a rank imports it too).
    for fname in sorted(os.listdir(DATA)) if os.path.isdir(DATA) else []:
        if fname.endswith(".json"):
            subprocess.run([sys.executable, os.path.abspath(__file__), "--compare", fname[:-5]], check=True)


if __name__ == "__main__":
    main()
