"""Streaming a payload through a direct path's receive buffer in chunks (flow control).

A message whose payload does not fit in the free part of the destination's buffer slice
used to take the MPI fallback, and a one-way stream of large messages then sent most of
them that way (the buffer holds the receiver's zero-copy views until the tensors are
dropped). Instead, the sender streams it: the header goes first (path ``"stream"``), then
the payload in chunks of at most :data:`CHUNK_BYTES`, each copied into a region reserved in
the receiver's buffer as room frees up and announced by a ``T_CHUNK`` control message. The
receiver allocates the message's tensors when its header arrives and copies every chunk
out as soon as it lands, freeing its region at once: a stream never depends on the
receiving program dropping tensors, so it cannot wait forever for room that views hold.

The same streaming serves a receiver that copies out anyway (``shm_zero_copy=False``):
the sender's copy of chunk *k + 1* then overlaps the receiver's copy of chunk *k*, instead
of the two whole-message copies running one after the other.

If no room frees within :data:`ROOM_WAIT_S` (the buffer's other regions are held by
zero-copy views the program keeps), the rest of the payload goes over MPI, from the
tensors' own memory (a ``T_CHUNK`` with region -1 announces each such piece).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from smp_comm.serialize import TensorStub

__all__ = [
    "CHUNK_BYTES",
    "ROOM_WAIT_S",
    "Assembly",
    "ChunkBody",
    "chunks_of",
    "scratch_views",
    "source_bytes",
    "wait_for_room",
]

#: The largest chunk: small enough that the sender's and the receiver's copies overlap
#: well and a chunk finds room soon; large enough that its control message is noise.
CHUNK_BYTES = 4 << 20
#: How long the sender waits for room for one chunk before sending the rest over MPI.
ROOM_WAIT_S = 0.2

# One chunk on the wire: (msg_id, stub index, start byte in that tensor, nbytes, path,
# region in the receiver's buffer, or -1: the bytes follow on the data communicator).
ChunkBody = tuple[int, int, int, int, str, int]


def chunks_of(stubs: list[TensorStub], chunk: int) -> list[tuple[int, int, int]]:
    """``(stub index, start, nbytes)`` of every chunk of a payload, in order; a chunk never
    spans two tensors (each side then copies plain contiguous byte ranges)."""
    out = []
    for i, s in enumerate(stubs):
        for start in range(0, s.nbytes, chunk):
            out.append((i, start, min(chunk, s.nbytes - start)))
    return out


def wait_for_room(
    reserve: Callable[[], int | None], poll: Callable[[], None], seconds: float
) -> int | None:
    """Retry ``reserve()`` until it gives a region or ``seconds`` pass, calling ``poll()``
    between tries (it drives MPI progress, which is what brings the receiver's FREEs)."""
    region = reserve()
    if region is not None:
        return region
    deadline = time.monotonic() + seconds
    pause = 2e-5
    while time.monotonic() < deadline:
        poll()
        region = reserve()
        if region is not None:
            return region
        time.sleep(pause)
        pause = min(pause * 2, 5e-4)
    return None


@dataclass
class Assembly:
    """A streamed message being received: its tensors' byte views and what is missing.

    Chunks are copied in by one thread (the receiver's postproc thread) and MPI pieces land
    by MPI; :meth:`landed` counts both, under the caller's serialization (postproc)."""

    views: list[np.ndarray]
    missing: int
    via: str = "mpi"  # the direct path its chunks take

    def landed(self, nbytes: int) -> bool:
        """``nbytes`` more arrived; True when that completed the message."""
        self.missing -= nbytes
        return self.missing == 0

    def target(self, index: int, start: int, nbytes: int) -> np.ndarray:
        """The bytes of tensor ``index`` a chunk fills."""
        return self.views[index][start : start + nbytes]


def scratch_views(stubs: list[TensorStub]) -> list[np.ndarray]:
    """Throw-away byte buffers: a message whose tensors cannot be built is still drained."""
    return [np.empty(s.nbytes, np.uint8) for s in stubs]


def source_bytes(src: Any) -> np.ndarray:
    """A flat uint8 view of one packed CPU source."""
    return src if isinstance(src, np.ndarray) else src.numpy()
