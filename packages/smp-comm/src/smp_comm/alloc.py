"""First-fit allocator over one sender's slice of a peer's persistent receive buffer."""

from __future__ import annotations

import threading

__all__ = ["RangeAllocator"]


class RangeAllocator:
    """Hands out byte ranges of ``[base, base + size)``; thread-safe; freed ranges coalesce."""

    def __init__(self, base: int, size: int, align: int = 4096) -> None:
        self.base = base
        self.size = size
        self._align = align
        self._free: list[tuple[int, int]] = [(base, size)] if size > 0 else []  # (start, length)
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> int | None:
        """Start offset of a free range of at least ``nbytes``, or ``None`` if none is free."""
        need = max(self._align, (nbytes + self._align - 1) // self._align * self._align)
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (start + need, length - need)
                    self._used[start] = need
                    return start
        return None

    def release(self, start: int) -> None:
        """Return a range obtained from :meth:`reserve`."""
        with self._lock:
            length = self._used.pop(start)
            self._free.append((start, length))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for s, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            self._free = merged

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(self._used.values())
