"""Request handles returned by ``Communicator.isend`` / ``Communicator.irecv``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from smp_comm.errors import CommError, CommTimeoutError

__all__ = ["Handle", "RecvHandle", "SendHandle"]

# (handle, timeout) -> whether the handle completed; the communicator drives progress meanwhile.
Waiter = Callable[["Handle", "float | None", "float | None"], bool]


class Handle:
    """Completion of one send or receive. Thread-safe; ``wait`` may be called repeatedly."""

    _what = "message"

    def __init__(self, peer: int, tag: int, rank: int, waiter: Waiter | None = None) -> None:
        self.peer = peer
        self.tag = tag
        self._rank = rank
        # A plain flag, and an Event only once some thread has to sleep on it: creating an
        # Event costs more than a whole small-message fast path send.
        self._done = False
        self._event: threading.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._waiter = waiter
        self._callbacks: list[Callable[[Handle], None]] | None = None

    def _complete(self, result: Any = None, error: BaseException | None = None) -> bool:
        """Set the outcome once; later calls are ignored. Returns whether this call set it."""
        with self._lock:
            if self._done:
                return False
            self._result, self._error = result, error
            self._done = True
            event = self._event
            callbacks, self._callbacks = self._callbacks, None
        if event is not None:
            event.set()
        if callbacks:
            for fn in callbacks:
                fn(self)
        return True

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(handle)`` once the operation finishes (at once if it has).

        ``fn`` runs on whichever thread completes the handle (often a backend thread): keep
        it short and non-blocking, e.g. setting an event that a loop waits on, so one thread
        can sleep until either a message arrives or something else happens.
        """
        with self._lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def _sleep(self, timeout: float | None) -> bool:
        """Block (no polling) until completed or ``timeout`` passes; True if completed."""
        with self._lock:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def test(self) -> bool:
        """True when the operation has finished (successfully or not); never blocks."""
        return self._done

    def wait(self, timeout: float | None = None, spin: float | None = None) -> Any:
        """Block until done; raise its error, or :class:`CommTimeoutError` after ``timeout`` s.

        ``spin``: at most this many seconds of driving progress on this thread before
        sleeping (default: the communicator's ``poll_spin``). A thread that waits for long
        idle stretches (a server loop) spins less, leaving the CPU to the ranks at work.
        """
        if not self._done:
            done = self._waiter(self, timeout, spin) if self._waiter else self._sleep(timeout)
            if not done:
                raise CommTimeoutError(self._timeout_text(timeout), self.peer, self.tag)
        if self._error is not None:
            raise self._error
        return self._result

    def _timeout_text(self, timeout: float | None) -> str:
        raise NotImplementedError


def _same_as(obj: Any, out: Any) -> Any:
    """``obj`` if it is a tensor of ``out``'s shape and dtype, else an error saying how it
    differs."""
    shape, dtype = getattr(obj, "shape", None), getattr(obj, "dtype", None)
    if not hasattr(obj, "copy_") or (tuple(shape) if shape is not None else ()) != tuple(out.shape) or dtype != out.dtype:
        what = (
            f"a tensor of shape {tuple(shape or ())} and dtype {dtype}" if hasattr(obj, "copy_")
            else f"a {type(obj).__name__}"
        )
        raise ValueError(
            f"the message is {what}; out is a tensor of shape {tuple(out.shape)} and dtype "
            f"{out.dtype}"
        )
    return obj


def _peer(p: int) -> str:
    return "any rank" if p < 0 else f"rank {p}"


def _tag(t: int) -> str:
    return "any tag" if t < 0 else f"tag {t}"


class SendHandle(Handle):
    """Returned by ``isend``; ``wait()`` returns ``None`` once the payload has left this rank's
    buffers (the sent tensors may be modified again)."""

    # Set for a send tracked lazily (a fast-path frame to a rank on this node): called when
    # a thread waits for it, so that the tracker polls for it again.
    _want: Callable[[], None] | None = None

    def wait(self, timeout: float | None = None, spin: float | None = None) -> Any:
        want = self._want
        if want is not None and not self._done:
            self._want = None
            want()
        return super().wait(timeout, spin)

    def _timeout_text(self, timeout: float | None) -> str:
        return (
            f"smp-comm rank {self._rank}: send to rank {self.peer} ({_tag(self.tag)}) "
            f"not complete after {timeout}s"
        )


class RecvHandle(Handle):
    """Returned by ``irecv``; ``wait()`` returns ``(obj, source, tag)``.

    With ``out`` (``irecv(out=...)``), ``obj`` is ``out`` itself, holding the message: the
    bytes land in it directly when the receive was posted before the message came, else they
    are copied in. A message that is not one tensor of ``out``'s shape and dtype completes
    the handle with an error naming both.
    """

    def __init__(
        self,
        peer: int,
        tag: int,
        rank: int,
        waiter: Waiter | None,
        canceller: Callable[[RecvHandle], bool],
        out: Any = None,
    ) -> None:
        super().__init__(peer, tag, rank, waiter)
        self._canceller = canceller
        self.out = out

    def _complete(self, result: Any = None, error: BaseException | None = None) -> bool:
        if self.out is not None and error is None and result is not None and result[0] is not self.out:
            obj, source, tag = result
            try:
                self.out.copy_(_same_as(obj, self.out))
            except Exception as exc:  # noqa: BLE001 - the waiter gets it
                error = CommError(
                    f"smp-comm rank {self._rank}: irecv(out=...) from rank {source} (tag {tag}): "
                    f"{exc}"
                )
            else:
                result = (self.out, source, tag)
        return super()._complete(result, error)

    def cancel(self) -> bool:
        """Withdraw a receive that no message has matched yet. True if it was withdrawn."""
        return self._canceller(self)

    def _timeout_text(self, timeout: float | None) -> str:
        return (
            f"smp-comm rank {self._rank}: no message from {_peer(self.peer)} "
            f"({_tag(self.tag)}) after {timeout}s (the receive stays posted; cancel() withdraws it)"
        )
