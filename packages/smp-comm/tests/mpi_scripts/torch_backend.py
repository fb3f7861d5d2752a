"""The ``smp`` torch.distributed backend against gloo, run under mpiexec.

Usage: ``torch_backend.py [HOSTS]``: with ``HOSTS`` = ``split`` the ranks pretend to sit on
two hosts (ranks 0, 1 on one, the rest on another), with ``interleave`` on ``rank % 2``, so
the cross-host (hierarchical) path runs; the default is one host. Inputs are a function of
the rank, so every rank also knows the exact answer.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from mpi4py import MPI
from payloads import case_ok, init_smp_world, main_guard

world = MPI.COMM_WORLD
RANK, SIZE = world.rank, world.size
HOSTS = sys.argv[1] if len(sys.argv) > 1 else "one"
if HOSTS == "split":
    os.environ["SMP_COMM_NODE_ID"] = f"host{min(RANK // 2, 1)}"
elif HOSTS == "interleave":
    os.environ["SMP_COMM_NODE_ID"] = f"host{RANK % 2}"

import smp_comm.torch_backend  # noqa: E402,F401
from smp_comm.collectives.local import CollectiveMismatchError  # noqa: E402

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128]
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
       "bxor": dist.ReduceOp.BXOR, "avg": dist.ReduceOp.AVG}
# 8 KiB slots (set by the test): 3000 float64 is several chunks; 70000 float32 (280 KB) is
# past the one-step all-reduce limit, so the two-step path runs too.
SIZES = [0, 1, 7, 3000]


def make(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        real = torch.float64
        x = torch.rand(n, generator=g, dtype=real) * 2 - 1
        if dtype.is_complex:
            x = torch.complex(x, torch.rand(n, generator=g, dtype=real) * 2 - 1)
        return x.to(dtype)
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, (n,), generator=g, dtype=torch.int64).to(dtype)


def exact(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    wide = [x.to(torch.complex128 if x.is_complex() else torch.float64) for x in xs]
    acc = wide[0].clone()
    for x in wide[1:]:
        acc = {"sum": acc + x, "avg": acc + x, "product": acc * x}.get(op, acc)
    return acc / len(xs) if op == "avg" else acc


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (any layout; a fresh tensor, so a one-element view of stride 2 works)."""
    out = torch.empty(t.numel(), dtype=t.dtype)
    out.copy_(t.reshape(-1))
    return out.view(torch.uint8)


