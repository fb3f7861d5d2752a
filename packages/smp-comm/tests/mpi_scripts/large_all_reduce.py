"""The large (two-step) all-reduce of the ``smp`` backend, bit for bit, run under mpiexec.

Every result must equal, byte for byte, the same reduction computed here left to right in
rank order with torch's own binary kernels, ``((x0 + x1) + x2) + ...`` (``avg`` divided by
the size at the end): on every rank, whichever rank reduced which part of a chunk, with the C
kernel or without it (``SMP_COMM_COMPILED=0``). Sizes are past the one-step limit and, with
the 8 KiB slots the test sets, many chunks whose parts do not split evenly among the ranks;
one tensor starts inside its storage, and the elements around it must stay untouched.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from mpi4py import MPI
from payloads import case_ok, init_smp_world, main_guard
from smp_comm.collectives import local
from smp_comm.collectives.shm import step_library

RANK, SIZE = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
       "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
       "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
KERNELS = {"sum": torch.add, "avg": torch.add, "product": torch.mul, "min": torch.minimum,
           "max": torch.maximum, "band": torch.bitwise_and, "bor": torch.bitwise_or,
           "bxor": torch.bitwise_xor}
# The C kernel's dtypes first (complex64 reaches it as float32 pairs), then some only torch
# reduces.
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.int8, torch.complex64]


def make(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: floats of mixed magnitude near 1 (sums round differently in
    another order; products neither overflow nor underflow), small integers otherwise."""
    g = torch.Generator().manual_seed(7919 * rank + n)
    if dtype.is_floating_point or dtype.is_complex:
        x = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5) * torch.exp2(
            torch.randint(-12, 12, (n,), generator=g).double() * (torch.rand(n, generator=g) < 0.3)
        )
        x = x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
        if dtype.is_complex:
            x = torch.complex(x, x.flip(0))
        return x.to(dtype)
    return torch.randint(-3, 4, (n,), generator=g, dtype=torch.int64).to(dtype)


def rank_order(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    if xs[0].is_complex():  # torch.distributed hands backends complex tensors as real pairs
        return torch.view_as_complex(rank_order(op, [torch.view_as_real(x) for x in xs]))
    out = xs[0].clone()
    for x in xs[1:]:
        out = KERNELS[op](out, x)
    return out.div_(len(xs)) if op == "avg" else out


def ops_for(dtype: torch.dtype) -> list[str]:
    if dtype.is_complex:
        return ["sum", "avg"]  # torch.distributed refuses the rest for complex
    if dtype.is_floating_point:
        return ["sum", "avg", "product", "min", "max"]
    return ["sum", "product", "min", "max", "band", "bor", "bxor"]


def main() -> None:
    compiled = os.environ.get("SMP_COMM_COMPILED", "1") != "0"
    assert (step_library() is not None) == compiled, "the C library's state is not the test's"
    init_smp_world(60)
    for dtype in DTYPES:
        size = torch.empty(0, dtype=dtype).element_size()
        # Past the one-step limit by an odd count: chunks of 8 KiB / size elements, the last
        # one short, no part boundary a multiple of anything.
        n = local._ONE_SHOT_BYTES // size + 1001
        xs = [make(r, n, dtype) for r in range(SIZE)]
        for op in ops_for(dtype):
            case = f"{dtype}-{op}-{n}"
            want = rank_order(op, xs)
            t = xs[RANK].clone()
            dist.all_reduce(t, op=OPS[op])
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), (
                f"{case}: not the rank-order result at "
                f"{(t != want).nonzero().flatten()[:5].tolist()}"
            )
            # Inside its storage, 3 elements in: the same bits, the neighbours untouched.
            base = torch.zeros(n + 5, dtype=dtype)
            base[3 : 3 + n] = xs[RANK]
            dist.all_reduce(base[3 : 3 + n], op=OPS[op])
            assert torch.equal(base[3 : 3 + n].view(torch.uint8), want.view(torch.uint8)), case
            assert not base[:3].any() and not base[3 + n :].any(), f"{case}: neighbours"
    case_ok("large-all-reduce")
    dist.destroy_process_group()


if __name__ == "__main__":
    main_guard(main)
