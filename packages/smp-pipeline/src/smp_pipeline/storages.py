"""Live tensor storages counted once: how many holders keep each alive, and their bytes.

Two counts of held memory need the same bookkeeping: what a forward saved for backward
(:mod:`smp_pipeline.activation_meter`) and what zero-bubble's queued weight-gradient tasks
hold (:class:`~smp_pipeline.wqueue.WeightGradQueue`). A storage held several times (a layer's
output saved as the next layer's input, one input held by two W tasks) counts once while any
holder lives; it leaves the count with its last holder.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LiveStorages", "storage_sizes"]


def storage_sizes(tensors: Sequence[torch.Tensor]) -> dict[int, int]:
    """Storage address -> its bytes, each storage of ``tensors`` once (a live storage's
    address is unique)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return seen


class LiveStorages:
    """Storage address -> [holders, bytes]; :attr:`bytes` is the sum over the storages held.

    Not locked: a caller shared between threads locks around it (or, reading from another
    thread, takes :meth:`sizes`, copied in one C call)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._held: dict[int, list[int]] = {}

    def __contains__(self, ptr: object) -> bool:
        return ptr in self._held

    def hold(self, ptr: int, nbytes: int) -> None:
        """One more holder of the storage at ``ptr`` (of ``nbytes``)."""
        entry = self._held.get(ptr)
        if entry is None:
            self._held[ptr] = [1, nbytes]
            self.bytes += nbytes
        else:
            entry[0] += 1

    def release(self, ptr: int) -> None:
        """One holder of the storage at ``ptr`` fewer; at the last, it leaves the count."""
        entry = self._held[ptr]
        entry[0] -= 1
        if not entry[0]:
            del self._held[ptr]
            self.bytes -= entry[1]

    def sizes(self) -> dict[int, int]:
        """Storage address -> bytes of each storage held."""
        return {ptr: entry[1] for ptr, entry in dict(self._held).items()}

    def keys(self) -> set[int]:
        """The addresses of the storages held."""
        return set(self._held)

    def clear(self) -> None:
        self._held.clear()
        self.bytes = 0
