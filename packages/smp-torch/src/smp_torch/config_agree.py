"""``smp.init``'s agreement: every rank learns, within a bounded time, whether every rank's
configuration is valid and the same, and all of them raise the same error when not.

Each rank parses its configuration locally first (:func:`smp_torch.config.parse_config`),
keeping a :class:`~smp_torch.errors.ConfigError` instead of raising it: a rank that raised
at once would leave the others waiting for it in the exchange for good (issue 49: a key
misspelt on one rank only). Then :func:`agree_on_config`, through rank 0:

1. rank 0 announces itself to every rank (with its ``timeout_s``);
2. every other rank waits for that announcement, then sends rank 0 its report: its
   comparable configuration (the keys of :data:`~smp_torch.consistency.PER_RANK_KEYS` left
   out) or its error's key and text. A rank that is not answered within its own
   ``timeout_s`` (the parsed value, or the default when its configuration is invalid) tells
   rank 0 it gave up and raises :class:`~smp_torch.errors.SMPError`;
3. rank 0 collects the reports until every rank has reported, one gave up, or its own
   ``timeout_s`` passed, and sends every rank one verdict: agreed; some ranks invalid (their
   keys and texts); the first key the valid configurations disagree on; or the ranks that
   did not report and the ranks that gave up;
4. every rank raises from the verdict (the same error everywhere, but that an invalid rank
   leads with its own key), or returns its configuration.

Why a report waits for rank 0's announcement: so that rank 0 counts only ranks that are
still waiting for its verdict. A rank that gave up before rank 0 arrived never sends a
report, only its "gave up", so rank 0 cannot conclude "agreed" and go on alone into the
collectives that follow ``smp.init``. Once announced, a rank waits rank 0's ``timeout_s``
plus a margin: rank 0 decides within its ``timeout_s``, so its verdict comes in that time.

Every wait polls a nonblocking probe against a deadline. The messages are point-to-point on
``MPI.COMM_WORLD`` (nothing else of smp's uses it point to point), on tags that count the
calls of ``smp.init``: a message left over from a call that failed is never taken for one of
a later call, and one from a rank already a call ahead waits, unread, until this rank gets
there. The verdict goes to every rank, reported or not, so a rank that arrives after rank
0 gave up on it reads at once why the call failed.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from smp_torch.config import SMPConfig
from smp_torch.consistency import PER_RANK_KEYS, by_value, ranks_text
from smp_torch.errors import ConfigError, SMPError

__all__ = ["agree_on_config"]

# Tags: to rank 0 (reports) _TAG_BASE + 2 * (call % _TAG_CALLS), from rank 0 that plus 1;
# within the 32767 every MPI library must allow.
_TAG_BASE = 30000
_TAG_CALLS = 1000
# How long a rank waits for rank 0's verdict beyond rank 0's timeout_s (message delays, a
# rank 0 briefly descheduled).
_VERDICT_MARGIN_S = 5.0
# Polling: fast at first (a healthy exchange takes well under a millisecond), then backing
# off so that a long wait costs little CPU.
_FIRST_SLEEP_S = 5e-5
_MAX_SLEEP_S = 5e-3

_calls = 0
# Sends not complete when their call ended (to a rank that never came): MPI may still read
# their buffers, so they are kept alive here until they complete.
_unfinished: list[Any] = []


@dataclass(frozen=True)
class _Report:
    """A rank's message to rank 0: its comparable configuration, its error, or that it gave
    up waiting for rank 0 (after ``gave_up_s`` seconds)."""

    rank: int
    values: dict[str, Any] | None = None
    error: tuple[str, str] | None = None  # (key, text) of its ConfigError
    gave_up_s: float | None = None


@dataclass(frozen=True)
class _Verdict:
    """Rank 0's decision, sent to every rank (``None`` instead: agreed)."""

    invalid: tuple[tuple[int, str, str], ...] = ()  # (rank, key, text), by rank
    disagree: tuple[str, tuple[tuple[int, Any], ...]] | None = None  # key, (rank, value)s
    missing: tuple[int, ...] = ()  # ranks that did not report within rank 0's timeout_s
    gave_up: tuple[tuple[int, float], ...] = ()  # (rank, its timeout_s)
    timeout_s: float = 0.0  # rank 0's


