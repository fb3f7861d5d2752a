"""A plain ``nn.Sequential`` pipelined over 2 CPU processes: smp with and without
``fast_mode`` vs one process, and vs ``torch.distributed.pipelining`` on the same split.

Run: python benchmarks/bench_sequential.py      (spawns the workers itself; ~3-5 minutes)

The model is an ``nn.Sequential`` of 8 blocks, each an ``nn.Sequential(LayerNorm, Linear(w,
4w), GELU, Linear(4w, w))``: nothing but a sequential container, the case a static pipeline
handles best. Every process uses one thread (``torch.set_num_threads(1)``), so two processes
have twice the compute of one. Per shape (width, rows per microbatch; 8 microbatches), runs
of these kinds alternate (best of ``BENCH_SEQ_ROUNDS`` runs, each the median of its steps):

- one process, plain PyTorch on the whole batch (the baseline of every ratio);
- one process accumulating the same 8 microbatches: what splitting the batch costs by
  itself, and from it the *ceiling* of a balanced two-stage pipeline with no overhead
  (2 x 8/9 of that rate);
- smp, ``pipeline_parallel_degree=2``, automatic partition, ``fast_mode`` on (the default:
  a stage's run of blocks is one request per microbatch, forward and backward) and off (one
  request per block);
- smp with ``static_mode`` too (from the second step stage 1 replays its recorded step on
  its main thread: no worker thread or token hand-off; the run prints how many steps it
  replayed and the step times of static mode, dynamic smp and torch's 1F1B side by side);
- smp with the same blocks in an ``nn.ModuleList`` the model's forward loops over (the
  Hugging Face decoder shape): ``fast_mode`` chains a stage's blocks into one request per
  microbatch once the first step saw the loop follow the chaining rule;
- ``torch.distributed.pipelining`` (``Schedule1F1B``) with the model cut where smp's
  automatic partition cut it (the smp run reports its cut; the same blocks on each stage).

A second line gives each rank's CPU (all its threads), context switches, minor page faults
and the CPU of its background threads (all but the main thread and smp's pipeline workers:
smp's failure watcher and comm tracker, gloo's loops) per microbatch inside the timed steps,
for smp, ``static_mode`` and 1F1B, beside the compute alone (half of one process's CPU per
microbatch while it accumulates): where a stage's time goes, side by side with the peer's.

Multi-process runs are launched with ``mpiexec -bind-to core`` (``BENCH_SEQ_BIND=""`` turns
it off). The two shapes are picked so that one block's forward on one microbatch takes about
0.2 ms and about 2 ms on one core (the run prints the measured time): at 0.2 ms a request's
~0.5 ms of CPU (docs/perf-notes.md) is as large as the work it carries, at 2 ms it is small
against it. Each has 64
rows per microbatch (see ``SHAPES``), so that splitting the batch does not by itself cost
more than a pipeline of two stages can win back.
"""

from __future__ import annotations

import os
import statistics
import time

import workers  # (this folder)

# width, rows per microbatch. 64 rows: with fewer, one process running the 8 microbatches
# one after another is far slower than running the whole batch at once (small matrix
# products), so even a perfect pipeline of two stages would lose to one process (ceiling
# 0.77x at 256 x 16 rows, 0.63x at 1024 x 8; 1.33x at 128 x 64, 1.40x at 384 x 64: measured
# one process, one thread).
SHAPES = ("128,64", "384,64")
_SHAPE = os.environ.get("BENCH_SEQ_SHAPE", SHAPES[0])
WIDTH, ROWS = (int(v) for v in _SHAPE.split(","))
BLOCKS, MB = 8, 8
WARMUP, STEPS = 2, 8
ROUNDS = int(os.environ.get("BENCH_SEQ_ROUNDS", "2"))
BIND = os.environ.get("BENCH_SEQ_BIND", "core")


def mlp_stack(width: int, blocks: int):  # type: ignore[no-untyped-def]
    """``nn.Sequential`` of ``blocks`` blocks ``LayerNorm, Linear(w, 4w), GELU, Linear(4w, w)``
    (also bench_accumulation's stage)."""
    from torch import nn

    return nn.Sequential(
        *[
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )
            for _ in range(blocks)
        ]
    )


