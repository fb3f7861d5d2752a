"""The failure channel's parts, in one process (the jobs are in tests/faults)."""

from __future__ import annotations

import pickle
import signal
import subprocess
import time

import pytest
import smp_torch as smp
from smp_torch.errors import PeerFailedError, SMPError
from smp_torch.liveness import BEAT_PERIOD_S, BEAT_TIMEOUT_S, Heartbeats, PeerProcesses, ProcessInfo


def test_peer_failed_error_names_both_ranks_and_pickles() -> None:
    err = PeerFailedError(1, "RuntimeError: boom", "outside smp, after step 2", "in step 3", 0)
    assert isinstance(err, SMPError) and smp.PeerFailedError is PeerFailedError
    text = str(err)
    assert text.startswith("rank 1 failed (outside smp, after step 2): RuntimeError: boom")
    assert text.endswith("rank 0 was in step 3")
    back = pickle.loads(pickle.dumps(err))
    assert (back.rank, back.error, back.waiting_for, str(back)) == (1, err.error, "in step 3", text)
    own = PeerFailedError(2, "ValueError: x", "in thread 'loader'", "outside smp", 2)
    assert str(own).startswith("rank 2 (this rank) failed (in thread 'loader')")


def test_peer_processes_sees_a_killed_process_even_unreaped() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        me = ProcessInfo.here()
        stat_start = PeerProcesses(0, [me, me], [0]).infos[0].start
        assert stat_start is not None
        child_info = ProcessInfo(me.host, child.pid, _start_of(child.pid))
        wrong = ProcessInfo(me.host, child.pid, (child_info.start or 0) + 1)  # a reused pid
        peers = PeerProcesses(0, [me, child_info, wrong], [0, 1, 2])
        assert peers.checked == [1]  # the pid that names another process is not checked
        assert peers.ended() == []
        alone = PeerProcesses(0, [me, child_info], [0, 1])
        assert not alone.all_ended(2)
        child.kill()
        deadline = time.monotonic() + 5
        while not peers.ended() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peers.ended() == [1]  # a zombie (not yet reaped) counts as ended
        assert alone.all_ended(2)
        assert not peers.all_ended(3)  # rank 2 cannot be seen: not known to have ended
    finally:
        child.kill()
        child.wait()
    assert peers.ended() == [1]


def test_peer_processes_polls_pidfds_not_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher's every-25-ms question (has a peer ended?) reads no ``/proc`` file where
    the kernel has pidfds: one poll (a /proc read costs ~120-140 µs of CPU on cold caches,
    docs/performance.md). Counts the reads; the answer is the same as the /proc check's."""
    import os

    from smp_comm import processes

    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open here")
    child = subprocess.Popen(["sleep", "30"])
    try:
        me = ProcessInfo.here()
        info = ProcessInfo(me.host, child.pid, _start_of(child.pid))
        peers = PeerProcesses(0, [me, info], [0, 1])
        reads = []
        real = processes._stat
        monkeypatch.setattr(processes, "_stat", lambda pid: reads.append(pid) or real(pid))
        assert [peers.ended() for _ in range(20)] == [[]] * 20
        assert reads == []  # old behaviour: one /proc read per peer and call (20)
        child.kill()
        child.wait()  # reaped too: the pid may be anyone's now; the pidfd still says ended
        assert peers.ended() == [1] and reads == []
    finally:
        child.kill()
        child.wait()


def test_peer_processes_tells_a_stopped_process_and_its_cpu_time() -> None:
    """What the frozen-rank check reads (issue 49): a stopped peer's state is ``T`` and it
    uses no CPU time; a spinning one's CPU time grows; ``kill`` ends a checked peer."""
    me = ProcessInfo.here()
    spin = subprocess.Popen(["python3", "-c", "while True: pass"])
    try:
        info = ProcessInfo(me.host, spin.pid, _start_of(spin.pid))
        peers = PeerProcesses(0, [me, info], [0, 1])
        before = peers.cpu_ticks(1)
        time.sleep(0.5)
        after = peers.cpu_ticks(1)
        assert before is not None and after is not None and after > before
        assert peers.state(1) in ("R", "S")
        spin.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while peers.state(1) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peers.state(1) == "T"
        stopped = peers.cpu_ticks(1)
        time.sleep(0.3)
        assert peers.cpu_ticks(1) == stopped
        assert peers.kill(1)
        spin.wait(5)
        assert peers.state(1) is None and peers.cpu_ticks(1) is None and not peers.kill(1)
    finally:
        spin.kill()
        spin.wait()


