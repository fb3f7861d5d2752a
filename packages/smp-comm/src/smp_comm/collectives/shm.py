"""One shared-memory segment per group of ranks on a host, and the step clock that orders it.

The segment holds a *control line* per rank and a data region of two *phases*, each with one
slot per rank::

    [ line 0 | line 1 | ... | line n-1 ]  (page aligned)  [ phase 0: slot 0 .. slot n-1 ]
                                                           [ phase 1: slot 0 .. slot n-1 ]

A collective is a sequence of *steps*, numbered on from the group's creation and the same on
every rank. In step ``s`` a rank writes only into its own slot of phase ``s % 2`` (and its
own control line), then *publishes* ``s`` in its line, then waits until every rank has
published ``s``, then reads any slot of that phase. Writing phase ``s % 2`` again, at step
``s + 2``, is safe: every rank has published ``s + 1``, which it does only after it finished
reading step ``s``. So one wait per step is the only synchronisation, with no locks and no
atomic read-modify-write (each word has one writer).

Waiting spins briefly, then sleeps on a futex on the awaited rank's sequence word (a
publisher wakes it); between sleeps it checks the peers' processes, so a dead peer raises
:class:`PeerFailedError` instead of hanging, and a rank that fails inside a collective marks
its line so the others raise too.

torch-free (numpy and ctypes only): it moves no tensors, it only orders their copies. A
one-step collective's whole step (copy in, publish, wait, compare descriptions) can instead
be one call each into ``_shmstep.c`` (:meth:`Segment.fast_step`), built on first use; where
no C compiler is found, :attr:`Segment.lib` is ``None`` and callers take the Python steps.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from smp_comm import compiled
from smp_comm.errors import CommError

__all__ = ["PeerFailedError", "Segment", "segment_bytes"]

LINE = 128  # bytes per control line: no two ranks' words share a cache line
_WORDS = LINE // 8
_SEQ, _FAILED, _PID, _BLAME = 0, 1, 2, 3  # _BLAME: 1 + the rank a timed-out rank waited for
_DESC = 4  # two descriptors (by step parity) of _DESC_LEN words each, from word 4
DESC_LEN = 6
_PAGE = 4096
_SPIN = 200  # polls before sleeping: a peer a few microseconds behind is not worth a syscall
_SLEEP_S = 0.05  # futex sleep bound: how often a waiter looks for dead peers
_SLEEP_NS = int(_SLEEP_S * 1e9)

# The C step spins (yielding the core to anyone who wants it) this long before it sleeps:
# a peer a few tens of microseconds behind costs no wake-up.
_SPIN_NS = int(float(os.environ.get("SMP_COMM_COLL_SPIN_US", "200")) * 1000)
_STEP_SOURCE = Path(__file__).with_name("_shmstep.c")

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())


class PeerFailedError(CommError):
    """A peer of a shared-memory group died or failed inside a collective."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None else None


def _futex_wait(addr: int, expected: int, seconds: float) -> None:
    if _libc is None:
        time.sleep(min(seconds, 1e-4))
        return
    ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    # ctypes drops the GIL around the call: other threads of this rank run meanwhile.
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected),
                  ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
    if _libc is not None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


_TYPED: list[ctypes.CDLL] = []  # the loaded step library, once its argument types are set