def _real(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(_real(dtype)).eps


def tiny(dtype: torch.dtype) -> float:
    return torch.finfo(_real(dtype)).tiny


def same_everywhere(t: torch.Tensor, gloo) -> bool:
    mine = raw(t)
    rows = [torch.empty_like(mine) for _ in range(SIZE)]
    dist.all_gather(rows, mine, group=gloo)
    return all(torch.equal(r, rows[0]) for r in rows)


def check_reduction(case: str, got: torch.Tensor, op: str, xs: list[torch.Tensor], gloo,
                    ref: torch.Tensor | None, everywhere: bool = True) -> None:
    dtype = got.dtype
    if not (dtype.is_floating_point or dtype.is_complex) or op in ("min", "max"):
        if ref is None:  # gloo refused this dtype/op: the exact answer, computed here
            ref = xs[0].clone()
            fn = {"sum": torch.add, "product": torch.mul, "min": torch.minimum,
                  "max": torch.maximum, "band": torch.bitwise_and, "bor": torch.bitwise_or,
                  "bxor": torch.bitwise_xor}[op]
            for x in xs[1:]:
                ref = fn(ref, x)
        assert torch.equal(got, ref), (case, got, ref)
        return
    want = exact(op, xs)
    mags = sum(x.to(want.dtype).abs() for x in xs)
    floor = 0.0
    if op == "product":  # relative bound, plus the absolute error of rounding near underflow
        mags, floor = want.abs(), SIZE * tiny(dtype)
    bound = (SIZE + 1) * eps(dtype) * mags.to(torch.float64) + floor + 1e-30
    err = (got.to(want.dtype) - want).abs()
    assert bool((err <= bound).all()), (case, float((err - bound).max()))
    assert not everywhere or same_everywhere(got, gloo), f"{case}: ranks differ"


def gloo_ok(fn, *args, **kwargs) -> bool:
    """Run a gloo collective; False if gloo refuses the dtype or reduction."""
    try:
        fn(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def test_reductions(gloo) -> None:
    for dtype in DTYPES:
        for op, rop in OPS.items():
            if op in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
                continue
            if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
                continue
            if op in ("min", "max", "product") and dtype.is_complex:
                continue  # torch.distributed refuses these itself
            for n in SIZES + ([70000] if dtype == torch.float32 else []):
                case = f"all_reduce-{dtype}-{op}-{n}"
                xs = [make(r, n, dtype) for r in range(SIZE)]
                t = xs[RANK].clone()
                dist.all_reduce(t, op=rop)
                ref = None
                if op != "avg":
                    ref = xs[RANK].clone()
                    ref = ref if gloo_ok(dist.all_reduce, ref, rop, group=gloo) else None
                check_reduction(case, t, op, xs, gloo, ref)
                again = xs[RANK].clone()
                dist.all_reduce(again, op=rop)
                assert torch.equal(again, t), f"{case}: differs from run to run"
                # non-contiguous: every other element of a longer tensor
                wide = torch.zeros(2 * n, dtype=dtype)
                wide[::2] = xs[RANK]
                view = wide[::2]
                dist.all_reduce(view, op=rop)
                assert torch.equal(view, t) and not wide[1::2].any(), f"{case}: strided"
                # reduce-scatter: SIZE blocks of n elements
                ins = [torch.cat([make(r, n, dtype, salt=b) for b in range(SIZE)])
                       for r in range(SIZE)]
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, ins[RANK], op=rop)
                blocks = [x.view(SIZE, n)[RANK] for x in ins]
                rref = None
                if op != "avg":
                    rref = torch.empty(n, dtype=dtype)
                    rs = dist.reduce_scatter_tensor
                    rref = rref if gloo_ok(rs, rref, ins[RANK], rop, group=gloo) else None
                check_reduction("reduce_scatter-" + case, out, op, blocks, gloo, rref, False)
                lst = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(lst, list(ins[RANK].view(SIZE, n)), op=rop)
                assert torch.equal(lst, out), f"{case}: list form"
    case_ok("reductions")


def test_gather_broadcast(gloo) -> None:
    for dtype in DTYPES + [torch.float8_e4m3fn, torch.uint16]:
        for n in SIZES + [5001]:
            xs = [make(r, n, torch.float64 if dtype == torch.float8_e4m3fn else dtype).to(dtype)
                  if dtype != torch.uint16 else torch.arange(n, dtype=torch.int32).to(dtype)
                  for r in range(SIZE)]
            out = torch.empty(SIZE * n, dtype=dtype)
            dist.all_gather_into_tensor(out, xs[RANK])
            want = torch.cat(xs)
            assert torch.equal(raw(out), raw(want)), (dtype, n)
            ref = torch.empty_like(out)
            if gloo_ok(dist.all_gather_into_tensor, ref, xs[RANK], group=gloo):
                assert torch.equal(raw(out), raw(ref)), (dtype, n)
            rows = [torch.empty(n, dtype=dtype) for _ in range(SIZE)]
            dist.all_gather(rows, xs[RANK])
            assert torch.equal(raw(torch.cat(rows)), raw(want))
            # non-contiguous input and output
            src = torch.zeros(2 * n, dtype=dtype)
            src[::2] = xs[RANK]
            big = torch.zeros(SIZE * n, 2, dtype=dtype)
            dist.all_gather_into_tensor(big[:, 0], src[::2])
            assert torch.equal(raw(big[:, 0]), raw(want))
            for root in range(SIZE):
                t = xs[RANK].clone()
                dist.broadcast(t, src=root)
                assert torch.equal(raw(t), raw(xs[root])), (dtype, n, root)
    case_ok("gather-broadcast")


def test_all_to_all(gloo) -> None:
    """all_to_all_single without split sizes: through the segment on one host (the group's
    hand-off to gloo is counted), by gloo across hosts and whenever split
    sizes are given; every answer exact and equal to gloo's."""
    pg = dist.group.WORLD
    one_host = HOSTS == "one"
    real = pg._other  # (what the group hands the collectives it does not run itself)
    calls = []

    def counted(tensors):
        calls.append(1)
        return real(tensors)

    pg._other = counted
    try:
        for dtype in (torch.bool, torch.int64, torch.bfloat16, torch.float32, torch.float64):
            # rows per block: 0, 1 and 3000 float64 rows (several 8 KiB slots' worth)
            for rows, cols in ((0, 3), (1, 1), (2, 5), (3000, 1), (37, 11)):
                xs = [make(r, SIZE * rows * cols, dtype, salt=5).view(SIZE * rows, cols) for r in range(SIZE)]
                out = torch.empty_like(xs[RANK])
                before = len(calls)
                dist.all_to_all_single(out, xs[RANK])
                want = torch.cat([x.view(SIZE, rows, cols)[RANK] for x in xs])
                assert torch.equal(raw(out), raw(want)), (dtype, rows, cols)
                assert (len(calls) == before) == one_host, (dtype, rows, cols, len(calls) - before)
                ref = torch.empty_like(out)
                if gloo_ok(dist.all_to_all_single, ref, xs[RANK], group=gloo):
                    assert torch.equal(raw(out), raw(ref)), (dtype, rows, cols)
        # non-contiguous input and output (one host: gloo refuses them), asynchronously
        x = make(RANK, SIZE * 4 * 6, torch.float32, salt=9).view(SIZE * 4, 6)
        src = torch.zeros(SIZE * 4, 12)
        src[:, ::2] = x
        big = torch.zeros(SIZE * 4, 12)
        if one_host:
            dist.all_to_all_single(big[:, 1::2], src[:, ::2], async_op=True).wait()
            want = torch.cat([make(r, SIZE * 4 * 6, torch.float32, salt=9).view(SIZE, 4, 6)[RANK] for r in range(SIZE)])
            assert torch.equal(big[:, 1::2], want) and not big[:, ::2].any()
        # uneven splits: gloo's
        before = len(calls)
        splits = [r + 1 for r in range(SIZE)]  # rank r sends r + 1 rows... to every peer j: j + 1
        inp = torch.full((sum(splits),), float(RANK))
        out = torch.empty(SIZE * (RANK + 1))
        dist.all_to_all_single(out, inp, [RANK + 1] * SIZE, splits)
        assert out.tolist() == [float(r) for r in range(SIZE) for _ in range(RANK + 1)]
        assert len(calls) == before + 1
        # split sizes given, even equal ones: gloo's on every rank (each rank's sizes are its
        # own, so equal here need not be equal on a peer: the path must not depend on them)
        x = torch.arange(SIZE * 2, dtype=torch.float32) + 100 * RANK
        out = torch.empty(SIZE * 2)
        dist.all_to_all_single(out, x, [2] * SIZE, [2] * SIZE)
        assert out.tolist() == [100.0 * r + 2 * RANK + k for r in range(SIZE) for k in range(2)]
        assert len(calls) == before + 2
    finally:
        del pg._other
    case_ok("all-to-all")


def test_names_and_fallback(gloo) -> None:
    pg = dist.group.WORLD
    x = torch.arange(5, dtype=torch.float32) + RANK
    want = torch.cat([torch.arange(5, dtype=torch.float32) + r for r in range(SIZE)])
    for name in ("all_gather_single", "_allgather_base"):
        out = torch.empty(5 * SIZE)
        getattr(pg, name)(out, x, c10d.AllgatherOptions()).wait()
        assert torch.equal(out, want), name
    for name in ("reduce_scatter_single", "_reduce_scatter_base"):
        out = torch.empty(5)
        getattr(pg, name)(out, want.clone(), c10d.ReduceScatterOptions()).wait()
        assert torch.equal(out, want.view(SIZE, 5)[RANK] * SIZE), name
    # the user-level names: torch 2.13's and the older ones
    for fn in (getattr(dist, "all_gather_single", None), dist.all_gather_into_tensor):
        if fn is not None:
            out = torch.empty(5 * SIZE)
            fn(out, x)
            assert torch.equal(out, want), fn
    for fn in (getattr(dist, "reduce_scatter_single", None), dist.reduce_scatter_tensor):
        if fn is not None:
            out = torch.empty(5)
            fn(out, want.clone())
            assert torch.equal(out, want.view(SIZE, 5)[RANK] * SIZE), fn
    # all_to_all_single (the segment's on one host, gloo's across hosts); gloo does the
    # rest: gather, point to point
    a2a = torch.empty(SIZE, dtype=torch.int64)
    dist.all_to_all_single(a2a, torch.arange(SIZE) + 10 * RANK)
    assert a2a.tolist() == [10 * r + RANK for r in range(SIZE)]
    if RANK < 2:
        t = torch.tensor([RANK + 1.0])
        if RANK == 0:
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)
            assert t.item() == 1.0
    dist.barrier()
    case_ok("names-fallback")


