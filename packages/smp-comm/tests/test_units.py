"""In-process unit tests: serialization, the region allocator, settings, a self-send."""

from __future__ import annotations

import dataclasses
import select
from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from smp_comm import doorbell
from smp_comm.alloc import RangeAllocator
from smp_comm.doorbell import Doorbells, doorbells_available
from smp_comm.serialize import ALIGN, new_buffers, pack, unpack
from smp_comm.settings import CommSettings, parse_bytes


def roundtrip(obj):
    """pack -> copy each payload into fresh buffers -> unpack (what every path does)."""
    packed = pack(obj)
    finals, views = new_buffers(packed.stubs, rank=0)
    for src, dst in zip(packed.sources, views):
        dst[:] = src
    return unpack(packed.skeleton, finals), packed


Point = namedtuple("Point", "x y")


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: list


def test_every_dtype_and_layout_roundtrips() -> None:
    base = torch.randn(4, 6)
    obj = {
        "bf16": base.to(torch.bfloat16).requires_grad_(),
        "t": base.t(),
        "neg": base.neg(),  # ordinary tensor
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "zero": torch.empty(0, 5, dtype=torch.float16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "bool": base > 0,
        "np": np.arange(10, dtype=np.float32)[::3],
        "np0": np.float64(2.5),
        "nt": Point(torch.ones(2), [torch.zeros(1)]),
        "dc": Frozen(torch.arange(3), [np.ones((2, 2))]),
    }
    got, packed = roundtrip(obj)
    assert len(packed.stubs) == 12 and all(s.offset % ALIGN == 0 for s in packed.stubs)
    for k in ("bf16", "t", "neg", "conj", "zero", "scalar", "bool"):
        want = obj[k].detach().resolve_conj()
        assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
        assert torch.equal(got[k], want), k
        assert got[k].is_contiguous(), k
    assert got["bf16"].requires_grad is False  # finish_tensor restores it, see below
    assert packed.stubs[0].requires_grad and packed.stubs[0].dtype == "bfloat16"
    assert np.array_equal(got["np"], obj["np"]) and got["np0"] == 2.5
    assert isinstance(got["nt"], Point) and torch.equal(got["nt"].y[0], torch.zeros(1))
    assert isinstance(got["dc"], Frozen) and torch.equal(got["dc"].a, torch.arange(3))


def test_requires_grad_and_shared_references() -> None:
    from smp_comm.serialize import finish_tensor

    t = torch.randn(3, requires_grad=True)
    packed = pack([t, t, {"again": t}])
    assert len(packed.stubs) == 1
    finals, views = new_buffers(packed.stubs, 0)
    views[0][:] = packed.sources[0]
    finals = [finish_tensor(s, v) for s, v in zip(packed.stubs, finals)]
    got = unpack(packed.skeleton, finals)
    assert got[0] is got[1] is got[2]["again"] and got[0].requires_grad


def test_objects_without_raw_bytes_are_pickled_whole() -> None:
    got, packed = roundtrip({"o": np.array([1, "a"], dtype=object), "s": "x"})
    assert packed.stubs == [] and got["o"].tolist() == [1, "a"] and got["s"] == "x"


def test_allocator_first_fit_and_coalescing() -> None:
    a = RangeAllocator(base=4096, size=4 * 4096)
    r1, r2, r3 = a.reserve(1), a.reserve(4096), a.reserve(8000)
    assert (r1, r2, r3) == (4096, 8192, 12288)
    assert a.reserve(1) is None  # full
    a.release(r2)
    assert a.reserve(5000) is None  # one free page only
    a.release(r1)
    assert a.reserve(8192) == 4096  # two freed neighbours merged
    assert RangeAllocator(0, 0).reserve(1) is None


def test_settings_kwargs_env_and_errors(monkeypatch) -> None:
    assert parse_bytes("64M", "x") == 64 << 20 and parse_bytes("1.5K", "x") == 1536
    with pytest.raises(ValueError, match="SMP_COMM_BUFFER_BYTES"):
        parse_bytes("lots", "SMP_COMM_BUFFER_BYTES")
    monkeypatch.setenv("SMP_COMM_BUFFER_BYTES", "2M")
    monkeypatch.setenv("SMP_COMM_DISABLE", "rma")
    monkeypatch.setenv("SMP_COMM_NODE_ID", "node{rank}")
    s = CommSettings.resolve(rank=3)
    assert s.buffer_bytes == 2 << 20 and s.disable == {"rma"} and s.node_id == "node3"
    s = CommSettings.resolve(rank=3, buffer_bytes=0, disable=(), node_id="n")
    assert s.buffer_bytes == 0 and s.disable == set() and s.node_id == "n"
    with pytest.raises(ValueError, match="mpi"):
        CommSettings.resolve(rank=0, disable="mpi")


def test_poll_spin_auto_spins_only_where_every_rank_has_a_core(monkeypatch) -> None:
    from mpi4py import MPI
    from smp_comm import Communicator
    from smp_comm.settings import SPIN_S, auto_poll_spin

    assert auto_poll_spin(2, 2) == SPIN_S and auto_poll_spin(4, 2) == 0.0
    assert auto_poll_spin(8, None) == SPIN_S  # (core count unknown: spin, as before)
    monkeypatch.delenv("SMP_COMM_POLL_SPIN", raising=False)
    assert CommSettings.resolve(rank=0).poll_spin is None  # "auto" until a Communicator
    with Communicator(MPI.COMM_SELF) as comm:  # one rank on this node
        assert comm.settings.poll_spin == SPIN_S
    monkeypatch.setattr("os.cpu_count", lambda: 0)  # a node with more ranks than cores
    with Communicator(MPI.COMM_SELF) as comm:
        assert comm.settings.poll_spin == 0.0
        h = comm.irecv(0, 2)  # a wait that sleeps at once still gets its message
        comm.isend(torch.ones(3), dest=0, tag=2).wait(10)
        assert torch.equal(h.wait(10)[0], torch.ones(3))
    monkeypatch.setenv("SMP_COMM_POLL_SPIN", "0.0005")  # an explicit value wins
    with Communicator(MPI.COMM_SELF) as comm:
        assert comm.settings.poll_spin == 0.0005
    monkeypatch.setenv("SMP_COMM_POLL_SPIN", "auto")
    assert CommSettings.resolve(rank=0).poll_spin is None


def test_self_send_on_comm_self() -> None:
    from mpi4py import MPI
    from smp_comm import ANY_SOURCE, Communicator

    with Communicator(MPI.COMM_SELF) as comm:
        h = comm.irecv(ANY_SOURCE, 3)
        comm.isend({"x": torch.arange(5000.0)}, dest=0, tag=3).wait(10)
        obj, src, tag = h.wait(10)
        assert torch.equal(obj["x"], torch.arange(5000.0)) and (src, tag) == (0, 3)
        assert comm.path_to(0) == "mpi"
    assert comm.closed


def test_constructor_settings_and_overrides(monkeypatch) -> None:
    """Every CommSettings field is a keyword (caller_copy_bytes too); unknown ones are named;
    ``settings=`` is a starting point that the keywords override."""
    from mpi4py import MPI
    from smp_comm import Communicator

    with pytest.raises(TypeError, match="'buffer_byte'"):
        Communicator(MPI.COMM_SELF, buffer_byte="1M")
    monkeypatch.setenv("SMP_COMM_INLINE_BYTES", "2K")
    with Communicator(MPI.COMM_SELF, caller_copy_bytes="64K", doorbell=False) as comm:
        assert comm.settings.caller_copy_bytes == 64 << 10
        assert comm.settings.inline_bytes == 2 << 10  # the environment still applies
        assert not comm.settings.doorbell
    base = CommSettings(inline_bytes=100, poll_spin=0.0)
    with Communicator(MPI.COMM_SELF, base, caller_copy_bytes=None, poll_spin=0.001) as comm:
        assert comm.settings.inline_bytes == 100  # from base, not the environment
        assert comm.settings.caller_copy_bytes == base.caller_copy_bytes  # None: not overridden
        assert comm.settings.poll_spin == 0.001
        h = comm.irecv(0, 1)
        comm.isend([torch.ones(300)], dest=0, tag=1).wait(10)  # > inline_bytes: not inline
        assert torch.equal(h.wait(10)[0][0], torch.ones(300))


def test_wire_header_is_a_plain_tuple_read_as_typed() -> None:
    import pickle

    from smp_comm.wire import Header

    packed = pack({"x": np.arange(3)})
    wire = (5, 7, "mpi", -1, packed.skeleton, packed.stubs, [b"abc"])
    body = pickle.loads(pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(body) is tuple  # what travels: no class reference in the pickle
    h = Header.of(body)
    assert (h.msg_id, h.tag, h.path, h.region, h.inline) == (5, 7, "mpi", -1, [b"abc"])
    assert h.skeleton is body[4] and h.stubs == packed.stubs and h == body


def test_backlog_thread_lets_go_of_each_item_before_waiting_for_the_next() -> None:
    """A handled item is not kept alive by the serving thread while it waits: a received
    message there holds zero-copy views, whose buffer region is freed only when they die
    (a thread that held its last item kept a 64 MiB region until the next message came)."""
    import gc
    import queue
    import threading
    import time
    import weakref

    from smp_comm.state import STOP, Backlog

    class Item:
        pass

    backlog, q = Backlog(), queue.SimpleQueue()
    handled = threading.Event()
    thread = threading.Thread(target=backlog.serve, args=(Backlog.POSTPROC, q, lambda item: handled.set()))
    thread.start()
    try:
        item = Item()
        alive = weakref.ref(item)
        backlog.put(Backlog.POSTPROC, q, item)
        del item
        assert handled.wait(10)
        deadline = time.monotonic() + 5
        while alive() is not None and time.monotonic() < deadline:
            gc.collect()  # (no cycle here: refcounting alone frees it once the thread lets go)
        assert alive() is None, "the serving thread still holds the item it handled"
        assert backlog.counts[Backlog.POSTPROC] == 0
    finally:
        q.put(STOP)
        thread.join(10)


def test_receive_buffers_ask_for_huge_pages() -> None:
    """Large receive buffers are advised huge pages before their first touch (a fresh 64 MiB
    torch.empty filled in 31 ms with 4 KiB pages, 6.7 ms with 2 MiB ones); small ones and
    unaligned edges are left alone."""
    import sys

    from smp_comm import hugepages

    small = torch.empty(hugepages.MIN_BYTES // 2, dtype=torch.uint8)
    assert not hugepages.advise_huge_pages(small.data_ptr(), small.numel())
    import os

    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):  # a kernel with THP
        big = torch.empty(hugepages.MIN_BYTES * 2, dtype=torch.uint8)
        assert hugepages.advise_huge_pages(big.data_ptr(), big.numel())
        # odd addresses and lengths: only the whole pages inside are advised (no EINVAL)
        assert hugepages.advise_huge_pages(big.data_ptr() + 1, big.numel() - 4097)
    if not sys.platform.startswith("linux"):
        return
    calls = []
    real = hugepages._MADVISE
    try:
        hugepages._MADVISE = lambda a, n, advice: calls.append((a, n, advice)) or 0
        packed = pack(torch.zeros(hugepages.MIN_BYTES))  # 16 MiB of float32
        new_buffers(packed.stubs, rank=0)
    finally:
        hugepages._MADVISE = real
    assert len(calls) == 1 and calls[0][1] >= packed.stubs[0].nbytes - 2 * 4096, calls


def test_failed_step_hooks_run_and_never_mask_the_error(monkeypatch) -> None:
    """note_failed_step runs every on_failed_step hook (the smp backend's groups mark
    themselves failed there); a hook that raises does not stop the others or escape."""
    from smp_comm import shutdown

    monkeypatch.setattr(shutdown, "_failure_hooks", [])
    calls: list[str] = []

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("hook failed")

    shutdown.on_failed_step(broken)
    shutdown.on_failed_step(lambda: calls.append("second"))
    shutdown.note_failed_step()
    assert calls == ["broken", "second"]


@pytest.mark.skipif(not doorbells_available(), reason="doorbells need Linux and /dev/shm")
def test_a_ring_wakes_the_waiting_thread_first_and_nobody_while_one_polls() -> None:
    from mpi4py import MPI

    bell = Doorbells(MPI.COMM_SELF)

    def rung() -> tuple[bool, bool]:
        """(tracker's socket, waiter's socket) got a datagram; both drained."""
        got = tuple(select.select([s], [], [], 0)[0] != [] for s in (bell._sock, bell._waiter_sock))
        for s in (bell._sock, bell._waiter_sock):
            doorbell._drain(s)
        return got  # type: ignore[return-value]

    try:
        me = bell.rank * doorbell._LINE
        bell.ring(0)
        assert rung() == (False, False)  # nobody asleep: nothing sent
        bell._flags[me + doorbell.TRACKER] = 1
        bell.ring(0)
        assert rung() == (True, False)  # the tracker sleeps
        bell._flags[me + doorbell.WAITER] = 1
        bell.ring(0)
        assert rung() == (False, True)  # the waiting thread too: it takes the ring
        bell.polling(True)
        bell.ring(0)
        assert rung() == (False, False) and bell.polled == 1  # a thread polls: it will see it
        bell.polling(False)
        bell.wake_waiter()
        assert rung() == (False, True)
        # A doze whose re-check finds the wait over does not sleep, and clears the byte.
        seen = []
        bell.doze(lambda: seen.append(bell._flags[me + doorbell.WAITER]) or True, timeout=5.0)
        assert seen == [1] and bell.dozes == 0 and bell._flags[me + doorbell.WAITER] == 0
        bell.wake_waiter()  # nobody dozes: nothing sent
        assert rung() == (False, False)
        # A doze that finds nothing sleeps until rung (the datagram is already there).
        bell._send(bell._waiter_addr[0])
        bell.doze(lambda: False, timeout=5.0)
        assert (bell.dozes, bell.rung) == (1, 1) and rung() == (False, False)  # drained
    finally:
        bell.close()


def test_a_rung_tracker_sleeps_again_after_its_last_look() -> None:
    """A ring wakes the tracker for a round that takes the message; it then goes back to
    sleep through its last look (two rounds): 3 rounds per wake-up, where an extra round
    after the busy one made 4 (each round's MPI calls hand the GIL over twice or more)."""
    import threading

    from smp_comm.progress import Progress

    rounds: list[bool] = []
    script = [True, False, False, False]  # (the ring's message, then nothing)

    class Bell:
        def __init__(self) -> None:
            self.sleeps = 0

        def sleep(self, recheck_busy: Any) -> None:
            if not recheck_busy():
                self.sleeps += 1
                progress._stop.set()  # (the test ends at the first real sleep)

    progress = Progress.__new__(Progress)
    progress.lock = threading.Lock()
    progress.bell = Bell()  # type: ignore[assignment]
    progress._stop, progress._wake = threading.Event(), threading.Event()
    progress._active, progress._spinners, progress._lazy_off = [], [], False

    def poll_once() -> bool:
        rounds.append(script[len(rounds)] if len(rounds) < len(script) else False)
        return rounds[-1]

    progress.poll_once = poll_once  # type: ignore[method-assign]
    progress._tracker_loop()
    assert progress.bell.sleeps == 1  # type: ignore[attr-defined]
    assert rounds == [True, False, False]  # busy, then the last look's two rounds


def test_a_last_look_takes_its_second_round_even_after_a_busy_first() -> None:
    """The second round of a last look surfaces a message that landed while nobody made an
    MPI call; a first round busy with something else (a FREE, another handle's message) must
    not skip it, or a waiting thread sleeps on unrung with its message already there."""
    from smp_comm.progress import Progress

    rounds: list[bool] = []
    script = [True, False]  # the first round finds something else; the second, ours

    progress = Progress.__new__(Progress)

    def poll_once() -> bool:
        rounds.append(script[len(rounds)])
        return rounds[-1]

    progress.poll_once = poll_once  # type: ignore[method-assign]
    assert progress.last_look() is True
    assert rounds == [True, False]  # both rounds ran
