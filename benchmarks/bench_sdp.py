"""Sharded data parallelism (sdp=4) vs plain data parallelism and vs hand-written FSDP2.

Run: python benchmarks/bench_sdp.py   (spawns `mpiexec -n 4` of itself four times; ~1-2 minutes)

The model: ``BLOCKS`` residual blocks of ``Linear(WIDTH, WIDTH)`` + GELU and a linear head,
AdamW, fp32, ``BATCH`` samples per rank. Three contenders on 4 processes:

- ``dp``: smp data parallelism (``smp.DistributedModel``, every rank holds everything and
  all-reduces the gradients);
- ``sdp``: smp with ``sharded_data_parallel_degree: 4`` (each block its own shard unit);
- ``fsdp2``: the same model wrapped by hand with ``fully_shard`` per block and on the root,
  the loop written in plain PyTorch (no smp step, agreement or optimizer wrapper).

Timing job: the three alternate round by round in one job, so they see the same machine
load; the median step time of each and the ratios sdp/dp and sdp/fsdp2 are printed. The
same job measures, after a step, the bytes this rank holds in parameters + gradients +
optimizer state (from the tensors: a DTensor counts its local shard) and prints sdp/dp.
Memory jobs: one job per contender (peak RSS only grows, so each needs its own processes):
rank 0's peak RSS (``ru_maxrss``) at the end, and its growth over the RSS before the
model was built (the interpreter, torch and MPI are the same in all three).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time

import workers  # (this folder)

WIDTH = int(os.environ.get("BENCH_SDP_WIDTH", "1024"))
BLOCKS = int(os.environ.get("BENCH_SDP_BLOCKS", "8"))
BATCH, WARMUP, STEPS, ROUNDS = 8, 2, 5, 3
NAMES = ("dp", "sdp", "fsdp2")


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _worker(modes: list[str]) -> None:
    import smp_torch as smp
    import torch
    import torch.nn.functional as F  # noqa: N812
    from smp_torch import sharded
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + F.gelu(self.fc(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

    def held_bytes(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> int:
        total = 0
        for p in params:
            for t in [p, p.grad, *opt.state.get(p, {}).values()]:
                if torch.is_tensor(t) and t.dim() > 0:
                    local = sharded.local_tensor(t)
                    total += local.numel() * local.element_size()
        return total

    def build(mode: str):  # type: ignore[no-untyped-def]
        config = {} if mode != "sdp" else {
            "sharded_data_parallel_degree": 4,
            "sdp_param_persistence_threshold": WIDTH * WIDTH,
        }
        smp.init(config)
        torch.manual_seed(0)
        net = Net()
        if mode == "fsdp2":
            mesh = init_device_mesh("cpu", (smp.size(),))
            for block in net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(net, mesh=mesh)
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

            def step(x: torch.Tensor, y: torch.Tensor) -> None:
                opt.zero_grad()
                F.mse_loss(net(x), y).backward()
                opt.step()

            return step, list(net.parameters()), opt
        model = smp.DistributedModel(net)
        dopt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

        @smp.step
        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        def smp_step(x: torch.Tensor, y: torch.Tensor) -> None:
            dopt.zero_grad()
            train_step(x, y)
            dopt.step()

        return smp_step, list(model.parameters()), dopt.optimizer

    base = _rss_kib()
    times: dict[str, list[float]] = {m: [] for m in modes}
    held: dict[str, int] = {}
    for _ in range(ROUNDS if len(modes) > 1 else 1):
        for mode in modes:
            step, params, opt = build(mode)
            g = torch.Generator().manual_seed(smp.rank())
            x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)
            for i in range(WARMUP + STEPS):
                smp.barrier()
                t0 = time.perf_counter()
                step(x, y)
                smp.barrier()
                if i >= WARMUP:
                    times[mode].append(time.perf_counter() - t0)
            held[mode] = held_bytes(params, opt)
            del step, params, opt
    if smp.rank() != 0:
        return
    load = open("/proc/loadavg").read().split()[:3]
    shape = f"{BLOCKS} x Linear({WIDTH},{WIDTH}), AdamW, 4 ranks, load {' '.join(load)}"
    if len(modes) == 1:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"MEM {modes[0]} {peak} {peak - base}", flush=True)
        return
    med = {m: statistics.median(times[m]) for m in modes}
    print(
        f"sdp ({shape}): step dp {med['dp'] * 1e3:.1f} ms, sdp=4 {med['sdp'] * 1e3:.1f} ms, "
        f"hand-written FSDP2 {med['fsdp2'] * 1e3:.1f} ms; ratio sdp/dp {med['sdp'] / med['dp']:.3f}, "
        f"sdp/fsdp2 {med['sdp'] / med['fsdp2']:.3f}",
        flush=True,
    )
    print(
        f"  bytes per rank (parameters + gradients + optimizer state): dp {held['dp'] / 2**20:.1f} MiB, "
        f"sdp=4 {held['sdp'] / 2**20:.1f} MiB, fsdp2 {held['fsdp2'] / 2**20:.1f} MiB; "
        f"ratio sdp/dp {held['sdp'] / held['dp']:.3f}",
        flush=True,
    )


def main() -> None:
    print(workers.run_self(__file__, 4, list(NAMES), timeout=600), end="", flush=True)
    mem = workers.peak_rss(__file__, 4, [[mode] for mode in NAMES])
    grown = {m: mem[m][1] for m in NAMES}
    ratios = f"; growth ratio sdp/dp {grown['sdp'] / grown['dp']:.3f}, sdp/fsdp2 {grown['sdp'] / grown['fsdp2']:.3f}"
    print(workers.rss_summary(mem, NAMES) + ratios, flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    else:
        main()
