"""Stall diagnosis: what each rank has pending, and the chain of waits it forms.

When a request times out, the rank that noticed asks every pipeline rank for its pending
work (:mod:`smp_pipeline.diagnosis`); each answers with a :class:`RankState`: its tasks (what
each runs, and what it waits for), the requests it sent and still waits for, and the
requests it received but has not started. This module follows the waits from the timed-out
request, rank to rank, to the work that holds them all up (a task that keeps the execution
token: blocked in user code, or in a module that never returns), and words the chain.

Everything here is a plain record or a pure function: the records travel in a
:class:`~smp_pipeline.protocol.StallReport`, and the chain is assembled from them alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

# How a task of a rank stands (TaskState.state).
RUNNING = "running"  # holds the execution token
DEVICE = "device"  # inside device_work()
WAITING = "waiting"  # PENDING until the value for its wait key arrives
READY = "ready"  # its value arrived: waits for the token
YIELDED = "yielded"  # gave the token back at a yield point: waits for it again

_MAX_OTHER_LINES = 12  # lines of "other pending work" after the chain


class Request(NamedTuple):
    """A request a rank sent and still waits for."""

    key: Any  # ("fwd", call key) or ("bwd", call key, request number)
    dest: int  # the pp rank it went to
    path: str  # the module it runs there
    mb: int
    age: float  # seconds since it was sent


class TaskState(NamedTuple):
    """One task of a rank (a worker thread holding a task)."""

    module: str  # "<step>" for the step function on the driver
    mb: int
    phase: str  # "forward" or "backward"
    state: str  # RUNNING, DEVICE, WAITING, READY or YIELDED
    serves: Any  # the key of the request it answers (None: the step function, a caller segment)
    waits: Any  # its wait key (WAITING), else None
    age: float | None  # RUNNING: seconds it has held the token
    where: str  # RUNNING / DEVICE: where its thread is (innermost frames)


class Queued(NamedTuple):
    """A request a rank received but has not started."""

    key: Any
    src: int
    path: str
    mb: int


class RankState(NamedTuple):
    """Everything one rank has pending, as it answers a stall query."""

    rank: int
    step: int
    tasks: tuple[TaskState, ...]
    requests: tuple[Request, ...]
    queued: tuple[Queued, ...]


def phase_of(key: Any) -> str:
    """``"forward"`` or ``"backward"``, from a request key."""
    return "forward" if key[0] == "fwd" else "backward"


def request_text(key: Any, dest: int, path: str, mb: int) -> str:
    """A request as the timeout message names it."""
    return f"the {phase_of(key)} of module '{path}' (microbatch {mb}) on pp rank {dest}"


def task_text(task: TaskState) -> str:
    """A task in a sentence: what it runs."""
    if task.module == "<step>":
        return f"the step function's {task.phase} (microbatch {task.mb})"
    return f"the {task.phase} of module '{task.module or '<root>'}' (microbatch {task.mb})"


def _wait_text(key: Any) -> str:
    """What a task waits for, where that is no request to another rank."""
    if isinstance(key, tuple) and key and key[0] == "admit":
        return "the schedule to admit its backward"
    if isinstance(key, tuple) and key and key[0] == "bwd_done":
        return "its backward segments on other ranks to complete"
    return f"{key!r}"


class _Walk:
    """Follows waits across the ranks' reports, writing one line per link."""

    def __init__(
        self, reports: Mapping[int, RankState | None], wait_s: float, comm_ranks: Sequence[int]
    ) -> None:
        self.reports = reports
        self.wait_s = wait_s
        self.comm_ranks = comm_ranks
        self.lines: list[str] = []
        self.culprit = ""
        #: The pp rank holding the chain up (None: none, or a cycle).
        self.culprit_rank: int | None = None
        self.seen: set[tuple[int, Any]] = set()
        self.mentioned: set[tuple[int, Any]] = set()  # (rank, request key or task) in the chain

    def name(self, rank: int) -> str:
        """``pp rank r``, and its communicator rank where that differs."""
        comm = self.comm_ranks[rank] if 0 <= rank < len(self.comm_ranks) else rank
        return f"pp rank {rank}" if comm == rank else f"pp rank {rank} (communicator rank {comm})"

    def request(self, rank: int, req: Request) -> None:
        """``rank`` waits for ``req``: say so, then follow it to its destination."""
        state = self.reports.get(rank)
        issuer = None
        if state is not None:
            issuer = next((t for t in state.tasks if t.waits == req.key), None)
        who = task_text(issuer) if issuer is not None else "it"
        if issuer is not None:
            self.mentioned.add((rank, issuer))
        self.mentioned.add((rank, req.key))
        self.lines.append(
            f"{self.name(rank)}: {who} waits ({req.age:.1f} s) for "
            f"{request_text(req.key, req.dest, req.path, req.mb)}"
        )
        if (req.dest, req.key) in self.seen:
            self.lines.append("  ... which closes a cycle: these requests wait on each other")
            self.culprit = "a cycle of requests waiting on each other (a deadlock)"
            self.culprit_rank = None
            return
        self.seen.add((req.dest, req.key))
        self._follow(req.dest, req)

    def _follow(self, rank: int, req: Request) -> None:
        """Where ``req`` stands on ``rank`` (its destination, or a relay's later owner)."""
        dest = self.reports.get(rank)
        if dest is None:
            self.lines.append(
                f"{self.name(rank)}: no answer to the stall query within {self.wait_s:g} s "
                "(its main thread is not in the pipeline's loop: not in this step, blocked "
                "outside the pipeline, or gone)"
            )
            self.culprit = f"{self.name(rank)}, which did not answer (not serving the pipeline)"
            self.culprit_rank = rank
            return
        task = next((t for t in dest.tasks if t.serves == req.key), None)
        if task is not None:
            self.task(dest, task)
            return
        running = next((t for t in dest.tasks if t.state == RUNNING), None)
        if any(q.key == req.key for q in dest.queued):
            if running is not None:
                self.lines.append(
                    f"{self.name(dest.rank)}: received it, not started: its execution token is "
                    f"held by {task_text(running)}"
                )
                self.task(dest, running)
            else:
                self.lines.append(f"{self.name(dest.rank)}: received it, not started yet")
                self.culprit = f"{self.name(dest.rank)}, which has not started it"
                self.culprit_rank = dest.rank
            return
        # Segment-mode backward: the task that served it ended, its nested requests remain.
        same = sorted((r for r in dest.requests if r.mb == req.mb), key=lambda r: -r.age)
        if same:
            self.lines.append(
                f"{self.name(dest.rank)}: no task runs it now; it waits for nested requests"
            )
            self.request(dest.rank, same[0])
            return
        # A fast_mode relay: the request went on, under the same key, to a later owner.
        onward = self._holder(req.key, rank)
        if onward is not None:
            self.lines.append(f"{self.name(rank)}: passed it on to {self.name(onward)} (a relay)")
            self.seen.add((onward, req.key))
            self._follow(onward, req)
            return
        self.lines.append(
            f"{self.name(dest.rank)}: has no record of it (the request, or its answer, is in flight)"
        )
        self.culprit = f"{self.name(dest.rank)}, which has no record of it"
        self.culprit_rank = dest.rank

    def _holder(self, key: Any, but: int) -> int | None:
        """Another rank (not yet followed) with a task serving ``key`` or holding it queued."""
        for rank, state in sorted(self.reports.items()):
            if state is None or rank == but or (rank, key) in self.seen:
                continue
            if any(t.serves == key for t in state.tasks) or any(q.key == key for q in state.queued):
                return rank
        return None

    def task(self, state: RankState, task: TaskState) -> None:
        """``task`` of ``state.rank`` holds up the chain: say how, following its own wait."""
        self.mentioned.add((state.rank, task))
        self.culprit_rank = state.rank
        what = f"{self.name(state.rank)}: {task_text(task)}"
        if task.state == RUNNING:
            age = f" for {task.age:.1f} s" if task.age is not None else ""
            self.lines.append(
                f"{what} has held the execution token{age} (blocked in user code, or a "
                f"module that does not return){task.where}"
            )
            self.culprit = f"{self.name(state.rank)}: {task_text(task)} runs{age}{task.where}"
        elif task.state == DEVICE:
            self.lines.append(f"{what} is in device work{task.where}")
            self.culprit = f"{self.name(state.rank)}: {task_text(task)} in device work"
        elif task.state == WAITING:
            req = next((r for r in state.requests if r.key == task.waits), None)
            if req is not None:
                self.request(state.rank, req)
                return
            self.lines.append(f"{what} waits for {_wait_text(task.waits)}")
            self.culprit = f"{self.name(state.rank)}: {task_text(task)}"
        else:  # READY / YIELDED: it could go on, once the token comes back
            running = next((t for t in state.tasks if t.state == RUNNING), None)
            self.lines.append(f"{what} is ready to go on, waiting for the execution token")
            if running is not None and running is not task:
                self.task(state, running)
            else:
                self.culprit = f"{self.name(state.rank)}, whose main loop does not resume it"


