"""Whether torch's native collective threads in this process have gone quiet.

At exit a process that ran gloo collectives pauses, so that gloo's worker threads
(``pt_gloo_runloop``) drop the collectives that have just ended while the interpreter can
still give them the GIL (:mod:`smp_comm.shutdown`, point 4). After a normal run those threads
are usually idle long before the exit; a fixed pause, scaled by the host's load, still cost
every process 0.5-4 s (2.5 s measured at a load average of 10 on 2 cores), on every rank of
every job. :func:`wait_until_quiet` ends the pause as soon as each such thread has been
asleep without running for a few polls in a row, reading its state from
``/proc/self/task/<tid>/stat`` and its time on a CPU from ``.../schedstat`` (nanoseconds).

"Asleep" is state ``S``: a thread that is runnable but not yet scheduled reads ``R``, and a
thread that waits for the GIL gets it within a poll, since this thread sleeps between polls;
either way its CPU time moves, and the quiet count starts again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["GLOO_THREAD", "Sample", "read_threads", "wait_until_quiet"]

#: The name (``comm``) of gloo's worker threads in torch.
GLOO_THREAD = "pt_gloo_runloop"

#: One look at the threads: task id -> (state letter, nanoseconds on a CPU so far).
Sample = dict[str, tuple[str, int]]

_TASKS = "/proc/self/task"


def read_threads(name: str = GLOO_THREAD) -> Sample | None:
    """This process's threads called ``name``, each with its state and CPU time; None where
    ``/proc`` cannot tell (not Linux, or no schedstat)."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    sample: Sample = {}
    for tid in tids:
        base = f"{_TASKS}/{tid}"
        try:
            with open(f"{base}/comm") as f:
                if f.read().strip() != name:
                    continue
            with open(f"{base}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"{base}/schedstat") as f:
                ran = int(f.read().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        except (OSError, IndexError, ValueError):
            return None
        sample[tid] = (state, ran)
    return sample


def wait_until_quiet(
    max_s: float,
    *,
    poll_s: float = 0.02,
    quiet_polls: int = 3,
    sample: Callable[[], Sample | None] = read_threads,
) -> bool:
    """Sleep until every gloo worker thread (``sample``'s threads) has been asleep, without
    running, across ``quiet_polls`` polls in a row, ``poll_s`` apart; at most ``max_s``
    seconds. True once they are quiet (at once if there are none); False after ``max_s``,
    or after sleeping ``max_s`` where the threads cannot be read."""
    deadline = time.monotonic() + max_s
    last = sample()
    if last is None:
        time.sleep(max_s)
        return False
    quiet = 0
    while True:
        if quiet >= quiet_polls or not last:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(poll_s, left))
        now = sample()
        if now is None:
            time.sleep(max(0.0, deadline - time.monotonic()))
            return False
        # the same threads, each asleep and not run since the last look
        still = now.keys() == last.keys() and all(
            state == "S" and ran == last[tid][1] for tid, (state, ran) in now.items()
        )
        quiet = quiet + 1 if still else 0
        last = now
