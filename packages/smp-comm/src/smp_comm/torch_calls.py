"""The call order of one ``smp`` group's collectives (:class:`CallOrder`).

A group's collectives run one at a time, in the order the caller made them, as every rank
must see them. A collective runs on the group's own thread while any is queued there, so
``async_op=True`` returns at once and the caller computes meanwhile. When nothing is queued,
a small one starts on the caller's thread instead (no hand-off between threads: its latency
is the shared-memory segment's), and, if its peers have not all arrived after a short spin,
the group's thread finishes it, first in line, while the caller gets a pending handle: an
``async_op=True`` caller never waits on a peer inside the call. (A small all-reduce or
barrier called synchronously is finished on the caller's thread, which would only wait for
the group's thread otherwise.)

A collective that fails out of step (a peer died, a timeout) marks the order broken: the
segment is told (``fail``), and every later collective is refused with the first error.
A mismatch between the ranks' descriptions of one collective leaves them in step, so it
raises for that call only.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from smp_comm.collectives.local import CollectiveMismatchError, exhaust
from smp_comm.collectives.shm import PeerFailedError
from smp_comm.torch_work import SmpWork

__all__ = ["CallOrder", "Run"]

# A collective: runs to its end, or returns the rest of itself as a generator (see
# LocalCollectives._quick) that yields while it waits for peers.
Run = Callable[[], "Iterator[None] | None"]
_DONE = object()


class CallOrder:
    """Runs one group's collectives in call order: on a thread of its own, or, for a small
    one when nothing is queued, starting on the caller's thread.

    ``fail`` tells the group's transport that this rank is out of step (peers waiting in a
    collective raise); ``inline_bytes`` bounds what starts on the caller's thread.
    """

    def __init__(self, fail: Callable[[], None], inline_bytes: int) -> None:
        self._fail = fail
        self.inline_bytes = inline_bytes
        self.broken: BaseException | None = None  # the error that broke the order, if any
        self._items: collections.deque[tuple[Run, SmpWork] | None] = collections.deque()
        self._arrived = threading.Condition()  # guards _items and queued
        self.queued = 0  # items queued or running on the thread
        self._running = threading.Lock()  # held while a collective runs; taken before a pop
        self._spare: SmpWork | None = None  # the express path's last finished handle
        self._thread = threading.Thread(target=self._serve, name="smp-collectives", daemon=True)
        self._thread.start()

    def abandon(self, error: BaseException) -> None:
        """Refuse every later collective with ``error`` (the first one given stays)."""
        if self.broken is None:
            self.broken = error
        self._fail()

    def shutdown(self) -> None:
        """Stop the thread once queued collectives are done."""
        self._enqueue(None)
        self._thread.join()

    # -- the thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._arrived:
                while not self._items:
                    self._arrived.wait()
            # Popped only with _running held: a collective the caller started (holding it)
            # and left for this thread to finish goes to the front first.
            with self._running:
                with self._arrived:
                    item = self._items.popleft()
                if item is None:
                    return
                run, work = item
                work._finish(self._execute(run))
            with self._arrived:
                self.queued -= 1

    def _execute(self, run: Run) -> BaseException | None:
        """Run one collective to its end; its error (for the waiter), or None."""
        if (refused := self._refusal()) is not None:
            return refused
        try:
            exhaust(run())
        except BaseException as exc:  # handed to the waiter, never lost
            return self._failed(exc)
        return None

    def _refusal(self) -> PeerFailedError | None:
        """Why a collective is refused here: the group failed before it; None otherwise."""
        if self.broken is None:
            return None
        return PeerFailedError(f"smp backend: group unusable: {self.broken}")

    def _failed(self, exc: BaseException) -> BaseException:
        if not isinstance(exc, CollectiveMismatchError):
            # The ranks are out of step now: tell them, and refuse later calls.
            self.broken = exc
            self._fail()
        return exc

    def _enqueue(self, item: tuple[Run, SmpWork] | None, first: bool = False) -> None:
        with self._arrived:
            if first:
                self._items.appendleft(item)
            else:
                self._items.append(item)
            self.queued += 1
            self._arrived.notify()

    def _late(self, rest: Iterator[None], result: list[torch.Tensor], opts: Any) -> SmpWork | None:
        """A collective started on the caller's thread whose peers were late (call with
        ``_running`` held). If the caller waits for it at once (``opts.asyncOp`` false, as
        ``dist.all_reduce`` and ``dist.barrier`` set it by default), ``rest`` is finished
        here and None returned: that spares the two hand-offs between threads the wait would
        cost. Else a pending handle, whose ``rest`` the thread finishes first in line (it
        cannot pop anything before we release)."""
        if getattr(opts, "asyncOp", True):
            work = SmpWork(result)
            self._enqueue((lambda: rest, work), first=True)
            return work
        exhaust(rest)
        return None

    # -- what the group calls ------------------------------------------------------------
    def submit(
        self, run: Run, result: list[torch.Tensor], nbytes: int = -1,
        quick: Callable[[], Iterator[None] | None] | None = None, opts: Any = None,
    ) -> SmpWork:
        """Run ``run`` in call order on the thread; or, when ``quick`` is given, the
        collective moves at most ``inline_bytes`` and nothing is queued, start ``quick()``'s
        one-step version here and now (if the peers are late: :meth:`_late`)."""
        # No lock around the test: a collective queued by another thread after `queued` was
        # read here comes after this one in call order, and cannot start before we release.
        if quick is not None and 0 <= nbytes <= self.inline_bytes and not self.queued and (
            self._running.acquire(False)
        ):
            try:
                error: BaseException | None = self._refusal()
                if error is None:
                    steps = quick()
                    if steps is None:  # no one-step version of this call: the thread runs it
                        work = SmpWork(result)
                        self._enqueue((run, work), first=True)
                        return work
                    if next(steps, _DONE) is not _DONE and (
                        pending := self._late(steps, result, opts)
                    ) is not None:
                        return pending
            except BaseException as exc:
                error = self._failed(exc)
            finally:
                self._running.release()
            return SmpWork.finished(result, error)
        work = SmpWork(result)
        self._enqueue((run, work))
        return work

    def express(
        self, start: Callable[..., Iterator[None] | Literal[True] | None],
        result: list[torch.Tensor], opts: Any, *args: Any,
    ) -> SmpWork | None:
        """Start a collective on the express path (nothing queued: the caller's thread, one C
        call, ``start(*args)``); ``None`` if ``start`` does not serve it. One whose peers are
        late is finished as in :meth:`submit` (:meth:`_late`)."""
        if self.queued or not self._running.acquire(False):
            return None
        try:
            error: BaseException | None = None if self.broken is None else self._refusal()
            if error is None:
                rest = start(*args)
                if rest is None:
                    return None
                if rest is not True and (pending := self._late(rest, result, opts)) is not None:
                    return pending
        except BaseException as exc:
            error = self._failed(exc)
        finally:
            self._running.release()
        if error is not None:
            return SmpWork.finished(result, error)
        # A finished handle that nobody else holds any more (the caller waited and dropped
        # it, as dist.all_reduce does) is reused: making one costs about as much as the
        # whole express step. (References: this object's, the local name, the argument.)
        spare = self._spare
        if spare is None or sys.getrefcount(spare) != 3:
            spare = self._spare = SmpWork.finished(result, None)
        else:
            spare.reuse(result)
        return spare
