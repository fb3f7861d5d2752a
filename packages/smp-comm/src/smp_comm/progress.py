"""MPI progress: the tracker thread, and the same polling done by threads blocked in ``wait``.

One round (:meth:`Progress.poll_once`) tests every outstanding MPI request and runs its
completion, sends the FREEs queued for it, probes for control messages (``Improbe`` +
``Mrecv``: never a blind receive) and takes fast-path frames. Headers, fast-path frames
and BYEs are handled in their sender's ``isend`` order (a per-destination sequence
number), whichever communicator and thread brought them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from smp_comm import fastpath
from smp_comm.cma import REPLIES
from smp_comm.doorbell import MAX_SLEEP_S, Doorbells
from smp_comm.errors import CommError
from smp_comm.handles import Handle
from smp_comm.matching import MatchingTable
from smp_comm.paths import DirectPaths
from smp_comm.state import Backlog, Lifecycle, nothing, start_thread
from smp_comm.wire import (
    ANY_SOURCE,
    ANY_TAG,
    FAST,
    T_BYE,
    T_CHUNK,
    T_DRAINED,
    T_FREE,
    T_HEADER,
    Header,
)

__all__ = ["Progress", "Tracked"]

# Fast-path probes a waiting thread makes between two full progress rounds: a round costs
# several probes (docs/perf-notes.md), and the probes are what finds a small message soonest.
_SPIN_PROBES = 32
_LANE_PROBES = 8  # probes per call into the compiled fast path, which drops the GIL for them


@dataclass
class Tracked:
    """MPI requests to test; ``on_done`` runs in the polling thread once all completed.

    ``lazy``: they complete without this rank's progress (a fast-path frame to a rank on
    this node: the receiver copies it out), so the tracker need not keep polling for them;
    any round tests them. Cleared when a thread waits for them (:meth:`Progress.want`).
    """

    requests: list[MPI.Request]
    on_done: Callable[[], None]
    lazy: bool = False


class Progress:
    """Drives MPI progress for one Communicator and runs its tracker thread.

    ``lock``: one thread at a time runs a round; it guards ``_active`` and the receive
    order state (``_seq_from``, ``_held``). The tracker thread belongs to this object.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        cc: MPI.Intracomm,
        fc: MPI.Intracomm,
        lane: Any,
        poll_spin: float,
        table: MatchingTable,
        paths: DirectPaths,
        backlog: Backlog,
        life: Lifecycle,
        bell: Doorbells | None,
    ) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self._cc, self._fc, self._fc_handle = cc, fc, fc.handle
        self._lane = lane  # the compiled fast path (smp_comm.compiled), or None: Python
        self._poll_spin = poll_spin
        self._table, self._paths, self._backlog, self._life = table, paths, backlog, life
        self.bell = bell
        self._status = MPI.Status()
        self._fstatus = MPI.Status()
        self._track_q: queue.SimpleQueue[Tracked] = queue.SimpleQueue()
        self.free_q: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._active: list[Tracked] = []  # outstanding MPI requests
        self._seq_from = [0] * size  # next expected sequence number per source
        self._held: list[dict[int, tuple[int, Any]]] = [{} for _ in range(size)]
        self._wake = threading.Event()  # nudges the tracker out of its idle sleep
        # One entry per thread inside wait's polling phase (list append/pop are atomic);
        # the lock orders the doorbell's POLLING byte with the list.
        self._spinners: list[None] = []
        self._spinners_lock = threading.Lock()
        # Held by the one waiting thread that sleeps on the waiter's doorbell (see wait()).
        self._doze_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lazy_off = False  # set by end_lazy()
        # Set by attach(): the receiver's handlers.
        self._on_header: Callable[[int, int, Header], None] = _unattached
        self._post_queued_free: Callable[[str, int, int], tuple[bool, MPI.Request | None]] = (
            _unattached
        )
        self._on_chunk: Callable[[int, Any], None] = _unattached
        # Set by the sender: a receiver's reply about a pulled payload (smp_comm.cma).
        self.on_pull_reply: Callable[[str, int, int], None] = _unattached

    def attach(
        self,
        on_header: Callable[[int, int, Header], None],
        post_queued_free: Callable[[str, int, int], tuple[bool, MPI.Request | None]],
        on_chunk: Callable[[int, Any], None],
    ) -> None:
        """Give the receiver's handlers: a header's turn, a FREE queued for the tracker
        (returns whether it was sent, and its request if still in flight), and a streamed
        chunk's arrival (:mod:`smp_comm.stream`)."""
        self._on_header, self._post_queued_free = on_header, post_queued_free
        self._on_chunk = on_chunk

    def start(self) -> None:
        """Start the tracker thread."""
        self._thread = start_thread("tracker", self._tracker_loop, self._table.fail_all)

    def stop(self) -> None:
        """End the tracker once its outstanding requests completed, and join it."""
        self._stop.set()
        self.nudge()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ wake-ups

    def nudge(self) -> None:
        """Wake the tracker: local work for it (or a waiter handing progress back)."""
        self._wake.set()
        if self.bell is not None:
            self.bell.nudge()

    def ring(self, dest: int) -> None:
        """After posting a message to ``dest``: wake its tracker if it sleeps."""
        if self.bell is not None:
            self.bell.ring(dest)

    def track(
        self, requests: list[MPI.Request], on_done: Callable[[], None], lazy: bool = False
    ) -> Tracked:
        """Run ``on_done`` in a polling thread once every request completed (``lazy``: see
        :class:`Tracked`)."""
        tracked = Tracked(requests, on_done, lazy)
        self._track_q.put(tracked)
        # No Event wake-up: a polling tracker polls within 1 ms anyway, and a thread waiting
        # on the handle polls at once (waking the tracker would only contend for the GIL).
        # A tracker asleep on its doorbell is woken (a flag read when it is not), unless
        # the requests are lazy: its next round, whenever it comes, takes them.
        if self.bell is not None and not lazy:
            self.bell.nudge()
        return tracked

    def want(self, tracked: Tracked) -> None:
        """A thread waits for ``tracked``: it is lazy no more (the tracker polls it again)."""
        if tracked.lazy:
            tracked.lazy = False
            self.nudge()

    def end_lazy(self) -> None:
        """Track every request eagerly from now on (``close()`` waits for the sends)."""
        self._lazy_off = True
        self.nudge()

    def _polling_needed(self) -> bool:
        """Requests in flight that need this rank's progress. (The tracker also reads it
        without ``lock``, as it read ``_active`` before: a list swapped whole, so a stale
        answer only delays or repeats one round.)"""
        if self._lazy_off:
            return bool(self._active)
        return any(not t.lazy for t in self._active)

    # ------------------------------------------------------------------ one round

    def last_look(self) -> bool:
        """The probe a thread makes after saying it will sleep (or stop polling), before it
        relies on a ring; the caller holds ``lock``. True if anything happened.

        Always two rounds: MPICH's probes match against what earlier progress brought in,
        and run progress only after, so a message that landed while no thread of this rank
        made an MPI call surfaces on the second probe, not the first. One round was not
        enough: a waiter woken by a ring polled once, found nothing, and slept the full 50 ms
        backstop for every message of a ping-pong (median latency 49.7 ms against 76 µs with
        two; docs/perf-notes.md, "A last look takes two probes"). The second round runs even
        when the first found something: what it found (a FREE, another handle's message) is
        not what a waiting thread waits for, and that thread then slept on unrung while its
        own message sat there until the next ring or the backstop (pipelines at pp = 4 idle
        for 15-50 ms at a time; docs/perf-notes.md, "Session of 2026-12-01").
        """
        first = self.poll_once()
        second = self.poll_once()
        return first or second

    def poll_once(self) -> bool:
        """One round of MPI progress; the caller holds ``lock``. True if anything happened."""
        busy = False
        while not self._track_q.empty():
            self._active.append(self._track_q.get())
            busy = True
        while not self.free_q.empty():
            sent, req = self._post_queued_free(*self.free_q.get())
            if not sent:
                continue  # the peers stopped listening for FREEs (close() is under way)
            if req is not None:
                self._active.append(Tracked([req], nothing))
            busy = True
        if self._active:
            still = []
            for t in self._active:
                if MPI.Request.Testall(t.requests):
                    t.on_done()
                    busy = True
                else:
                    still.append(t)
            self._active = still
        status = self._status
        for _ in range(64):
            msg = self._cc.improbe(ANY_SOURCE, ANY_TAG, status)
            if msg is None:
                break
            self._on_control(status.Get_source(), status.Get_tag(), msg.recv())
            busy = True
        for _ in range(64):
            if not self._take_fast():
                break
            busy = True
        return busy

    def _take_fast(self) -> bool:
        """Receive one fast-path frame if one has arrived (caller holds ``lock``)."""
        if self._lane is not None:
            got = self._lane.take(self._fc_handle, 1, self.rank)
            if got is None:
                return False
            self._on_taken(*got)
            return True
        msg = self._fc.Improbe(ANY_SOURCE, ANY_TAG, self._fstatus)
        if msg is None:
            return False
        self._on_frame(msg)
        return True

    def _on_frame(self, msg: MPI.Message) -> None:
        """Receive the frame ``msg`` just probed into ``_fstatus`` (caller holds ``lock``).
        A matched probe: the frame is this thread's alone once probed, so the tracker and
        waiting threads may all probe at once without stealing."""
        st = self._fstatus
        source, tag = st.Get_source(), st.Get_tag()
        buf = bytearray(st.Get_count(MPI.BYTE))
        msg.Recv(buf)
        self._on_taken(source, tag, fastpath.frame_seq(buf), buf, -1)

    def _on_taken(self, source: int, tag: int, seq: int, obj: Any, nbytes: int) -> None:
        """Order a received frame (caller holds ``lock``): ``obj`` is its object and
        ``nbytes`` its payload, or ``obj`` is the frame itself and ``nbytes`` -1."""
        if seq == self._seq_from[source] and not self._held[source]:
            self._seq_from[source] = seq + 1  # its turn already: the common case, inlined
            self._table.on_fast(source, seq, tag, obj, nbytes)
        else:
            self._in_order(source, seq, FAST, (tag, obj, nbytes))

    def _on_control(self, source: int, tag: int, body: Any) -> None:
        if tag == T_HEADER:
            self._in_order(source, body[0], T_HEADER, body)
        elif tag == T_BYE:
            self._in_order(source, body, T_BYE, None)
        elif tag == T_FREE:
            path, region = body
            if path in REPLIES:  # a pull path reply (smp_comm.cma), not a region
                self.on_pull_reply(path, source, region)
            else:
                self._paths.release(path, source, region)
        elif tag == T_CHUNK:
            self._on_chunk(source, body)
        elif tag == T_DRAINED:
            self._table.on_drained(source)
        else:  # pragma: no cover - only our own tags travel on this communicator
            raise CommError(
                f"smp-comm rank {self.rank}: unknown control tag {tag} from rank {source}"
            )

    def _in_order(self, source: int, seq: int, kind: int, item: Any) -> None:
        """Handle headers, fast-path frames and the final BYE in the sender's isend order
        (``seq``), whichever communicator and thread brought them; early ones wait."""
        held = self._held[source]
        if seq != self._seq_from[source]:
            held[seq] = (kind, item)
            return
        self._seq_from[source] = seq + 1
        self._dispatch(source, seq, kind, item)
        while held and self._seq_from[source] in held:
            seq = self._seq_from[source]
            kind, item = held.pop(seq)
            self._seq_from[source] = seq + 1
            self._dispatch(source, seq, kind, item)

    def _dispatch(self, source: int, seq: int, kind: int, item: Any) -> None:
        if kind == FAST:
            self._table.on_fast(source, seq, *item)
        elif kind == T_BYE:
            self._table.on_bye(source)
        else:
            self._on_header(source, seq, Header.of(item))

    # ------------------------------------------------------------------ tracker thread

    def has_work(self) -> bool:
        """Requests still in flight (the tracker keeps polling until they complete)."""
        return bool(self._active)

    def _tracker_loop(self) -> None:
        # No busy spinning here: a thread that keeps dropping and retaking the GIL starves
        # the others (CPython hands the GIL over only on request). Threads blocked in
        # wait() spin instead, briefly; the tracker sleeps between rounds, 20 us doubling
        # up to 1 ms while idle, and local work wakes it at once.
        # With doorbells, the first round that finds nothing sleeps until a sender rings
        # (a pipeline rank is idle between messages: fewer wake-ups, each one useful).
        sleep = 0.0
        while not (self._stop.is_set() and not self._active):
            if self._spinners:
                # A thread blocked in wait() is driving progress: stay out of its way.
                self._wake.wait(1e-3)
                self._wake.clear()
                continue
            with self.lock:
                busy = self.poll_once()
            if busy:
                sleep = 0.0
                if self.bell is None or self._polling_needed():
                    continue
                # With doorbells, to sleep at once: the last look before sleeping (two
                # rounds; more work found there ends it) is the round that came next here,
                # one round (and its GIL hand-offs) fewer per ring.
            if self.bell is not None and not self._polling_needed():  # (in flight: poll)
                self.bell.sleep(self._busy_before_sleep)
                self._wake.clear()
                continue
            sleep = min(1e-3, max(2e-5, sleep * 2))
            if self._wake.wait(sleep):
                self._wake.clear()
                sleep = 0.0

    def _busy_before_sleep(self) -> bool:
        """The tracker's last look before sleeping on its doorbell (its flag is set)."""
        if self._wake.is_set() or self._spinners or self._stop.is_set():
            return True
        with self.lock:
            return self.last_look() or self._polling_needed()

    # ------------------------------------------------------------------ waiting threads

    def wait(self, handle: Handle, timeout: float | None, spin: float | None = None) -> bool:
        """Block until ``handle`` completes or ``timeout`` passes; True if it completed.

        For up to ``poll_spin`` seconds after the last event the waiting thread drives MPI
        progress itself (no thread hand-off on the critical path of a small message):
        mostly fast-path probes, the cheapest way to see a small message the moment it
        lands, with a full progress round every ``_SPIN_PROBES`` probes. After that it
        sleeps: with doorbells on its own (:meth:`_doze`: the arrival wakes this thread, not
        the tracker and then this one), else on the handle while the tracker thread polls.
        """
        if handle._done:
            return True
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_s = self._poll_spin if spin is None else min(spin, self._poll_spin)
        if spin_s > 0:
            self._spin(handle, deadline, spin_s, now + spin_s)
        if handle._done:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if self.bell is not None and not self._life.closed and self._doze_lock.acquire(False):
            try:
                return self._doze(handle, deadline)
            finally:
                self._doze_lock.release()
        self.nudge()  # hand progress back to the tracker thread
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return handle._sleep(left)

    def _spin(
        self, handle: Handle, deadline: float | None, spin_s: float, spin_until: float
    ) -> None:
        """:meth:`wait`'s polling phase: until ``handle`` completes, ``deadline`` passes or
        ``spin_s`` seconds pass without an event (the first ending at ``spin_until``)."""
        life, working, lock = self._life, self._backlog.counts, self.lock
        self._enter_spin()
        try:
            while not handle._done:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                if now >= spin_until or life.closed:
                    break
                if any(working):
                    # Backend threads have work: poll only every 200 us, or this thread
                    # would keep taking the GIL from them.
                    if handle._sleep(2e-4):
                        break
                if not lock.acquire(timeout=5e-4):
                    # Another thread is polling (a round takes microseconds; it also
                    # completes our handle if our message is there).
                    continue
                try:
                    if self._spin_fast(handle):
                        if handle._done:
                            break  # (straight back: the common case, latency-critical)
                        spin_until = time.monotonic() + spin_s
                    elif self.poll_once():
                        spin_until = time.monotonic() + spin_s
                except Exception as exc:
                    raise self._table.fail_all(exc) from exc
                finally:
                    lock.release()
        finally:
            self._leave_spin()

    def _enter_spin(self) -> None:
        """This thread polls: senders need not ring this rank's doorbells meanwhile."""
        with self._spinners_lock:
            self._spinners.append(None)
            if self.bell is not None:
                self.bell.polling(True)

    def _leave_spin(self) -> None:
        """This thread stops polling; if it was the last, senders ring again, and one more
        round takes what arrived unrung in between (or the tracker would find it only at its
        next wake-up)."""
        with self._spinners_lock:
            self._spinners.pop()
            last = not self._spinners and self.bell is not None
            if last:
                assert self.bell is not None
                self.bell.polling(False)
        if last:
            self._poll_round()

    def _poll_round(self) -> None:
        """A last look (:meth:`last_look`), waiting for ``lock`` if another thread polls."""
        with self.lock:
            try:
                self.last_look()
            except Exception as exc:
                raise self._table.fail_all(exc) from exc

    def _doze(self, handle: Handle, deadline: float | None) -> bool:
        """Sleep on the waiter's doorbell until ``handle`` completes (True) or ``deadline``
        passes (False), polling after each wake-up. The tracker sleeps on meanwhile: a
        sender rings this thread, and a completion on another thread (the tracker while it
        polls requests in flight, a backend thread) rings it through the handle's
        callback."""
        bell = self.bell
        assert bell is not None
        me = threading.get_ident()
        if not getattr(handle, "_rings_waiter", False):
            handle._rings_waiter = True  # type: ignore[attr-defined]

            def completed(_h: Handle) -> None:
                if threading.get_ident() != me:  # (this thread's own polls need no ring)
                    bell.wake_waiter()

            handle.add_done_callback(completed)

        def recheck_done() -> bool:
            if not handle._done:
                self._poll_round()
            return handle._done

        # Each doze polls after marking the waiter asleep, so a wake-up needs no poll of its own.
        while not handle._done:
            left = MAX_SLEEP_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return recheck_done()  # (what the last sleep was woken for)
            if self._life.closed:
                self.nudge()
                return handle._sleep(None if deadline is None else max(0.0, left))
            bell.doze(recheck_done, min(left, MAX_SLEEP_S))
        return True

    def _spin_fast(self, handle: Handle) -> bool:
        """Probe for fast-path frames until one arrives (True) or ``_SPIN_PROBES`` probes
        found none (False); the caller holds ``lock``."""
        lane = self._lane
        if lane is not None:  # probes in C, _LANE_PROBES at a time with the GIL released
            comm, rank = self._fc_handle, self.rank
            for _ in range(_SPIN_PROBES // _LANE_PROBES):
                got = lane.take(comm, _LANE_PROBES, rank)
                if got is not None:
                    self._on_taken(*got)
                    return True
                if handle._done:
                    return False
            return False
        probe, st = self._fc.Improbe, self._fstatus
        for _ in range(_SPIN_PROBES):
            msg = probe(ANY_SOURCE, ANY_TAG, st)
            if msg is not None:
                self._on_frame(msg)
                return True
            if handle._done:  # completed by another thread (or on a general path)
                return False
        return False


def _unattached(*args: Any) -> Any:  # pragma: no cover - attach() runs before start()
    raise CommError("smp-comm: Progress used before attach()")
