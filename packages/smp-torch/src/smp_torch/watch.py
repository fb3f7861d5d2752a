"""smp's failure channel: when one rank fails, every other rank knows within a second.

``smp.init`` opens one private communicator for it (:class:`FailureWatch`) and starts one
daemon thread per rank, the *watcher*, which every :data:`POLL_S` seconds takes arrived
notices and checks that the peer processes live (:mod:`smp_torch.liveness`: ``/proc`` on
this node, a heartbeat ring over every rank). Nothing of it is on a step's path: no collective, no
message while all goes well; a step reads one attribute to know that all is well.

A rank *fails* when

- an exception goes uncaught in its main thread or any other thread (smp chains
  ``sys.excepthook`` and ``threading.excepthook``): it sends a notice to every other rank
  (its rank, the exception's type and message, what it was doing) before the traceback is
  printed;
- its step raises and its peers may be blocked in a collective it will never join (pp = 1
  with tensor parallelism, where the step runs on a helper thread: :meth:`FailureWatch.run`);
  otherwise a failed step is settled by the step's agreement
  (:meth:`smp_torch.context.SMPContext.agree`) or the pipeline's own ``Abort``;
- its process ends without exiting (killed, crashed): the peers on its node see it in
  ``/proc`` and tell the others; a whole node going silent is found by the heartbeat ring;
- its process is frozen (alive, but no thread runs: SIGSTOP, a hung driver): the rank that
  watches it in the ring hears nothing for ``timeout_s``, ends it and tells the others;
- it holds the job up: a wait of smp lasted ``timeout_s`` (:meth:`FailureWatch.bounded`) and
  the stall query (:meth:`FailureWatch.stalled`) found it running user code or a module
  that does not return, or not answering.

A rank that learns of a failure raises :class:`~smp_torch.errors.PeerFailedError` where it
waits inside smp — the step's agreement, the tensor-parallel step thread, the pipeline
runtime (interrupted through ``PipelineRuntime.interrupt``), the data-parallel reduction,
the optimizer's broadcasts, ``smp.barrier`` and the other ``smp`` collectives — or, if it is
outside smp (user code, a raw ``torch.distributed`` call), when it next enters it. A rank
that does not reach such a point within :data:`OUTSIDE_GRACE_S` (outside smp) or
:data:`INSIDE_GRACE_S` (inside, e.g. blocked in a collective smp cannot interrupt) prints the
error and ends (:func:`smp_comm.shutdown.leave_now`): a failed job never waits for a timeout.

Exit after a failure: a rank whose peer's process died leaves at once when its interpreter
exits (``MPI_Finalize`` and every collective close would wait for the dead rank forever);
otherwise the exit is the orderly one of :mod:`smp_comm.shutdown`, given
:data:`EXIT_GRACE_S` to finish before the rank leaves anyway.
"""

from __future__ import annotations

import array
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from mpi4py import MPI
from smp_comm.shutdown import (
    exit_status,
    leave_now,
    set_exit_deadline,
    set_peers_ended_check,
    unlink_mpi_shared_memory,
)

from smp_torch.errors import PeerFailedError, StallError
from smp_torch.exit_hooks import arm_exit_alarm, forget, install
from smp_torch.liveness import BEAT_TIMEOUT_S, Heartbeats, PeerProcesses, ProcessInfo
from smp_torch.notices import Failure, first_line, maybe_consequence
from smp_torch.stall_report import RankReport, describe, judge
from smp_torch.waits import Waiting, run_raising, step_threads, wait_request, wait_work

__all__ = [
    "EXIT_GRACE_S",
    "INSIDE_GRACE_S",
    "OUTSIDE_GRACE_S",
    "POLL_S",
    "Failure",
    "FailureWatch",
    "first_line",
]

