"""Process exit after a failed step, while torch or smp threads may still be inside a
native blocking call.

CPython 3.11–3.13 stop a thread that tries to take the GIL after finalization began by
calling ``pthread_exit``. If that thread is in C++ code (a ``torch.distributed`` collective's
``wait``, or gloo's own worker thread dropping the last reference to a finished collective,
which releases the tensors' Python objects), the forced unwind crosses a ``noexcept`` frame
and the C++ runtime aborts the whole process ("terminate called without an active
exception", exit status 6), after the user's program has already finished.

A collective is left unfinished only after a failed step: a peer that raised never joined
it. Gloo releases it when the peer's process ends or the peer destroys its groups, and a
peer that exits normally first waits in ``MPI_Finalize`` for every rank, this one included.
So, at exit, after a failed step:

1. collectives given up on (:func:`abandon_collective`) are waited for, each on a thread of
   its own, together with the threads the caller names;
2. if a thread is still blocked after a short wait: close the live communicators and
   finalize MPI here, which lets the exiting peers finish and end their processes; wait
   again: their ends release the blocked call, the thread ends, and the interpreter
   finalizes normally (mpi4py sees MPI already finalized). This second wait lasts until the
   exit deadline a caller set (:func:`set_exit_deadline`: the failure channel of smp-torch
   sets the one it enforces itself, so the two are one bounded sequence), at least
   :data:`AFTER_FINALIZE_S`: the peer whose end releases the call may be slow to exit on a
   loaded machine (seen: over 3 s at a load average of 13 on 2 cores);
   Without a deadline, when every peer process is on this host (so its end can be seen in
   ``/proc``: :func:`smp_comm.processes.know_peers`, called by every Communicator), the
   wait lasts up to
   :data:`SEEN_PEERS_WAIT_S`, since nothing is lost by waiting for peers one can watch.
   The wait ends early once every other rank's process has ended (a caller's check,
   :func:`set_peers_ended_check`, else the peers every Communicator made known): nothing
   is left that could release the thread (it is blocked in user code, e.g. a module that
   never returns), and nobody is left for the launcher to kill;
3. if a thread is still blocked after that (a peer that keeps running), leave at once with
   the status Python would have used, without interpreter finalization. A last resort
   only: MPICH's launcher kills every other rank, with SIGKILL, when a rank that finalized
   MPI ends without the C library's ``exit`` (reproduced with three ranks: finalize, then
   ``os._exit(0)`` on one; the others, still running, are killed and the job fails);
3a. if the threads have ended (a peer's end released them) and every other rank's process
   ends within a few seconds (:data:`_LEAVE_AFTER_PEERS_S`; only where their ends can be
   seen), leave without interpreter finalization as well: nobody is left for the launcher
   to kill, and torch's native threads (gloo's, whose collective the peer's end has just
   failed) may still drop the collective's tensors, which needs the interpreter. A
   fresh-clone CI run aborted that way once after the pause of point 4 ("terminate called
   without an active exception": smp-pipeline's tensor-parallel abort case, the worker
   released from a gloo ``all_reduce`` by its peer's end). What finalization would
   still do for this process (the remaining exit handlers) is skipped; the standard streams
   are flushed. Two such ranks wait for each other's end: after the few seconds, each
   goes on to point 4;
4. otherwise pause briefly (:data:`SETTLE_S`, longer on a host with more runnable threads
   than cores: :func:`settle_seconds`) once, so gloo's worker threads drop the collectives
   that have just ended while the interpreter can still give them the GIL.
   (Reproduced: pp=1 x tp=2, one rank raising; without the pause about one exit in four on a
   loaded 2-core machine aborted in ``~AsyncAlltoallWork`` on a ``pt_gloo_runloop`` thread.)
   A caller whose collectives were asynchronous asks for the same pause after a normal run
   (:func:`settle_at_exit`): seen once in a fresh-clone CI run, a 4-rank checkpoint-reshard
   test whose every case had passed aborted at exit ("terminate called without an active
   exception") and the launcher killed the job. After a normal run the pause ends as soon
   as every ``pt_gloo_runloop`` thread has been asleep, not running, for three polls 20 ms
   apart (:func:`smp_comm.native_threads.wait_until_quiet`): their collectives have all
   ended, so nothing is left for them to drop. After a failed step it lasts its whole
   length, since a peer's end may still release a collective.

Where no orderly exit is possible (a peer process is dead, so ``MPI_Finalize`` and every
collective close would wait for it; or a thread stays blocked), :func:`leave_now` is the one
last resort: flush, remove MPI's shared-memory file names, finalize MPI if that can still
complete, ``os._exit``.

MPICH keeps a named file in ``/dev/shm`` (``mpich_shm_*``) for the job's life and removes it
in ``MPI_Finalize``: a job whose processes end any other way (a rank killed, the launcher
killing the rest, :func:`leave_now`) leaves it behind. :func:`unlink_mpi_shared_memory`
removes the *names* of the files this process has mapped (the mappings stay valid, as for
smp-comm's own buffers, which are unlinked as soon as every peer mapped them).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from smp_comm import processes
from smp_comm.native_threads import wait_until_quiet

__all__ = [
    "AFTER_FINALIZE_S",
    "SEEN_PEERS_WAIT_S",
    "SETTLE_S",
    "abandon_collective",
    "exit_status",
    "leave_now",
    "note_failed_step",
    "on_failed_step",
    "set_exit_deadline",
    "set_peers_ended_check",
    "settle_at_exit",
    "settle_seconds",
    "unlink_mpi_shared_memory",
    "wait_for_threads_at_exit",
]

# Seconds to wait for blocked threads: before finalizing MPI (a peer's exit may already have
# released them), and after (the peers leave MPI_Finalize together with this rank).
_BEFORE_FINALIZE_S = 1.0
#: The shortest wait after finalizing MPI (the whole wait when no exit deadline is set and
#: some peer runs on another host).
AFTER_FINALIZE_S = 3.0
#: The wait after finalizing MPI without a deadline when every peer's end can be seen: a
#: peer's exit that releases the blocked call may take seconds on a loaded host (a rank
#: leaving before it gets the whole job killed by MPICH's launcher).
SEEN_PEERS_WAIT_S = 15.0
# Seconds to pause at exit after a failed step, once every blocked call has ended (point 4).
SETTLE_S = 0.5
# The longest pause on a loaded host (settle_seconds).
_SETTLE_MAX_S = 4.0

# Whether the exit pauses SETTLE_S (point 4): after a failed step, or when asked.
_settle_wanted = False
# Whether a step failed in this process (the pause then lasts its whole length).
_step_failed = False
# When (time.monotonic()) an exit after a failed step must be over: set_exit_deadline.
_exit_deadline: float | None = None
# Whether every other rank's process has ended: set_peers_ended_check.
_peers_ended: Callable[[], bool] | None = None
# How often the wait after finalizing MPI asks _peers_ended.
_PEERS_POLL_S = 0.05
# Point 3a: how long a rank whose blocked threads have ended waits for every peer's end
# before it leaves without interpreter finalization (else it finalizes after the pause).
_LEAVE_AFTER_PEERS_S = 5.0
# Collectives (objects with ``wait()``) a failed step left unfinished. Held until the
# interpreter ends, so their last reference is not dropped on one of gloo's threads.
_abandoned: list[Any] = []
_abandoned_waited = 0
# Run by note_failed_step (on_failed_step).
_failure_hooks: list[Callable[[], None]] = []


def note_failed_step() -> None:
    """Record that a step failed in this process: exit then follows the module's protocol
    (whose only per-process state is the settle pause), and every :func:`on_failed_step`
    hook runs."""
    global _step_failed
    _step_failed = True
    settle_at_exit()
    for hook in list(_failure_hooks):
        try:
            hook()
        except Exception:  # noqa: BLE001 - a failing hook must not mask the step's error
            pass


def on_failed_step(hook: Callable[[], None]) -> None:
    """Run ``hook()`` whenever :func:`note_failed_step` is called in this process: for
    what would otherwise keep peers waiting on this rank after its step failed (the ``smp``
    backend's groups mark themselves failed, so a peer inside one of their collectives
    raises at once instead of waiting for this process to end, while this process's exit
    waits for that very collective)."""
    _failure_hooks.append(hook)


def settle_at_exit() -> None:
    """Pause at exit even after a normal run (point 4 of the module docstring: until gloo's
    threads are quiet, at most :func:`settle_seconds`): for a caller that ran asynchronous
    gloo collectives."""
    global _settle_wanted
    _settle_wanted = True


def set_exit_deadline(when: float | None) -> None:
    """Let the wait after finalizing MPI (point 2 of the module docstring) last until
    ``when`` (a :func:`time.monotonic` time), not just :data:`AFTER_FINALIZE_S`: the caller
    enforces that deadline itself (None: no caller deadline)."""
    global _exit_deadline
    _exit_deadline = when


def set_peers_ended_check(check: Callable[[], bool] | None) -> None:
    """Let the wait after finalizing MPI (point 2 of the module docstring) end as soon as
    ``check()`` returns True: every other rank's process has ended, so nothing can release
    a blocked thread any more. ``check`` must be cheap and must never block (None: no
    check; the wait lasts until the deadline)."""
    global _peers_ended
    _peers_ended = check


def _peers_seen() -> bool:
    """Whether every peer the communicators made known can be seen ending (all on this
    host; :func:`smp_comm.processes.know_peers`)."""
    return processes.watchable_peers() is not None


def _all_peers_ended() -> bool:
    check = _peers_ended
    try:
        if check is not None:
            return bool(check())
        seen = processes.watchable_peers()
        return seen is not None and all(processes.has_ended(i) for i in seen)
    except Exception:  # noqa: BLE001 - a broken check must not change the exit
        return False


def abandon_collective(work: Any) -> None:
    """Hand over an asynchronous collective (anything with ``wait()``) a failed step will not
    wait for: it is kept alive and waited for at exit (see the module docstring)."""
    note_failed_step()
    _abandoned.append(work)


def _wait_quietly(work: Any) -> None:
    try:
        work.wait()
    except Exception:  # noqa: BLE001 - a peer that failed fails the collective: expected
        pass


def _abandoned_waiters() -> list[threading.Thread]:
    """One started thread per abandoned collective not yet waited for."""
    global _abandoned_waited
    fresh = _abandoned[_abandoned_waited:]
    _abandoned_waited = len(_abandoned)
    waiters = [
        threading.Thread(target=_wait_quietly, args=(w,), name="smp-abandoned-collective", daemon=True)
        for w in fresh
    ]
    for t in waiters:
        t.start()
    return waiters


def settle_seconds(load: float | None = None, cores: int | None = None) -> float:
    """The pause of point 4: :data:`SETTLE_S`, times the host's load per core when that is
    above 1 (at most 4 s). A gloo thread that drops a finished collective must first be
    scheduled: seen once in a fresh-clone CI run on 2 loaded cores, 0.5 s was not enough
    (pp=2 x tp=2, a worker released from a collective by its peer's exit; the process
    aborted in interpreter finalization)."""
    try:
        load = os.getloadavg()[0] if load is None else load
        cores = (os.cpu_count() or 1) if cores is None else cores
    except OSError:  # no load average on this platform
        return SETTLE_S
    return min(_SETTLE_MAX_S, SETTLE_S * max(1.0, load / max(1, cores)))


def _settle() -> None:
    global _settle_wanted
    if _settle_wanted:
        _settle_wanted = False
        if _step_failed:
            # A peer's end may still release a collective that waits for it: the whole pause.
            time.sleep(settle_seconds())
        else:
            # After a normal run every collective has ended: only as long as gloo's threads
            # still run (native_threads).
            wait_until_quiet(settle_seconds())


def exit_status() -> int:
    """The status of an interpreter exit now: 1 after an uncaught exception, else 0.

    (``sys.exit(n)`` with ``n`` other than 0/1 cannot be seen from an exit handler; such a
    program, leaving with a thread still blocked, exits 0.)
    """
    return 1 if getattr(sys, "last_value", None) is not None else 0


def _join(threads: list[threading.Thread], seconds: float) -> list[threading.Thread]:
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


def _join_until_peers_end(threads: list[threading.Thread], seconds: float) -> list[threading.Thread]:
    """:func:`_join`, ending early once every other rank's process has ended."""
    deadline = time.monotonic() + seconds
    pending = [t for t in threads if t.is_alive()]
    while pending and not _all_peers_ended():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        pending[0].join(min(_PEERS_POLL_S, left))
        pending = [t for t in pending if t.is_alive()]
    return pending


