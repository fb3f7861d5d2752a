"""Process exit while a helper thread is still inside a native blocking call.

CPython 3.11–3.13 stop a daemon thread that tries to take the GIL after finalization began
by calling ``pthread_exit``. If that thread was in C++ code that released the GIL (a
``torch.distributed`` collective's ``wait``, say), the forced unwind crosses a ``noexcept``
frame and the C++ runtime aborts the whole process ("terminate called without an active
exception", exit status 6), after the user's program has already finished.

A thread is left in such a call only after a failed step: a peer that raised never joined
the collective. Gloo releases the call only when the peer's *process* ends (destroying or
aborting the group on the peer does not close its connections), and a peer that exits
normally first waits in ``MPI_Finalize`` for every rank, this one included. So, at exit,
with a thread still blocked after a short wait:

1. close the live communicators and finalize MPI here, which lets the exiting peers
   finish and end their processes;
2. wait again: their ends release the blocked call, the thread ends, and the interpreter
   finalizes normally (mpi4py sees MPI already finalized);
3. if a thread is still blocked after that (a peer that keeps running), leave at once
   with the status Python would have used, without interpreter finalization.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable

__all__ = ["exit_status", "wait_for_threads_at_exit"]

# Seconds to wait for blocked threads: before finalizing MPI (a peer's exit may already have
# released them), and after (the peers leave MPI_Finalize together with this rank).
_BEFORE_FINALIZE_S = 1.0
_AFTER_FINALIZE_S = 3.0


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
    pending = _join([t for t in threads if t is not threading.current_thread()], _BEFORE_FINALIZE_S)
    if not pending:
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
