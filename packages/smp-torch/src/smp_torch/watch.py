"""Failure notices between ranks for steps that run without a pipeline runtime (pp = 1).

With tensor parallelism a step runs collectives inside forward and backward: if one rank's
step function raises, its tensor-parallel peers would wait in such a collective forever
(and the failing rank in the step's outcome agreement). So with tp > 1 the step runs on a
helper thread while the calling thread watches a private communicator; the outcome agreement
(:meth:`smp_torch.context.SMPContext.agree`, every step at every pipeline degree) polls the same
communicator for notices. A rank whose step
raises sends a notice to every other rank and raises at once; every other rank raises
:class:`StepFailedElsewhere` naming it — whether it is blocked in a collective or already
waiting for the outcome. (The pipeline runtime has its own abort messages for pp > 1.)

After such a failure the blocked helper thread stays blocked and the job's collectives are
unusable: the error is for ending the job cleanly, not for carrying on. At exit, a helper
thread still blocked is waited for (the collective fails once the peers' processes end)
before the interpreter finalizes, which would otherwise abort the process (see
:mod:`smp_comm.shutdown`).
"""

from __future__ import annotations

import array
import atexit
import threading
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI
from smp_comm.shutdown import wait_for_threads_at_exit

from smp_torch.errors import SMPError

_NOTICE_TAG = 7
_POLL_S = 2e-3
# Step threads that have not ended (a step that raised elsewhere leaves one blocked).
_RUNNING: set[threading.Thread] = set()


@atexit.register
def wait_for_step_threads() -> None:
    """At exit: wait until no step thread is blocked any more (see the module docstring)."""
    wait_for_threads_at_exit(list(_RUNNING), "smp-torch")


class StepFailedElsewhere(SMPError):
    """The step raised on another rank (named in the message)."""


class StepWatch:
    """Runs steps on a helper thread and turns another rank's failure into an error here."""

    def __init__(self, world: Any) -> None:
        self.comm = world.Dup()  # collective: every rank builds one
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def run(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a helper thread; re-raise its exception, or raise
        :class:`StepFailedElsewhere` as soon as another rank reports a failure."""
        box: dict[str, BaseException] = {}

        def target() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
                box["error"] = exc
            finally:
                _RUNNING.discard(threading.current_thread())

        thread = threading.Thread(target=target, name="smp-torch-step", daemon=True)
        _RUNNING.add(thread)
        thread.start()
        while thread.is_alive():
            thread.join(_POLL_S)
            if thread.is_alive():
                self.check()
        if "error" in box:
            raise box["error"]

    def check(self) -> None:
        """Raise :class:`StepFailedElsewhere` if another rank sent a failure notice."""
        status = MPI.Status()
        if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_NOTICE_TAG, status=status):
            notice = self.comm.recv(source=status.Get_source(), tag=_NOTICE_TAG)
            raise StepFailedElsewhere(
                f"the step failed on rank {notice['rank']}: {notice['error']}"
            )

    def notify(self, error: BaseException) -> None:
        """Tell every other rank that this rank's step raised ``error`` (waits up to 5 s for
        the notices to leave, so they are not lost if this process exits next)."""
        text = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        notice = {"rank": self.rank, "error": text}
        requests = [
            self.comm.isend(notice, dest=r, tag=_NOTICE_TAG)
            for r in range(self.size)
            if r != self.rank
        ]
        deadline = time.monotonic() + 5.0
        while requests and time.monotonic() < deadline:
            requests = [r for r in requests if not r.Test()]
            if requests:
                time.sleep(_POLL_S)

    def allreduce_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over all ranks (the step's outcome
        agreement), raising :class:`StepFailedElsewhere` instead if a rank reports a failure
        meanwhile."""
        send = array.array("q", values)
        recv = array.array("q", [0] * len(values))
        request = self.comm.Iallreduce(send, recv, op=MPI.MAX)
        pause = 5e-5  # usually done within microseconds: back off from short pauses
        while not request.Test():
            self.check()
            time.sleep(pause)
            pause = min(_POLL_S, pause * 2)
        return [int(v) for v in recv]
