"""Point to point for the ``smp`` backend: MPI, straight between the callers' tensors.

gloo's ``send``/``recv`` move a tensor over TCP through gloo's own buffers. When the job
runs under MPI (mpi4py imported and initialised with ``MPI_THREAD_MULTIPLE``, and the group's
ranks are MPI processes), an ``smp`` group gets an MPI communicator of its ranks at creation
(``MPI_Comm_create_group``: collective over the group's ranks only, as the group's creation
is) and sends from the caller's tensor and receives into the caller's tensor: the receiver
allocates nothing, and MPICH moves a large message between the two processes' memories in
its shared-memory path. Without MPI (``torchrun``), gloo serves as before.

Semantics are c10d's: a receive names its sender (or any), the tag matches, the sizes must
agree (a message of another size is an error naming the peer, never a silent truncation or
a partly filled tensor), and a wait is bounded by the group's timeout, naming the peer.
Waits poll the request with a short spin, then sleeps, so a waiting rank does not take the
core a peer needs (MPICH's blocking waits spin).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import Work

from smp_comm.collectives.local import flat
from smp_comm.collectives.shm import PeerFailedError

__all__ = ["MpiPointToPoint", "P2PWork", "build"]

_SPIN_S = 50e-6  # polled without sleeping first: a message on its way lands in µs
_SLEEP_S = (20e-6, 1e-3)  # then sleeps, doubling from the first to the second


def build(store: Any, rank: int, size: int, timeout: timedelta, labels: list[str]) -> MpiPointToPoint | None:
    """Point to point over MPI for a group made now by all its ``size`` ranks, or ``None``
    when the job does not run under MPI with threads (then gloo serves). ``store`` is the
    group's store: the ranks tell each other their MPI ranks through it."""
    MPI = sys.modules.get("mpi4py.MPI")  # noqa: N806 - the module's own name
    usable = (
        MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()
        and MPI.Query_thread() == MPI.THREAD_MULTIPLE
    )
    # Every rank says whether it can, so that all take the same branch (Create_group is
    # collective): MPI on every rank, or gloo on every rank.
    world = MPI.COMM_WORLD if usable and MPI is not None else None
    store.set(f"smp-p2p/{rank}", str(world.Get_rank()) if world is not None else "-")
    seen = [store.get(f"smp-p2p/{r}").decode() for r in range(size)]
    if "-" in seen or world is None:
        return None
    mpi_ranks = [int(x) for x in seen]
    group = world.Get_group().Incl(mpi_ranks)
    try:
        comm = world.Create_group(group, tag=7411)
    finally:
        group.Free()
    return MpiPointToPoint(comm, timeout.total_seconds(), labels)


def _bytes(t: torch.Tensor) -> Any:
    """The bytes of contiguous ``t`` as a numpy array over its memory (any dtype)."""
    return flat(t).view(torch.uint8).numpy()