def loop_stack(width: int, blocks: int):  # type: ignore[no-untyped-def]
    """The same blocks in an ``nn.ModuleList`` that the model's own forward loops over (the
    Hugging Face decoder shape), where ``fast_mode`` chains the calls instead of planning a
    ``Sequential``."""
    from torch import nn

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(list(mlp_stack(width, blocks)))

        def forward(self, x):  # type: ignore[no-untyped-def]
            for block in self.blocks:
                x = block(x)
            return x

    return Loop()


def _setup(loop: bool = False):  # type: ignore[no-untyped-def]
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = loop_stack(WIDTH, BLOCKS) if loop else mlp_stack(WIDTH, BLOCKS)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS * MB, WIDTH, generator=g)
    y = torch.randn(ROWS * MB, WIDTH, generator=g)
    return torch, net, x, y


def _rate(times: list[float]) -> float:
    """Samples per second of the median step (robust to a step another job slowed down)."""
    return ROWS * MB / statistics.median(times)


def block_forward_ms() -> dict:
    """One block's forward on one microbatch, one thread (median of many)."""
    torch, net, x, _ = _setup()
    block, xs = net[0], x[:ROWS]
    times = []
    with torch.no_grad():
        for _ in range(50):
            block(xs)
        for _ in range(200):
            t0 = time.perf_counter()
            block(xs)
            times.append(time.perf_counter() - t0)
    return {"ms": 1e3 * statistics.median(times)}


def single(microbatches: int = 1) -> dict:
    """One process; ``microbatches`` > 1 accumulates over that many equal slices."""
    torch, net, x, y = _setup()
    import torch.nn.functional as F

    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def run() -> None:
        opt.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (F.mse_loss(net(xs), ys) / microbatches).backward()
        opt.step()

    timed = workers.timed_steps(run, WARMUP, STEPS)
    return {"rate": _rate(timed.times), "cpu": [_per_mb(timed)]}


# The threads that run a stage's compute (smp's driver runs its microbatches on pipeline
# workers); every other thread's CPU is "background": smp's failure watcher and comm tracker,
# gloo's loops. Those wake on a timer or per message, so their CPU per microbatch grows with
# the step's length (docs/performance.md, "Where the CPU goes").
_COMPUTE_THREADS = ("MainThread", "smp-pipeline-worker")


def _per_mb(timed: workers.TimedSteps) -> tuple[float, float, float, float]:
    """A process's CPU (ms), context switches, minor page faults and background threads' CPU
    (ms) per microbatch over the timed steps."""
    n = STEPS * MB
    background = sum(s for name, s in timed.threads.items() if name not in _COMPUTE_THREADS)
    return (1e3 * timed.cpu_s / n, timed.switches / n, timed.faults / n, 1e3 * background / n)


