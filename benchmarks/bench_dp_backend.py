"""smp-torch data parallelism on gloo vs on smp-comm's ``smp`` backend (``collective_backend``).

Run: ``python benchmarks/bench_dp_backend.py`` (spawns ``mpiexec -n 2`` of itself).

Two ranks, data parallelism only (the gradients of 8 ``Linear(1024, 1024)`` layers, 32 MiB,
are all-reduced every step; a batch of 16 rows per rank keeps compute small, so the
reduction is a large share of the step, as on a GPU), then the same with tensor parallelism
(``tensor_parallel_degree=2``: the TP layers' collectives run on the group's backend too).
Rounds alternate between the two backends (``smp.init`` again each time) so both see the
same machine load; prints the median step time of each and the ratio gloo / smp (above 1:
the smp backend is faster).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

WIDTH, LAYERS, ROWS = 1024, 8, 16
WARMUP, STEPS, ROUNDS = 2, 8, 3


def _measure(layout: str, backend: str) -> list[float]:
    """Step times of one configuration (``smp.init`` again: a fresh model and groups)."""
    import smp_torch as smp
    import torch
    import torch.nn.functional as F
    from torch import nn

    config: dict[str, object] = {"collective_backend": backend}
    if layout == "tp2":
        config["tensor_parallel_degree"] = 2
    smp.init(config)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    net = nn.Sequential(*layers)
    if layout == "tp2":
        smp.set_tensor_parallelism(net)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    @smp.step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    times = []
    for step in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        opt.zero_grad()
        train(x, y)
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def worker() -> None:
    import smp_torch as smp
    import torch

    torch.set_num_threads(1)
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(ROUNDS):
        for layout in ("dp2", "tp2"):
            for backend in ("gloo", "smp"):
                results.setdefault((layout, backend), []).extend(_measure(layout, backend))
    if smp.rank() == 0:
        for layout in ("dp2", "tp2"):
            gloo = statistics.median(results[(layout, "gloo")]) * 1e3
            fast = statistics.median(results[(layout, "smp")]) * 1e3
            print(
                f"dp backend {layout} (2 ranks, {LAYERS}x Linear({WIDTH}), {ROWS} rows/rank): "
                f"step gloo {gloo:.1f} ms | smp {fast:.1f} ms | gloo/smp {gloo / fast:.2f}x "
                f"(load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )


def main() -> None:
    from smp_comm.testing import mpiexec_path

    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_DP_BACKEND_WORKER="1")
    env.pop("SMP_CONFIG", None)
    cmd = [mpiexec_path(), "-n", "2", sys.executable, os.path.abspath(__file__)]
    subprocess.run(cmd, env=env, check=True, timeout=600)


if __name__ == "__main__":
    if os.environ.get("BENCH_DP_BACKEND_WORKER"):
        worker()
    else:
        main()
