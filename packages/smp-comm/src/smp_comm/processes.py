"""Which peer processes of this job still run, read from ``/proc`` (no collective).

Every rank's host name, pid and process start time are exchanged once (by whoever builds
the view: :class:`~smp_comm.Communicator` at construction, smp-torch's failure watcher); a
peer on this host has ended when its ``/proc/<pid>`` is gone, is a zombie, or belongs to a
newer process (the pid was reused). Reading ``/proc`` costs microseconds and never errs on
the side of "ended" while the peer runs, however busy it is. A peer on another host cannot
be seen this way.
"""

from __future__ import annotations

import os
import signal
import socket
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
        # Only peers seen alive now with the start time they reported: a pid from another
        # pid namespace (a container) would name some other process, or none.
        self.checked = [
            r
            for r in node_ranks
            if r != rank
            and infos[r].start is not None
            and (stat := _stat(infos[r].pid)) is not None
            and stat[1] == infos[r].start
        ]

    def ended(self) -> list[int]:
        """The checked peers whose process has ended (gone, zombie, or pid reused)."""
        return [r for r in self.checked if has_ended(self.infos[r])]

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
