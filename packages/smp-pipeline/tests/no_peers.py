"""A communicator for a pipeline of one rank (single-process tests)."""

from __future__ import annotations

from typing import Any


class NoPeers:
    """A communicator for a single rank: nothing ever arrives, sending is a bug.

    The transport posts a receive whenever its main loop polls, which depends on timing (a
    cold first step polls during housekeeping, a warm one may not), so the handle supports
    everything a posted receive is asked: its callback is simply never run.
    """

    rank = 0

    class _Handle:
        def test(self) -> bool:
            return False

        def wait(self, timeout: float | None = None, spin: float | None = None) -> Any:
            from smp_comm import CommTimeoutError

            raise CommTimeoutError("nothing", 0, 0)

        def cancel(self) -> bool:
            return True

        def add_done_callback(self, fn: Any) -> None:
            pass  # nothing ever arrives

    def irecv(self, source: int = -1, tag: int = -1) -> _Handle:
        return self._Handle()

    def isend(self, obj: Any, dest: int, tag: int = 0, **kwargs: Any) -> Any:
        raise AssertionError(f"a single rank sent a message: {obj!r}")