def _start_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    return int(raw[raw.rfind(")") + 2 :].split()[19])


def test_heartbeat_ring_between_nodes() -> None:
    groups = [[3, 4], [0, 1], [2]]  # the ring, node by node: 0 1 2 3 4
    assert Heartbeats(1, groups, 0.0).active  # every rank beats (issue 49: frozen ranks)
    assert not Heartbeats(0, [[0]], 0.0).active  # alone: nothing to watch
    hb = Heartbeats(0, groups, 0.0)
    assert (hb.send_to, hb.watched, hb.watched_group, hb.same_node) == (1, 4, [3, 4], False)
    assert hb.limit == BEAT_TIMEOUT_S
    assert hb.beat_due(0.0) and not hb.beat_due(0.1) and hb.beat_due(BEAT_PERIOD_S + 0.01)
    t = 0.0
    while t < BEAT_TIMEOUT_S - 0.5:
        t += 0.5
        assert hb.silent(t) is None
    hb.heard(4, False, t)
    hb.heard(3, False, t + 3)  # not the watched rank: ignored
    heard, silent = t, None
    while silent is None and t < heard + 2 * BEAT_TIMEOUT_S:
        t += 0.25  # the watcher's turns (far apart, but not a stall)
        silent = hb.silent(t)
    assert silent == 4 and heard + BEAT_TIMEOUT_S < t <= heard + BEAT_TIMEOUT_S + 0.25
    assert hb.silent(t + 0.25) is None  # reported once
    assert hb.beat_due(t + 1.0)  # ... and this rank still beats (it lives)

    stalled = Heartbeats(0, groups, 0.0)
    assert stalled.silent(0.5) is None
    assert stalled.silent(9.0) is None  # this rank did not run for 8.5 s: not the peer's fault
    bye = Heartbeats(0, groups, 0.0)
    bye.heard(4, True, 1.0)
    assert bye.silent(60.0) is None


def test_heartbeat_from_a_rank_of_this_node_is_silent_after_timeout_s() -> None:
    """A rank of the same node is watched too: its silence for ``timeout_s`` (not the
    node timeout) means its process is frozen (issue 49)."""
    hb = Heartbeats(1, [[0, 1, 2]], 0.0, frozen_after_s=8.0)
    assert (hb.send_to, hb.watched, hb.watched_group, hb.same_node) == (2, 0, [0], True)
    t, silent = 0.0, None
    while silent is None and t < 20:
        t += 0.25
        silent = hb.silent(t)
    assert silent == 0 and 8.0 < t <= 8.25


class _Work:
    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.waited = False

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls <= 0

    def wait(self) -> None:
        self.waited = True


def test_watch_raises_where_the_rank_waits() -> None:
    from mpi4py import MPI
    from smp_torch.watch import Failure, FailureWatch

    watch = FailureWatch(MPI.COMM_SELF)
    try:
        watch.check()  # nothing known: returns
        work = _Work(5)
        watch.wait_work(work)
        assert work.waited
        with pytest.raises(KeyError) as info:
            with watch.waiting("in step 1, running the step function"):
                assert watch.where == "in step 1, running the step function"
                raise KeyError("x")
        assert watch.where is None
        assert info.value._smp_where == "in step 1, running the step function"  # type: ignore[attr-defined]
        watch.step = 2
        watch.record(Failure(5, "RuntimeError: boom", "outside smp, after step 2"))
        with watch.waiting("in smp.barrier(WORLD)"):
            with pytest.raises(PeerFailedError, match="rank 0 was in smp.barrier") as err:
                watch.wait_work(_Work(10**9))
        assert err.value.rank == 5 and watch.delivered
        with pytest.raises(PeerFailedError, match="outside smp, after step 2$"):
            watch.begin_step()
    finally:
        watch.close()