def agree_on_config(parsed: SMPConfig | ConfigError, comm: Any) -> SMPConfig:
    """Collective over ``comm``, bounded in time: return this rank's configuration if every
    rank's is valid and they agree (but for :data:`PER_RANK_KEYS`); else raise.

    ``parsed`` is what :func:`~smp_torch.config.parse_config` returned or raised here.
    Raises :class:`ConfigError` naming the key and the ranks when a configuration is invalid
    (on an invalid rank: its own key first, chained to its own error) or when the ranks
    disagree; :class:`SMPError` when a rank did not take part in time (module docstring).
    """
    global _calls
    if comm.Get_size() == 1:
        if isinstance(parsed, ConfigError):
            raise parsed
        return parsed
    _calls += 1
    tag = _TAG_BASE + 2 * (_calls % _TAG_CALLS)
    rank = comm.Get_rank()
    if isinstance(parsed, ConfigError):
        report = _Report(rank, error=(parsed.key, parsed.detail))
        timeout_s = SMPConfig().timeout_s
    else:
        values = {k: v for k, v in dataclasses.asdict(parsed).items() if k not in PER_RANK_KEYS}
        report = _Report(rank, values=values)
        timeout_s = parsed.timeout_s
    if rank == 0:
        verdict = _collect(comm, report, tag, timeout_s)
    else:
        verdict = _report(comm, report, tag, timeout_s)
    error = _error(verdict, rank, comm.Get_size())
    if error is not None:
        if isinstance(parsed, ConfigError):
            raise error from parsed
        raise error
    assert isinstance(parsed, SMPConfig)
    return parsed


def _poll(comm: Any, source: int, tag: int, deadline: float) -> Any:
    """The next message from ``source`` with ``tag``, unpickled; ``None`` once ``deadline``
    (``time.monotonic``) has passed without one."""
    sleep = _FIRST_SLEEP_S
    while True:
        msg = comm.improbe(source=source, tag=tag)
        if msg is not None:
            return msg.recv()
        if time.monotonic() > deadline:
            return None
        time.sleep(sleep)
        sleep = min(2 * sleep, _MAX_SLEEP_S)


def _collect(comm: Any, mine: _Report, tag: int, timeout_s: float) -> _Verdict | None:
    """Rank 0: announce itself, gather the reports, decide, send the verdict to every rank."""
    size = comm.Get_size()
    deadline = time.monotonic() + timeout_s
    sends = [comm.isend(("here", timeout_s), dest=r, tag=tag + 1) for r in range(1, size)]
    reports = {0: mine}
    timed_out = False
    while len(reports) < size:
        report = _poll(comm, MPI.ANY_SOURCE, tag, deadline)
        if report is None:
            timed_out = True
            break
        reports[report.rank] = report
        if report.gave_up_s is not None:
            break  # the call fails whatever the others say: tell them now
    verdict = _decide(reports, size, timeout_s if timed_out else None)
    sends += [comm.isend(("verdict", verdict), dest=r, tag=tag + 1) for r in range(1, size)]
    _keep_unfinished(sends)
    return verdict


def _report(comm: Any, mine: _Report, tag: int, timeout_s: float) -> _Verdict | None:
    """Another rank: wait for rank 0's announcement, report, wait for the verdict."""
    here = _poll(comm, 0, tag + 1, time.monotonic() + timeout_s)
    if here is None:
        # Rank 0 must know this rank will not wait for its verdict (see the module docstring).
        _keep_unfinished([comm.isend(_Report(mine.rank, gave_up_s=timeout_s), dest=0, tag=tag)])
        raise SMPError(
            f"rank 0 did not reach smp.init within {timeout_s:g} s (rank {mine.rank}'s "
            "timeout_s; rank 0 compares every rank's configuration)"
        )
    kind, root_timeout_s = here
    assert kind == "here"
    send = comm.isend(mine, dest=0, tag=tag)
    got = _poll(comm, 0, tag + 1, time.monotonic() + root_timeout_s + _VERDICT_MARGIN_S)
    _keep_unfinished([send])
    if got is None:
        raise SMPError(
            f"rank 0 reached smp.init but sent rank {mine.rank} no verdict on the ranks' "
            f"configurations within its timeout_s ({root_timeout_s:g} s) + "
            f"{_VERDICT_MARGIN_S:g} s"
        )
    kind, verdict = got
    assert kind == "verdict"
    return verdict  # type: ignore[no-any-return]