def test_mismatch_and_async(gloo, store) -> None:
    if HOSTS == "one":  # across hosts a mismatch is gloo's to catch (it aborts the process)
        t = torch.ones(3 + (RANK == 1), dtype=torch.float32)
        try:
            dist.all_reduce(t)
        except CollectiveMismatchError:
            pass
        else:
            raise AssertionError("different sizes were not refused")
    if HOSTS == "one" and os.environ.get("SMP_COMM_COMPILED", "1") != "0":
        # Small all-reduces and barriers here take the express path (one C call each); its
        # mismatch above raised like the ordinary path's.
        assert dist.group.WORLD._express is not None, "the express path did not build"
    t = torch.ones(4)
    dist.all_reduce(t)  # the group is still usable
    assert t.tolist() == [float(SIZE)] * 4
    # Overlap: rank 0's async all-reduce must return before rank 1 has entered it, since
    # rank 1 enters only after rank 0 set a key after the call returned.
    x = torch.full((1000,), float(RANK))
    if RANK == 0:
        work = dist.all_reduce(x, async_op=True)
        store.set("entered", "1")
        work.wait()
    else:
        if RANK == 1:
            store.wait(["entered"], timedelta(seconds=60))
        work = dist.all_reduce(x, async_op=True)
        assert work.wait()
    assert work.is_completed() and bool((x == sum(range(SIZE))).all())
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    assert fut.wait()[0].tolist() == [float(SIZE)] * 2
    case_ok("mismatch-async")


def main() -> None:
    store = init_smp_world(60)
    assert dist.get_backend() == "smp"
    gloo = dist.new_group(backend="gloo")
    test_gather_broadcast(gloo)
    test_reductions(gloo)
    test_names_and_fallback(gloo)
    test_all_to_all(gloo)
    test_mismatch_and_async(gloo, store)
    sub = dist.new_group([0, SIZE - 1], backend="smp")
    if RANK in (0, SIZE - 1):
        t = torch.tensor([RANK + 1])
        dist.all_reduce(t, group=sub)
        assert t.item() == SIZE + 1
    case_ok("subgroup")
    dist.destroy_process_group()


if __name__ == "__main__":
    main_guard(main)
