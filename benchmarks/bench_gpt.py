"""End-to-end: the GPT example pipelined over 2 CPU processes vs one process, and vs
``torch.distributed.pipelining`` on the same model.

Run: python benchmarks/bench_gpt.py      (spawns the workers itself; ~8 minutes)

Every process uses one thread (``torch.set_num_threads(1)``), so two processes have twice the
compute of one. Six runs train the same GPT (examples/gpt/model.py, global batch 32) for a
few steps after a warm-up:

- one process, plain PyTorch on the whole batch;
- one process accumulating gradients over the same 8 microbatches: what splitting the batch
  costs by itself (on a small model, mostly PyTorch's per-operator overhead, paid 8 times).
  With it the run prints the *ceiling* of a two-stage 1F1B pipeline: twice this rate, less
  the bubble (8/9), i.e. what a perfectly balanced pipeline with no overhead would reach;
- smp, ``pipeline_parallel_degree=2`` on 2 processes, 8 microbatches, automatic partition,
  with the default ``active_microbatches`` (pp + 2 = 4) and with all 8 in flight (a config
  key a user tunes for throughput: more microbatches in flight hide request latency at the
  cost of activation memory);
- smp the same, with ``pipeline: "zero_bubble"`` (every rank splits its owned Linear,
  LayerNorm and Embedding backwards into input-grad now and weight-grad W tasks placed in its
  idle time); printed with its W task counts per rank (idle / eager / drained, steps rested)
  and how much of the model it split: the parametrized layers split out of those the rank
  owns and the W tasks per microbatch, by operator (attention's SDPA and GELU hold no
  weights: their whole backward is input-grad);
- ``torch.distributed.pipelining`` (``Schedule1F1B``, 8 microbatches) with the model cut by
  hand into the same two halves (embeddings + 4 blocks | 4 blocks + head; the head gets its
  own copy of the tied embedding, which does not change the work).

Multi-process runs are launched with ``mpiexec -bind-to core`` (``BENCH_GPT_BIND=""`` turns
it off), the same for smp and torch.distributed.pipelining.

Two shapes: the headline (8 blocks of width 128, 64-character windows; 3 rounds) and a
wider, longer one (width 256, 128 characters; 1 round). Runs alternate (per run the median
step; best run of each kind) so that other load on the machine affects every kind alike.
Prints one line per shape: tokens/s of each, the ratios to one process, the share of the
ceiling each pipeline reaches, and smp's ratio to torch.distributed.pipelining.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import workers  # (this folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))

# dim, layers, heads, seq, batch, microbatches. The first shape is the headline (the issue's
# target is measured on it); the second, wider and longer, shows how the ratio grows once
# the per-request overhead is small against each microbatch's compute.
SHAPES = ("128,8,4,64,32,8", "256,8,8,128,32,8")
_SHAPE = os.environ.get("BENCH_GPT_SHAPE", SHAPES[0])
DIM, LAYERS, HEADS, SEQ, BATCH, MB = (int(v) for v in _SHAPE.split(","))
WARMUP, STEPS = 2, 6
ROUNDS = int(os.environ.get("BENCH_GPT_ROUNDS", "3"))
BIND = os.environ.get("BENCH_GPT_BIND", "core")  # "" launches without binding


def _setup():  # type: ignore[no-untyped-def]
    import common
    import torch
    from model import build_gpt

    torch.set_num_threads(1)
    corpus = common.CharCorpus()
    torch.manual_seed(0)
    return torch, corpus, build_gpt(corpus.vocab_size, SEQ, DIM, HEADS, LAYERS, False)


def _rate(times: list[float]) -> float:
    # The median step: robust to a step that another job on the machine slowed down.
    return BATCH * SEQ / statistics.median(times)


def single(microbatches: int = 1) -> dict:
    """One process; with ``microbatches`` > 1 it accumulates gradients over that many equal
    slices of the batch (the work a pipeline does, without the pipeline)."""
    torch, corpus, model = _setup()
    from model import lm_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(WARMUP + STEPS):
        x, y = corpus.batch(step, BATCH, SEQ)
        t0 = time.perf_counter()
        opt.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (lm_loss(model(xs), ys) / microbatches).backward()
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
    return {"tokens_per_s": _rate(times)}


def smp_pp2(active: int | None = None, pipeline: str | None = None) -> dict:
    torch, corpus, net = _setup()
    import smp_torch as smp
    from model import lm_loss

    config: dict = {"pipeline_parallel_degree": 2, "microbatches": MB}
    if active is not None:
        config["active_microbatches"] = active
    if pipeline is not None:
        config["pipeline"] = pipeline
    smp.init(config)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(x, y):  # type: ignore[no-untyped-def]
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    times = []
    for step in range(WARMUP + STEPS):
        x, y = corpus.batch(step, BATCH, SEQ)
        smp.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        train_step(x, y)
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
    out = {"tokens_per_s": _rate(times), "rank": smp.rank()}
    if pipeline == "zero_bubble":
        from mpi4py import MPI

        out["w"] = MPI.COMM_WORLD.allgather(_w_counts(model.engine.runtime, WARMUP + STEPS))
    return out


def _w_counts(rt, steps: int) -> dict:  # type: ignore[no-untyped-def]
    """This rank's zero-bubble W tasks over ``steps`` steps, and what it split."""
    st, work = rt.weight_grad_stats, rt.weight_grads
    mods = dict(rt.module.named_modules())
    owned = {id(mods[p]) for p in rt.owned_modules()
             if any(q.requires_grad for q in mods[p].parameters(recurse=False))}  # fmt: skip
    split_steps = max(steps - st.rested_steps, 1)
    return {"idle": st.idle, "eager": st.eager, "drained": st.drained,
            "rested": st.rested_steps, "split": len(work.modules), "owned": len(owned),
            "per_mb": {op: n / (split_steps * MB) for op, n in st.deferred_ops.items()},
            "w_ms_per_step": st.seconds * 1e3 / steps}  # fmt: skip


