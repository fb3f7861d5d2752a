"""The express path of small collectives: one C call from the caller's thread.

A 64 B all-reduce between two processes takes MPICH about 10 us. Through the segment's
one-step protocol (:meth:`LocalCollectives._quick`) it took smp 50-60 us: the step itself
is well under a microsecond, the rest was Python around it, above all ctypes (~0.35 us per
argument per call, several calls). Here the whole step (copy in, publish, spin for the
peers, compare the descriptors, reduce) is one call into ``_shmexpress.c``, a CPython
extension built on first use like the fast path, and what the call needs is worked out
once per segment (slot and phase addresses) or once per shape (the descriptor bytes).

The protocol and its results are the segment's own (see :mod:`smp_comm.collectives.local`):
the same steps, descriptors and rank-order reductions, so express and ordinary calls mix
freely on one group and across ranks. When the peers are not all there after the spin,
the call returns the rest of the collective as a generator, which finishes it exactly as
the ordinary path does (waits with failure and timeout checks, then the descriptor check
and the reduction).

Without the Python headers or a C compiler, :func:`build` returns ``None`` and callers keep
the ordinary path.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Literal, NoReturn

import torch

from smp_comm import compiled
from smp_comm.collectives.local import (
    _ALL_REDUCE,
    _BARRIER,
    _CODE,
    _OP_CODE,
    DTYPES,
    REDUCE_OPS,
    LocalCollectives,
    c_codes,
)

__all__ = ["Express", "build"]

_SOURCE = Path(__file__).with_name("_shmexpress.c")
_INCLUDES = (Path(__file__).with_name("_shmstep.c"),)
_DONE = -1  # every rank took the step (>= 0: the rank still awaited after the spin)
_MISMATCH, _NO_KERNEL = -2, -3


def _module() -> ModuleType | None:
    return compiled.load_extension(_SOURCE, "smp_comm.collectives._shmexpress", *_INCLUDES)


def build(local: LocalCollectives, max_bytes: int) -> Express | None:
    """The express path of ``local``'s segment for collectives of at most ``max_bytes``, or
    ``None`` where it cannot be built (then the ordinary path serves every call)."""
    if max_bytes <= 0 or local.seg.lib is None:
        return None
    module = _module()
    return None if module is None else Express(local, module, max_bytes)


class Express:
    """One segment's express collectives. Each method returns ``None`` when the call is not
    one it serves (the caller takes the ordinary path), ``True`` when the collective is done,
    or a generator that finishes it (its peers were not all there yet); it raises
    :class:`~smp_comm.collectives.local.CollectiveMismatchError` when the ranks disagree."""

    def __init__(self, local: LocalCollectives, module: ModuleType, max_bytes: int) -> None:
        seg = local.seg
        self._local, self._seg, self._call = local, seg, module.step
        self._limit = min(max_bytes, seg.slot_bytes)
        # The segment's constants, handed to C as one bytes object (see _shmexpress.c).
        self._ctx = struct.pack(
            "<9q", seg.base, seg.size, seg.rank, seg.spin_ns, seg.slot_bytes,
            *(seg.base + seg.slot_offset(p, seg.rank) for p in (0, 1)),
            *(seg.base + seg.phase_offset(p) for p in (0, 1)),
        )
        # (dtype, reduction) -> (C dtype, C reduction, the descriptor's dtype and op words)
        self._codes = {
            (dtype, op): (*codes, _CODE[dtype], _OP_CODE[op])
            for dtype in DTYPES
            for op in REDUCE_OPS
            if (codes := c_codes(dtype, op)) is not None
        }
        # (dtype, reduction, elements) -> what all_reduce passes to C, or () if not served.
        self._calls: dict[tuple[torch.dtype, str, int], tuple[bytes, int, int, int, int] | tuple[()]] = {}
        self._barrier = struct.pack("<6q", _BARRIER, 0, 0, 0, 0, 0)

    def all_reduce(self, t: torch.Tensor, op: str) -> Iterator[None] | Literal[True] | None:
        """``t`` (contiguous, CPU) = the reduction of every rank's ``t``, in rank order."""
        call = self._calls.get((t.dtype, op, t.numel()))
        if call is None:
            call = self._calls[(t.dtype, op, t.numel())] = self._plan(t.dtype, op, t.numel())
        if not call:
            return None
        desc, nbytes, count, code, c_op = call
        seg = self._seg
        s = seg.step + 1
        seg.step = s
        at = t.data_ptr()
        r = self._call(self._ctx, s, desc, at, nbytes, count, code, c_op)
        if r == _DONE:
            return True
        if r >= 0:
            return self._rest(s, lambda s: self._local.c_reduce(at, s, count, code, c_op))
        return self._failed(s, r)

    def _plan(self, dtype: torch.dtype, op: str, count: int) -> tuple[bytes, int, int, int, int] | tuple[()]:
        """What :meth:`all_reduce` passes to C for this dtype, reduction and size; ``()``
        when it does not serve them (another dtype or reduction, empty, too big)."""
        codes = self._codes.get((dtype, op))
        nbytes = count * dtype.itemsize
        if codes is None or not 0 < nbytes <= self._limit:
            return ()
        code, c_op, dtype_word, op_word = codes
        # As LocalCollectives._desc: (kind, dtype, elements, root, reduction, 0).
        desc = struct.pack("<6q", _ALL_REDUCE, dtype_word, count, 0, op_word, 0)
        return desc, nbytes, count, code, c_op

    def barrier(self) -> Iterator[None] | Literal[True]:
        """Return once every rank of the segment has called it."""
        seg = self._seg
        s = seg.step + 1
        seg.step = s
        r = self._call(self._ctx, s, self._barrier, 0, 0, 0, 0, -1)
        if r == _DONE:
            return True
        if r >= 0:
            return self._rest(s, None)
        return self._failed(s, r)

    def _rest(self, s: int, then: Callable[[int], None] | None) -> Iterator[None]:
        """The rest of step ``s`` once the peers were late: as the ordinary one-step path."""
        yield
        self._seg.fast_finish(s)
        self._local.end_quick(s, then)

    def _failed(self, s: int, r: int) -> NoReturn:
        if r == _MISMATCH:
            self._local.end_quick(s)  # raises, naming every rank's description
        why = "no C kernel for it" if r == _NO_KERNEL else f"result {r}"
        raise AssertionError(f"smp backend: express step {s}: {why}")
