"""The token baton: a binary semaphore that any thread may release."""

from __future__ import annotations

import threading
import time

from smp_pipeline.worker import Baton


def test_starts_taken_and_times_out() -> None:
    b = Baton()
    t0 = time.monotonic()
    assert b.acquire(timeout=0.05) is False
    assert time.monotonic() - t0 >= 0.04
    assert b.acquire(blocking=False) is False


def test_release_from_another_thread_wakes_the_waiter() -> None:
    b = Baton()
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(b.acquire(timeout=5)))
    waiter.start()
    time.sleep(0.02)
    b.release()
    waiter.join(5)
    assert got == [True]
    assert b.acquire(blocking=False) is False  # taking it cleared it


def test_double_release_is_absorbed() -> None:
    b = Baton()
    b.release()
    b.release()  # no error: still one pass
    assert b.acquire(blocking=False) is True
    assert b.acquire(blocking=False) is False
