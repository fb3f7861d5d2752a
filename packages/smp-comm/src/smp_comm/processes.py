"""Which peer processes of this job still run, read from ``/proc`` (no collective).

Every rank's host name, pid and process start time are exchanged once (by whoever builds
the view: :class:`~smp_comm.Communicator` at construction, smp-torch's failure watcher); a
peer on this host has ended when its ``/proc/<pid>`` is gone, is a zombie, or belongs to a
newer process (the pid was reused). Reading ``/proc`` costs ~15 µs back to back and never
errs on the side of "ended" while the peer runs, however busy it is. A peer on another host cannot
be seen this way.

:class:`PeerProcesses` (what smp-torch's failure watcher asks every 25 ms) holds a *pidfd*
per checked peer where the kernel has them (Linux 5.3+): a peer has ended when its pidfd is
readable, one ``poll`` for all peers and no ``/proc`` read. Why: a watcher turn comes
every 25 ms to caches a training step has cold, and there reading ``/proc/<pid>/stat`` (an
open, a read of the kernel's per-thread totals, a close) took ~120-140 µs of CPU against ~1
µs for the poll: ~45 % of the watcher's CPU (docs/performance.md, "Where the CPU goes").
A pidfd names one process, so a reused pid cannot fool it either.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import weakref
from dataclasses import dataclass

__all__ = ["PeerProcesses", "ProcessInfo", "has_ended", "know_peers", "watchable_peers"]


@dataclass(frozen=True)
class ProcessInfo:
    """Where a rank's process runs: host name, pid, and its start time in clock ticks since
    boot (``/proc/<pid>/stat`` field 22), None where ``/proc`` is not available."""

    host: str
    pid: int
    start: int | None

    @classmethod
    def here(cls) -> ProcessInfo:
        """This process's information."""
        pid = os.getpid()
        stat = _stat(pid)
        return cls(socket.gethostname(), pid, None if stat is None else stat[1])

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, start time, CPU time used)`` of process ``pid`` (times in clock ticks; the
    CPU time is user + system), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19]), int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


def _pidfd(pid: int) -> int | None:
    """A pidfd for process ``pid`` (readable once it exits), None where the kernel or Python
    has none or the process is gone."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# The peer processes every Communicator made known (know_peers), for the exit protocol
# (smp_comm.shutdown): those on this host, and whether any runs elsewhere (its end cannot be
# seen).
_seen_peers: dict[tuple[int, int | None], ProcessInfo] = {}
_peer_elsewhere = False


def know_peers(infos: list[ProcessInfo], rank: int) -> None:
    """Record the processes of a communicator's ranks (``infos[rank]`` is this one)."""
    global _peer_elsewhere
    me = infos[rank]
    for r, info in enumerate(infos):
        if r == rank:
            continue
        if info.host != me.host or info.start is None or info.pid == me.pid:
            _peer_elsewhere = True
        else:
            _seen_peers[(info.pid, info.start)] = info


def watchable_peers() -> list[ProcessInfo] | None:
    """The peers made known by :func:`know_peers` when every one of them runs on this host
    (so its end can be seen in ``/proc``); None when none is known or one runs elsewhere."""
    if _peer_elsewhere or not _seen_peers:
        return None
    return list(_seen_peers.values())


def has_ended(info: ProcessInfo) -> bool:
    """Whether the process ``info`` names (on this host) has ended: gone, a zombie, or its
    pid reused by a newer process."""
    stat = _stat(info.pid)
    return stat is None or stat[0] in ("Z", "X") or stat[1] != info.start


class PeerProcesses:
    """The peers whose processes this rank can check in ``/proc`` (same node, start time
    known and matching now), and which of them have ended.

    Args:
        rank: this rank.
        infos: every rank's :class:`ProcessInfo`, by rank.
        node_ranks: the ranks sharing this node (this one included).
    """

    def __init__(self, rank: int, infos: list[ProcessInfo], node_ranks: list[int]) -> None:
        self.infos = infos
        self.checked: list[int] = []
        # Checked peers with a pidfd: fd -> rank, all registered in one poll object.
        self._pidfds: dict[int, int] = {}
        self._poll = select.poll()
        for r in node_ranks:
            if r == rank or infos[r].start is None:
                continue
            # The pidfd first, then the start time: if it matches, the pidfd names the peer
            # (a pid reused before the open would show another start time).
            fd = _pidfd(infos[r].pid)
            stat = _stat(infos[r].pid)
            # Only peers seen alive now with the start time they reported: a pid from
            # another pid namespace (a container) would name some other process, or none.
            if stat is None or stat[1] != infos[r].start:
                if fd is not None:
                    os.close(fd)
                continue
            self.checked.append(r)
            if fd is not None:
                self._pidfds[fd] = r
                self._poll.register(fd, select.POLLIN)
        self._polled = set(self._pidfds.values())
        # The pidfds live as long as this object (the watcher may be in a turn at close).
        weakref.finalize(self, _close_all, list(self._pidfds))

    def ended(self) -> list[int]:
        """The checked peers whose process has ended (gone, zombie, or pid reused)."""
        gone: set[int] = set()
        if self._pidfds:
            for fd, events in self._poll.poll(0):
                r = self._pidfds[fd]
                # Readable: the process exited. (POLLNVAL cannot happen while this object
                # lives; if it did, /proc answers instead.)
                if not events & select.POLLNVAL or has_ended(self.infos[r]):
                    gone.add(r)
        return [
            r
            for r in self.checked
            if r in gone or (r not in self._polled and has_ended(self.infos[r]))
        ]

    def state(self, r: int) -> str | None:
        """Peer ``r``'s process state letter in ``/proc`` (``"R"``, ``"S"``, ``"D"``, ``"T"``
        stopped, ``"t"`` stopped by a debugger...), None if it cannot be seen or has ended."""
        if r not in self.checked:
            return None
        info = self.infos[r]
        stat = _stat(info.pid)
        if stat is None or stat[1] != info.start or stat[0] in ("Z", "X"):
            return None
        return stat[0]

    def cpu_ticks(self, r: int) -> int | None:
        """The CPU time peer ``r``'s process has used (user + system, clock ticks), None if it
        cannot be seen. A process none of whose threads runs (stopped, stuck in the kernel)
        uses none; one that runs, or busy-polls a network, does."""
        if r not in self.checked:
            return None
        stat = _stat(self.infos[r].pid)
        return None if stat is None or stat[1] != self.infos[r].start else stat[2]

    def kill(self, r: int) -> bool:
        """SIGKILL peer ``r``'s process (a frozen one: it cannot end by itself, and a
        launcher that waits for every rank would wait for it). Only a checked peer whose pid
        still belongs to it; returns whether the signal was sent."""
        if self.state(r) is None:
            return False
        try:
            os.kill(self.infos[r].pid, signal.SIGKILL)
        except OSError:
            return False
        return True

    def all_ended(self, world_size: int) -> bool:
        """Whether every other rank's process is known to have ended (only peers on this
        node can be seen: with a rank elsewhere, False)."""
        if len(self.checked) != world_size - 1:
            return False
        return len(self.ended()) == len(self.checked)
