"""The cost of splitting a backward into input-grad (I) and weight-grad (W) tasks.

Run: python benchmarks/bench_wsplit.py   (one process; 5-6 minutes on a 2-core machine at
load average 12-21, estimated 1-2 minutes quiet)
Smoke: BENCH_WSPLIT_REPS=3 BENCH_WSPLIT_SCALE=0.25 python benchmarks/bench_wsplit.py

For each case, a forward (untimed) then its backward, timed, ``REPS`` times, the two
contenders alternating (which goes first alternates too), gradients reset before each:

- ``plain``: ``out.backward(g)``;
- ``split``: the same backward under ``smp_pipeline.wsplit.deferred_weight_grads`` (the I
  pass: input gradients, W tasks queued), then ``queue.run()`` (the W pass).

One intra-op thread by default (``BENCH_WSPLIT_THREADS``): on a shared machine two OpenMP
threads wait at every barrier for whichever was preempted, which swamps a 5% difference.

Cases, fp32 on CPU (``SCALE`` multiplies the token count): ``linear`` (one ``nn.Linear``
1024 -> 1024 on 1024 tokens), ``attention`` (qkv projection, ``F.scaled_dot_product_attention``
with 8 heads, output projection; width 512, 2 x 512 tokens), ``layernorm`` / ``rmsnorm`` (one
norm of width 1024 on 8192 tokens), ``block`` (a pre-norm transformer block: LayerNorm,
attention, LayerNorm, GELU MLP of 4x; width 512, 2 x 512 tokens).

Printed per case: the median and best plain backward, I, W and I + W in milliseconds, and
the ratio (I + W) / plain, median over median and best over best (wall time), and of the
process's CPU time (medians; less moved by other jobs' preemption), against the target of
<= 1.05x a plain backward (a benchmark target, never asserted). Then the bytes autograd saves
for backward in the forward (distinct storages, the input included, parameters excluded) — what a
1F1B stage keeps per microbatch in flight from F to B — against what the queued W tasks hold
after the I pass — what a zero-bubble stage keeps per microbatch from I to W.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from smp_pipeline.wsplit import deferred_weight_grads
from torch import nn

REPS = int(os.environ.get("BENCH_WSPLIT_REPS", "15"))
SCALE = float(os.environ.get("BENCH_WSPLIT_SCALE", "1"))
THREADS = int(os.environ.get("BENCH_WSPLIT_THREADS", "1"))
TARGET = 1.05


class Attention(nn.Module):
    def __init__(self, d: int, heads: int = 8) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, t, d))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.n1, self.attn, self.n2 = nn.LayerNorm(d), Attention(d), nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.out(F.gelu(self.fc(self.n2(x))))  # type: ignore[no-any-return]


def _tokens(n: int) -> int:
    return max(8, int(n * SCALE))


CASES: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "linear": lambda: (nn.Linear(1024, 1024), torch.randn(_tokens(1024), 1024)),
    "attention": lambda: (Attention(512), torch.randn(2, _tokens(512), 512)),
    "layernorm": lambda: (nn.LayerNorm(1024), torch.randn(_tokens(8192), 1024)),
    "rmsnorm": lambda: (nn.RMSNorm(1024), torch.randn(_tokens(8192), 1024)),
    "block": lambda: (Block(512), torch.randn(2, _tokens(512), 512)),
}


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Distinct storages autograd saves in one forward, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def _case(name: str) -> None:
    torch.manual_seed(0)
    model, x = CASES[name]()
    x.requires_grad_(True)
    g = torch.randn_like(model(x))
    times: dict[str, list[float]] = {"plain": [], "I": [], "W": [], "I+W": []}
    cpu: dict[str, list[float]] = {"plain": [], "I+W": []}

    def reset() -> None:
        for p in model.parameters():
            p.grad = None
        x.grad = None

    def plain() -> None:
        reset()
        out = model(x)
        c0, t0 = time.process_time(), time.perf_counter()
        out.backward(g)
        times["plain"].append(time.perf_counter() - t0)
        cpu["plain"].append(time.process_time() - c0)

    held = [0]

    def split() -> None:
        reset()
        with deferred_weight_grads(model) as q:
            out = model(x)
            c0, t0 = time.process_time(), time.perf_counter()
            out.backward(g)
            c1, t1 = time.process_time(), time.perf_counter()
        held[0] = q.pending_bytes()
        c2, t2 = time.process_time(), time.perf_counter()
        q.run()
        c3, t3 = time.process_time(), time.perf_counter()
        cpu["I+W"].append(c1 - c0 + c3 - c2)
        times["I"].append(t1 - t0)
        times["W"].append(t3 - t2)
        times["I+W"].append(t1 - t0 + t3 - t2)

    plain(), split()  # warm-up, untimed
    for v in (*times.values(), *cpu.values()):
        v.clear()
    for r in range(REPS):
        for f in (plain, split) if r % 2 == 0 else (split, plain):
            f()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    best = {k: min(v) * 1e3 for k, v in times.items()}
    cols = "  ".join(f"{k} {med[k]:7.2f}/{best[k]:7.2f}" for k in times)
    print(f"{name:10s} ms median/best: {cols}")
    print(f"{'':10s} (I+W)/plain: median {med['I+W'] / med['plain']:.3f}x, best "
          f"{best['I+W'] / best['plain']:.3f}x; CPU time median "
          f"{statistics.median(cpu['I+W']) / statistics.median(cpu['plain']):.3f}x   "
          f"(target <= {TARGET:.2f}x)")  # fmt: skip
    fwd = _saved_bytes(model, x)
    print(f"{'':10s} saved for backward after F: {fwd / 2**20:7.2f} MiB; held by W tasks after "
          f"I: {held[0] / 2**20:7.2f} MiB ({held[0] / fwd:.2f}x)")  # fmt: skip


def main() -> None:
    torch.set_num_threads(THREADS)
    print(f"bench_wsplit: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"REPS={REPS}, SCALE={SCALE}, load average {os.getloadavg()}")  # fmt: skip
    for name in CASES:
        _case(name)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
