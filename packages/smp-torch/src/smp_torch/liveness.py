"""Is a peer rank's process still alive? Two answers, without any collective.

- **Same node**: every rank's pid and process start time are exchanged when the failure
  channel opens (:mod:`smp_torch.watch`); a peer on this node has ended when its
  ``/proc/<pid>`` is gone, is a zombie, or belongs to a newer process (the pid was reused).
  Reading ``/proc`` costs microseconds and never errs on the side of "dead" while the peer
  runs, however busy it is.
- **Other nodes**: a ring of heartbeats between nodes. The first rank of each node sends a
  small message every :data:`BEAT_PERIOD_S` to the first rank of the next node and expects
  them from the previous one; silence for :data:`BEAT_TIMEOUT_S` means that node is gone. (A
  rank that dies on a node whose other ranks live is found by those ranks' ``/proc`` check,
  and they tell the job; the heartbeat covers a whole node going away.) A rank whose own
  watcher did not run for a while (a long call holding the GIL) forgives that gap instead of
  blaming the peer.
"""

from __future__ import annotations

from smp_comm.processes import PeerProcesses, ProcessInfo

__all__ = ["BEAT_PERIOD_S", "BEAT_TIMEOUT_S", "Heartbeats", "PeerProcesses", "ProcessInfo"]

BEAT_PERIOD_S = 0.5
BEAT_TIMEOUT_S = 5.0
# A watcher turn later than this after the previous one: this rank stalled, not the peer.
_STALL_S = 1.0


class Heartbeats:
    """The heartbeat ring between nodes (see the module docstring), for one rank.

    Args:
        rank: this rank.
        groups: the ranks of each node (each group sorted; every rank in exactly one).
        now: the current ``time.monotonic()``.
    """

    def __init__(self, rank: int, groups: list[list[int]], now: float) -> None:
        ordered = sorted(groups, key=lambda g: g[0])
        leaders = [g[0] for g in ordered]
        self.active = len(ordered) > 1 and rank in leaders
        self.send_to: int | None = None
        self.watched: int | None = None
        self.watched_group: list[int] = []
        if self.active:
            i = leaders.index(rank)
            self.send_to = leaders[(i + 1) % len(leaders)]
            prev = ordered[i - 1]
            self.watched, self.watched_group = prev[0], list(prev)
        self._last_heard = now
        self._next_beat = now
        self._last_turn = now
        self._said_bye = False

    def beat_due(self, now: float) -> bool:
        """Whether a heartbeat should go to :attr:`send_to` now (then counts it as sent)."""
        if not self.active or now < self._next_beat:
            return False
        self._next_beat = now + BEAT_PERIOD_S
        return True

    def heard(self, src: int, bye: bool, now: float) -> None:
        """A heartbeat (or, with ``bye``, a last one before an orderly exit) from ``src``."""
        if src != self.watched:
            return
        self._last_heard = now
        if bye:
            self._said_bye = True

    def silent(self, now: float) -> int | None:
        """The watched node's first rank if it has been silent for too long, else None."""
        if not self.active or self._said_bye:
            return None
        if now - self._last_turn > _STALL_S:
            self._last_heard = max(self._last_heard, now - BEAT_PERIOD_S)  # we stalled
        self._last_turn = now
        if now - self._last_heard > BEAT_TIMEOUT_S:
            self.active = False  # reported once
            return self.watched
        return None