def smp_pp2(fast: bool, static: bool = False, loop: bool = False) -> dict:
    torch, net, x, y = _setup(loop)
    import smp_torch as smp
    import torch.nn.functional as F

    # BENCH_SEQ_ACTIVE: smp's active_microbatches (default pp + 2 = 4; torch's 1F1B keeps 2).
    active = os.environ.get("BENCH_SEQ_ACTIVE")
    smp.init(
        {"pipeline_parallel_degree": 2, "microbatches": MB, "fast_mode": fast, "static_mode": static,
         **({"active_microbatches": int(active)} if active else {})}  # fmt: skip
    )
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(x, y):  # type: ignore[no-untyped-def]
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    def run() -> None:
        opt.zero_grad()
        train_step(x, y)
        opt.step()

    timed = workers.timed_steps(run, WARMUP, STEPS, smp.barrier)
    rt = model.engine.runtime
    # Stage 0's share of the top-level blocks (the cut torch.distributed.pipelining reuses),
    # and the requests stage 1 served per microbatch (forward + backward).
    prefix = "blocks." if loop else ""
    cut = sum(1 for i in range(BLOCKS) if rt.assignment[f"{prefix}{i}"] == 0)
    served = smp.allgather(rt.requests_served, smp.PP_GROUP)[1]
    per_mb = served / ((WARMUP + STEPS) * MB)
    inlined = smp.allgather(rt.server.executor.inlined, smp.PP_GROUP)[1]
    # static_mode: the steps stage 1 replayed (its recorded program, on its main thread) and
    # the replays that fell back to dynamic mode.
    stats = smp.allgather(rt.replay_stats, smp.PP_GROUP)[1]
    replay = None if stats is None else (stats.replayed, stats.fallbacks, WARMUP + STEPS)
    # Deterministic accumulation's per-microbatch gradient buffers on stage 1 (most alive at
    # once, in microbatches; 0: every contribution streamed into .grad), and their size.
    buffers = smp.allgather(rt.server.grads.peak_buffers, smp.PP_GROUP)[1]
    stage_mb = smp.allgather(
        sum(p.numel() * p.element_size() for p in rt.local_parameters()) / 2**20, smp.PP_GROUP
    )[1]
    cpu = smp.allgather(_per_mb(timed), smp.PP_GROUP)
    return {
        "rate": _rate(timed.times), "rank": smp.rank(), "cut": cut, "requests_per_mb": per_mb,
        "inlined_per_mb": inlined / ((WARMUP + STEPS) * MB), "buffers": buffers,
        "stage_mib": stage_mb, "cpu": cpu, "replay": replay,
    }  # fmt: skip


