"""Collectives among the ranks of one host, through a :class:`~smp_comm.collectives.shm.Segment`.

Every function takes flat contiguous CPU tensors (the backend prepares them) and runs whole
steps, so every rank takes the same number of steps for the same call. The first step of
each call carries a descriptor (operation, dtype, element count, root, reduction); if the
ranks disagree, every rank raises :class:`CollectiveMismatchError` at that same step and
the group stays usable.

Floating-point reductions add in rank order, ``((x0 + x1) + x2) + ...``, whichever rank
computes them, so results are identical on every rank and from run to run, within
``(n - 1) * eps * sum |x_i|`` of the exact sum. Integer and bitwise reductions are exact.
Large all-reduces are two steps per chunk (each rank reduces one n-th, then all copy the
parts out); small ones are one step (every rank reduces the whole, in the same order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from smp_comm.collectives.shm import Segment

__all__ = ["DTYPES", "REDUCE_OPS", "CollectiveMismatchError", "LocalCollectives", "check_reduce"]

# Codes for descriptors: the position in this tuple (the same on every rank of one install).
DTYPES: tuple[torch.dtype, ...] = tuple(
    d
    for d in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
        torch.complex128, getattr(torch, "uint16", None), getattr(torch, "uint32", None),
        getattr(torch, "uint64", None), getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
    )
    if d is not None
)
_CODE = {d: i for i, d in enumerate(DTYPES)}
_REDUCIBLE = set(DTYPES[:12])  # the dtypes torch's CPU kernels add, multiply and compare

# Reduction names (the backend maps torch's ReduceOp onto them) and their binary kernels.
_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.add, "avg": torch.add, "product": torch.mul, "min": torch.minimum,
    "max": torch.maximum, "band": torch.bitwise_and, "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}
REDUCE_OPS = tuple(_KERNELS)
_OP_CODE = {name: i for i, name in enumerate(REDUCE_OPS)}
_ALL_GATHER, _REDUCE_SCATTER, _ALL_REDUCE, _BROADCAST, _BARRIER = range(1, 6)
_ONE_SHOT_BYTES = 256 * 1024  # all-reduces up to this take one step (every rank reduces all)


class CollectiveMismatchError(ValueError):
    """Ranks called different collectives (or the same with different sizes or dtypes)."""


def check_reduce(dtype: torch.dtype, op: str) -> None:
    """Raise ``TypeError`` unless ``op`` can reduce ``dtype`` here (checked before any step,
    so every rank raises alike)."""
    if dtype not in _REDUCIBLE:
        raise TypeError(f"smp backend: cannot reduce {dtype}")
    if op in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"smp backend: {op} needs an integer or bool tensor, not {dtype}")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"smp backend: avg needs a floating-point tensor, not {dtype}")
    if op in ("min", "max") and dtype.is_complex:
        raise TypeError(f"smp backend: {op} is undefined for {dtype}")


def reduce_into(out: torch.Tensor, srcs: Sequence[torch.Tensor], op: str, n: int) -> None:
    """``out = srcs[0] (op) srcs[1] (op) ...``, left to right; ``avg`` divides by ``n``."""
    kernel = _KERNELS[op]
    if len(srcs) == 1:
        out.copy_(srcs[0])
    else:
        kernel(srcs[0], srcs[1], out=out)
        for src in srcs[2:]:
            kernel(out, src, out=out)
    if op == "avg":
        out.div_(n)


class LocalCollectives:
    """The collectives of the ranks that share one :class:`Segment`."""

    def __init__(self, segment: Segment) -> None:
        self.seg = segment
        self.rank, self.size = segment.rank, segment.size
        self._mem = torch.frombuffer(segment.mm, dtype=torch.uint8)

    def fail(self) -> None:
        """Mark this rank failed in the segment: peers waiting on it raise."""
        self.seg.fail()

    # -- views of the segment ------------------------------------------------------------
    def _slot(self, step: int, rank: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        at = self.seg.slot_offset(step, rank)
        return self._mem[at : at + self.seg.slot_bytes].view(dtype)

    def _phase(self, step: int) -> torch.Tensor:
        at = self.seg.phase_offset(step)
        return self._mem[at : at + self.size * self.seg.slot_bytes]

    def _step(self, desc: Sequence[int] | None) -> int:
        """Take one step (after this rank wrote its part); check descriptors if given."""
        s = self.seg.next_step()
        if desc is not None:
            self.seg.set_descriptor(s, desc)
        self.seg.advance()
        if desc is not None:
            seen = self.seg.descriptors(s)
            mine = seen[self.rank]
            if not (seen == mine).all():
                raise CollectiveMismatchError(
                    "smp backend: ranks disagree on the collective (op, dtype code, elements, "
                    f"root, reduction): {[tuple(int(x) for x in row[:5]) for row in seen]}"
                )
        return s

    @staticmethod
    def _desc(kind: int, t: torch.Tensor, root: int = 0, op: str = "sum") -> list[int]:
        return [kind, _CODE.get(t.dtype, 99), t.numel(), root, _OP_CODE[op], 0]

    # -- collectives ---------------------------------------------------------------------
    def barrier(self) -> None:
        """Return once every rank has called it."""
        self._step([_BARRIER, 0, 0, 0, 0, 0])

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` (``size * inp.numel()`` elements) = every rank's ``inp``, in rank order."""
        desc = self._desc(_ALL_GATHER, inp)
        src = inp.view(-1).view(torch.uint8)
        dst = out.view(-1).view(torch.uint8).view(self.size, -1)
        total, cap = src.numel(), self.seg.slot_bytes
        lo = 0
        while True:
            c = min(cap, total - lo)
            if c:
                self._slot(self.seg.next_step(), self.rank)[:c].copy_(src[lo : lo + c])
            s = self._step(desc if lo == 0 else None)
            if c:
                for r in range(self.size):
                    from_ = src[lo : lo + c] if r == self.rank else self._slot(s, r)[:c]
                    dst[r, lo : lo + c].copy_(from_)
            lo += c
            if lo >= total:
                return

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """Every rank's ``t`` = ``root``'s (the root uses a whole phase per step)."""
        desc = self._desc(_BROADCAST, t, root=root)
        buf = t.view(-1).view(torch.uint8)
        total, cap = buf.numel(), self.size * self.seg.slot_bytes
        lo = 0
        while True:
            c = min(cap, total - lo)
            if c and self.rank == root:
                self._phase(self.seg.next_step())[:c].copy_(buf[lo : lo + c])
            s = self._step(desc if lo == 0 else None)
            if c and self.rank != root:
                buf[lo : lo + c].copy_(self._phase(s)[:c])
            lo += c
            if lo >= total:
                return

    def all_reduce(self, t: torch.Tensor, op: str) -> None:
        """``t`` = the reduction of every rank's ``t`` (flat, contiguous), in place."""
        desc = self._desc(_ALL_REDUCE, t, op=op)
        n, total = self.size, t.numel()
        cap = self.seg.slot_bytes // t.element_size()
        one_shot = total * t.element_size() <= _ONE_SHOT_BYTES
        lo = 0
        while True:
            m = min(cap, total - lo)
            part = t[lo : lo + m]
            if m:
                self._slot(self.seg.next_step(), self.rank, t.dtype)[:m].copy_(part)
            s = self._step(desc if lo == 0 else None)
            if m and (one_shot or n == 1):
                reduce_into(part, [self._slot(s, r, t.dtype)[:m] for r in range(n)], op, n)
            elif m:
                # Two-shot: this rank reduces elements [b[rank], b[rank + 1]) of the chunk
                # into its slot of the next step's phase, then every rank copies all parts.
                b = [r * m // n for r in range(n + 1)]
                a, z = b[self.rank], b[self.rank + 1]
                mine = self._slot(s + 1, self.rank, t.dtype)[a:z]
                reduce_into(mine, [self._slot(s, r, t.dtype)[a:z] for r in range(n)], op, n)
                s2 = self._step(None)
                for r in range(n):
                    part[b[r] : b[r + 1]].copy_(self._slot(s2, r, t.dtype)[b[r] : b[r + 1]])
            lo += m
            if lo >= total:
                return

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        """``out`` = the reduction over ranks of block ``rank`` of ``inp`` (``size`` blocks)."""
        desc = self._desc(_REDUCE_SCATTER, inp, op=op)
        n, total = self.size, out.numel()
        blocks = inp.view(n, total)
        cap = self.seg.slot_bytes // out.element_size() // n  # elements of each block per step
        lo = 0
        while True:
            c = min(cap, total - lo)
            if c:
                mine = self._slot(self.seg.next_step(), self.rank, out.dtype)[: n * cap]
                mine.view(n, cap)[:, :c].copy_(blocks[:, lo : lo + c])
            s = self._step(desc if lo == 0 else None)
            if c:
                at = self.rank * cap
                srcs = [self._slot(s, r, out.dtype)[at : at + c] for r in range(n)]
                reduce_into(out[lo : lo + c], srcs, op, n)
            lo += c
            if lo >= total:
                return