def _peers_end_within(seconds: float) -> bool:
    """Whether every other rank's process ends within ``seconds`` (False at once when their
    ends cannot be seen: peers on another host and no caller's check)."""
    if _peers_ended is None and not _peers_seen():
        return False
    deadline = time.monotonic() + seconds
    while not _all_peers_ended():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_PEERS_POLL_S)
    return True


def _finalize_mpi() -> None:
    from smp_comm.communicator import close_live_communicators

    close_live_communicators()
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def wait_for_threads_at_exit(threads: Iterable[threading.Thread], who: str) -> None:
    """From an exit handler: make sure none of ``threads`` is alive when the interpreter
    finalizes (see the module docstring). Returns normally once they have all ended;
    otherwise ends the process with :func:`exit_status`."""
    waited = [t for t in threads if t is not threading.current_thread()] + _abandoned_waiters()
    pending = _join(waited, _BEFORE_FINALIZE_S)
    if not pending:
        _settle()
        return
    names = ", ".join(t.name for t in pending)
    sys.stderr.write(
        f"{who}: thread(s) {names} still blocked after a failed step; finalizing MPI and "
        "waiting for the other ranks to exit\n"
    )
    sys.stderr.flush()
    _finalize_mpi()
    finalized_at = time.monotonic()
    wait = AFTER_FINALIZE_S
    if _exit_deadline is not None:
        wait = max(wait, _exit_deadline - finalized_at)
    elif _peers_seen():
        wait = max(wait, SEEN_PEERS_WAIT_S)
    pending = _join_until_peers_end(pending, wait)
    if not pending:
        left = max(0.0, finalized_at + wait - time.monotonic())
        if _peers_end_within(min(_LEAVE_AFTER_PEERS_S, left)):  # point 3a (module docstring)
            leave_now(
                exit_status(),
                f"{who}: thread(s) {names} released and every other rank has ended; "
                "exiting without interpreter finalization",
            )
        _settle()
        return
    status = exit_status()
    why = "every other rank has ended" if _all_peers_ended() else "the exit deadline passed"
    leave_now(
        status,
        f"{who}: thread(s) {names} still blocked {time.monotonic() - finalized_at:.1f} s "
        f"after MPI finalized ({why}); leaving with status {status} without interpreter "
        "finalization",
    )


