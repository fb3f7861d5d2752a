"""Context-parallel attention: the ring (``context_parallel_attention``) vs all-to-all over
heads (``ulysses_attention``) vs one process's SDPA on the whole sequence.

Run: python benchmarks/bench_cp_attention.py   (spawns ``torchrun --nproc-per-node 2`` and
then ``4`` of itself, gloo on CPU, one thread per rank; a few minutes on 2 cores)

Shapes: B=1, H=8 query and key/value heads, D=64, float32, causal, balanced layout; S in
``SEQS`` at cp=2 and ``SEQS_CP4`` at cp=4. A call is forward + backward of one attention
(output gradient given); every rank holds its ``S / cp`` shard. Ring and Ulysses alternate
call by call after ``WARMUP`` calls each, a barrier before each call (untimed); the figure is
the median over ``STEPS`` calls of rank 0's time. SDPA runs on rank 0 alone (the others wait)
on the full sequence: the one-process time the cp ranks share. ``ring/ulysses`` > 1 means
Ulysses is faster.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import workers  # (this folder)

B, H, D = 1, 8, 64
SEQS, SEQS_CP4 = (1024, 4096), (4096,)
WARMUP, STEPS = 2, 7


def _fwd_bwd(attn: Callable[..., Any], q: Any, k: Any, v: Any, dout: Any) -> None:
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    attn(qs, ks, vs).backward(dout)


def _worker() -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812
    from smp_tp import context_parallel_attention, split_sequence, ulysses_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    contenders = {name: functools.partial(fn, group=group, causal=True)
                  for name, fn in (("ring", context_parallel_attention), ("ulysses", ulysses_attention))}
    rows = []
    for seq in SEQS if cp == 2 else SEQS_CP4:
        gen = torch.Generator().manual_seed(seq)
        full = [torch.randn(B, H, seq, D, generator=gen) for _ in range(4)]  # q, k, v, dout
        shard = [split_sequence(x, rank, cp, 2, "balanced") for x in full]
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for step in range(WARMUP + STEPS):  # alternating, so both see the same machine load
            for name, attn in contenders.items():
                t = workers.timed_steps(functools.partial(_fwd_bwd, attn, *shard), 0, 1,
                                        sync=functools.partial(dist.barrier, group))
                if step >= WARMUP:
                    times[name] += t.times
        sdpa = [0.0]
        if rank == 0:
            one = functools.partial(_fwd_bwd, functools.partial(F.scaled_dot_product_attention, is_causal=True),
                                    *full)
            sdpa = workers.timed_steps(one, WARMUP, STEPS).times
        dist.barrier(group)
        rows.append({"cp": cp, "seq": seq, "sdpa": statistics.median(sdpa),
                     **{name: statistics.median(ts) for name, ts in times.items()}})
    dist.destroy_process_group()
    return {"rank": rank, "rows": rows}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(nprocs: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           os.path.abspath(__file__), "--worker", "cp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, env=env, check=True, timeout=1800, capture_output=True, text=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return list(json.loads(line[7:])["rows"])


def main() -> None:
    print(f"B={B} H={H} D={D} fp32 causal balanced, gloo CPU, 1 thread/rank, {os.cpu_count()} cores; "
          f"forward+backward ms per call, median of {STEPS} after {WARMUP} warm-up")
    print(f"{'cp':>3} {'S':>6} {'ring':>10} {'ulysses':>10} {'1-proc SDPA':>12} {'ring/ulysses':>13}")
    for nprocs in (2, 4):
        for r in _launch(nprocs):
            print(f"{r['cp']:>3} {r['seq']:>6} {1e3 * r['ring']:>10.1f} {1e3 * r['ulysses']:>10.1f} "
                  f"{1e3 * r['sdpa']:>12.1f} {r['ring'] / r['ulysses']:>12.2f}x", flush=True)


if __name__ == "__main__":
    if not workers.serve_worker({"cp": _worker}):
        main()
