"""Collectives among the ranks of one host, through a :class:`~smp_comm.collectives.shm.Segment`.

Every function takes flat contiguous CPU tensors (the backend prepares them) and runs whole
steps, so every rank takes the same number of steps for the same call. The first step of
each call carries a descriptor (operation, dtype, element count, root, reduction); if the
ranks disagree, every rank raises :class:`CollectiveMismatchError` at that same step and
the group stays usable.

Floating-point reductions add in rank order, ``((x0 + x1) + x2) + ...``, whichever rank
computes them, so results are identical on every rank and from run to run, within
``(n - 1) * eps * sum |x_i|`` of the exact sum. Integer and bitwise reductions are exact.
Large all-reduces are two steps per chunk (each rank reduces one n-th, reading its own
terms from its own tensor, then copies the peers' parts out); small ones are one step (every
rank reduces the whole, in the same order).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence

import torch

from smp_comm.collectives.shm import Segment

__all__ = [
    "DTYPES", "REDUCE_OPS", "CollectiveMismatchError", "LocalCollectives", "c_codes",
    "check_reduce", "exhaust", "flat",
]

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
_ALL_GATHER, _REDUCE_SCATTER, _ALL_REDUCE, _BROADCAST, _BARRIER, _ALL_TO_ALL = range(1, 7)
_ONE_SHOT_BYTES = 256 * 1024  # all-reduces up to this take one step (every rank reduces all)
# What _shmstep.c's reduction handles: its dtype codes, and the reductions per kind. Float
# min/max stay in torch (NaN propagation); integer avg is refused by check_reduce.
_C_DTYPE = {torch.float32: 0, torch.float64: 1, torch.int32: 2, torch.int64: 3}
_C_OPS = {
    True: {"sum": 0, "avg": 1, "product": 2},
    False: {"sum": 0, "product": 2, "min": 3, "max": 4},
}


def c_codes(dtype: torch.dtype, op: str) -> tuple[int, int] | None:
    """``_shmstep.c``'s (dtype code, reduction code) for reducing ``dtype`` with ``op``, or
    None where its kernels do not (then torch's do)."""
    code = _C_DTYPE.get(dtype)
    c_op = None if code is None else _C_OPS[dtype.is_floating_point].get(op)
    return None if code is None or c_op is None else (code, c_op)


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


def flat(t: torch.Tensor) -> torch.Tensor:
    """A flat contiguous tensor with ``t``'s elements (``t``'s own memory when it is
    contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    # as_strided, not view: a contiguous tensor of one element may have any stride, and a
    # byte view of it needs stride 1.
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def exhaust(steps: Iterator[None] | None) -> bool:
    """Run a quick collective (a :meth:`LocalCollectives._quick` generator) to its end;
    False if there was none (``steps`` is None)."""
    if steps is None:
        return False
    for _ in steps:
        pass
    return True


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
            self._check_desc(s)
        return s

    def _quick(
        self, desc: Sequence[int], src: int, nbytes: int, dst: int,
        then: Callable[[int], None] | None = None,
    ) -> Iterator[None]:
        """A one-step collective in C: ``nbytes`` from ``src`` to ``dst``, then ``then(step)``.
        A generator: it yields once if the peers had not all arrived after a short spin (its
        caller may hand the rest to another thread), and ends when the collective is done."""
        s, done = self.seg.fast_begin(desc, src, nbytes, dst)
        if not done:
            yield
            self.seg.fast_finish(s)
        self.end_quick(s, then)

    def end_quick(self, s: int, then: Callable[[int], None] | None = None) -> None:
        """The end of a one-step collective whose step ``s`` every rank has taken: the
        descriptor check (raises :class:`CollectiveMismatchError`), then ``then(s)``."""
        self._check_desc(s)
        if then is not None:
            then(s)

    def c_reduce(self, at: int, s: int, count: int, code: int, c_op: int) -> None:
        """The memory at address ``at`` = the rank-order reduction, in C, of the ``count``
        elements in every rank's slot of step ``s`` (codes from :func:`c_codes`)."""
        lib = self.seg.lib
        assert lib is not None
        done = lib.smp_reduce(at, self._addr(self.seg.phase_offset(s)), self.seg.slot_bytes,
                              self.size, count, code, c_op)
        assert done == 0, (code, c_op)

    def _check_desc(self, s: int) -> None:
        if self.seg.mismatch(s):
            seen = self.seg.descriptors(s)
            raise CollectiveMismatchError(
                "smp backend: ranks disagree on the collective (op, dtype code, elements, "
                f"root, reduction): {[tuple(int(x) for x in row[:5]) for row in seen]}"
            )

    def _addr(self, offset: int) -> int:
        return self.seg.base + offset

    @staticmethod
    def _desc(kind: int, t: torch.Tensor, root: int = 0, op: str = "sum") -> list[int]:
        return [kind, _CODE.get(t.dtype, 99), t.numel(), root, _OP_CODE[op], 0]

    # -- collectives ---------------------------------------------------------------------
    def quick_barrier(self) -> Iterator[None] | None:
        """:meth:`barrier` as a :meth:`_quick` generator, or None where C is not built."""
        if self.seg.lib is None:
            return None
        return self._quick([_BARRIER, 0, 0, 0, 0, 0], 0, 0, 0)

    def barrier(self) -> None:
        """Return once every rank has called it."""
        if not exhaust(self.quick_barrier()):
            self._step([_BARRIER, 0, 0, 0, 0, 0])

    def quick_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Iterator[None] | None:
        """:meth:`all_gather` (contiguous tensors) as a :meth:`_quick` generator, or None
        unless ``inp`` fits a slot and C is built."""
        total = inp.numel() * inp.element_size()
        if self.seg.lib is None or total > self.seg.slot_bytes:
            return None
        at = out.data_ptr()

        def copy_out(s: int) -> None:
            for r in range(self.size):  # rank r's bytes from its slot (ours too: one code path)
                ctypes.memmove(at + r * total, self._addr(self.seg.slot_offset(s, r)), total)

        dst = self._addr(self.seg.slot_offset(self.seg.next_step(), self.rank))
        return self._quick(self._desc(_ALL_GATHER, inp), inp.data_ptr(), total, dst, copy_out)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` (``size * inp.numel()`` elements) = every rank's ``inp``, in rank order."""
        if exhaust(self.quick_all_gather(out, inp)):
            return
        desc = self._desc(_ALL_GATHER, inp)
        total, cap = inp.numel() * inp.element_size(), self.seg.slot_bytes
        src = inp.view(-1).view(torch.uint8)
        dst = out.view(-1).view(torch.uint8).view(self.size, -1)
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

    def quick_broadcast(self, t: torch.Tensor, root: int) -> Iterator[None] | None:
        """:meth:`broadcast` (contiguous ``t``) as a :meth:`_quick` generator, or None unless
        ``t`` fits a phase and C is built."""
        total = t.numel() * t.element_size()
        if self.seg.lib is None or total > self.size * self.seg.slot_bytes:
            return None
        mine, at = self.rank == root, t.data_ptr()

        def copy_out(s: int) -> None:
            if not mine:
                ctypes.memmove(at, self._addr(self.seg.phase_offset(s)), total)

        phase = self._addr(self.seg.phase_offset(self.seg.next_step()))
        desc = self._desc(_BROADCAST, t, root=root)
        return self._quick(desc, at, total if mine else 0, phase, copy_out)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """Every rank's ``t`` = ``root``'s (the root uses a whole phase per step)."""
        if exhaust(self.quick_broadcast(t, root)):
            return
        desc = self._desc(_BROADCAST, t, root=root)
        total, cap = t.numel() * t.element_size(), self.size * self.seg.slot_bytes
        buf = t.view(-1).view(torch.uint8)
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

    def quick_all_reduce(self, t: torch.Tensor, op: str) -> Iterator[None] | None:
        """:meth:`all_reduce` (contiguous ``t``) as a :meth:`_quick` generator, or None
        unless ``t`` fits a slot and C is built and reduces its dtype with ``op``."""
        codes = c_codes(t.dtype, op)
        nbytes, count = t.numel() * t.element_size(), t.numel()
        if self.seg.lib is None or codes is None or not 0 < nbytes <= self.seg.slot_bytes:
            return None
        at = t.data_ptr()

        def reduce(s: int) -> None:
            self.c_reduce(at, s, count, *codes)

        dst = self._addr(self.seg.slot_offset(self.seg.next_step(), self.rank))
        return self._quick(self._desc(_ALL_REDUCE, t, op=op), at, nbytes, dst, reduce)

    def all_reduce(self, t: torch.Tensor, op: str) -> None:
        """``t`` = the reduction of every rank's ``t`` (contiguous), in place."""
        if exhaust(self.quick_all_reduce(t, op)):
            return
        desc = self._desc(_ALL_REDUCE, t, op=op)
        n, total = self.size, t.numel()
        cap = self.seg.slot_bytes // t.element_size()
        t = flat(t)
        if n > 1 and total * t.element_size() > _ONE_SHOT_BYTES:
            self._two_shot(t, op, desc, cap)
            return
        lo = 0
        while True:
            m = min(cap, total - lo)
            part = t[lo : lo + m]
            if m:
                self._slot(self.seg.next_step(), self.rank, t.dtype)[:m].copy_(part)
            s = self._step(desc if lo == 0 else None)
            if m:
                reduce_into(part, [self._slot(s, r, t.dtype)[:m] for r in range(n)], op, n)
            lo += m
            if lo >= total:
                return

    def _two_shot(self, t: torch.Tensor, op: str, desc: Sequence[int], cap: int) -> None:
        """:meth:`all_reduce` of a large flat ``t``: two steps per chunk of up to ``cap``
        elements. Rank ``r`` reduces elements ``[b[r], b[r + 1])`` of the chunk; every rank
        puts into its slot only the parts its peers reduce (its own part it reads from ``t``:
        the same values, so the rank-order sum is unchanged), reduces its part into ``t`` and
        its slot of the next phase at once, then copies the peers' finished parts out (in C
        with streaming stores). Each element thus crosses the segment twice, against four
        times for copying whole chunks in and out."""
        n, rank, total, dtype = self.size, self.rank, t.numel(), t.dtype
        lib, codes = self.seg.lib, c_codes(dtype, op)
        fused = lib is not None and codes is not None
        size, stride = t.element_size(), self.seg.slot_bytes
        lo = 0
        while lo < total:
            m = min(cap, total - lo)
            part = t[lo : lo + m]
            b = [r * m // n for r in range(n + 1)]
            a, z = b[rank], b[rank + 1]
            mine = self._slot(self.seg.next_step(), rank, dtype)
            for r in range(n):
                if r != rank:
                    mine[b[r] : b[r + 1]].copy_(part[b[r] : b[r + 1]])
            s = self._step(desc if lo == 0 else None)
            done = self._slot(s + 1, rank, dtype)[a:z]
            if fused:
                assert lib is not None and codes is not None
                phase = self._addr(self.seg.phase_offset(s)) + a * size
                got = lib.smp_reduce2(part.data_ptr() + a * size, done.data_ptr(),
                                      part.data_ptr() + a * size, phase, stride, n, rank,
                                      z - a, *codes)
                assert got == 0, (dtype, op)
            else:
                srcs = [part[a:z] if r == rank else self._slot(s, r, dtype)[a:z]
                        for r in range(n)]
                reduce_into(done, srcs, op, n)
                part[a:z].copy_(done)
            s2 = self._step(None)
            for r in range(n):
                if r == rank or b[r] == b[r + 1]:
                    continue
                if lib is not None:  # streaming stores: ``t`` is not read back here
                    lib.smp_copy_out(part.data_ptr() + b[r] * size,
                                     self._addr(self.seg.slot_offset(s2, r)) + b[r] * size,
                                     (b[r + 1] - b[r]) * size)
                else:
                    part[b[r] : b[r + 1]].copy_(self._slot(s2, r, dtype)[b[r] : b[r + 1]])
            lo += m

    def _block_steps(self, blocks: torch.Tensor, desc: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
        """Move ``blocks`` (``size`` rows) through the slots, a piece of every row per step:
        after each step that moved something, yield ``(step, lo, count, at)``: the piece
        ``[lo, lo + count)`` of the row addressed to this rank is, in rank ``r``'s slot of
        ``step``, at ``[at, at + count)`` (elements of ``blocks``' dtype). The caller reads
        it before the next step is written."""
        n, total = blocks.shape
        cap = self.seg.slot_bytes // blocks.element_size() // n  # elements of each row per step
        lo = 0
        while True:
            c = min(cap, total - lo)
            if c:
                mine = self._slot(self.seg.next_step(), self.rank, blocks.dtype)[: n * cap]
                mine.view(n, cap)[:, :c].copy_(blocks[:, lo : lo + c])
            s = self._step(desc if lo == 0 else None)
            if c:
                yield s, lo, c, self.rank * cap
            lo += c
            if lo >= total:
                return

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Block ``r`` of ``out`` = block ``rank`` of rank ``r``'s ``inp`` (contiguous, the
        same number of elements; ``size`` equal blocks each): moved as :meth:`reduce_scatter`
        moves its blocks, each rank copying out the pieces addressed to it."""
        n = self.size
        src = inp.view(-1).view(torch.uint8).view(n, -1)
        dst = out.view(-1).view(torch.uint8).view(n, -1)
        for s, lo, c, at in self._block_steps(src, self._desc(_ALL_TO_ALL, inp)):
            for r in range(n):
                from_ = src[r, lo : lo + c] if r == self.rank else self._slot(s, r)[at : at + c]
                dst[r, lo : lo + c].copy_(from_)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        """``out`` = the reduction over ranks of block ``rank`` of ``inp`` (``size`` blocks)."""
        n, total = self.size, out.numel()
        for s, lo, c, at in self._block_steps(inp.view(n, total), self._desc(_REDUCE_SCATTER, inp, op=op)):
            srcs = [self._slot(s, r, out.dtype)[at : at + c] for r in range(n)]
            reduce_into(out[lo : lo + c], srcs, op, n)

