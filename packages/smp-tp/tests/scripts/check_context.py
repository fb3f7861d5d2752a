"""Context-parallel (ring) attention on every rank of the world, against one process's SDPA.

Every rank builds the same seeded full-sequence q, k, v and output gradient, computes the
reference with ``scaled_dot_product_attention`` on the whole sequence (forward and backward),
then runs ``context_parallel_attention`` on its own shard (``split_sequence``) and compares
its output rows and its shards of dq, dk, dv; the gathered outputs reassembled with
``gather_sequence`` must be the reference's whole output. ``quick`` as an argument runs
only the causal balanced GQA case (for 4 ranks). ``ulysses`` as an argument checks
``ulysses_attention`` (all-to-all over heads) instead of the ring, on the same cases (the
module case apart) plus one with a value head size of its own, and its refusal of key/value
heads that the ranks do not divide.
"""

from __future__ import annotations

import functools
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
from smp_tp.layers.ulysses import ulysses_attention

rank, world, _ = setup()
group = dist.new_group(list(range(world)))
WORST: dict[str, float] = {}
ULYSSES = "ulysses" in sys.argv[1:]
attention = ulysses_attention if ULYSSES else context_parallel_attention


def case(causal: bool, layout: str, hq: int, hkv: int, seq: int, module: bool = False, dv: int = 16) -> None:
    gen = torch.Generator().manual_seed(seq * 100 + hq * 10 + hkv + int(causal))
    b, d = 2, 16
    q = torch.randn(b, hq, seq, d, generator=gen, requires_grad=True)
    k = torch.randn(b, hkv, seq, d, generator=gen, requires_grad=True)
    v = torch.randn(b, hkv, seq, dv, generator=gen, requires_grad=True)
    dout = torch.randn(b, hq, seq, dv, generator=gen)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    ref.backward(dout)

    def mine(x: torch.Tensor) -> torch.Tensor:
        return split_sequence(x.detach(), rank, world, 2, layout)

    ql, kl, vl = (mine(x).requires_grad_() for x in (q, k, v))
    t0 = time.perf_counter()
    if module:
        out = ContextParallelAttention(group, causal=causal, layout=layout)(ql, kl, vl)
    else:
        out = attention(ql, kl, vl, group, causal=causal, layout=layout)
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
# Ulysses: q, k, v of three shapes take three exchanges; the ring: Dv != D takes the math blocks
CASES.append(("causal balanced gqa dv", dict(causal=True, layout="balanced", hq=4, hkv=2, seq=32, dv=8)))
if ULYSSES:  # the module is the ring's
    CASES = [c for c in CASES if "module" not in c[0]]
if "quick" in sys.argv[1:]:  # Ulysses needs the 4 ranks to divide the heads; the ring does not
    CASES = [("causal balanced gqa", dict(causal=True, layout="balanced", hq=8 if ULYSSES else 4,
                                          hkv=4 if ULYSSES else 2, seq=64))]

for label, kwargs in CASES:
    before = len(FAILURES)
    check(label, functools.partial(case, **kwargs))  # type: ignore[arg-type]
    if len(FAILURES) == before:
        log(f"{label} cp={world}: checked")


def odd_local_length() -> None:
    x = torch.zeros(1, 2, 5, 8)
    try:
        attention(x, x, x, group, causal=True, layout="balanced")
    except ValueError as e:
        log(f"ValueError: {e}")
        return
    raise AssertionError("an odd balanced shard was accepted")


check("odd local length", odd_local_length)


def too_few_kv_heads() -> None:
    q, kv = torch.zeros(1, 4, 8, 8), torch.zeros(1, 1, 8, 8)
    try:
        ulysses_attention(q, kv, kv, group, causal=True)
    except ValueError as e:
        log(f"ValueError: {e}")
        return
    raise AssertionError(f"ulysses_attention split 1 key/value head over {world} ranks")


if ULYSSES:
    check("too few kv heads", too_few_kv_heads)
log(f"worst |diff| over the cases: {', '.join(f'{n} {e:.2e}' for n, e in WORST.items())}")
finish(FAILURES)