# Files MPICH keeps in /dev/shm while a job runs (removed by its MPI_Finalize).
_MPI_SHM_PREFIXES = ("/dev/shm/mpich_shm_",)


def unlink_mpi_shared_memory() -> list[str]:
    """Remove the names of the MPI library's shared-memory files this process maps (see the
    module docstring); returns the paths removed. Safe once every process of the node has
    mapped them (after ``MPI_Init`` returned everywhere): mappings outlive names, and MPICH
    does not open them again (its ``MPI_Finalize`` ignores a missing name)."""
    removed: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "/dev/shm/" in line}
    except OSError:  # not Linux: nothing known to clean
        return removed
    for path in sorted(paths):
        if path.startswith(_MPI_SHM_PREFIXES) and not path.endswith("(deleted)"):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:  # a node peer removed it first
                pass
    return removed


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass


def _bounded(fn: Any, seconds: float, name: str) -> None:
    """Run ``fn`` on a daemon thread for at most ``seconds`` (it may block forever: a
    stream another thread holds, an MPI_Finalize that waits for a rank that left)."""
    try:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        t.join(seconds)
    except RuntimeError:  # interpreter shutting down: no new threads; try here
        fn()


def leave_now(status: int, message: str | None = None, finalize_mpi: bool = False) -> NoReturn:
    """End the process at once with ``status``, without interpreter finalization: the last
    resort when an orderly exit would wait forever (see the module docstring). Writes
    ``message`` (if any) to stderr after flushing both streams, and removes the names of MPI's
    shared-memory files.

    ``finalize_mpi``: first close the live communicators and finalize MPI (at most 2 s), so
    that the other ranks' ``MPI_Finalize`` does not wait for this one and the launcher sees
    an orderly end (MPICH's launcher kills every rank when one ends without it). Only when
    every peer process is alive: finalizing with a dead peer never completes.
    """
    try:
        unlink_mpi_shared_memory()
        _bounded(_flush_streams, 1.0, "smp-leave-flush")
        if message:
            os.write(2, (message.rstrip("\n") + "\n").encode(errors="replace"))
        if finalize_mpi:
            _bounded(_finalize_mpi, 2.0, "smp-leave-finalize")
    finally:
        os._exit(status)