_NOTICE_TAG = 7
_BEAT_TAG = 8
_QUERY_TAG = 9  # a wait timed out: "what are you doing?" (answered by the watcher)
_ANSWER_TAG = 10
#: How long a stall query waits for the other ranks' answers (a watcher answers within a
#: turn, ~25 ms; one that does not is frozen).
QUERY_WAIT_S = 2.0
#: The watcher's period (seconds).
POLL_S = 0.025
#: A rank outside smp gets this long to enter smp (and raise there) before it is ended.
OUTSIDE_GRACE_S = 1.0
#: A rank inside smp that has not raised after this long (blocked where smp cannot
#: interrupt it, or computing) is ended.
INSIDE_GRACE_S = 5.0
#: After a failure, an interpreter exit that has not finished after this long is cut short,
#: with the status Python would have used. For exits that hang, not slow ones: the orderly
#: exit after a failed step takes 1-5 s, and over 10 s at a load average of 14-19 on 2 cores,
#: where cutting it (at 6 s) made the launcher kill the whole job.
EXIT_GRACE_S = 15.0
# Once smp's exit handlers run, their own bounded protocol (smp_comm.shutdown) waits until
# EXIT_GRACE_S and leaves itself; the watcher cuts the exit only this much later (a hang
# after them, e.g. in MPI_Finalize), so the two never race.
_BACKSTOP_S = 3.0
# The exit alarm rings this long after EXIT_GRACE_S, behind the watcher's own deadline.
_ALARM_AFTER_S = 10.0
# A rank another rank named as the one holding the job up (see stalled) leaves this long
# after: its main thread raises at once if it can (it waits for a step thread), else it is
# stuck in user code.
_CULPRIT_GRACE_S = 0.25
_SEND_WAIT_S = 2.0  # how long an uncaught exception waits for its notices to leave
_EXPLAIN_S = 0.5  # how long a communication error waits for the watcher to explain it
_CONFIRM_S = 0.1  # how long an unexplained process end waits for a notice explaining it


