"""What travels on the control communicator: message kinds (MPI tags) and the header.

A general-path message is announced by a header, pickled by mpi4py on the control
communicator. Its fields are :class:`Header`'s, in that order; on the wire it is a plain
tuple (:data:`WireHeader`): pickle writes a named tuple as a class reference plus
arguments, which costs more per message (docs/perf-notes.md). The receiver reads it back as a
:class:`Header` (:meth:`Header.of`), no copy. Fast-path frames have their own layout
(:mod:`smp_comm.fastpath`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mpi4py import MPI

from smp_comm.serialize import TensorStub

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "FAST",
    "T_BYE",
    "T_CHUNK",
    "T_DRAINED",
    "T_FREE",
    "T_HEADER",
    "Header",
    "WireHeader",
]

ANY_SOURCE: int = MPI.ANY_SOURCE
ANY_TAG: int = MPI.ANY_TAG

# Control-message tags on the private control communicator.
T_HEADER = 1  # body: a WireHeader
T_FREE = 2  # body: (path, region): the receiver copied the region out; it is free again
# (or (reply, msg_id): a reply on the pull path, smp_comm.cma)
T_BYE = 3  # body: the sender's next sequence number; it sends nothing after this
T_DRAINED = 4  # body: None; the sender will post no more FREEs
T_CHUNK = 5  # body: a smp_comm.stream.ChunkBody: one chunk of a streamed payload landed
FAST = 0  # not a tag: a fast-path frame waiting for its turn in its sender's order

# The header as sent: (msg_id, tag, path, region, skeleton, stubs, inline).
WireHeader = tuple[int, int, str, int, bytes, list[TensorStub], list[bytes] | None]


class Header(NamedTuple):
    """The header of a general-path message, as the receiver reads it."""

    msg_id: int  # the sender's per-destination sequence number (also the payload MPI tag)
    tag: int  # the user's tag
    # "mpi", "shm", "rma", "cuda_ipc", "stream" (chunks follow: T_CHUNK), or "pull" (the
    # receiver reads the bytes from the sender's memory: smp_comm.cma)
    path: str
    # offset of the reserved region in the receiver's buffer (-1 on mpi); on "pull", the
    # address of the payload's bytes in the sender
    region: int
    skeleton: bytes  # the pickled object with tensors replaced by stubs
    stubs: list[TensorStub]
    inline: list[bytes] | None  # the payload itself when it rides in the header

    @classmethod
    def of(cls, body: Any) -> Header:
        """The received tuple, typed (no copy of its fields)."""
        return tuple.__new__(cls, body)
