"""The handle of one collective of an ``smp`` group (:class:`SmpWork`).

A collective runs on its group's thread and completes its handle there, or ran already on
the caller's thread (the express and one-step paths), whose handle is made complete.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
from torch._C._distributed_c10d import Work
from torch.futures import Future

__all__ = ["SmpWork"]

_ALREADY_DONE = threading.Event()  # shared by every handle made complete
_ALREADY_DONE.set()
_DONE_FUTURE_LOCK = threading.Lock()  # for finished handles' futures, made rarely


class SmpWork(Work):
    """The handle of one collective of an :class:`SmpProcessGroup` (completed by its thread,
    or already complete when the collective ran on the caller's thread)."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._result = result
        self._done = threading.Event()
        self._error: BaseException | None = None
        # Made on first use: most handles are only waited on, and a Future costs microseconds.
        self._future: Future[list[torch.Tensor]] | None = None
        self._future_lock = threading.Lock()

    @classmethod
    def finished(cls, result: list[torch.Tensor], error: BaseException | None) -> SmpWork:
        """A handle of a collective that already ran (on the caller's thread)."""
        work = cls.__new__(cls)
        Work.__init__(work)
        work._result, work._error, work._done = result, error, _ALREADY_DONE
        work._future, work._future_lock = None, _DONE_FUTURE_LOCK
        return work

    def reuse(self, result: list[torch.Tensor]) -> None:
        """Make this finished, successful handle that of another finished collective
        (for a handle no one holds any more)."""
        self._result, self._future = result, None

    def _finish(self, error: BaseException | None) -> None:
        with self._future_lock:
            self._error = error
            self._done.set()
            if self._future is not None:
                self._complete(self._future)

    def _complete(self, future: Future[list[torch.Tensor]]) -> None:
        if self._error is None:
            future.set_result(self._result)
        else:
            future.set_exception(self._error)  # type: ignore[arg-type]

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective finished; raise its error if it failed."""
        if not self._done.is_set():
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
            if not self._done.wait(seconds if seconds else None):
                raise TimeoutError(f"smp backend: collective not done after {seconds} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the collective finished (successfully or not)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """Whether the collective finished without error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The collective's error, if it failed."""
        return self._error

    def get_future(self) -> Future[list[torch.Tensor]]:
        """A future completed with the output tensors (DDP's communication hooks use it)."""
        with self._future_lock:
            if self._future is None:
                self._future = Future()
                if self._done.is_set():
                    self._complete(self._future)
            return self._future

    def result(self) -> list[torch.Tensor]:
        """The output tensors."""
        return self._result
