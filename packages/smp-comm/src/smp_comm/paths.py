"""Persistent receive buffers of the direct paths and the copies in and out of them.

Every rank owns, per direct path, one receive buffer created once (collectively) when the
Communicator starts:

``shm``       a POSIX shared-memory file per rank, mapped once by every node peer (and
              unlinked at once); the sender ``memcpy``\\ s straight into the region it
              reserved, the receiver hands out zero-copy views of it (the region is freed
              when the last view is garbage collected) or, with ``shm_zero_copy=False``,
              copies out;
``rma``       an ``MPI.Win.Allocate`` window over the whole communicator; the sender
              ``Put``\\ s into it inside a passive-target ``Lock``/``Unlock`` epoch;
``cuda_ipc``  a CUDA tensor whose IPC handle every node peer opened once at start.

A receive buffer is split evenly among the peers that may write into it, and each sender
owns the allocator of its slice: reserving room needs no round trip. The receiver gives a
region back with a ``FREE`` control message once it has copied the payload out; the header
(path + region offset) and that ``FREE`` are the handshake both sides agree through.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from smp_comm import cma
from smp_comm.alloc import RangeAllocator
from smp_comm.errors import CommError
from smp_comm.serialize import Packed, TensorStub, new_buffers, torch
from smp_comm.settings import CommSettings

__all__ = ["DirectPaths"]

_PAGE = 4096
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class _RegionView:
    """Exposes ``n`` bytes of a mapping to numpy and is the base of every array made from
    them (numpy would collapse a slice's base to the whole mapping), so a finalizer on it
    runs exactly when the last array or tensor viewing the region is gone."""

    def __init__(self, mem: mmap.mmap, offset: int, n: int) -> None:
        self._anchor = (ctypes.c_char * n).from_buffer(mem, offset)  # pins the mapping
        self.__array_interface__ = {
            "shape": (n,),
            "typestr": "|u1",
            "data": (ctypes.addressof(self._anchor), False),
            "version": 3,
        }


class _Lease:
    """Counts the live views of one zero-copy region; calls ``release`` when none is left."""

    def __init__(self, count: int, release: Callable[[], None]) -> None:
        self._count = count + 1  # +1 until armed(): no release while still building
        self._release = release
        self._lock = threading.Lock()

    def drop(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._release()

    def armed(self) -> None:
        self.drop()


def _cuda_ok(settings: CommSettings) -> bool:
    if "cuda_ipc" in settings.disable or torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver means no CUDA path
        return False


def _slice_of(sender: int, receiver: int, writers: list[int], size: int) -> tuple[int, int]:
    """(base, length) of ``sender``'s slice in ``receiver``'s buffer of ``size`` bytes."""
    if not writers or size <= 0:
        return 0, 0
    length = size // len(writers) // _PAGE * _PAGE
    return writers.index(sender) * length, length


class DirectPaths:
    """The shm / rma / cuda_ipc buffers of one Communicator. Construction and :meth:`close`
    are collective over ``cc`` and run in the same order on every rank."""

    def __init__(self, cc: MPI.Intracomm, settings: CommSettings) -> None:
        self._cc = cc
        #: Payloads this large stream when they find no room (0: never); smp_comm.stream.
        self.stream_min_bytes = settings.stream_min_bytes
        self.rank = rank = cc.Get_rank()
        size = cc.Get_size()
        enabled = {p for p in ("shm", "rma") if p not in settings.disable}
        cuda_ok = _cuda_ok(settings)

        # Node identity: the real shared-memory domain unless overridden.
        real = cc.Split_type(MPI.COMM_TYPE_SHARED)
        real_key = f"host-of-rank-{real.allreduce(rank, op=MPI.MIN)}"
        real.Free()
        info = cc.allgather(
            (
                settings.node_id or real_key,
                enabled,
                settings.buffer_bytes,
                settings.gpu_buffer_bytes,
                cuda_ok,
                settings.shm_zero_copy,
            )
        )
        keys = [i[0] for i in info]
        # Which ranks copy shm payloads out on receipt (smp_comm.stream: worth streaming).
        self._copies_out = [not i[5] for i in info]
        colors = sorted(set(keys))
        self.node_of = keys
        self.node = cc.Split(colors.index(keys[rank]), rank)
        local = [r for r in range(size) if keys[r] == keys[rank]]
        self._node_rank = {r: i for i, r in enumerate(local)}

        def peers(r: int, same_node: bool) -> list[int]:
            return [q for q in range(size) if q != r and (keys[q] == keys[r]) == same_node]

        def host_size(r: int, path: str) -> int:
            same = path == "shm"
            return info[r][2] if path in info[r][1] and peers(r, same) else 0

        def gpu_size(r: int) -> int:
            ok = info[r][4] and any(info[q][4] for q in peers(r, True))
            return info[r][3] if ok else 0

        self._usable: dict[str, set[int]] = {"shm": set(), "rma": set(), "cuda_ipc": set()}
        self._alloc: dict[tuple[str, int], RangeAllocator] = {}
        for dest in range(size):
            if dest == rank:
                continue
            same = keys[dest] == keys[rank]
            for path in ("shm", "rma"):
                if (path == "shm") != same or path not in enabled or path not in info[dest][1]:
                    continue
                self._usable[path].add(dest)
                base, n = _slice_of(rank, dest, peers(dest, same), host_size(dest, path))
                self._alloc[(path, dest)] = RangeAllocator(base, n)
            if same and cuda_ok and info[dest][4]:
                self._usable["cuda_ipc"].add(dest)
                base, n = _slice_of(
                    rank, dest, [q for q in peers(dest, True) if info[q][4]], gpu_size(dest)
                )
                self._alloc[("cuda_ipc", dest)] = RangeAllocator(base, n)

        # shm: one POSIX shared-memory file per rank, mapped by every node peer, unlinked
        # as soon as all have mapped it (so nothing is left in /dev/shm, even on a crash).
        # Python's mmap stays mapped while any array still views it, which makes handing
        # out zero-copy views safe even after close().
        self._shm_views: dict[int, np.ndarray] = {}
        self._shm_maps: dict[int, mmap.mmap] = {}
        self._zero_copy = settings.shm_zero_copy
        if any(host_size(r, "shm") for r in range(size)):
            actual = self._open_shm(host_size(rank, "shm"), local)
            for dest in self._usable["shm"]:
                if actual[dest] != host_size(dest, "shm"):  # that rank could not get it all
                    base, n = _slice_of(rank, dest, peers(dest, True), actual[dest])
                    self._alloc[("shm", dest)] = RangeAllocator(base, n)

        # pull: which node peers may read this rank's memory and whose this rank may read
        # (process_vm_readv; smp_comm.cma), tried once per pair now.
        self.single_copy_min_bytes = settings.single_copy_min_bytes
        pull_on = self.single_copy_min_bytes > 0 and "shm" in enabled
        pids, can_read, read_by = cma.probe(self.node, pull_on)
        self._pids = {r: pids[self._node_rank[r]] for r in local}
        self._pull_from = {r for r in local if can_read[self._node_rank[r]]}
        self._pulled_by = {r for r in local if read_by[self._node_rank[r]]}

        # rma: one window over the whole communicator.
        self._rma_win: MPI.Win | None = None
        self._rma_own: np.ndarray | None = None
        if any(host_size(r, "rma") for r in range(size)):
            self._rma_win = MPI.Win.Allocate(host_size(rank, "rma"), 1, comm=cc)
            self._rma_own = np.frombuffer(self._rma_win.tomemory(), dtype=np.uint8)  # type: ignore[call-overload]

        # cuda_ipc: a GPU buffer per rank, IPC handles exchanged once on the node.
        self._gpu_own: Any = None
        self._gpu_peers: dict[int, Any] = {}
        self._stream: Any = None
        if any(gpu_size(r) for r in range(size)):
            handle = None
            if gpu_size(rank):
                from torch.multiprocessing.reductions import reduce_tensor

                dev = torch.device("cuda", torch.cuda.current_device())
                self._gpu_own = torch.empty(gpu_size(rank), dtype=torch.uint8, device=dev)
                self._stream = torch.cuda.Stream(device=dev)
                handle = reduce_tensor(self._gpu_own)
            handles = self.node.allgather(handle)
            for r in local:
                h = handles[self._node_rank[r]]
                if r != rank and h is not None and r in self._usable["cuda_ipc"]:
                    rebuild, args = h
                    self._gpu_peers[r] = rebuild(*args)

    def _open_shm(self, nbytes: int, local: list[int]) -> dict[int, int]:
        """Create this rank's buffer, map every node peer's; returns each one's size."""
        path = None
        if nbytes:
            path = os.path.join(_SHM_DIR, f"smp-comm-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # Reserve the pages now: on a small /dev/shm (containers default to 64 MiB)
                # a sparse file would fail later with SIGBUS on the first write past the
                # limit. Without room, this rank receives over MPI instead.
                try:
                    st = os.statvfs(_SHM_DIR)
                    if st.f_bavail * st.f_frsize < nbytes:  # don't fill it up trying
                        raise OSError(errno.ENOSPC, f"{st.f_bavail * st.f_frsize} bytes free")
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as exc:
                    warnings.warn(
                        f"smp-comm rank {self.rank}: cannot reserve {nbytes} bytes in "
                        f"{_SHM_DIR} ({exc}); the shm path to this rank is off",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    nbytes = 0
                    os.ftruncate(fd, 0)
            finally:
                os.close(fd)
            if not nbytes:
                os.unlink(path)
                path = None
        names = self.node.allgather((path, nbytes))
        sizes = {}
        failure = None
        try:
            for r in local:
                name, n = names[self._node_rank[r]]
                sizes[r] = n
                if name is not None:
                    fd = os.open(name, os.O_RDWR)
                    try:
                        mem = mmap.mmap(fd, n)
                    finally:
                        os.close(fd)
                    self._shm_maps[r] = mem
                    self._shm_views[r] = np.frombuffer(mem, dtype=np.uint8)
        except OSError as exc:  # e.g. a node_id override that groups different hosts
            failure = f"rank {self.rank}: {exc}"
        finally:
            self.node.Barrier()  # every peer has mapped it (or failed): unlink now
            if path is not None:
                os.unlink(path)
        # Every rank learns of a failure anywhere, so none goes on alone into the next
        # collective call.
        failures = [f for f in self._cc.allgather(failure) if f]
        if failures:
            raise CommError(
                "smp-comm: cannot map the shared-memory buffers of node peers "
                f"(is node_id grouping ranks of different hosts?): {'; '.join(failures)}"
            )
        return sizes

    # ---------------------------------------------------------------- routing

    def candidates(self, dest: int, all_gpu: bool, any_gpu: bool) -> list[str]:
        """Direct paths that could carry a payload to ``dest``, best first."""
        out = []
        if all_gpu and any_gpu and dest in self._usable["cuda_ipc"]:
            out.append("cuda_ipc")
        for path in ("shm", "rma"):
            if dest in self._usable[path]:
                out.append(path)  # GPU tensors are staged through host memory
        return out

    def pulls_to(self, dest: int) -> bool:
        """Whether ``dest`` can read this rank's memory (the pull path, :mod:`smp_comm.cma`)."""
        return dest in self._pulled_by

    def pulls_from(self, source: int) -> bool:
        """Whether this rank can read ``source``'s memory."""
        return source in self._pull_from

    def pull(self, source: int, address: int, dst: np.ndarray) -> None:
        """Read ``dst.nbytes`` bytes at ``address`` of ``source``'s memory into ``dst``."""
        cma.read_from(self._pids[source], address, dst)

    def stop_pulls(self, peer: int) -> None:
        """A read between this rank and ``peer`` failed: neither pulls from the other again."""
        self._pull_from.discard(peer)
        self._pulled_by.discard(peer)

    def reserve(self, path: str, dest: int, nbytes: int) -> int | None:
        """Offset of a region of ``dest``'s ``path`` buffer now owned by this rank, or None."""
        return self._alloc[(path, dest)].reserve(nbytes)

    def release(self, path: str, dest: int, region: int) -> None:
        """``dest`` copied a payload out of ``region``: it may be reused."""
        self._alloc[(path, dest)].release(region)

    def slice_bytes(self, path: str, dest: int) -> int:
        """Size of this rank's slice of ``dest``'s ``path`` buffer."""
        return self._alloc[(path, dest)].size

    def copies_out(self, path: str, dest: int) -> bool:
        """Whether ``dest`` copies a payload out of its ``path`` buffer on receipt (rma
        always; shm with ``shm_zero_copy=False``): then a streamed send overlaps the two
        copies (:mod:`smp_comm.stream`)."""
        return path == "rma" or (path == "shm" and self._copies_out[dest])

    def write_bytes(self, path: str, dest: int, region: int, src: np.ndarray) -> None:
        """Copy the flat bytes ``src`` into ``dest``'s host buffer at ``region`` (one
        chunk of a streamed payload; shm or rma)."""
        if path == "shm":
            self._shm_views[dest][region : region + src.size] = src
            return
        win = self._rma_win
        assert win is not None
        win.Lock(dest, MPI.LOCK_SHARED)
        win.Put([src, MPI.BYTE], dest, target=(region, src.size, MPI.BYTE))
        win.Unlock(dest)

    def read_bytes(self, path: str, region: int, dst: np.ndarray) -> None:
        """Copy ``dst.size`` bytes at ``region`` of this rank's own host buffer into
        ``dst`` (the receiving side of :meth:`write_bytes`)."""
        if path == "shm":
            dst[:] = self._shm_views[self.rank][region : region + dst.size]
            return
        win, own = self._rma_win, self._rma_own
        assert win is not None and own is not None
        win.Lock(self.rank, MPI.LOCK_SHARED)
        dst[:] = own[region : region + dst.size]
        win.Unlock(self.rank)

    # ---------------------------------------------------------------- copies

    def write(self, path: str, dest: int, region: int, packed: Packed) -> None:
        """Copy the payload into ``dest``'s buffer at ``region`` (sender side)."""
        if path == "cuda_ipc":
            peer = self._gpu_peers[dest]
            with torch.cuda.stream(self._stream):
                for s, src in zip(packed.stubs, packed.sources):
                    if s.nbytes:
                        peer[region + s.offset : region + s.offset + s.nbytes].copy_(
                            src, non_blocking=True
                        )
            self._stream.synchronize()
            return
        host = [src if isinstance(src, np.ndarray) else src.cpu().numpy() for src in packed.sources]
        if path == "shm":
            dst = self._shm_views[dest]
            for s, src in zip(packed.stubs, host):
                dst[region + s.offset : region + s.offset + s.nbytes] = src
            # The header that follows is an MPI message: MPI's own synchronization orders
            # these stores before the receiver's loads.
        else:
            win = self._rma_win
            assert win is not None
            win.Lock(dest, MPI.LOCK_SHARED)
            for s, src in zip(packed.stubs, host):
                if s.nbytes:
                    win.Put([src, MPI.BYTE], dest, target=(region + s.offset, s.nbytes, MPI.BYTE))
            win.Unlock(dest)  # the Puts are complete at the target when this returns

    def read(
        self, path: str, region: int, stubs: list[TensorStub], release: Callable[[], None],
        into: tuple[list[Any], list[np.ndarray]] | None = None,
    ) -> list[Any]:
        """The payload at ``region`` of this rank's own buffer, as tensors (receiver side):
        new ones, or ``into`` (``(finals, byte views)``, the receive's own tensor).

        ``release`` is called once the region may be reused: right after the copy out, or,
        for zero-copy shm, when the last handed-out view is garbage collected.
        """
        if path == "shm" and self._zero_copy and into is None:
            return self._shm_views_of(region, stubs, release)
        if path == "cuda_ipc":
            finals = []
            with torch.cuda.stream(self._stream):
                for s in stubs:
                    raw = torch.empty(s.nbytes, dtype=torch.uint8, device=self._gpu_own.device)
                    raw.copy_(
                        self._gpu_own[region + s.offset : region + s.offset + s.nbytes],
                        non_blocking=True,
                    )
                    finals.append(raw.view(getattr(torch, s.dtype)).view(s.shape))
            self._stream.synchronize()
            release()
            return finals
        finals, views = into or new_buffers(stubs, self.rank)
        if path == "shm":
            own = self._shm_views[self.rank]
            for s, v in zip(stubs, views):
                v[:] = own[region + s.offset : region + s.offset + s.nbytes]
        else:
            win, rma_own = self._rma_win, self._rma_own
            assert win is not None and rma_own is not None
            own = rma_own
            win.Lock(self.rank, MPI.LOCK_SHARED)
            for s, v in zip(stubs, views):
                v[:] = own[region + s.offset : region + s.offset + s.nbytes]
            win.Unlock(self.rank)
        release()
        return finals

    def _shm_views_of(
        self, region: int, stubs: list[TensorStub], release: Callable[[], None]
    ) -> list[Any]:
        own = self._shm_maps[self.rank]
        lease = _Lease(sum(1 for s in stubs if s.nbytes), release)
        finals: list[Any] = []
        for s in stubs:
            if not s.nbytes:
                finals.append(new_buffers([s], self.rank)[0][0])
                continue
            holder = _RegionView(own, region + s.offset, s.nbytes)
            weakref.finalize(holder, lease.drop)
            view = np.asarray(holder)  # keeps ``holder`` alive as its base
            del holder
            if s.kind == "torch":
                if torch is None:
                    raise ImportError(
                        f"smp-comm rank {self.rank}: a message holds torch tensors but torch is not importable"
                    )
                t = torch.from_numpy(view).view(getattr(torch, s.dtype)).view(s.shape)
                finals.append(t)
            else:
                finals.append(view.view(s.dtype).reshape(s.shape))
            del view
        lease.armed()
        return finals

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Collective: free the windows and the node communicator, in construction order."""
        # The mappings go when the last handed-out view does.
        self._shm_views.clear()
        self._shm_maps.clear()
        self._rma_own = None
        if self._rma_win is not None:
            self._rma_win.Free()
            self._rma_win = None
        if self._gpu_own is not None or self._gpu_peers:
            torch.cuda.synchronize()
            self._gpu_peers.clear()
            self._gpu_own = None
        self.node.Free()
