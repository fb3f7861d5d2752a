"""Ask for transparent huge pages on large receive buffers.

A fresh receive tensor is faulted in page by page while the bytes land in it. With 4 KiB
pages that dominated the copy: filling a new 64 MiB ``torch.empty`` took 31 ms here, a new
``numpy.empty`` 6.7 ms (numpy advises huge pages on its own large arrays; torch does not),
and a buffer already faulted in 4.8 ms. Where the kernel's THP mode is ``madvise`` (a
common default) only advised memory gets huge pages, so :func:`advise_huge_pages` gives
that advice for the buffers smp-comm allocates to receive into (the MPI path, streamed and
copied-out payloads). It is advice: where it is refused or unavailable nothing changes.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable

__all__ = ["MIN_BYTES", "advise_huge_pages"]

MIN_BYTES = 4 << 20  # smaller buffers gain little (numpy uses the same threshold)
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
_PAGE = mmap.PAGESIZE


def _load_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - a libc without madvise
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _load_madvise()


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Advise huge pages for the whole pages inside ``[address, address + nbytes)``, before
    they are first touched; True if the kernel took the advice. Buffers under
    :data:`MIN_BYTES`, and systems without ``madvise``, are left alone (False)."""
    if _MADVISE is None or nbytes < MIN_BYTES:
        return False
    start = -(-address // _PAGE) * _PAGE  # whole pages only: the edges may be shared
    end = (address + nbytes) // _PAGE * _PAGE
    return end > start and _MADVISE(start, end - start, _MADV_HUGEPAGE) == 0
