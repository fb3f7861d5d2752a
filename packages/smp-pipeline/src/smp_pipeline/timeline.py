"""The execution timeline: Chrome-trace JSON and a PNG like the paper's Figure 5.

Every EXECUTING span of a task is one event ``(pp rank, microbatch, module, phase, start,
end)`` (wall-clock seconds; the phase an :class:`~smp_pipeline.actions.ActionKind` member, or
its old string: they compare equal). ``to_chrome_trace`` gives a ``chrome://tracing`` / Perfetto file
with one row per rank; ``plot_timeline`` draws the same with matplotlib (the ``[plot]``
extra), forward spans light and backward spans dark, coloured by microbatch; zero-bubble's
weight-gradient tasks (phase ``weight_grad``) in one colour of their own, hatched.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

Event = Sequence[Any]  # (rank, mb, module, phase, start, end)

_NAMES = {"forward": "FWD", "backward": "BWD", "weight_grad": "W"}
W_COLOUR = "#9e9e9e"  # weight-gradient tasks: grey, whatever their microbatch


def to_chrome_trace(events: Iterable[Event]) -> dict[str, Any]:
    """Events as a Chrome-trace dictionary (microseconds from the earliest start)."""
    events = list(events)
    t0 = min((e[4] for e in events), default=0.0)
    trace = []
    for rank, mb, module, phase, start, end in events:
        trace.append(
            {
                "name": f"{_NAMES.get(str(phase), 'BWD')} mb{mb} {module or '<root>'}",
                "cat": phase,
                "ph": "X",
                "ts": (start - t0) * 1e6,
                "dur": max(end - start, 0.0) * 1e6,
                "pid": 0,
                "tid": int(rank),
                "args": {"microbatch": mb, "module": module, "phase": phase, "rank": rank},
            }
        )
    ranks = sorted({int(e[0]) for e in events})
    meta = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"pp rank {r}"}}
        for r in ranks
    ]
    return {"traceEvents": meta + trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[Event], path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_chrome_trace(events), f)


def plot_timeline(events: Iterable[Event], path: str, title: str = "pipeline timeline") -> None:
    """Draw the timeline as a PNG (needs matplotlib: ``pip install smp-pipeline[plot]``)."""
    # matplotlib is optional (the [plot] extra): imported only when a plot is asked for.
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plot_timeline needs matplotlib: pip install 'smp-pipeline[plot]'") from exc
    events = list(events)
    t0 = min((e[4] for e in events), default=0.0)
    ranks = sorted({int(e[0]) for e in events})
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * max(len(ranks), 1)))
    for rank, mb, _module, phase, start, end in events:
        w = phase == "weight_grad"
        color = W_COLOUR if w else cmap((2 * int(mb)) % 20 + (0 if phase == "backward" else 1))
        ax.barh(
            int(rank),
            (end - start) * 1e3,
            left=(start - t0) * 1e3,
            height=0.8,
            color=color,
            edgecolor="black" if phase == "backward" else "none",
            linewidth=0.3,
            hatch="///" if w else None,
        )
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"pp rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{title} (light: forward, dark/outlined: backward, colour: microbatch; "
                 "grey hatched: weight gradients)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
