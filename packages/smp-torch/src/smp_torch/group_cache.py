"""``torch.distributed`` process groups, made once per member list and reused across
``smp.init`` calls.

torch keeps every group until it is destroyed, and a gloo group's threads (two workers and
a transport loop waking every 10 ms) end only when its last reference goes, which the
previous models often hold through autograd hooks that the garbage collector cannot see.
A fresh set of groups per ``smp.init`` therefore piled up: after four re-inits a rank ran
26 gloo transport threads, and a 7-case test beside one busy process ran five times slower
(minutes instead of 25 s), in CI past its timeout. Re-initialising with the same topology
now finds the groups it needs here.

A group is reusable only while no collective on it was left unfinished: after a failure,
:func:`forget` drops the groups of that context, so the next ``smp.init`` makes fresh ones.
The dropped groups are not destroyed: a collective a failed peer never joined may still be
running on one, and destroying a gloo group waits for its running work. Every rank calls
:func:`process_group` for the same member lists in the same order (``new_group``'s rule),
and so finds or makes the same groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["GroupKey", "forget", "forget_all", "group_key", "process_group"]

#: A group's identity here: (backend, members).
GroupKey = tuple[str | None, tuple[int, ...]]

# key -> the group new_group returned (NON_GROUP_MEMBER, one shared object, for a non-member:
# so groups are told apart by key, never by object).
_GROUPS: dict[GroupKey, Any] = {}


def group_key(members: Sequence[int], backend: str | None = None) -> GroupKey:
    """The key of the group of ``members`` on ``backend``, the same on every rank."""
    return (backend, tuple(members))


def process_group(members: Sequence[int], backend: str | None = None) -> Any:
    """Collective over the job the first time (``dist.new_group``): the group of ``members``
    on ``backend`` (None: the default group's)."""
    key = group_key(members, backend)
    group = _GROUPS.get(key)
    if group is None:
        group = dist.new_group(ranks=list(members), backend=backend)
        _GROUPS[key] = group
    return group


def forget(keys: Iterable[GroupKey]) -> None:
    """Stop reusing the groups of ``keys`` (after a failure one may still be inside a
    collective): the next :func:`process_group` call for their members makes new ones. Every
    rank must forget the same keys (the caller agrees on the failure first)."""
    for key in keys:
        _GROUPS.pop(key, None)


def forget_all() -> None:
    """Drop every remembered group: the default group is being destroyed (exit)."""
    _GROUPS.clear()
