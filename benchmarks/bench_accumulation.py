"""What deterministic accumulation costs inside a stage's backward, against plain autograd.

Run: python benchmarks/bench_accumulation.py      (one process, one thread; ~3 minutes)

smp-pipeline sums each parameter's microbatch gradients in microbatch order through two
autograd hooks per parameter (``smp_pipeline.accumulation.GradAccumulator``); one process
accumulating microbatches pays nothing of the kind. This measures that difference where it
matters most, a stage of small blocks: 4 blocks of ``LayerNorm, Linear(w, 4w), GELU,
Linear(4w, w)`` (24 parameters), 8 microbatches of 64 rows, forward and backward of each
microbatch in order, the same model once plain and once tracked by a ``GradAccumulator``
whose parameters each get one contribution per microbatch (``streamable``: the common case on
a stage, one request per microbatch or one per block, where contributions stream into
``.grad``), and once with every contribution buffered until its microbatch completes
(``streamable`` empty: a stage whose step function shares parameters with calls it serves,
say, or before per-parameter streaming, every stage that served several calls per
microbatch). Rounds alternate plain and tracked, so load on the machine hits both alike; it
prints the median paired difference per microbatch, per parameter, and as a share of the
microbatch's time, and checks the gradients are bitwise those of plain autograd.

The buffered case's cost is mostly the CPU allocator, not the hooks: a buffered contribution
is autograd's own tensor kept alive until its microbatch folds, so the backward's next
gradients need fresh memory, and glibc's default malloc hands out (and later returns) large
blocks straight from the kernel: every page faults in again. With
``MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000`` (or jemalloc /
tcmalloc) the buffered backward costs what the plain one does (docs/perf-notes.md).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F
from bench_sequential import mlp_stack  # (this folder: the same blocks as that benchmark)
from smp_pipeline.accumulation import ALL_PARAMETERS, GradAccumulator
from torch import nn

WIDTHS = (128, 384)
ROWS, MB, BLOCKS = 64, 8, 4
ROUNDS = int(os.environ.get("BENCH_ACC_ROUNDS", "30"))
STEPS = 5  # per round and model; the median step counts


def _build(width: int) -> nn.Module:
    torch.manual_seed(0)
    return mlp_stack(width, BLOCKS)  # type: ignore[no-any-return]


def _steps(
    net: nn.Module,
    acc: GradAccumulator | None,
    mb: list[int | None],
    x: torch.Tensor,
    y: torch.Tensor,
) -> float:
    """Median seconds of a step (every microbatch's forward and backward, in order; ``mb[0]``
    names the microbatch running, for the accumulator)."""
    times = []
    for step in range(STEPS):
        for p in net.parameters():
            p.grad = None
        t0 = time.perf_counter()
        if acc is not None:
            acc.begin(step)
        for i, (xs, ys) in enumerate(zip(x.chunk(MB), y.chunk(MB))):
            mb[0] = i
            (F.mse_loss(net(xs), ys) / MB).backward()
            if acc is not None:
                acc.complete(step, i)
        if acc is not None:
            acc.end()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(width: int, streaming: bool) -> str:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS * MB, width, generator=g), torch.randn(ROWS * MB, width, generator=g)
    plain, tracked = _build(width), _build(width)
    mb: list[int | None] = [None]
    every = ALL_PARAMETERS if streaming else frozenset()
    acc = GradAccumulator(lambda: mb[0], True, lambda: every)
    acc.track(tracked.parameters())
    n_params = sum(1 for _ in plain.parameters())
    base, extra = [], []
    for _ in range(ROUNDS):
        a = _steps(plain, None, mb, x, y)
        b = _steps(tracked, acc, mb, x, y)
        base.append(a)
        extra.append((b - a) / MB)
    same = all(
        torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), tracked.parameters())
    )
    per_mb = statistics.median(extra)
    mb_time = statistics.median(base) / MB
    extra.sort()
    q1, q3 = extra[len(extra) // 4], extra[3 * len(extra) // 4]
    mode = "streamed" if streaming else "buffered"
    return (
        f"width {width}, {mode}: a microbatch's forward and backward {mb_time * 1e3:.2f} ms; "
        f"accumulation hooks +{per_mb * 1e6:.0f} us per microbatch (quartiles {q1 * 1e6:.0f} / "
        f"{q3 * 1e6:.0f}), {per_mb / n_params * 1e6:.1f} us per parameter ({n_params}), "
        f"{per_mb / mb_time:.1%} of the microbatch; gradients bitwise equal: {same}"
    )


def main() -> None:
    torch.set_num_threads(1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"bench_accumulation (load avg {load:.1f}, 1 thread, {ROUNDS} alternating rounds):",
        flush=True,
    )
    for width in WIDTHS:
        for streaming in (True, False):
            print("  " + _measure(width, streaming), flush=True)


if __name__ == "__main__":
    main()