def _other_work(walk: _Walk, reports: Mapping[int, RankState | None]) -> list[str]:
    """The pending work the chain did not mention, a line per item (bounded)."""
    lines: list[str] = []
    for rank in range(len(walk.comm_ranks)):
        state = reports.get(rank)
        name = walk.name(rank)
        if state is None:
            if not any(line.startswith(f"{name}: no answer") for line in walk.lines):
                lines.append(f"{name}: no answer to the stall query")
            continue
        for t in state.tasks:
            # (A task waiting for a request is listed with that request, below.)
            if (rank, t) in walk.mentioned or any(r.key == t.waits for r in state.requests):
                continue
            lines.append(f"{name}: {task_text(t)}: {t.state}{t.where}")
        for r in sorted(state.requests, key=lambda r: -r.age):
            if (rank, r.key) not in walk.mentioned:
                issuer = next((t for t in state.tasks if t.waits == r.key), None)
                who = task_text(issuer) if issuer is not None else "it"
                lines.append(
                    f"{name}: {who} waits ({r.age:.1f} s) for "
                    f"{request_text(r.key, r.dest, r.path, r.mb)}"
                )
        for q in state.queued:
            lines.append(
                f"{name}: not started: the {phase_of(q.key)} of module '{q.path}' "
                f"(microbatch {q.mb}) for pp rank {q.src}"
            )
    if len(lines) > _MAX_OTHER_LINES:
        more = len(lines) - _MAX_OTHER_LINES
        lines = lines[:_MAX_OTHER_LINES] + [f"... and {more} more"]
    return lines


