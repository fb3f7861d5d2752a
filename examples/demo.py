"""The main job: train the GPT example on 4 CPU processes, pipeline 2 x tensor 2.

    python examples/demo.py            # what `nox -s demo` runs
    python examples/demo.py --steps 20 --pp 2 --tp 2

It launches ``mpiexec -n 4 python examples/gpt/train.py`` with the ``mpiexec`` beside this
Python (the ``mpich`` wheel) or on PATH. Rank 0 prints the partition table (from
smp-partition) and a progress bar with the loss and tokens/s, and these land in ``runs/demo``:

- ``partition.txt`` / ``partition.svg`` — the automatic partition: per-stage table, and the
  module tree coloured by pipeline stage;
- ``timeline.json`` — the pipeline's request timeline as a Chrome trace (chrome://tracing or
  https://ui.perfetto.dev), ``timeline.png`` — the same drawn like the paper's Figure 5
  (the last steps of training);
- ``metrics.json`` — losses per step, throughput, a greedy sample.

Then it checks the promise of SPEC §8 on the demo itself: it trains the same model (same seed,
same batches) in this one process, without smp, accumulating gradients over the same
microbatches, and every step's loss must equal the job's within the equivalence bound
(``rtol=1e-5``, ``atol=1e-6``). With tensor parallelism the sums run in another order, and
over 80 AdamW steps that alone moves the loss by more than ``rtol``: one process whose only
change is that every ``nn.Linear`` sums its two input halves separately (what a row-parallel
layer does) differs from the plain one by up to 1.6e-5 (at step 31, none of the first 20 steps
above 4.4e-8). So for tp > 1 the demo also trains that split-sum process and allows each step
:data:`SPREAD_FACTOR` times the largest relative difference the split sums made up to that
step (SPEC §8: "a norm-based bound", here measured, not assumed). Losses are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# SPEC §8's bound for fp32 losses, per step.
RTOL, ATOL = 1e-5, 1e-6
# With tp > 1: a step may differ by this many times the largest relative difference that
# summing each Linear's input halves separately made in one process up to that step. The two
# are different orders of the same sums, so their rounding walks differ; on this machine the
# job's was at most 1.2x the split-sum process's.
SPREAD_FACTOR = 4.0


@contextlib.contextmanager
def split_linear_sums() -> Iterator[None]:
    """Every ``nn.Linear`` computes ``x W^T`` as the sum of its two input halves' products,
    the order a row-parallel layer over two ranks sums in (for the demo's reference only)."""
    import torch.nn.functional as F
    from torch import nn

    plain = nn.Linear.forward

    def split(self: nn.Linear, x: Any) -> Any:
        k = self.in_features // 2
        y = F.linear(x[..., :k], self.weight[:, :k]) + F.linear(x[..., k:], self.weight[:, k:])
        return y if self.bias is None else y + self.bias

    nn.Linear.forward = split  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.forward = plain  # type: ignore[method-assign]


def mpiexec() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(local, os.X_OK):
        return local
    found = shutil.which("mpiexec")
    if not found:
        sys.exit("demo: no mpiexec found: `pip install mpich` (or load a system MPI)")
    return found


def reference_losses(train_argv: list[str], nprocs: int) -> list[float]:
    """The losses of one process training what ``train.py train_argv`` trains on ``nprocs``
    ranks: the same model, seed, batches and optimizer (read from ``train.py``'s own argument
    defaults, so the two cannot drift), each data-parallel rank's share of a batch split into
    ``microbatches`` parts and the loss averaged over all of them, as the pipeline does."""
    sys.path[:0] = [os.path.join(ROOT, "examples"), os.path.join(ROOT, "examples", "gpt")]
    # (imported here: the demo's launcher part needs neither torch nor the example's modules)
    import common
    import torch
    import train
    from model import build_gpt, lm_loss

    args = train.parse_args(train_argv)
    # Default batch mode (scaled_batch): the tensor-parallel ranks are data-parallel ranks
    # too, each fed its own share of the global batch.
    dp = nprocs // args.pp
    torch.set_num_threads(args.threads)
    corpus = common.CharCorpus()
    torch.manual_seed(args.seed)
    net = build_gpt(corpus.vocab_size, args.seq, args.dim, args.heads, args.layers, False)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        x, y = corpus.batch(step, args.batch, args.seq)
        optimizer.zero_grad()
        parts = [
            (xm, ym)
            for xs, ys in zip(x.chunk(dp), y.chunk(dp))
            for xm, ym in zip(xs.chunk(args.microbatches), ys.chunk(args.microbatches))
        ]
        total = 0.0
        for xm, ym in parts:
            loss = lm_loss(net(xm), ym) / len(parts)
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description="smp demo: GPT on 4 CPU processes (pp=2 x tp=2)")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--out", default=os.path.join("runs", "demo"))
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    train_argv = [
        "--pp", str(args.pp), "--tp", str(args.tp), "--microbatches", str(args.microbatches),
        "--steps", str(args.steps), "--out", out, "--timeline", "--progress", "--sample", "60",
    ]  # fmt: skip
    cmd = [
        mpiexec(), "-n", str(args.nprocs), sys.executable,
        os.path.join(ROOT, "examples", "gpt", "train.py"), *train_argv,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    print(f"demo: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"demo: timed out after {args.timeout:.0f}s", file=sys.stderr)
        return 1
    if proc.returncode != 0:
        print(f"demo: the training job failed (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode
    expected = ["metrics.json"]
    if args.pp > 1:
        expected += ["partition.txt", "partition.svg", "timeline.json", "timeline.png"]
    missing = [f for f in expected if not os.path.exists(os.path.join(out, f))]
    if missing:
        print(f"demo: missing outputs {missing}", file=sys.stderr)
        return 1
    with open(os.path.join(out, "metrics.json"), encoding="utf-8") as f:
        metrics = json.load(f)
    losses = metrics["losses"]
    print(
        f"demo: done in {time.perf_counter() - start:.0f}s; loss {losses[0]:.3f} -> "
        f"{losses[-1]:.3f}; {metrics['tokens_per_s']:,.0f} tokens/s; outputs in {out}:"
    )
    for name in expected:
        print(f"  {os.path.join(out, name)}")
    t_ref = time.perf_counter()
    want = reference_losses(train_argv, args.nprocs)
    print(f"demo: one-process reference trained in {time.perf_counter() - t_ref:.0f}s")
    spread = [0.0] * len(want)
    if args.tp > 1:
        with split_linear_sums():
            split = reference_losses(train_argv, args.nprocs)
        worst_so_far = 0.0
        for step, (a, b) in enumerate(zip(want, split)):
            worst_so_far = max(worst_so_far, abs(a - b) / abs(a))
            spread[step] = worst_so_far
        print(
            f"demo: one process summing each Linear's halves apart differs from it by up to "
            f"{max(spread):.1e} (relative): the job may differ by {SPREAD_FACTOR:g}x that"
        )
    print(f"  {'step':>4}  {'smp':>12}  {'one process':>12}  {'|diff|':>9}  {'bound':>9}")
    bad = []
    for step, (got, ref) in enumerate(zip(losses, want)):
        diff = abs(got - ref)
        bound = ATOL + max(RTOL, SPREAD_FACTOR * spread[step]) * abs(ref)
        if diff > bound:
            bad.append(step)
        if step < 3 or step >= len(losses) - 3 or diff > bound:
            print(f"  {step:>4}  {got:>12.7f}  {ref:>12.7f}  {diff:>9.2e}  {bound:>9.2e}")
    worst = max(abs(g - r) / abs(r) for g, r in zip(losses, want))
    if bad or len(losses) != len(want):
        print(
            f"demo: the loss differs from one process's at steps {bad} (rtol={RTOL:g}, "
            f"atol={ATOL:g}, with tp the split-sum spread x{SPREAD_FACTOR:g}; "
            f"{len(losses)} vs {len(want)} steps)",
            file=sys.stderr,
        )
        return 1
    print(
        f"demo: every step's loss matches one process's within its bound (largest relative "
        f"difference {worst:.1e}; rtol={RTOL:g}, atol={ATOL:g})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
