"""Task ordering across tensor-parallel peers (the order channel).

Tensor-parallel peers of a pipeline stage sit in different pipeline groups, yet they run
collectives inside module executions, so they must start tasks in the same order. One peer,
the *leader*, publishes the identity of every task it hands the execution token to:
``(step, microbatch, kind, index)`` where ``index`` counts the grants of that microbatch on
this rank and ``kind`` is ``"start"`` (a microbatch's step function starts), ``"admit"`` (its
backward is admitted by the schedule), ``"inline"`` (a request static mode ran on the
leader's main thread, start to end in one grant: followers run it inline too, so their grant
counts stay the same) or ``"task"`` (anything else: a request, a response resuming a caller, a
backward segment, the end of device work). Followers start their ready tasks only in that
order; on a follower driver the leader's choices replace the schedule.

Peers must run the same model with the same control flow per microbatch (true for tensor
parallelism, where peers execute the same stage on different data), so their per-microbatch
task sequences correspond one to one. If a follower finds itself at a different index than
the leader announced, it raises instead of guessing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

OrderItem = tuple[int, int, str, int]  # (step, microbatch, kind, index within the microbatch)


class OrderChannel:
    """Publishes (leader) or receives (followers) task identities over an smp_comm communicator.

    Args:
        comm: an ``smp_comm.Communicator`` containing the leader and the followers.
        leader: the leader's rank in ``comm``.
        followers: the followers' ranks in ``comm``.
        tag: the message tag reserved for this channel.
    """

    def __init__(self, comm: Any, leader: int, followers: Sequence[int], tag: int = 7360) -> None:
        self.comm = comm
        self.leader = leader
        self.followers = list(followers)
        self.tag = tag
        self.is_leader = comm.rank == leader
        if not self.is_leader and comm.rank not in self.followers:
            raise ValueError(f"rank {comm.rank} is neither the leader {leader} nor a follower {followers}")
        self._seq = 0
        self._sends: list[Any] = []
        self._recv: Any = None
        # Called (on a communicator thread) when an announcement arrives: lets a follower's
        # main loop sleep until the leader's next task instead of polling for it.
        self.on_arrival: Callable[[Any], None] | None = None
        self._buffer: dict[int, OrderItem] = {}
        self._next = 0

    # leader -------------------------------------------------------------------------------
    def publish(self, item: OrderItem) -> None:
        """Announce the task the leader starts now."""
        for f in self.followers:
            self._sends.append(self.comm.isend((self._seq, item), dest=f, tag=self.tag))
        self._seq += 1
        if len(self._sends) > 256:
            self._sends = [h for h in self._sends if not h.test()]

    def flush(self, timeout: float | None = None, check: Callable[[], None] | None = None) -> None:
        """Wait until every announcement has left (up to ``timeout`` seconds each); with
        ``check``, call it every 0.1 s meanwhile (it raises to give up, e.g. on an abort: a
        send to a follower that died never completes)."""
        handles, self._sends = self._sends, []
        for h in handles:
            if check is None:
                h.wait(timeout=timeout)
                continue
            deadline = None if timeout is None else time.monotonic() + timeout
            while not h.test():
                check()
                if deadline is not None and time.monotonic() > deadline:
                    h.wait(timeout=0)  # raises smp-comm's timeout error, naming the peer
                time.sleep(1e-3)

    # followers ----------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            if self._recv is None:
                self._recv = self.comm.irecv(source=self.leader, tag=self.tag)
                if self.on_arrival is not None:
                    self._recv.add_done_callback(self.on_arrival)
            if not self._recv.test():
                return
            (seq, item), _, _ = self._recv.wait()
            self._recv = None
            self._buffer[seq] = tuple(item)  # type: ignore[assignment]

    def peek(self) -> OrderItem | None:
        """The next task the leader started, if it has been announced."""
        self._drain()
        return self._buffer.get(self._next)

    def pop(self) -> None:
        """Mark the item returned by :meth:`peek` as started here."""
        del self._buffer[self._next]
        self._next += 1

    def close(self) -> None:
        if self._recv is not None:
            try:
                self._recv.cancel()
            except Exception:
                pass
            self._recv = None