def torch_pipelining() -> dict:
    torch, corpus, net = _setup()
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI
    from smp_torch.bootstrap import init_torch_distributed
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    init_torch_distributed(MPI.COMM_WORLD, 120.0)
    rank = dist.get_rank()
    half = LAYERS // 2

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = net.wte, net.wpe
            self.blocks = nn.ModuleList(net.blocks[:half])

        def forward(self, idx):  # type: ignore[no-untyped-def]
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.blocks:
                x = b(x)
            return x

    class Second(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(net.blocks[half:])
            self.ln_f = net.ln_f
            self.head = nn.Linear(DIM, net.head.out_features, bias=False)
            self.head.weight = nn.Parameter(copy.deepcopy(net.wte.weight.detach()))

        def forward(self, x):  # type: ignore[no-untyped-def]
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln_f(x))

    mod = First() if rank == 0 else Second()
    stage = PipelineStage(mod, rank, 2, torch.device("cpu"))

    def loss_fn(logits, y):  # type: ignore[no-untyped-def]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    sched = Schedule1F1B(stage, n_microbatches=MB, loss_fn=loss_fn)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
    times = []
    for step in range(WARMUP + STEPS):
        x, y = corpus.batch(step, BATCH, SEQ)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {"tokens_per_s": _rate(times), "rank": rank}


def _launch(kind: str, nprocs: int, shape: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", BENCH_GPT_SHAPE=shape)
    env.pop("SMP_CONFIG", None)
    return workers.launch(__file__, kind, nprocs, env, BIND)


def main() -> None:
    if workers.serve_worker({
        "single": single,
        "accum": lambda: single(MB),
        "smp": smp_pp2,
        "smp_active": lambda: smp_pp2(MB),
        "smp_zb": lambda: smp_pp2(pipeline="zero_bubble"),
        "torchpp": torch_pipelining,
    }):  # fmt: skip
        return
    for i, shape in enumerate(SHAPES):
        _compare(shape, ROUNDS if i == 0 else 1)


def _compare(shape: str, rounds: int) -> None:
    dim, layers, _, seq, batch, mb = (int(v) for v in shape.split(","))
    # Interleaved rounds, best of each: other load on the machine hits every kind alike.
    kinds = (("single", 1), ("accum", 1), ("smp", 2), ("smp_active", 2), ("smp_zb", 2),
             ("torchpp", 2))
    best = {kind: 0.0 for kind, _ in kinds}
    w_counts: list = []
    for _ in range(rounds):
        for kind, n in kinds:
            result = _launch(kind, n, shape)
            if float(result["tokens_per_s"]) > best[kind]:
                best[kind] = float(result["tokens_per_s"])
                w_counts = result.get("w", w_counts)
    one, smp_rate, tpp = best["single"], best["smp"], best["torchpp"]
    smp_all = best["smp_active"]
    # What splitting the batch costs by itself (per-op overhead of smaller tensors), and the
    # ratio a perfectly balanced 1F1B pipeline with no overhead at all would reach.
    accum = best["accum"]
    ceiling = 2 * mb / (mb + 1) * accum / one
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"bench_gpt (load avg {load:.1f} on {os.cpu_count()} cores, bind {BIND or 'none'}): GPT {layers}x{dim}, batch "
        f"{batch}x{seq}, {mb} microbatches, 1 thread/process: "
        f"one process {one:,.0f} tok/s; smp pp=2 {smp_rate:,.0f} tok/s "
        f"({smp_rate / one:.2f}x one process, target >=1.6x; {smp_rate / one / ceiling:.0%} of the "
        f"ceiling {ceiling:.2f}x = 2 x {mb}/{mb + 1} (bubble) x {accum / one:.2f} (one process "
        f"accumulating {mb} microbatches: {accum:,.0f} tok/s)); "
        f"smp active_microbatches={mb} {smp_all:,.0f} tok/s ({smp_all / one:.2f}x); "
        f"torch.distributed.pipelining 1F1B {tpp:,.0f} tok/s ({tpp / one:.2f}x one process, "
        f"{tpp / one / ceiling:.0%} of the ceiling; "
        f"smp/torch {smp_rate / tpp:.2f}x, {smp_all / tpp:.2f}x)",
        flush=True,
    )
    zb = best["smp_zb"]
    print(
        f"  zero_bubble pp=2 (load avg {load:.1f}): {zb:,.0f} tok/s ({zb / one:.2f}x one "
        f"process, {zb / one / ceiling:.0%} of the 1F1B ceiling {ceiling:.2f}x: "
        f"{'above' if zb / one > ceiling else 'below'} it; / smp dynamic {zb / smp_rate:.2f}x, "
        f"/ torch 1F1B {zb / tpp:.2f}x). Its best run's W tasks per rank:",
        flush=True,
    )
    for r, w in enumerate(w_counts):
        ops = ", ".join(f"{op} {n:.1f}" for op, n in sorted(w["per_mb"].items()))
        print(
            f"    rank {r}: idle {w['idle']} / eager {w['eager']} / drained {w['drained']}, "
            f"rested {w['rested']} of {WARMUP + STEPS} steps; split {w['split']} of the "
            f"{w['owned']} parametrized layers it owns; W tasks per microbatch (split steps) "
            f"{sum(w['per_mb'].values()):.1f}: {ops}; W time {w['w_ms_per_step']:.1f} ms/step",
            flush=True,
        )


if __name__ == "__main__":
    main()
