"""Stall diagnosis on one rank: answering stall queries, and asking every rank on a timeout.

A request that times out names only what this rank waits for; the rank that holds the
pipeline up is usually another one, further down a chain of nested requests (rank 0 waits
for rank 1's ``body``, which waits for rank 2's ``body.inner``, whose forward never returns).
So when :class:`~smp_pipeline.transport.Transport` aborts with a timeout, it first asks
:meth:`StallDiagnosis.explain`: this sends a :class:`~smp_pipeline.protocol.StallQuery` to
every pipeline rank, waits (at most :data:`QUERY_WAIT_S`) for their
:class:`~smp_pipeline.protocol.StallReport`, and words the chain
(:func:`smp_pipeline.stall.explain`), which the abort then carries to every rank.

The query is answered by the rank's main thread, wherever it waits: the transport takes
stall messages itself, and the main thread keeps receiving while a worker holds the
execution token (:meth:`Executor.switch` polls every 0.1 s), so a rank whose worker is stuck
in user code still answers. Nothing of this runs while all goes well: the only cost on the
hot path is the time of each token grant, which :meth:`Executor.switch` had already.
"""

from __future__ import annotations

import itertools
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from smp_pipeline.errors import PipelineError
from smp_pipeline.executor import Executor
from smp_pipeline.protocol import BwdReq, FwdReq, Message, StallQuery, StallReport
from smp_pipeline.seqruns import span_label
from smp_pipeline.stall import (
    DEVICE,
    READY,
    RUNNING,
    WAITING,
    YIELDED,
    Queued,
    RankState,
    Request,
    TaskState,
    explain,
)
from smp_pipeline.transport import Transport
from smp_pipeline.worker import DEVICE as WORKER_DEVICE
from smp_pipeline.worker import EXECUTING, Task

# The longest the rank that noticed a timeout waits for the other ranks' reports. A rank
# in the pipeline's loop answers within ~0.1 s; one that is not never does, and the timeout
# is then raised this much later.
QUERY_WAIT_S = 2.0
_POLL_S = 0.01
# Frames of these directories are skipped when saying where a stuck thread is.
_LIBRARY_DIRS = tuple(
    os.path.join(d, "")
    for d in (
        sysconfig.get_paths()["stdlib"],
        os.path.dirname(os.path.abspath(torch.__file__)),
        os.path.dirname(os.path.abspath(__file__)),
    )
)