def torch_pipelining() -> dict:
    torch, net, x, y = _setup()
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI
    from smp_torch.bootstrap import init_torch_distributed
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    init_torch_distributed(MPI.COMM_WORLD, 120.0)
    rank = dist.get_rank()
    cut = int(os.environ.get("BENCH_SEQ_CUT", str(BLOCKS // 2)))
    mod = net[:cut] if rank == 0 else net[cut:]
    stage = PipelineStage(mod, rank, 2, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=MB, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(mod.parameters(), lr=1e-3)

    def run() -> None:
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()

    timed = workers.timed_steps(run, WARMUP, STEPS, dist.barrier)
    cpu: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(cpu, _per_mb(timed))
    dist.destroy_process_group()
    return {"rate": _rate(timed.times), "rank": rank, "cpu": cpu}


def _launch(kind: str, nprocs: int, shape: str, cut: int | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", BENCH_SEQ_SHAPE=shape)
    env.pop("SMP_CONFIG", None)
    if cut is not None:
        env["BENCH_SEQ_CUT"] = str(cut)
    return workers.launch(__file__, kind, nprocs, env, BIND)


def _compare(shape: str) -> None:
    width, rows = (int(v) for v in shape.split(","))
    block_ms = _launch("block", 1, shape)["ms"]
    best: dict[str, float] = {}
    info: dict[str, dict] = {}
    for _ in range(ROUNDS):
        kinds = (
            ("single", 1), ("accum", 1), ("smp_fast", 2), ("smp_static", 2), ("smp_slow", 2),
            ("smp_list", 2),
        )  # fmt: skip
        for kind, n in kinds:
            r = _launch(kind, n, shape)
            if r["rate"] > best.get(kind, 0.0):
                best[kind], info[kind] = r["rate"], r
        r = _launch("torchpp", 2, shape, info["smp_fast"]["cut"])
        if r["rate"] > best.get("torchpp", 0.0):
            best["torchpp"], info["torchpp"] = r["rate"], r
    one = best["single"]
    ceiling = 2 * MB / (MB + 1) * best["accum"] / one
    fast, slow, tpp = best["smp_fast"], best["smp_slow"], best["torchpp"]
    static, loop = best["smp_static"], best["smp_list"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"bench_sequential (load avg {load:.1f} on {os.cpu_count()} cores, bind "
        f"{BIND or 'none'}): Sequential of {BLOCKS} blocks, width {width}, {MB} microbatches of "
        f"{rows} rows (one block's microbatch forward {block_ms:.2f} ms), 1 thread/process: "
        f"one process {one:,.0f} samples/s; ceiling {ceiling:.2f}x; "
        f"smp pp=2 fast_mode on {fast / one:.2f}x one process "
        f"({info['smp_fast']['requests_per_mb']:.0f} requests/microbatch on stage 1, cut "
        f"{info['smp_fast']['cut']}|{BLOCKS - info['smp_fast']['cut']}), "
        f"fast_mode off {slow / one:.2f}x ({info['smp_slow']['requests_per_mb']:.0f} "
        f"requests/microbatch, cut {info['smp_slow']['cut']}|{BLOCKS - info['smp_slow']['cut']}, "
        f"stage 1's gradient buffers at most {info['smp_slow']['buffers']} microbatches of "
        f"{info['smp_slow']['stage_mib']:.1f} MiB); torch.distributed.pipelining 1F1B {tpp / one:.2f}x; "
        f"smp fast/torch {fast / tpp:.2f}x, fast on/off {fast / slow:.2f}x; "
        f"static_mode (with fast_mode) {static / one:.2f}x one process, {static / tpp:.2f}x "
        f"torch, {static / fast:.2f}x without it "
        f"({info['smp_static']['inlined_per_mb']:.1f} of stage 1's requests per microbatch "
        f"served on its main loop); the blocks in an nn.ModuleList looped by the model's "
        f"forward (fast_mode's chains) {loop / one:.2f}x one process, {loop / tpp:.2f}x torch, "
        f"{loop / slow:.2f}x one request per block ({info['smp_list']['requests_per_mb']:.1f} "
        f"requests/microbatch, cut {info['smp_list']['cut']}|{BLOCKS - info['smp_list']['cut']})",
        flush=True,
    )
    # Step times side by side (ms, the best run's median step): static_mode's replay against
    # dynamic smp and torch's 1F1B on the same split.
    replayed, fell_back, steps = info["smp_static"]["replay"]

    def step_ms(kind: str) -> float:
        return 1e3 * rows * MB / best[kind]

    print(
        f"  step time (load avg {load:.1f}): static_mode {step_ms('smp_static'):.1f} ms "
        f"(stage 1 replayed {replayed} of {steps} steps, {fell_back} fell back), dynamic smp "
        f"{step_ms('smp_fast'):.1f} ms, torch 1F1B {step_ms('torchpp'):.1f} ms: static/torch "
        f"{step_ms('smp_static') / step_ms('torchpp'):.2f}x, static/dynamic "
        f"{step_ms('smp_static') / step_ms('smp_fast'):.2f}x (step-time ratios: lower is faster)",
        flush=True,
    )
    # Where a stage's time goes: CPU per microbatch of each rank (all its threads, inside the
    # timed steps) against the compute itself (half of one process's, accumulating the same
    # microbatches: a balanced stage's share), and the context switches.
    compute = info["accum"]["cpu"][0][0] / 2

    def ranks(kind: str) -> str:
        return " | ".join(
            f"{ms:.2f} ms ({sw:.0f} switches, {pf:.0f} page faults, background threads "
            f"{bg:.2f} ms)"
            for ms, sw, pf, bg in info[kind]["cpu"]
        )

    print(
        f"  CPU per microbatch per rank (rank 0 | rank 1), best runs: compute alone "
        f"{compute:.2f} ms per stage; smp fast_mode {ranks('smp_fast')}; static_mode "
        f"{ranks('smp_static')}; torch 1F1B {ranks('torchpp')}",
        flush=True,
    )


def main() -> None:
    if workers.serve_worker({
        "block": block_forward_ms,
        "single": single,
        "accum": lambda: single(MB),
        "smp_fast": lambda: smp_pp2(True),
        "smp_slow": lambda: smp_pp2(False),
        "smp_static": lambda: smp_pp2(True, True),
        "smp_list": lambda: smp_pp2(True, loop=True),
        "torchpp": torch_pipelining,
    }):  # fmt: skip
        return
    shapes = os.environ.get("BENCH_SEQ_SHAPES")
    for shape in shapes.split(";") if shapes else SHAPES:
        _compare(shape)


if __name__ == "__main__":
    main()
