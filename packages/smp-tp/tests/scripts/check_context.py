"""Context-parallel (ring) attention on every rank of the world, against one process's SDPA.

Every rank builds the same seeded full-sequence q, k, v and output gradient, computes the
reference with ``scaled_dot_product_attention`` on the whole sequence (forward and backward),
then runs ``context_parallel_attention`` on its own shard (``split_sequence``) and compares
its output rows and its shards of dq, dk, dv; the gathered outputs reassembled with
``gather_sequence`` must be the reference's whole output. ``quick`` as the first argument
runs only the causal balanced GQA case (for 4 ranks).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import FAILURES, check, close, finish, log, setup
from smp_tp.layers.context import (
    ContextParallelAttention,
    context_parallel_attention,
    gather_sequence,
    split_sequence,
)

rank, world, _ = setup()
group = dist.new_group(list(range(world)))
WORST: dict[str, float] = {}


def case(causal: bool, layout: str, hq: int, hkv: int, seq: int, module: bool = False) -> None:
    gen = torch.Generator().manual_seed(seq * 100 + hq * 10 + hkv + int(causal))
    b, d = 2, 16
    q = torch.randn(b, hq, seq, d, generator=gen, requires_grad=True)
    k = torch.randn(b, hkv, seq, d, generator=gen, requires_grad=True)
    v = torch.randn(b, hkv, seq, d, generator=gen, requires_grad=True)
    dout = torch.randn(b, hq, seq, d, generator=gen)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    ref.backward(dout)

    def mine(x: torch.Tensor) -> torch.Tensor:
        return split_sequence(x.detach(), rank, world, 2, layout)

    ql, kl, vl = (mine(x).requires_grad_() for x in (q, k, v))
    t0 = time.perf_counter()
    if module:
        out = ContextParallelAttention(group, causal=causal, layout=layout)(ql, kl, vl)
    else:
        out = context_parallel_attention(ql, kl, vl, group, causal=causal, layout=layout)
    t1 = time.perf_counter()
    out.backward(mine(dout))
    t2 = time.perf_counter()
    pairs = {"out": (out, mine(ref)), "dq": (ql.grad, mine(q.grad)), "dk": (kl.grad, mine(k.grad)),
             "dv": (vl.grad, mine(v.grad))}
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out.detach().contiguous(), group=group)
    pairs["gathered out"] = (gather_sequence(parts, 2, layout), ref.detach())
    for name, (got, want) in pairs.items():
        assert got is not None and want is not None, name
        close(name, got, want)
        err = (got - want).abs().max().item()
        WORST[name] = max(WORST.get(name, 0.0), err)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            log(f"{name}: outside the unscaled allclose(rtol=1e-5, atol=1e-6), |diff| {err:.2e}")
    log(f"fwd {1e3 * (t1 - t0):.1f} ms, bwd {1e3 * (t2 - t1):.1f} ms, worst |diff| "
        + ", ".join(f"{n} {(g - w).abs().max().item():.1e}" for n, (g, w) in pairs.items()))


CASES = [
    ("causal balanced", dict(causal=True, layout="balanced", hq=2, hkv=2, seq=32)),
    ("causal contiguous", dict(causal=True, layout="contiguous", hq=2, hkv=2, seq=64)),
    ("non-causal contiguous", dict(causal=False, layout="contiguous", hq=2, hkv=2, seq=32)),
    ("non-causal balanced", dict(causal=False, layout="balanced", hq=2, hkv=2, seq=48)),
    ("causal balanced gqa", dict(causal=True, layout="balanced", hq=4, hkv=2, seq=64)),
    ("causal contiguous gqa module", dict(causal=True, layout="contiguous", hq=4, hkv=2, seq=32, module=True)),
]
if sys.argv[1:] == ["quick"]:
    CASES = [c for c in CASES if c[0] == "causal balanced gqa"]

for label, kwargs in CASES:
    before = len(FAILURES)
    check(label, case, *kwargs.values())  # type: ignore[arg-type]
    if len(FAILURES) == before:
        log(f"{label} cp={world}: checked")


def odd_local_length() -> None:
    x = torch.zeros(1, 2, 5, 8)
    try:
        context_parallel_attention(x, x, x, group, causal=True, layout="balanced")
    except ValueError as e:
        log(f"ValueError: {e}")
        return
    raise AssertionError("an odd balanced shard was accepted")


check("odd local length", odd_local_length)
log(f"worst |diff| over the cases: {', '.join(f'{n} {e:.2e}' for n, e in WORST.items())}")
finish(FAILURES)