class StallDiagnosis:
    """Answers stall queries for one rank, and asks every rank when one of its waits times out.

    Args:
        pp_rank, pp_size: this rank's pipeline index and the pipeline degree.
        transport: sends the queries and reports; this object becomes its
            ``on_stall_message`` and ``explain_stall``.
        executor: the tasks whose state a report describes.
        step: the current step number.
    """

    def __init__(
        self,
        pp_rank: int,
        pp_size: int,
        transport: Transport,
        executor: Executor,
        step: Callable[[], int],
    ) -> None:
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.transport = transport
        self.executor = executor
        self._step = step
        self._queries = itertools.count(1)
        self._query = 0  # the query under way (0: none)
        self._reports: dict[int, RankState | None] = {}
        self._sends: list[Any] = []  # handles of queries and reports sent (kept until done)
        self._names: dict[int, str] = {}  # id(module) -> its path (see name_modules)
        transport.on_stall_message = self.on_message
        transport.explain_stall = self.explain

    def name_modules(self, root: torch.nn.Module) -> None:
        """Name the modules of ``root`` by their paths where a report says which module a
        stuck thread is in."""
        self._names = {id(m): path or "<root>" for path, m in root.named_modules()}

    # ------------------------------------------------------------------ answering
    def on_message(self, msg: Message) -> None:
        """A stall query (answered at once) or a report (kept if it answers our query)."""
        if type(msg) is StallQuery:
            self._send(msg.src, StallReport(self.pp_rank, msg.query, self.snapshot()))
        elif type(msg) is StallReport and msg.query == self._query:
            self._reports[msg.src] = msg.state

    def _send(self, dest: int, msg: Message) -> None:
        self._sends = [h for h in self._sends if not h.test()]
        try:
            self._sends.append(self.transport.send_note(dest, msg))
        except Exception:  # noqa: BLE001 - best effort: the timeout is raised anyway
            pass

    def snapshot(self) -> RankState:
        """This rank's pending work now (from the main thread, while a worker may run: a
        container that changes under us is read again)."""
        for _ in range(3):
            try:
                return self._snapshot()
            except RuntimeError:  # "changed size during iteration": a worker moved on
                continue
        return RankState(self.pp_rank, self._step(), (), (), ())

    def _snapshot(self) -> RankState:
        ex, tr = self.executor, self.transport
        mono, now = time.monotonic(), time.time()
        requests = tuple(
            Request(key, dest, path, mb, mono - t0)
            for key, (t0, dest, path, mb) in list(tr.outstanding.items())
        )
        waits = {id(w): key for key, w in list(ex.waiting.items())}
        ready = {id(w) for w, _ in list(ex.ready)}
        yielded = {id(w) for w in list(ex.yielded)}
        current = ex.current
        frames: dict[int, FrameType] | None = None
        tasks: list[TaskState] = []
        for worker in list(ex.workers):
            task = worker.task
            if task is None:
                continue
            if id(worker) in waits:
                state = WAITING
            elif id(worker) in ready:
                state = READY
            elif id(worker) in yielded:
                state = YIELDED
            elif worker.state == WORKER_DEVICE:
                state = DEVICE
            elif worker.state == EXECUTING and task is current:
                state = RUNNING
            else:  # between two states (the token is changing hands)
                continue
            where = ""
            if state in (RUNNING, DEVICE):
                frames = frames if frames is not None else sys._current_frames()
                where = _where(frames.get(worker.thread.ident or -1), self._names)
            age = now - ex.current_since if state == RUNNING else None
            serves = _serves(task)
            tasks.append(
                TaskState(task.module, task.mb, task.phase, state, serves, waits.get(id(worker)), age, where)
            )  # fmt: skip
        queued = tuple(
            Queued(_request_key(m), m.src, span_label(m.path, m.span) if type(m) is FwdReq else m.path, m.mb)
            for m in list(tr.inbox)
            if isinstance(m, (FwdReq, BwdReq))
        )
        return RankState(self.pp_rank, self._step(), tuple(tasks), requests, queued)

    # ------------------------------------------------------------------ asking
    def explain(self, reason: str, key: Any) -> tuple[str, int | None]:
        """``reason`` (a timeout of request ``key``, or None) with the chain of waits behind
        it, from every rank's report, and the pp rank the chain ends at (None: unknown).
        Returns ``reason`` alone if that cannot be done; raises only if an abort arrived
        meanwhile (then that abort is the error)."""
        if self.pp_size < 2:
            return reason, None
        try:
            reports = self._ask()
            ranks = self.transport.comm_ranks
            return explain(reason, self.pp_rank, key, reports, QUERY_WAIT_S, ranks)
        except PipelineError:
            raise
        except Exception as exc:  # noqa: BLE001 - the timeout itself must still be raised
            return f"{reason} (the stall diagnosis failed: {exc!r})", None

    def _ask(self) -> dict[int, RankState | None]:
        """Every rank's report (a rank that does not answer within QUERY_WAIT_S is absent)."""
        tr = self.transport
        self._query = next(self._queries)
        self._reports = {self.pp_rank: self.snapshot()}
        try:
            for rank in range(self.pp_size):
                if rank != self.pp_rank:
                    self._send(rank, StallQuery(self.pp_rank, self._query))
            deadline = time.monotonic() + QUERY_WAIT_S
            while len(self._reports) < self.pp_size and time.monotonic() < deadline:
                tr.poll()  # takes the reports (and answers other ranks' queries)
                if tr.abort_msg is not None:
                    tr.raise_if_aborted()
                time.sleep(_POLL_S)
            return dict(self._reports)
        finally:
            self._query = 0


def _request_key(msg: FwdReq | BwdReq) -> Any:
    """The key the sender awaits the answer to ``msg`` under."""
    if isinstance(msg, FwdReq):
        return ("fwd", msg.key)
    return ("bwd", msg.key, msg.req)


def _serves(task: Task[Any]) -> Any:
    """The key of the request ``task`` answers (None: the step function, a caller segment)."""
    payload = task.payload
    if isinstance(payload, (FwdReq, BwdReq)):
        return _request_key(payload)
    return None


def frame_text(frame: FrameType) -> str:
    """``"function (file.py:line)"`` for a frame (stall reports; smp-torch's too)."""
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


def innermost_module(frame: FrameType | None) -> torch.nn.Module | None:
    """The module whose call is innermost among ``frame`` and its callers (a thread's stack,
    read from another thread: stall reports; smp-torch's too), or None."""
    while frame is not None:
        if frame.f_code.co_name in ("_call_impl", "_wrapped_call_impl"):
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                return owner
        frame = frame.f_back
    return None


def _module(frame: FrameType | None, names: dict[int, str]) -> str:
    """``", in module 'path'"`` for :func:`innermost_module` (named by ``names``, else by its
    class), or ""."""
    owner = innermost_module(frame)
    if owner is None:
        return ""
    return f", in module '{names.get(id(owner), '<' + type(owner).__name__ + '>')}'"


def _where(frame: FrameType | None, names: dict[int, str] | None = None) -> str:
    """Where a thread is: the innermost module it runs (``names``: module paths by id), its
    innermost frame outside Python, torch and this package (the user's code), and its
    innermost frame if that differs."""
    if frame is None:
        return ""
    module = _module(frame, names or {})
    user: FrameType | None = frame
    while user is not None and user.f_code.co_filename.startswith(_LIBRARY_DIRS):
        user = user.f_back
    if user is None:
        return f"{module}, at {frame_text(frame)}"
    if user is frame:
        return f"{module}, at {frame_text(user)}"
    return f"{module}, at {frame_text(user)} (innermost: {frame_text(frame)})"
