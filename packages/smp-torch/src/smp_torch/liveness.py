"""Is a peer rank's process still alive, and still running? Answers without any collective.

- **Same node**: every rank's pid and process start time are exchanged when the failure
  channel opens (:mod:`smp_torch.watch`); a peer on this node has ended when its
  ``/proc/<pid>`` is gone, is a zombie, or belongs to a newer process (the pid was reused).
  This never errs on the side of "dead" while the peer runs, however busy it is. The watcher
  asks every turn through a pidfd per peer (one ``poll``; ``/proc`` where the kernel has no
  pidfds), since a ``/proc`` read on a training step's cold caches costs ~130 µs of CPU.
- **Every rank**: a ring of heartbeats. Each rank's watcher thread sends a small message every
  :data:`BEAT_PERIOD_S` to the next rank of the ring (ranks ordered node by node) and expects
  them from the previous one. Silence means:

  * from a rank on another node, for :data:`BEAT_TIMEOUT_S`: that node is gone (a rank that
    dies on a node whose other ranks live is found by those ranks' ``/proc`` check);
  * from a rank on this node, for ``timeout_s``: its process is *frozen* — alive in
    ``/proc`` (stopped by SIGSTOP, a debugger, a hung driver, swapped out) but none of its
    threads runs. ``/proc`` alone cannot tell that from a busy process.

  A rank whose own watcher did not run for a while (a long call holding the GIL) forgives that
  gap instead of blaming the peer.
"""

from __future__ import annotations

from smp_comm.processes import PeerProcesses, ProcessInfo

__all__ = ["BEAT_PERIOD_S", "BEAT_TIMEOUT_S", "Heartbeats", "PeerProcesses", "ProcessInfo"]

BEAT_PERIOD_S = 0.5
BEAT_TIMEOUT_S = 5.0
# A watcher turn later than this after the previous one: this rank stalled, not the peer.
_STALL_S = 1.0


class Heartbeats:
    """The heartbeat ring (see the module docstring), for one rank.

    Args:
        rank: this rank.
        groups: the ranks of each node (each group sorted; every rank in exactly one).
        now: the current ``time.monotonic()``.
        frozen_after_s: the silence after which a rank of this node is taken for frozen
            (``timeout_s``).
    """

    def __init__(
        self, rank: int, groups: list[list[int]], now: float, frozen_after_s: float = float("inf")
    ) -> None:
        ordered = sorted(groups, key=lambda g: g[0])
        ring = [r for g in ordered for r in g]
        node_of = {r: i for i, g in enumerate(ordered) for r in g}
        self.active = len(ring) > 1
        self.send_to: int | None = None
        self.watched: int | None = None
        #: The ranks presumed gone with :attr:`watched` when it falls silent.
        self.watched_group: list[int] = []
        #: Whether :attr:`watched` runs on this node (its silence means frozen, not gone).
        self.same_node = False
        self.limit = BEAT_TIMEOUT_S
        if self.active:
            i = ring.index(rank)
            self.send_to = ring[(i + 1) % len(ring)]
            self.watched = ring[i - 1]
            self.same_node = node_of[self.watched] == node_of[rank]
            if self.same_node:
                self.watched_group, self.limit = [self.watched], frozen_after_s
            else:
                self.watched_group = list(ordered[node_of[self.watched]])
        self._last_heard = now
        self._next_beat = now
        self._last_turn = now
        self._said_bye = False
        self._next_left = False
        self._reported = False

    def beat_due(self, now: float) -> bool:
        """Whether a heartbeat should go to :attr:`send_to` now (then counts it as sent)."""
        if not self.active or self._next_left or now < self._next_beat:
            return False
        self._next_beat = now + BEAT_PERIOD_S
        return True

    def heard(self, src: int, bye: bool, now: float) -> None:
        """A heartbeat (or, with ``bye``, a last one before an orderly exit) from ``src``."""
        if bye and src == self.send_to:
            self._next_left = True  # it exits: no more heartbeats to it
        if src != self.watched:
            return
        self._last_heard = now
        if bye:
            self._said_bye = True

    def rearm(self, now: float) -> None:
        """The watched rank's silence was not a death: watch it again from ``now``."""
        self._reported = False
        self._last_heard = now

    def silent(self, now: float) -> int | None:
        """The watched rank if it has been silent for longer than :attr:`limit`, else None."""
        if not self.active or self._said_bye or self._reported:
            return None
        if now - self._last_turn > _STALL_S:
            self._last_heard = max(self._last_heard, now - BEAT_PERIOD_S)  # we stalled
        self._last_turn = now
        if now - self._last_heard > self.limit:
            self._reported = True  # once (and beats still go out: this rank lives)
            return self.watched
        return None