class FailureWatch:
    """The failure channel of one ``smp.init`` (see the module docstring).

    Collective over ``world``: every rank builds one, in the same order.

    Args:
        world: the job's communicator (duplicated).
        timeout_s: the longest any wait inside smp lasts before the ranks are asked who holds
            it up (:meth:`stalled`), and the silence after which a peer on this node is
            taken for frozen.
        pid_check: check same-node peers in ``/proc``; False treats every rank as alone on
            its node, so heartbeats watch every peer (used by the fault tests).
    """

    def __init__(self, world: Any, timeout_s: float = 300.0, pid_check: bool = True) -> None:
        self.timeout_s = timeout_s
        self.comm = world.Dup()
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        node_ranks = sorted(node.allgather(self.rank))
        node.Free()
        self.infos: list[ProcessInfo] = self.comm.allgather(ProcessInfo.here())
        groups = self.comm.allgather(node_ranks)
        if not pid_check:
            node_ranks, groups = [self.rank], [[r] for r in range(self.size)]
        # Every process of this node finished MPI_Init (Split_type was collective): MPI's
        # shared-memory file names can go now, so a job that dies leaves none behind.
        if self.rank == node_ranks[0]:
            unlink_mpi_shared_memory()
        self.node_ranks = node_ranks
        unique = {tuple(g): list(g) for g in groups}
        self.peers = PeerProcesses(self.rank, self.infos, node_ranks)
        self.beats = Heartbeats(self.rank, list(unique.values()), time.monotonic(), timeout_s)
        #: What this rank is doing inside smp (None: outside), for messages and deadlines,
        #: and since when (``time.monotonic()``).
        self.where: str | None = None
        self.where_since = time.monotonic()
        self._query = 0  # the stall query this rank asked last (see stalled)
        # The watched peer's CPU time at its last heartbeat (same node: see _peer_silent).
        self._watched_cpu: int | None = None
        self._warned_silent = False
        self._patient = 0  # inside patient() blocks
        self._answers: dict[int, RankReport] = {}
        #: ``@smp.step`` calls so far.
        self.step = 0
        #: The first failure learnt (any rank's, this one's included), or None.
        self.failure: Failure | None = None
        self.failed_at = 0.0
        #: A PeerFailedError (or this rank's own error) has been raised to the user.
        self.delivered = False
        self.dead: set[int] = set()
        #: Ranks that left because of a failure: rank -> whether they finalized MPI first.
        self.left: dict[int, bool] = {}
        self._ended_at: dict[int, float] = {}  # peer processes seen ended, and when
        self._announced = False
        self._exiting_at: float | None = None  # smp's exit handler ran
        self._main_ended_at: float | None = None  # the main thread ended (exit began)
        self._interrupts: list[Callable[[str], None]] = []
        self._sends: list[Any] = []  # unfinished isends: their buffers must stay alive
        # Guards the failure fields, and MPI use once the interpreter exits (MPI_Finalize
        # may run on the main thread while the watcher still runs).
        self._lock = threading.Lock()
        self._mpi_open = True
        self._warned = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="smp-torch-watcher", daemon=True)
        self._thread.start()
        install(self)

    # ------------------------------------------------------------------ where this rank is
    def waiting(self, label: str) -> Waiting:
        """Context manager: this rank is inside smp doing ``label`` (for messages, and for
        the deadline of a rank that learns of a failure)."""
        return Waiting(self, label)

    def where_now(self) -> str:
        """What this rank is doing, in words."""
        if self.where is not None:
            return self.where
        if self.step:
            return f"outside smp, after step {self.step}"
        return "outside smp, before the first step"

    def begin_step(self) -> int:
        """A step starts: raise if a failure is known; returns its number (1, 2, ...)."""
        self.check()
        self.step += 1
        return self.step

    # ------------------------------------------------------------------ raising
    def check(self) -> None:
        """Raise :class:`PeerFailedError` if a failure is known (one attribute read)."""
        if self.failure is not None:
            raise self.error()

    def error(self, failure: Failure | None = None, waiting_for: str | None = None) -> PeerFailedError:
        """The error for ``failure`` (default: the one learnt), raised here now while this
        rank does ``waiting_for`` (default: :meth:`where_now`); from here on the failure
        counts as delivered to the user."""
        f = failure or self.failure
        assert f is not None
        self.delivered = True
        return PeerFailedError(f.rank, f.error, f.where, waiting_for or self.where_now(), self.rank)

    def explain(self, error: BaseException, waiting_for: str | None = None) -> PeerFailedError | None:
        """The :class:`PeerFailedError` that ``error`` (raised by this rank's step, while it
        did ``waiting_for``) is a consequence of, or None if it is this rank's own. A
        communication error waits up to 0.5 s for the watcher to learn why."""
        if isinstance(error, PeerFailedError):
            self.delivered = True
            return error
        if not maybe_consequence(error, self.rank):
            return None
        deadline = time.monotonic() + _EXPLAIN_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return None if self.failure is None else self.error(waiting_for=waiting_for)

    def on_failure(self, interrupt: Callable[[str], None]) -> None:
        """Call ``interrupt(message)`` (on the watcher's thread) when a failure is learnt, so
        a wait that does not poll :meth:`check` ends (e.g. ``PipelineRuntime.interrupt``)."""
        self._interrupts.append(interrupt)
        f = self.failure
        if f is not None:
            interrupt(str(PeerFailedError(f.rank, f.error, f.where, self.where_now(), self.rank)))

    # ------------------------------------------------------------------ telling the others
    def announce(self, error: BaseException, where: str | None = None, delivered: bool = True) -> None:
        """This rank failed with ``error``: tell every other rank (once; waits up to 2 s for
        the notices to leave, as this process may exit next). ``where`` defaults to what the
        rank was doing when ``error`` was raised; ``delivered``: ``error`` reaches the user
        here (False for another thread's error: then this rank's main thread raises
        :class:`PeerFailedError` too, or is ended, as on the other ranks)."""
        with self._lock:
            if self._announced:
                return
            self._announced = True
        place = where or getattr(error, "_smp_where", None) or self.where_now()
        failure = Failure(self.rank, first_line(error), place)
        self._learn(failure)
        if delivered:
            self.delivered = True
        self._notify(failure, self._others())
        self._settle_sends(_SEND_WAIT_S)

    def _notify(self, failure: Failure, dests: list[int], left: tuple[int, bool] | None = None) -> None:
        """Send ``failure`` to ``dests``. ``left``: (this rank, whether it finalized MPI): it
        leaves now because of ``failure``; its end is not a failure of its own."""
        wire = (failure.rank, failure.error, failure.where, failure.dead, left)
        self._send(_NOTICE_TAG, wire, dests)

    def _others(self, exclude: list[int] | tuple[int, ...] = ()) -> list[int]:
        return [r for r in range(self.size) if r != self.rank and r not in self.dead and r not in exclude]

    def _send(self, tag: int, msg: Any, dests: list[int]) -> None:
        with self._lock:
            if not self._mpi_open:
                return
            for r in dests:
                try:
                    self._sends.append(self.comm.isend(msg, dest=r, tag=tag))
                except Exception:  # noqa: BLE001 - best effort: the peer may be gone
                    pass

    def _settle_sends(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            with self._lock:
                if not self._mpi_open:
                    return
                self._sends = [q for q in self._sends if not q.Test()]
                if not self._sends:
                    return
            if time.monotonic() > deadline:
                return
            time.sleep(2e-3)

    # ------------------------------------------------------------------ learning
    def record(self, failure: Failure) -> None:
        """Note a failure learnt elsewhere than on the channel (the step's agreement), about
        to be raised to the user here."""
        self._learn(failure)
        self.delivered = True

    def _learn(self, failure: Failure) -> None:
        with self._lock:
            if failure.dead:
                self.dead.add(failure.rank)
            if self.failure is not None:
                return
            self.failure = failure
            self.failed_at = time.monotonic()
            interrupts = list(self._interrupts)
        if interrupts:
            text = str(PeerFailedError(failure.rank, failure.error, failure.where, self.where_now(), self.rank))
            for interrupt in interrupts:
                try:
                    interrupt(text)
                except Exception:  # noqa: BLE001 - one broken waiter must not stop the others
                    pass

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._turn(time.monotonic())
            except Exception as exc:  # noqa: BLE001 - the watcher must outlive a bad turn
                self._warn(exc)

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:  # once: a broken MPI fails every turn alike
            self._warned = True
            sys.stderr.write(f"smp rank {self.rank}: failure watcher: {exc!r}\n")

    def _turn(self, now: float) -> None:
        if self._main_ended_at is None and not threading.main_thread().is_alive():
            # The program ended: the exit has begun, even if it never reaches smp's exit
            # handler (a handler before it, or a thread it joins, may hang).
            self._main_ended_at = now
        if self._exiting_at is None:
            # Ended processes first, notices next: a rank that leaves because of a failure
            # says so before its process ends, so its end is never taken for the failure.
            ended = [r for r in self.peers.ended() if r not in self.dead]
            notices: list[tuple[Failure, tuple[int, bool] | None]] = []
            queries: list[tuple[int, int]] = []
            try:
                with self._lock:
                    if self._mpi_open:
                        notices, queries = self._receive(now)
                        if self.beats.beat_due(now) and self.beats.send_to is not None:
                            beat = self.comm.isend("beat", dest=self.beats.send_to, tag=_BEAT_TAG)
                            self._sends.append(beat)
                        self._sends = [q for q in self._sends if not q.Test()]
            except Exception as exc:  # noqa: BLE001 - MPI broke: /proc and deadlines still work
                self._warn(exc)
            for failure, left in notices:  # (outside the lock: learning takes it)
                self._learn(failure)
                if left is not None:
                    self.left[left[0]] = left[1]
            for src, query in queries:
                self._send(_ANSWER_TAG, (query, self.report()), [src])
            for r in ended:
                self._ended_at.setdefault(r, now)
            self._judge_ended(now)
            silent = self.beats.silent(now)
            if silent is not None and self.beats.same_node:
                self._peer_silent(silent, now)
            elif silent is not None:
                self._node_silent(silent)
        self._enforce(now)

    def _receive(
        self, now: float
    ) -> tuple[list[tuple[Failure, tuple[int, bool] | None]], list[tuple[int, int]]]:
        """Take every arrived message: heartbeats are noted, answers to this rank's stall
        query kept; notices are returned (each with its sender's departure, if it leaves:
        see :meth:`_notify`), and the stall queries to answer (sender, query)."""
        notices = []
        queries = []
        status = MPI.Status()
        while True:
            # A matched probe: the receive below takes exactly this message, at once.
            probed = self.comm.improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            if probed is None:
                break
            src, tag = status.Get_source(), status.Get_tag()
            msg = probed.recv()
            if tag == _BEAT_TAG:
                self.beats.heard(src, msg == "bye", now)
                if src == self.beats.watched and self.beats.same_node:
                    self._watched_cpu = self.peers.cpu_ticks(src)
            elif tag == _NOTICE_TAG:
                rank, error, where, dead, left = msg
                notices.append((Failure(rank, error, where, dead), left))
            elif tag == _QUERY_TAG:
                queries.append((src, msg))
            elif tag == _ANSWER_TAG and msg[0] == self._query:
                self._answers[src] = msg[1]
        return notices, queries

    def _judge_ended(self, now: float) -> None:
        """Turn ended peer processes into failures. One that left because of a failure (it
        said so) is not one; an end nothing explains yet gets :data:`_CONFIRM_S` for its
        notice to arrive (a rank that leaves within milliseconds of a death can be seen gone
        together with the dead one), then the earliest end seen is the failure."""
        for r, finalized in self.left.items():
            if r in self._ended_at and not finalized:
                self.dead.add(r)  # left without MPI_Finalize: nobody can wait for it
        unexplained = sorted(
            (t, r) for r, t in self._ended_at.items() if r not in self.dead and r not in self.left
        )
        if not unexplained:
            return
        if self.failure is None and now - unexplained[0][0] < _CONFIRM_S:
            return
        for _, r in unexplained:  # the first one is the failure, if none is known yet
            self._peer_ended(r)

    def _peer_ended(self, r: int) -> None:
        info = self.infos[r]
        text = f"its process ended without exiting ({info.describe()}: killed, or crashed)"
        self._learn(Failure(r, text, "", dead=True))
        # The peers on this node see it themselves; one of them tells the other nodes.
        live = [x for x in self.node_ranks if x not in self.dead]
        if live and live[0] == self.rank:
            self._notify(Failure(r, text, "", dead=True), self._others(self.node_ranks))

    def _peer_silent(self, r: int, now: float) -> None:
        """Peer ``r`` on this node sent no heartbeat for ``timeout_s`` yet its process lives.
        It is frozen if it is stopped, or used no CPU time since its last heartbeat: then it
        is ended (SIGKILL: a stopped process cannot end by itself, and the launcher would wait
        for it) and the job told. A process that runs (its watcher thread starved: the GIL
        held, MPI's lock held by a long blocking call) is not frozen: the ring waits again."""
        state = self.peers.state(r)
        if state is None:
            return  # it ended: the /proc check reports that
        ticks = self.peers.cpu_ticks(r)
        if state not in ("T", "t") and ticks is not None:
            if self._watched_cpu is None or ticks > self._watched_cpu:  # (None: never heard)
                self.beats.rearm(now)
                self._watched_cpu = ticks
                if not self._warned_silent:
                    self._warned_silent = True
                    sys.stderr.write(
                        f"smp rank {self.rank}: rank {r} sent no heartbeat for "
                        f"{self.beats.limit:g} s but its process runs (its failure watcher "
                        "cannot run): not taken for frozen\n"
                    )
                return
        self._peer_frozen(r, state)

    def _peer_frozen(self, r: int, state: str) -> None:
        """Peer ``r`` on this node is frozen (:meth:`_peer_silent`): end it, tell the job."""
        how = {
            "T": "stopped (SIGSTOP)",
            "t": "stopped by a debugger",
            "D": "in uninterruptible sleep",
        }.get(state, f"in state {state}, using no CPU time")
        killed = self.peers.kill(r)
        text = (
            f"FrozenRankError: its process is frozen: alive ({self.infos[r].describe()}, {how}) "
            f"but no heartbeat from it for {self.beats.limit:g} s (timeout_s)"
            + ("; ended with SIGKILL by rank " + str(self.rank) if killed else "")
        )
        failure = Failure(r, text, "", dead=True)
        self._learn(failure)
        self._notify(failure, self._others([r]))

    def _node_silent(self, leader: int) -> None:
        group = self.beats.watched_group
        text = (
            f"no heartbeat from its node (ranks {group}) for {BEAT_TIMEOUT_S:g} s: "
            "presumed dead"
        )
        for r in group:
            self._learn(Failure(r, text, "", dead=True))
        self._notify(Failure(leader, text, "", dead=True), self._others(group))

    # ------------------------------------------------------------------ deadlines and exit
    def _enforce(self, now: float) -> None:
        f = self.failure
        if f is None:
            return
        exit_began = self._exiting_at or self._main_ended_at
        if exit_began is not None:
            if self.dead and self._exiting_at is not None:
                self._leave(exit_status(), "its exit would wait for the dead rank")
            if self.stalled_here() and now - exit_began > _CULPRIT_GRACE_S:
                # Its stuck thread ends never, and the peers' blocked collectives wait for
                # this process's end: the exit handlers (which join threads) are not waited for.
                self._leave(exit_status() or 1, "it held the job up (a thread stuck)")
            grace = EXIT_GRACE_S + (_BACKSTOP_S if self._exiting_at is not None else 0.0)
            if now - max(exit_began, self.failed_at) > grace:
                status = exit_status()  # 0 if the program caught the error and ended
                self._leave(status, f"its exit did not finish within {grace:g} s")
            return
        if self.delivered:
            return
        if f.rank == self.rank and not self._announced:
            # Another rank named this one (stalled): its main thread is stuck, raising here
            # is not to be expected.
            if now - self.failed_at > _CULPRIT_GRACE_S:
                self._leave(1, "another rank found it stalled")
        elif self.where is None:
            if now - self.failed_at > OUTSIDE_GRACE_S:
                self._leave(1, f"it did not enter smp within {OUTSIDE_GRACE_S:g} s")
        elif now - self.failed_at > INSIDE_GRACE_S:
            self._leave(1, f"smp could not raise there within {INSIDE_GRACE_S:g} s")

    def _leave(self, status: int, why: str) -> None:
        assert self.failure is not None
        error = PeerFailedError(
            self.failure.rank, self.failure.error, self.failure.where, self.where_now(), self.rank
        )
        exiting = (self._exiting_at or self._main_ended_at) is not None
        finalize = not self.dead and not exiting
        self._depart(finalize)
        leave_now(
            status,
            f"smp rank {self.rank}: PeerFailedError: {error}; {why}: leaving with status "
            f"{status} [unix time {time.time():.3f}]",
            # Finalizing lets the others' MPI_Finalize (and the launcher) see an orderly end;
            # not with a dead peer (it would wait for it), nor during the exit, whose main
            # thread may be inside MPI right now.
            finalize_mpi=finalize,
        )

    def _depart(self, finalized: bool) -> None:
        """Before leaving because of the failure: tell the others (up to 0.5 s), so they do
        not take this rank's end for a failure, then stop using MPI here."""
        assert self.failure is not None
        self._notify(self.failure, self._others(), left=(self.rank, finalized))
        self._settle_sends(0.5)
        # A send that completed may still sit in MPI's buffers, lost if the process ends at
        # once (seen: 1 run in 5). The others' 0.1 s wait covers a lost one (_judge_ended).
        time.sleep(0.05)
        with self._lock:
            self._mpi_open = False

    def exiting(self) -> None:
        """The interpreter exits (smp's first exit handler): stop using MPI here (the main
        thread finalizes it soon), and leave at once if a peer process is dead."""
        if self.failure is not None:
            arm_exit_alarm(EXIT_GRACE_S + _ALARM_AFTER_S)  # first: nothing below may hang it
            # smp_comm.shutdown's exit protocol waits for blocked threads up to this
            # deadline, which the watcher then no longer enforces itself (see _BACKSTOP_S).
            began = self._main_ended_at or time.monotonic()
            set_exit_deadline(max(began, self.failed_at) + EXIT_GRACE_S)
            # ...and ends early once no peer is left to release a blocked thread (one stuck
            # in a module that never returns would otherwise hold the exit to the deadline).
            set_peers_ended_check(lambda: self.peers.all_ended(self.size))
        if self.dead:
            self._depart(False)
        # (Bounded: a watcher turn holding the lock inside a broken MPI must not stop exit.)
        locked = self._lock.acquire(timeout=1.0)
        try:
            if self._mpi_open and locked and self.beats.active:
                # The next rank stops expecting heartbeats (this exit is not a death), and the
                # previous one stops sending them (nothing here receives them any more).
                for dest in {self.beats.send_to, self.beats.watched} - {None}:
                    try:
                        self._sends.append(self.comm.isend("bye", dest=dest, tag=_BEAT_TAG))
                    except Exception:  # noqa: BLE001 - exiting anyway
                        pass
            self._mpi_open = False
            self._exiting_at = time.monotonic()
        finally:
            if locked:
                self._lock.release()
        if self.dead:
            status = exit_status()
            leave_now(
                status,
                f"smp rank {self.rank}: rank(s) {sorted(self.dead)} ended without "
                f"MPI_Finalize: leaving with status {status} without it too (it would wait for "
                f"them) [unix time {time.time():.3f}]",
            )
        if self.stalled_here():
            # Its stuck thread (user code, a module that never returns) ends never: waiting
            # for it would hold the peers, whose own blocked collectives wait for this end.
            status = exit_status() or 1
            leave_now(
                status,
                f"smp rank {self.rank}: this rank held the job up (a thread stuck, see the "
                f"StallError): leaving with status {status} without waiting for it "
                f"[unix time {time.time():.3f}]",
                finalize_mpi=True,
            )

    def stalled_here(self) -> bool:
        """Whether the failure is a stall this rank was found to cause: smp's verdict
        (:meth:`stalled`) or the pipeline's (a timeout whose chain of waits ends here)."""
        f = self.failure
        return (
            f is not None
            and f.rank == self.rank
            and f.error.startswith(("StallError", "PipelineTimeoutError"))
        )

    def close(self) -> None:
        """Stop the watcher and free the communicator (``smp.init`` again; collective)."""
        self._stop.set()
        self._thread.join(1.0)
        with self._lock:
            was_open, self._mpi_open = self._mpi_open, False
        forget(self)
        if was_open:
            try:
                self.comm.Free()
            except Exception:  # noqa: BLE001 - re-initialising anyway
                pass

    # ------------------------------------------------------------------ waits that raise
    @contextlib.contextmanager
    def patient(self) -> Iterator[None]:
        """Waits that begin in this block are not bounded by ``timeout_s`` (a checkpoint's
        phases: a peer may write or read files for longer, and a save must not be cut)."""
        self._patient += 1
        try:
            yield
        finally:
            self._patient -= 1

    def arrive(self, label: str, comm: Any = None) -> None:
        """Wait until every rank of ``comm`` (default: the job) reaches this point, sleeping
        between polls, before a blocking MPI collective that follows work whose length differs
        between ranks (building the model, the partition on rank 0). MPICH's blocking
        collectives poll without sleeping: with more ranks than cores the waiting ranks took
        the CPU from the rank they waited for (a model build 2 s alone took 23-44 s beside
        three waiting ranks on 2 cores). A failure elsewhere raises here; not bounded by
        ``timeout_s`` (a rank may build a large model for longer)."""
        with self.waiting(label), self.patient():
            self.wait_request((comm or self.comm).Ibarrier())

    def bounded(self) -> Callable[[], None]:
        """A ``check`` for one wait that begins now: :meth:`check`, and after ``timeout_s``
        :meth:`stalled` (outside :meth:`patient`)."""
        if self._patient:
            return self.check
        deadline = time.monotonic() + self.timeout_s

        def check() -> None:
            self.check()
            if time.monotonic() > deadline:
                self.stalled(self.where_now())

        return check

    def run(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a helper thread; re-raise its exception, or raise
        :class:`PeerFailedError` as soon as a failure is known (see :func:`waits.run_raising`),
        or :meth:`stalled` after ``timeout_s`` (the step at pp = 1 with tensor parallelism;
        outside :meth:`patient`)."""
        run_raising(fn, self.bounded())

    def wait_request(self, request: Any) -> None:
        """Wait for an MPI request, raising :class:`PeerFailedError` meanwhile if a failure
        is known (a peer that failed never completes it), or :meth:`stalled` after
        ``timeout_s``."""
        wait_request(request, self.bounded())

    def wait_work(self, work: Any, cuda: bool = False) -> None:
        """Wait for a ``torch.distributed`` collective (``async_op=True``), raising
        :class:`PeerFailedError` meanwhile if a failure is known (see :func:`waits.wait_work`).
        A collective that fails because a peer did (an ``smp``-backend group marked failed by
        the peer's failed step) raises the peer's :class:`PeerFailedError` instead, once
        known (:meth:`explain`)."""
        try:
            wait_work(work, self.bounded(), cuda)
        except (PeerFailedError, StallError):
            raise
        except Exception as exc:
            peer = self.explain(exc)
            if peer is None:
                raise
            raise peer from exc

    def allreduce_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over all ranks (the step's outcome
        agreement), raising :class:`PeerFailedError` instead if a failure is known."""
        send = array.array("q", values)
        recv = array.array("q", [0] * len(values))
        self.wait_request(self.comm.Iallreduce(send, recv, op=MPI.MAX))
        return [int(v) for v in recv]

    # ------------------------------------------------------------------ stalls
    def report(self) -> RankReport:
        """What this rank does now (:mod:`smp_torch.stall_report`; from any thread)."""
        for_s = time.monotonic() - self.where_since
        return describe(self.rank, self.where_now(), for_s, step_threads())

    def stalled(self, waited: str) -> NoReturn:
        """A wait of this rank (``waited``) lasted ``timeout_s``: ask every rank what it does
        (their watchers answer; :data:`QUERY_WAIT_S` at most), name the rank that holds the
        job up (:func:`smp_torch.stall_report.judge`), tell every rank, and raise:
        :class:`StallError` if it is this rank, else :class:`PeerFailedError` naming it."""
        with self._lock:
            self._query += 1
            self._answers = {}
        others = self._others()
        mine = self.report()
        self._send(_QUERY_TAG, self._query, others)
        deadline = time.monotonic() + QUERY_WAIT_S
        while len(self._answers) < len(others) and time.monotonic() < deadline:
            self.check()  # (another rank may have named the culprit meanwhile)
            time.sleep(0.01)
        with self._lock:
            answers = dict(self._answers)
        reports: dict[int, RankReport | None] = {r: answers.get(r) for r in others}
        reports[self.rank] = mine
        verdict = judge(self.rank, waited, self.timeout_s, reports, QUERY_WAIT_S)
        failure = Failure(verdict.rank, verdict.error, verdict.where)
        self._learn(failure)
        if self.failure != failure:  # another rank's verdict, or another failure, came first
            raise self.error()
        self._notify(failure, self._others())
        self._settle_sends(0.5)
        if verdict.rank == self.rank:
            self.delivered = True
            raise StallError(verdict.error.removeprefix("StallError: "))
        raise self.error(failure)
