"""Single-copy receives on one node: the receiver reads the sender's tensor itself.

Linux's cross-memory attach (``process_vm_readv``, "CMA") copies bytes straight from
another process's memory into one's own, with one copy and no shared buffer in between.
MPICH moves its large on-node messages that way (``strace`` of a 64 MiB ``Send``/``Recv``
shows ``process_vm_readv``), which is why ``Irecv`` into a reused buffer beat smp-comm's
two copies (sender into the shm buffer, receiver out of it into ``irecv(out=...)``).

The protocol (the ``pull`` path: :class:`~smp_comm.sender.Sender`,
:class:`~smp_comm.receiver.Receiver`): the sender posts a header whose region field is the
address of its tensor's bytes and keeps the send open; the receiver reads the bytes into
the receive's own tensor (or new buffers) and answers with a reply on the ``FREE`` tag:

``pulled``      read into the receive's ``out`` (or into new buffers, for a message no
                receive was posted for yet): the send completes;
``pulled-new``  read into new buffers for a receive without ``out``: the send completes,
                and the sender goes back to its other paths for this peer;
``refused``     the read failed: the sender sends the bytes over MPI instead (a payload
                ``Isend`` the receiver already posted the ``Irecv`` for), and neither uses
                the pull path with the other again;
``want-pull``   not a reply: the receiver got a large message into an ``out`` tensor over
                another path, and would take the next ones by pulling.

Whether a receiver may read a sender's memory (same user, ptrace policy, seccomp) is
decided once per pair when the Communicator starts (:func:`probe`). The environment
variable ``SMP_COMM_PULL_REFUSE`` (tests only) makes ``probe`` (value ``probe``) or every
read after it (``read``) fail as if the kernel refused, to exercise the fallbacks.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from typing import Any

import numpy as np
from mpi4py import MPI

__all__ = ["PULLED", "PULLED_NEW", "REFUSED", "REPLIES", "WANT_PULL", "probe", "read_from"]

PULLED = "pulled"
PULLED_NEW = "pulled-new"
REFUSED = "refused"
WANT_PULL = "want-pull"
REPLIES = frozenset({PULLED, PULLED_NEW, REFUSED, WANT_PULL})


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _syscall() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):  # not Linux, or a libc without it
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong
    ]
    return fn


_READV = _syscall()


def _refused(stage: str) -> bool:
    return os.environ.get("SMP_COMM_PULL_REFUSE", "") == stage


#: Reads this large are split in two halves read at once by two threads (the sender
#: only waits meanwhile, so its core is free where each rank has one).
SPLIT_MIN_BYTES = 16 << 20


def read_from(pid: int, address: int, dst: np.ndarray) -> None:
    """Copy ``dst.nbytes`` bytes at ``address`` of process ``pid`` into ``dst`` (a
    contiguous array). Raises ``OSError`` if the kernel refuses or the read falls short."""
    if _refused("read"):
        raise OSError(errno.EPERM, "process_vm_readv refused (SMP_COMM_PULL_REFUSE=read)")
    n = dst.nbytes
    if n < SPLIT_MIN_BYTES or (os.cpu_count() or 1) < 2:
        _read(pid, address, dst)
        return
    half = n // 2 // 4096 * 4096
    failed: list[OSError] = []

    def second() -> None:
        try:
            _read(pid, address + half, dst[half:])
        except OSError as exc:
            failed.append(exc)

    helper = threading.Thread(target=second, name="smp-comm-pull", daemon=True)
    helper.start()
    try:
        _read(pid, address, dst[:half])
    finally:
        helper.join()
    if failed:
        raise failed[0]


def _read(pid: int, address: int, dst: np.ndarray) -> None:
    if _READV is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available")
    base, total, done = dst.ctypes.data, dst.nbytes, 0
    while done < total:
        local = _IoVec(base + done, total - done)
        remote = _IoVec(address + done, total - done)
        # ctypes drops the GIL for the call: other threads run while the bytes move.
        n = _READV(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno() if n < 0 else errno.EFAULT
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += n


def probe(node: MPI.Comm, enabled: bool) -> tuple[list[int], list[bool], list[bool]]:
    """Collective over ``node``: can each rank read each other's memory? Returns, by node
    rank, every rank's pid, whether this rank can read from it, and whether it can read
    from this rank. ``enabled=False`` takes part without reading (nor being read)."""
    pattern = np.frombuffer(os.urandom(64), dtype=np.uint8).copy()
    mine = (os.getpid(), pattern.ctypes.data, pattern.tobytes()) if enabled else None
    everyone = node.allgather(mine)
    me = node.Get_rank()
    can_read = []
    for r, other in enumerate(everyone):
        ok = False
        if enabled and other is not None and r != me and not _refused("probe"):
            pid, address, expected = other
            got = np.zeros(64, dtype=np.uint8)
            try:
                _read(pid, address, got)
                ok = got.tobytes() == expected
            except OSError:
                ok = False
        can_read.append(ok)
    table = node.allgather(can_read)  # the peers must not free ``pattern`` before this
    del pattern
    pids = [o[0] if o is not None else -1 for o in everyone]
    return pids, can_read, [row[me] for row in table]
