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
   finalizes normally (mpi4py sees MPI already finalized);
3. if a thread is still blocked after that (a peer that keeps running), leave at once with
   the status Python would have used, without interpreter finalization;
4. otherwise pause briefly (:data:`SETTLE_S`) once, so gloo's worker threads drop the
   collectives that have just ended while the interpreter can still give them the GIL.
   (Reproduced: pp=1 x tp=2, one rank raising; without the pause about one exit in four on a
   loaded 2-core machine aborted in ``~AsyncAlltoallWork`` on a ``pt_gloo_runloop`` thread.)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

__all__ = [
    "SETTLE_S",
    "abandon_collective",
    "exit_status",
    "note_failed_step",
    "wait_for_threads_at_exit",
]

# Seconds to wait for blocked threads: before finalizing MPI (a peer's exit may already have
# released them), and after (the peers leave MPI_Finalize together with this rank).
_BEFORE_FINALIZE_S = 1.0
_AFTER_FINALIZE_S = 3.0
# Seconds to pause at exit after a failed step, once every blocked call has ended (point 4).
SETTLE_S = 0.5

_failed_step = False
# Collectives (objects with ``wait()``) a failed step left unfinished. Held until the
# interpreter ends, so their last reference is not dropped on one of gloo's threads.
_abandoned: list[Any] = []
_abandoned_waited = 0


def note_failed_step() -> None:
    """Record that a step failed in this process: exit then follows the module's protocol."""
    global _failed_step
    _failed_step = True


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


def _settle() -> None:
    global _failed_step
    if _failed_step:
        _failed_step = False
        time.sleep(SETTLE_S)


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
    pending = _join(pending, _AFTER_FINALIZE_S)
    if not pending:
        _settle()
        return
    status = exit_status()
    try:
        sys.stderr.write(
            f"{who}: thread(s) {names} still blocked {_AFTER_FINALIZE_S:.0f} s after MPI "
            f"finalized; leaving with status {status} without interpreter finalization\n"
        )
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)
