"""Pausing the cyclic garbage collector around bulk, acyclic allocation."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector; its previous state is restored on exit.

    Validating and partitioning a graph allocate a few small containers per module and free
    nothing until they return. None of it can form a cycle, so full collections over
    millions of live objects would only cost time (about a quarter of it on a
    million-module graph).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