def step_library() -> ctypes.CDLL | None:
    """``_shmstep.c`` built and loaded (with its argument types), or ``None``."""
    lib = compiled.load_library(_STEP_SOURCE)
    if lib is not None and lib not in _TYPED:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.smp_publish.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr]
        lib.smp_publish.restype = None
        lib.smp_await.argtypes = [ptr, i64, i64, i64, i64, i64]
        lib.smp_await.restype = i64
        lib.smp_mismatch.argtypes = [ptr, i64, i64]
        lib.smp_mismatch.restype = i64
        lib.smp_step.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, i64]
        lib.smp_step.restype = i64
        lib.smp_reduce.argtypes = [ptr, ptr, i64, i64, i64, i64, i64]
        lib.smp_reduce.restype = ctypes.c_int
        lib.smp_reduce2.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
        lib.smp_reduce2.restype = ctypes.c_int
        lib.smp_copy_out.argtypes = [ptr, ptr, i64]
        lib.smp_copy_out.restype = None
        _TYPED.append(lib)
    return lib


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a dead child not yet reaped by its launcher is a zombie: as good as dead
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def segment_bytes(size: int, slot_bytes: int) -> int:
    """Bytes of a segment for ``size`` ranks with ``slot_bytes`` per slot."""
    return _data_offset(size) + 2 * size * slot_bytes


