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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(local, os.X_OK):
        return local
    found = shutil.which("mpiexec")
    if not found:
        sys.exit("demo: no mpiexec found: `pip install mpich` (or load a system MPI)")
    return found


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
    cmd = [
        mpiexec(), "-n", str(args.nprocs), sys.executable,
        os.path.join(ROOT, "examples", "gpt", "train.py"),
        "--pp", str(args.pp), "--tp", str(args.tp), "--microbatches", str(args.microbatches),
        "--steps", str(args.steps), "--out", out, "--timeline", "--progress", "--sample", "60",
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
