"""Where a rank waits inside smp, and waits that give way to a peer's failure.

The failure channel (:mod:`smp_torch.watch`) learns of a failure on its own thread; these
are the waits that notice it: each polls a ``check`` callable (``FailureWatch.check``, one
attribute read) between short sleeps instead of blocking, so a rank raises
:class:`~smp_torch.errors.PeerFailedError` where it waits rather than in a collective the
failed rank never joins. :class:`Waiting` labels what the rank is doing meanwhile, for the
error messages and the deadlines of the channel.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

import torch.distributed as dist
from smp_comm.shutdown import settle_at_exit, wait_for_threads_at_exit

__all__ = [
    "Located",
    "Waiting",
    "run_raising",
    "step_threads",
    "wait_for_step_threads",
    "wait_request",
    "wait_work",
]

_STEP_POLL_S = 2e-3
# Step threads that have not ended (a step that raised elsewhere leaves one blocked).
_RUNNING: set[threading.Thread] = set()


@atexit.register
def wait_for_step_threads() -> None:
    """At exit: wait until no step thread is blocked any more, then pause briefly so gloo's
    threads drop the asynchronous collectives smp ran while the interpreter still runs them
    (see :mod:`smp_comm.shutdown`)."""
    if dist.is_available() and dist.is_initialized():
        settle_at_exit()
    wait_for_threads_at_exit(list(_RUNNING), "smp-torch")


class Located(Protocol):
    """What :class:`Waiting` labels: anything with ``where`` and ``where_since`` (when the
    current label was set, ``time.monotonic()``)."""

    where: str | None
    where_since: float


class Waiting:
    """``with watch.waiting(label):`` sets ``holder.where`` to ``label`` for the block and
    tags an exception leaving it with the innermost label (a class, not a generator: it runs
    every step)."""

    __slots__ = ("holder", "label", "previous", "previous_since")

    def __init__(self, holder: Located, label: str) -> None:
        self.holder = holder
        self.label = label
        self.previous: str | None = None
        self.previous_since = 0.0

    def __enter__(self) -> None:
        self.previous, self.previous_since = self.holder.where, self.holder.where_since
        self.holder.where, self.holder.where_since = self.label, time.monotonic()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # (Back outside: the time outside is counted from now.)
        self.holder.where = self.previous
        self.holder.where_since = self.previous_since if self.previous is not None else time.monotonic()
        if exc is not None and not hasattr(exc, "_smp_where"):
            try:  # the innermost label: what the rank did when it raised (for its notice)
                exc._smp_where = self.label  # type: ignore[attr-defined]
            except AttributeError:
                pass


def step_threads() -> list[threading.Thread]:
    """The step threads that run now (for stall reports)."""
    return list(_RUNNING)


def run_raising(fn: Callable[[], None], check: Callable[[], None]) -> None:
    """Run ``fn`` on a helper thread; re-raise its exception, or whatever ``check`` raises
    as soon as it does (the helper thread may stay blocked in a collective a failed rank
    never joins: it is waited for at exit, :func:`wait_for_step_threads`)."""
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
        thread.join(_STEP_POLL_S)
        if thread.is_alive():
            check()
    if "error" in box:
        raise box["error"]


def wait_request(request: Any, check: Callable[[], None]) -> None:
    """Wait for an MPI request, calling ``check`` between polls."""
    pause = 5e-5  # usually done within microseconds: back off from short pauses
    while not request.Test():
        check()
        time.sleep(pause)
        pause = min(_STEP_POLL_S, pause * 2)


def wait_work(work: Any, check: Callable[[], None], cuda: bool = False) -> None:
    """Wait for a ``torch.distributed`` collective (``async_op=True``), calling ``check``
    between polls. ``cuda``: NCCL work, waited for as usual (``wait()`` only orders the
    stream; polling would block the CPU on the device)."""
    if not cuda:
        pause = 5e-5
        while not work.is_completed():
            check()
            time.sleep(pause)
            pause = min(2e-4, pause * 2)  # (bounds the latency polling adds)
    work.wait()