def _keep_unfinished(sends: list[Any]) -> None:
    """Keep the sends not yet complete alive, without waiting for them (a send to a rank
    that never came may never complete); forget those that completed since."""
    _unfinished[:] = [r for r in [*_unfinished, *sends] if not r.Test()]


def _decide(
    reports: dict[int, _Report], size: int, timed_out_s: float | None
) -> _Verdict | None:
    """Rank 0's verdict on the reports it has (``None``: every rank valid and agreeing);
    ``timed_out_s``: rank 0's timeout_s if it passed, ``None`` if rank 0 stopped early (a
    rank gave up), when the ranks that did not report yet are not called missing."""
    missing = () if timed_out_s is None else tuple(r for r in range(size) if r not in reports)
    ordered = sorted(reports.items())
    gave_up = tuple((r, rep.gave_up_s) for r, rep in ordered if rep.gave_up_s is not None)
    invalid = tuple((r, rep.error[0], rep.error[1]) for r, rep in ordered if rep.error)
    if missing or gave_up or invalid:
        timeout_s = timed_out_s or 0.0
        return _Verdict(invalid=invalid, missing=missing, gave_up=gave_up, timeout_s=timeout_s)
    first = reports[0].values
    assert first is not None
    for key in first:
        values = [(r, rep.values[key]) for r, rep in ordered if rep.values is not None]
        if any(v != first[key] for _, v in values):
            return _Verdict(disagree=(key, tuple(values)))
    return None


def _error(verdict: _Verdict | None, rank: int, size: int) -> SMPError | None:
    """The error this rank raises for ``verdict`` (``None``: none)."""
    if verdict is None:
        return None
    if verdict.missing or verdict.gave_up:
        parts = []
        if verdict.missing:
            parts.append(
                f"{ranks_text(list(verdict.missing))} did not reach smp.init within "
                f"{verdict.timeout_s:g} s (rank 0's timeout_s)"
            )
            if rank in verdict.missing:
                parts[-1] += f": rank {rank} (this rank) arrived after rank 0 had given up"
        for r, waited in verdict.gave_up:
            parts.append(
                f"rank {r} stopped waiting for rank 0 in smp.init after {waited:g} s (its "
                "timeout_s), before rank 0 arrived"
            )
        if verdict.invalid:
            parts.append(f"besides, {ConfigError(*_invalid_text(verdict.invalid, rank, size))}")
        return SMPError("; ".join(parts))
    if verdict.invalid:
        return ConfigError(*_invalid_text(verdict.invalid, rank, size))
    assert verdict.disagree is not None
    key, values = verdict.disagree
    return ConfigError(
        key,
        f"ranks disagree: {by_value(list(values))}; every rank must pass the same "
        "configuration",
    )


def _invalid_text(
    invalid: tuple[tuple[int, str, str], ...], rank: int, size: int
) -> tuple[str, str]:
    """``(key, text)`` for the invalid ranks: ranks with the same key and text are one group;
    this rank's own group comes first (its own error leads), else the lowest rank's."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r, key, text in invalid:
        groups.setdefault((key, text), []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (rank not in kv[1], kv[1]))

    def where(ranks: list[int]) -> str:
        return f"every rank ({size})" if len(ranks) == size else ranks_text(ranks)

    (key, text), ranks = ordered[0]
    parts = [f"invalid on {where(ranks)}: {text}"]
    parts += [f"key {k!r} invalid on {where(rs)}: {t}" for (k, t), rs in ordered[1:]]
    return key, "; also ".join(parts)
