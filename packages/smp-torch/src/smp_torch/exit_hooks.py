"""Process hooks of smp's failure channel: uncaught exceptions (in any thread) are announced
on the current channel before their traceback is printed, and the interpreter's exit tells
the channel first (see :mod:`smp_torch.watch`)."""

from __future__ import annotations

import atexit
import signal
import sys
import threading
from types import TracebackType
from typing import Any, Protocol

from smp_torch.errors import PeerFailedError

__all__ = ["Watch", "arm_exit_alarm", "forget", "install"]


class Watch(Protocol):
    """What the hooks need of :class:`smp_torch.watch.FailureWatch`."""

    def announce(
        self, error: BaseException, where: str | None = None, delivered: bool = True
    ) -> None: ...

    def exiting(self) -> None: ...


_CURRENT: Watch | None = None
_HOOKED = False


def install(watch: Watch) -> None:
    """Make ``watch`` the channel uncaught exceptions are reported on; chain the hooks
    (once per process) in front of whatever hooks were installed before."""
    global _CURRENT, _HOOKED
    _CURRENT = watch
    if _HOOKED:
        return
    _HOOKED = True
    previous_hook = sys.excepthook
    previous_thread_hook = threading.excepthook

    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        _uncaught(exc, None)
        previous_hook(exc_type, exc, tb)

    def thread_excepthook(args: Any) -> None:
        if args.exc_type is not SystemExit:  # (ends the thread quietly, as by default)
            _uncaught(args.exc_value, args.thread)
        previous_thread_hook(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    # Registered after smp's other exit handlers: runs before them (atexit is LIFO).
    atexit.register(_at_exit)


def _uncaught(exc: BaseException | None, thread: threading.Thread | None) -> None:
    watch = _CURRENT
    if watch is None or exc is None or isinstance(exc, PeerFailedError):
        return  # (a PeerFailedError is the consequence of a failure already announced)
    try:
        where = None if thread is None else f"in thread {thread.name!r}"
        watch.announce(exc, where=where, delivered=thread is None)
    except Exception:  # noqa: BLE001 - an exception hook must not fail
        pass


def arm_exit_alarm(seconds: float) -> None:
    """End the process with SIGALRM after ``seconds`` whatever it does: the backstop of an
    exit that blocks after Python's own threads stopped (mpi4py finalizes MPI after the
    interpreter, where MPICH's MPI_Finalize waits for every rank)."""
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the default action ends the process
        signal.setitimer(signal.ITIMER_REAL, seconds)
    except (ValueError, OSError, AttributeError):  # not the main thread; no SIGALRM here
        pass


def _at_exit() -> None:
    if _CURRENT is not None:
        _CURRENT.exiting()


def forget(watch: Watch) -> None:
    """``watch`` closed: uncaught exceptions are no longer announced on it."""
    global _CURRENT
    if _CURRENT is watch:
        _CURRENT = None