def _data_offset(size: int) -> int:
    return -(-size * LINE // _PAGE) * _PAGE


class Segment:
    """A mapped segment and this rank's place in it (see the module docstring).

    Build it with :meth:`create` on one rank and ``Segment(path, ...)`` on the others, passing
    the path between them out of band (the torch backend uses its c10d store).
    """

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, timeout: float) -> None:
        self.path, self.rank, self.size, self.slot_bytes = path, rank, size, slot_bytes
        self.timeout = timeout
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, segment_bytes(size, slot_bytes))
        finally:
            os.close(fd)
        self._lines = np.frombuffer(self.mm, dtype=np.int64, count=size * _WORDS).reshape(
            size, _WORDS
        )
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.base = base
        self._seq_addr = [base + r * LINE for r in range(size)]  # low 32 bits: the futex word
        self.data_offset = _data_offset(size)
        self.lib = step_library()
        # Spinning only pays when every rank of the segment has a core: oversubscribed (4
        # ranks on 2 cores in tests), a spinning rank takes the core its peer needs.
        self.spin_ns = _SPIN_NS if size <= len(os.sched_getaffinity(0)) else 0
        self._desc_buf = (ctypes.c_int64 * DESC_LEN)()
        self.step = int(self._lines[rank, _SEQ])  # 0 in a new segment
        self._lines[rank, _PID] = os.getpid()
        self._lines[rank, _FAILED] = 0
        self._lines[rank, _BLAME] = 0
        self.pids: list[int] = []
        # How errors name a segment rank (the torch backend sets job-wide ranks here).
        self.labels: list[str] = [f"rank {r} of this group" for r in range(size)]

    @classmethod
    def create(cls, size: int, slot_bytes: int, rank: int, timeout: float) -> Segment:
        """Create a zero-filled segment in ``/dev/shm`` and map it (the creator's side)."""
        path = os.path.join("/dev/shm", f"smp-coll-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, segment_bytes(size, slot_bytes))
        finally:
            os.close(fd)
        return cls(path, rank, size, slot_bytes, timeout)

    def start(self) -> None:
        """Record every rank's pid (call once all ranks have attached)."""
        self.pids = [int(p) for p in self._lines[:, _PID]]

    def unlink(self) -> None:
        """Remove the segment's name (once every rank has mapped it)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def slot_offset(self, step: int, rank: int) -> int:
        """Byte offset of ``rank``'s slot in the phase of ``step``."""
        return self.data_offset + ((step % 2) * self.size + rank) * self.slot_bytes

    def phase_offset(self, step: int) -> int:
        """Byte offset of the phase of ``step`` (its ``size`` slots are contiguous)."""
        return self.data_offset + (step % 2) * self.size * self.slot_bytes

    def set_descriptor(self, step: int, desc: Sequence[int]) -> None:
        """Describe this rank's collective in its line, read by peers at ``step``."""
        at = _DESC + (step % 2) * DESC_LEN
        self._lines[self.rank, at : at + len(desc)] = desc

    def descriptors(self, step: int) -> np.ndarray:
        """Every rank's descriptor of ``step`` (valid once :meth:`advance` returned)."""
        at = _DESC + (step % 2) * DESC_LEN
        return np.array(self._lines[:, at : at + DESC_LEN])

    def next_step(self) -> int:
        """The number of the step this rank is about to take."""
        return self.step + 1

    def advance(self) -> int:
        """Publish the next step and wait until every rank has published it; return it."""
        s = self.step + 1
        self.step = s
        self._lines[self.rank, _SEQ] = s
        _futex_wake(self._seq_addr[self.rank])
        deadline = time.monotonic() + self.timeout
        for r in range(self.size):
            if r != self.rank:
                self._wait_for(r, s, deadline)
        return s

    def fast_begin(
        self, desc: Sequence[int] | None, src: int, nbytes: int, dst: int
    ) -> tuple[int, bool]:
        """Start a step in C (:attr:`lib` must be set): copy ``nbytes`` from address ``src``
        to ``dst`` (this rank's part of the next step's phase), publish the step with
        ``desc``, and spin briefly for the peers. Returns the step and whether every rank
        has taken it; if not, :meth:`fast_finish` waits for them."""
        lib = self.lib
        assert lib is not None
        s = self.step + 1
        self.step = s
        if desc is not None:
            self._desc_buf[:] = desc  # type: ignore[call-overload]
        buf = self._desc_buf if desc is not None else None
        r = lib.smp_step(self.base, self.size, self.rank, s, buf, src, nbytes, dst, self.spin_ns, 0)
        return s, r < 0

    def fast_finish(self, s: int) -> None:
        """Wait until every rank has taken step ``s``; failures, deaths and timeouts raise as
        in :meth:`advance`."""
        assert self.lib is not None
        deadline = time.monotonic() + self.timeout
        while (r := self.lib.smp_await(self.base, self.size, self.rank, s, self.spin_ns,
                                       _SLEEP_NS)) >= 0:
            self._check(r, s, deadline)

    def mismatch(self, s: int) -> bool:
        """Whether the ranks described step ``s`` differently (valid once it is taken)."""
        if self.lib is not None:
            return bool(self.lib.smp_mismatch(self.base, self.size, s) >= 0)
        seen = self.descriptors(s)
        return not bool((seen == seen[0]).all())

    def _wait_for(self, r: int, s: int, deadline: float) -> None:
        lines = self._lines
        for _ in range(_SPIN):
            if lines[r, _SEQ] >= s:
                return
        while True:
            seen = int(lines[r, _SEQ])
            if seen >= s:
                return
            self._check(r, s, deadline)
            _futex_wait(self._seq_addr[r], seen & 0xFFFFFFFF, _SLEEP_S)

    def _check(self, r: int, s: int, deadline: float) -> None:
        failed = [q for q in range(self.size) if self._lines[q, _FAILED]]
        if failed:
            raise PeerFailedError("; ".join(self._why(q) for q in failed))
        if self.pids and not _alive(self.pids[r]):
            raise PeerFailedError(f"{self.labels[r]} (pid {self.pids[r]}) died")
        if time.monotonic() > deadline:
            self._lines[self.rank, _BLAME] = r + 1  # read by peers once this rank fails
            raise PeerFailedError(
                f"timed out after {self.timeout:g} s waiting for {self.labels[r]} to join "
                f"collective step {s}"
            )

    def _why(self, q: int) -> str:
        blamed = int(self._lines[q, _BLAME]) - 1
        if 0 <= blamed != self.rank:
            return f"{self.labels[q]} timed out waiting for {self.labels[blamed]} to join a collective"
        return f"{self.labels[q]} failed or aborted inside a collective"

    def fail(self) -> None:
        """Mark this rank failed (peers waiting on it raise) and wake them."""
        self._lines[self.rank, _FAILED] = 1
        _futex_wake(self._seq_addr[self.rank])

    def failed(self) -> bool:
        """Whether any rank of the group marked itself failed."""
        return bool(self._lines[:, _FAILED].any())