class P2PWork(Work):
    """One send or receive of an ``smp`` group (an MPI request)."""

    def __init__(self, p2p: MpiPointToPoint, req: Any, what: str, peer: int, nbytes: int,
                 keep: torch.Tensor, out: torch.Tensor | None = None) -> None:
        super().__init__()
        self._p2p, self._req, self._what, self._peer = p2p, req, what, peer
        # keep: the memory MPI reads or writes, alive until the request completes (a
        # contiguous copy of a strided tensor, or the tensor itself); out: a receive's tensor.
        self._nbytes, self._keep, self._out = nbytes, keep, out
        self._done = False
        self._error: BaseException | None = None
        self._source = peer

    def _test(self, status: Any) -> bool:
        """Test the request; on completion check a receive's size and deliver it."""
        MPI = sys.modules["mpi4py.MPI"]  # noqa: N806
        try:
            if not self._req.Test(status):
                return False
        except MPI.Exception as exc:  # a message longer than the receiving tensor
            if exc.Get_error_class() == MPI.ERR_TRUNCATE:
                why = f"the message is longer than the receiving tensor's {self._nbytes} bytes"
            else:
                why = exc.Get_error_string()
            self._error = ValueError(f"smp backend: {self._what}: {why}")
            self._done = True
            return True
        self._done = True
        if self._out is None:
            return True
        got, self._source = status.Get_count(), status.Get_source()  # bytes: MPI.BYTE
        if got != self._nbytes:
            self._error = ValueError(
                f"smp backend: {self._what}: {self._p2p.label(self._source)} sent {got} bytes, "
                f"the receiving tensor has {self._nbytes}"
            )
        elif self._keep is not self._out:  # a strided tensor, received through a copy
            self._out.copy_(self._keep.view(self._out.shape))
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the message is sent or received; raise on a size mismatch, or when
        the group's timeout (or ``timeout``) passes first, naming the peer."""
        if not self._done:
            MPI = sys.modules["mpi4py.MPI"]  # noqa: N806
            status = MPI.Status()
            limit = timeout.total_seconds() if timeout else self._p2p.timeout
            start = time.monotonic()
            sleep = _SLEEP_S[0]
            while not self._test(status):
                waited = time.monotonic() - start
                if waited > limit:
                    peer = self._p2p.label(self._peer) if self._peer >= 0 else "any rank"
                    raise PeerFailedError(
                        f"smp backend: {self._what} timed out after {limit:g} s waiting for {peer}"
                    )
                if waited > _SPIN_S:
                    time.sleep(sleep)
                    sleep = min(sleep * 2, _SLEEP_S[1])
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the message has been sent or received (tests the request)."""
        if not self._done:
            self._test(sys.modules["mpi4py.MPI"].Status())
        return self._done

    def is_success(self) -> bool:
        """Whether it completed without error."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """The error, if it failed."""
        return self._error

    def _source_rank(self) -> int:
        """The sender's group rank (what ``dist.recv`` without ``src`` returns)."""
        return self._source

    def result(self) -> list[torch.Tensor]:
        """The received tensor (nothing for a send)."""
        return [self._out] if self._out is not None else []


class MpiPointToPoint:
    """Sends and receives of one group over an MPI communicator of its ranks (communicator
    rank = group rank)."""

    def __init__(self, comm: Any, timeout: float, labels: list[str]) -> None:
        MPI = sys.modules["mpi4py.MPI"]  # noqa: N806
        comm.Set_errhandler(MPI.ERRORS_RETURN)  # errors raise in Python, never abort
        self.comm, self.timeout, self._labels = comm, timeout, labels
        self._tag_ub = int(comm.Get_attr(MPI.TAG_UB))

    def label(self, r: int) -> str:
        """How errors name group rank ``r``."""
        return self._labels[r] if 0 <= r < len(self._labels) else f"group rank {r}"

    def _check(self, t: torch.Tensor, tag: int, what: str) -> None:
        if not 0 <= tag <= self._tag_ub:
            raise ValueError(f"smp backend: {what}: tag {tag} outside MPI's 0..{self._tag_ub}")
        if t.device.type != "cpu":
            raise ValueError(f"smp backend: {what}: not a CPU tensor ({t.device})")

    def send(self, t: torch.Tensor, dst: int, tag: int) -> P2PWork:
        """Send ``t`` to group rank ``dst`` (from ``t``'s memory when contiguous)."""
        self._check(t, tag, "send")
        src = t if t.is_contiguous() else t.contiguous()
        req = self.comm.Isend(_bytes(src), dst, tag)
        return P2PWork(self, req, f"send to {self.label(dst)} (tag {tag})", dst, src.nbytes, src)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> P2PWork:
        """Receive into ``t`` from group rank ``src`` (``-1``: any rank)."""
        self._check(t, tag, "recv")
        MPI = sys.modules["mpi4py.MPI"]  # noqa: N806
        into = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
        req = self.comm.Irecv(_bytes(into), MPI.ANY_SOURCE if src < 0 else src, tag)
        what = f"recv from {self.label(src) if src >= 0 else 'any rank'} (tag {tag})"
        return P2PWork(self, req, what, src, into.nbytes, into, out=t)