def explain(
    reason: str,
    origin: int,
    root: Any,
    reports: Mapping[int, RankState | None],
    wait_s: float,
    comm_ranks: Sequence[int],
) -> tuple[str, int | None]:
    """The timeout message ``reason`` with the chain of waits behind it, and the pp rank the
    chain ends at (None: a cycle, or no chain).

    Args:
        reason: the timeout's own message (one line).
        origin: the pp rank that noticed the timeout.
        root: the key of its request that timed out (None: no request did; then the chain
            starts from the oldest request any rank waits for).
        reports: each pp rank's pending work (None, or absent: it did not answer).
        wait_s: how long the query waited for answers (for the message).
        comm_ranks: the communicator rank of each pp rank (their number: the pipeline degree).

    Returns:
        ``reason``, the chain's end on the same line, then the chain (a line per link) and
        the other pending work; and the rank the chain ends at.
    """
    walk = _Walk(reports, wait_s, comm_ranks)
    start = _start(origin, root, reports)
    if start is not None:
        walk.request(*_head(reports, *start))
    else:
        # No request is waited for: a rank whose task keeps the token holds everyone up
        # (the driver's own step function, stuck before its first request), or a rank that
        # did not answer.
        running = [
            (t.age or 0.0, s.rank, t)
            for s in reports.values() if s is not None for t in s.tasks if t.state == RUNNING
        ]  # fmt: skip
        silent = sorted(r for r in range(len(comm_ranks)) if reports.get(r) is None)
        if running:
            _, rank, task = max(running, key=lambda x: (x[0], -x[1]))
            state = reports[rank]
            assert state is not None
            walk.lines.append("no rank waits for a request of another")
            walk.task(state, task)
        elif silent:
            walk.lines.append("no rank waits for a request of another")
            walk._follow(silent[0], Request(None, silent[0], "", -1, 0.0))
        else:
            walk.lines.append("no rank waits for a request")
    head = reason if not walk.culprit else f"{reason}; the chain of waits ends at {walk.culprit}"
    out = [head, "stall chain (each rank's own report):"]
    out += [f"  {line}" for line in walk.lines]
    others = _other_work(walk, reports)
    if others:
        out.append("other pending work:")
        out += [f"  {line}" for line in others]
    return "\n".join(out), walk.culprit_rank


def _start(
    origin: int, root: Any, reports: Mapping[int, RankState | None]
) -> tuple[int, Request] | None:
    """Where the chain starts: ``origin``'s timed-out request, else its oldest request, else
    the oldest request of any rank."""
    mine = reports.get(origin)
    own: Sequence[Request] = mine.requests if mine is not None else ()
    for req in own:
        if req.key == root:
            return origin, req
    everyone = [(s.rank, r) for s in reports.values() if s is not None for r in s.requests]
    candidates = [(origin, r) for r in own] or everyone
    if not candidates:
        return None
    return max(candidates, key=lambda c: c[1].age)


def _head(
    reports: Mapping[int, RankState | None], rank: int, req: Request
) -> tuple[int, Request]:
    """The first request of the chain ``req`` is part of: while the task that sent it serves
    another rank's request, that request (the chain then reads from the step function)."""
    seen: set[tuple[int, Any]] = set()
    while (rank, req.key) not in seen:
        seen.add((rank, req.key))
        state = reports.get(rank)
        issuer = next((t for t in state.tasks if t.waits == req.key), None) if state else None
        if issuer is None or issuer.serves is None:
            break
        up = next(
            ((s.rank, r) for s in reports.values() if s is not None for r in s.requests
             if r.key == issuer.serves),
            None,
        )  # fmt: skip
        if up is None:
            break
        rank, req = up
    return rank, req
