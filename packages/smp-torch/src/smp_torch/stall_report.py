"""What a rank is doing when a wait inside smp outlasts ``timeout_s``, and who holds the job up.

A wait of smp (the step's agreement, a collective smp issues, the tensor-parallel step
thread, ``smp.barrier``...) that lasts longer than ``timeout_s`` asks every rank, over the
failure channel (:mod:`smp_torch.watch`), what it is doing. Each rank's *watcher thread*
answers with a :class:`RankReport`, read from the stacks of its main thread and its step
threads: the rank's main thread is not needed, so a rank stuck in user code answers too, and
a rank that does not answer at all is frozen (stopped, swapped out, or its threads cannot
run). :func:`judge` then names the culprit:

1. a rank that did not answer (frozen);
2. else a rank that *runs* — a thread of it is in user code or in a module's computation,
   not in a wait of smp or a collective — the one running longest, with its module;
3. else every rank waits: they wait for different things (a deadlock); the asking rank
   reports every rank's wait.

The module a thread runs is found from its frames (the innermost ``nn.Module`` call) and
named by its path in a model wrapped by ``smp.DistributedModel`` (:func:`register_model`).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import FrameType

import mpi4py
import smp_comm
import smp_pipeline
import torch
from smp_pipeline.diagnosis import frame_text, innermost_module
from torch import nn

__all__ = ["RankReport", "Verdict", "describe", "judge", "register_model"]

# Frames in these directories are not where a thread "is": the standard library (a thread
# blocked in Event.wait is where it called it), torch's module machinery.
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")
# A thread whose innermost frame outside the standard library is in one of these waits for
# other ranks: a collective (torch.distributed, MPI, smp-comm), the pipeline's loop, smp's
# own waits.
_WAIT_DIRS = tuple(
    os.path.join(os.path.dirname(os.path.abspath(m.__file__ or "")), "")
    for m in (torch.distributed, smp_comm, smp_pipeline, mpi4py)
)
_WAIT_FILES = frozenset(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), f) for f in ("waits.py", "watch.py")
)
_WORKER_PREFIX = "smp-pipeline-worker"  # smp_pipeline.worker's thread names

_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def register_model(root: nn.Module) -> None:
    """Name the modules of ``root`` (a model ``smp.DistributedModel`` wraps) in reports."""
    _MODELS.add(root)


def _module_path(module: nn.Module) -> str:
    for root in list(_MODELS):
        for path, m in root.named_modules():
            if m is module:
                return path or "<root>"
    return f"<{type(module).__name__}>"


@dataclass(frozen=True)
class RankReport:
    """One rank's answer to a stall query.

    Attributes:
        rank: the answering rank.
        where: what smp says it does (``"in step 3, reducing gradients ..."``, or outside).
        running: a thread of it runs (user code, a module's computation), not a wait.
        module: the path of the innermost module that thread is in ("" if none).
        at: its innermost frame outside the standard library (``"fn (file.py:12)"``).
        for_s: seconds since it began ``where``.
    """

    rank: int
    where: str
    running: bool
    module: str
    at: str
    for_s: float

    def text(self) -> str:
        """The report in words: ``rank 1 runs module 'layers.0' (at hook (x.py:3)), ...``."""
        doing = "runs" if self.running else "waits"
        module = f" module '{self.module}'" if self.module else ""
        at = f" at {self.at}" if self.at else ""
        return f"rank {self.rank} {doing}{module}{at}, {self.where} for {self.for_s:.1f} s"


def _thread_state(frame: FrameType | None) -> tuple[bool, str, str]:
    """``(running, module path, innermost frame)`` of a thread whose innermost frame is
    ``frame``."""
    if frame is None:
        return False, "", ""
    inner: FrameType | None = frame
    while inner is not None and inner.f_code.co_filename.startswith(_STDLIB):
        inner = inner.f_back
    if inner is None:
        return False, "", frame_text(frame)
    file = inner.f_code.co_filename
    waiting = file.startswith(_WAIT_DIRS) or file in _WAIT_FILES
    owner = innermost_module(inner)
    return not waiting, "" if owner is None else _module_path(owner), frame_text(inner)


def describe(rank: int, where: str, for_s: float, step_threads: Iterable[threading.Thread]) -> RankReport:
    """This rank's :class:`RankReport` (from any thread: the watcher's, when answering).

    The thread described is the first that runs among the step threads (the step at pp = 1
    with tensor parallelism runs on one while the main thread waits for it), the pipeline's
    workers and the main thread, else the main thread; not the calling thread (a rank
    describing itself does so from a wait). Other threads (a data loader's) are not smp's
    to judge.
    """
    frames = sys._current_frames()
    # smp's step threads and the pipeline's workers (which run modules), then the main thread.
    workers = [t for t in threading.enumerate() if t.name.startswith(_WORKER_PREFIX)]
    threads = [*step_threads, *workers]
    idents = [t.ident for t in threads if t.is_alive() and t.ident is not None]
    idents.append(threading.main_thread().ident or -1)
    # The thread asking (the main thread, in a wait that timed out) is where it asks from.
    idents = [i for i in idents if i != threading.get_ident()]
    best: tuple[bool, str, str] = (False, "", "")
    for ident in idents:
        state = _thread_state(frames.get(ident))
        if state[0] or not best[2]:
            best = state
        if state[0]:
            break
    running, module, at = best
    return RankReport(rank, where, running, module, at, for_s)


@dataclass(frozen=True)
class Verdict:
    """Who holds the job up (see the module docstring).

    Attributes:
        rank: the culprit.
        error: ``"<type>: <message>"`` for the failure channel.
        where: what the culprit does.
    """

    rank: int
    error: str
    where: str


def judge(
    asker: int, waited: str, timeout_s: float, reports: Mapping[int, RankReport | None], query_s: float
) -> Verdict:
    """The culprit, from every rank's report (None: it did not answer within ``query_s``).

    Args:
        asker: the rank whose wait timed out.
        waited: what it waited for.
        timeout_s: how long it waited.
        reports: by rank.
        query_s: how long the query waited for answers.
    """
    head = f"rank {asker} waited more than {timeout_s:g} s ({waited})"
    silent = sorted(r for r, rep in reports.items() if rep is None)
    others = "; ".join(rep.text() for _, rep in sorted(reports.items()) if rep is not None)
    if silent:
        r = silent[0]
        text = (
            f"StallError: rank {r} is frozen: it did not answer a stall query within "
            f"{query_s:g} s (its process is stopped, or none of its threads can run); {head}"
        )
        return Verdict(r, f"{text}; {others}" if others else text, "")
    running = [rep for rep in reports.values() if rep is not None and rep.running]
    if running:
        rep = max(running, key=lambda x: (x.for_s, -x.rank))
        module = f" in module '{rep.module}'" if rep.module else ""
        text = (
            f"StallError: rank {rep.rank} made no progress{module} for {rep.for_s:.1f} s "
            f"(at {rep.at or 'an unknown place'}: blocked in user code, or a module that does "
            f"not return); {head}; {others}"
        )
        return Verdict(rep.rank, text, rep.where)
    text = f"StallError: every rank waits inside smp, for different things (a deadlock): {others}"
    return Verdict(asker, f"{text}; {head}", waited)
