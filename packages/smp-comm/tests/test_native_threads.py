"""The exit pause's wait for gloo's worker threads (smp_comm.native_threads)."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
from smp_comm import native_threads
from smp_comm.native_threads import GLOO_THREAD, Sample, read_threads, wait_until_quiet


def _scripted(samples: list[Sample]):  # type: ignore[no-untyped-def]
    """A sampler that returns ``samples`` in turn (the last one for ever), counting calls."""
    calls = []

    def sample() -> Sample:
        calls.append(1)
        return samples[min(len(calls) - 1, len(samples) - 1)]

    return sample, calls


def test_no_gloo_threads_no_wait() -> None:
    sample, calls = _scripted([{}])
    assert wait_until_quiet(5.0, poll_s=0.001, sample=sample)
    assert len(calls) == 1


def test_quiet_only_after_the_threads_stop_running() -> None:
    """Running (its CPU time moves, or state R) resets the count: quiet after 3 still polls."""
    running = [{"7": ("R", 10)}, {"7": ("S", 20)}, {"7": ("S", 30)}, {"7": ("R", 30)}]
    still = [{"7": ("S", 30)}] * 3
    sample, calls = _scripted([*running, *still])
    assert wait_until_quiet(5.0, poll_s=0.001, quiet_polls=3, sample=sample)
    assert len(calls) == len(running) + len(still)


def test_never_quiet_ends_at_the_bound() -> None:
    ticks = iter(range(10**9))

    def busy() -> Sample:
        return {"7": ("S", next(ticks))}

    assert not wait_until_quiet(0.05, poll_s=0.001, sample=busy)


def test_unreadable_threads_sleep_the_whole_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    slept = []
    monkeypatch.setattr(native_threads.time, "sleep", slept.append)
    assert not wait_until_quiet(0.7, sample=lambda: None)
    assert slept == [0.7]


def _name_this_thread(name: str) -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: the thread's comm


def test_a_real_busy_thread_is_waited_for() -> None:
    """A thread named like gloo's that spins for a while: the wait returns only after it
    has stopped (and is asleep), well inside the bound."""
    named = threading.Event()
    done = threading.Event()
    release = threading.Event()

    def spin() -> None:
        _name_this_thread(GLOO_THREAD)
        named.set()
        end = time.monotonic() + 0.3
        x = 0
        while time.monotonic() < end:
            x += 1
        done.set()
        release.wait()  # asleep from here (state S)

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    named.wait()
    try:
        found = read_threads()
        assert found is not None and len(found) == 1, found
        assert wait_until_quiet(10.0)
        assert done.is_set(), "the wait ended while the thread still ran"
    finally:
        release.set()
        t.join()
