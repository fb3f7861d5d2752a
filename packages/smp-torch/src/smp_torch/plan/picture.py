"""A picture of a plan's top candidates: predicted step time, and each stage's predicted
peak memory against the budget (``python -m smp_torch.plan ... --plot plan.png``).

The table says the same in numbers; the picture shows at a glance how close each pick runs
to the budget, stage by stage, and what the faster candidates that do not fit would need.
matplotlib is optional (smp-torch's ``test`` extra has it; ``pip install matplotlib``):
imported only when a picture is asked for.
"""

from __future__ import annotations

from smp_partition.plan import Estimate, Plan

__all__ = ["plot_plan"]

_FITS, _OVER = "#4c72b0", "#c44e52"


def _rows(result: Plan, top: int) -> list[Estimate]:
    """The ``top`` fastest candidates that fit, then up to 3 faster ones that do not (what
    the budget costs), fastest first."""
    fitting = result.feasible[:top]
    if not fitting:
        return sorted(result.estimates, key=lambda e: e.step_s)[:top]
    limit = fitting[0].step_s
    faster = [e for e in result.estimates if not e.fits and e.step_s < limit]
    return sorted([*fitting, *sorted(faster, key=lambda e: e.step_s)[:3]], key=lambda e: e.step_s)


def plot_plan(result: Plan, path: str, top: int = 8) -> None:
    """Write a PNG of ``result``'s ``top`` fitting candidates (and up to 3 faster ones that
    do not fit, in red): predicted step time on the left, each stage's predicted peak per
    rank on the right with the budget as a dashed line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("plotting a plan needs matplotlib: pip install matplotlib") from exc
    rows = _rows(result, top)
    if not rows:
        raise ValueError("the plan has no candidate to draw")
    # A candidate that does not fit says why under its name (its tick label, in red).
    labels = [e.candidate.label() + ("" if e.fits else f"\n{(e.reason or '')[:48]}") for e in rows]
    ys = list(range(len(rows)))[::-1]  # fastest at the top
    colours = [_FITS if e.fits else _OVER for e in rows]
    gib = 2.0**30
    unit, scale = ("GiB", gib) if result.memory_per_rank >= gib else ("MiB", 2.0**20)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 1.6), sharey=True)
    ax_t.barh(ys, [e.step_s for e in rows], color=colours)
    ax_t.set_yticks(ys, labels, fontsize=7)
    for tick, colour in zip(ax_t.get_yticklabels(), colours):
        tick.set_color(colour)
    ax_t.set_xlabel("predicted step time (s)")
    for y, e in zip(ys, rows):
        ax_t.text(e.step_s, y, f" {e.step_s:.3g} s, bubble {e.bubble:.0%}", va="center", fontsize=7)
    # Each stage's peak as a thin bar inside the candidate's row.
    for y, e, colour in zip(ys, rows, colours):
        n = max(len(e.stage_peak_bytes), 1)
        height = 0.8 / n
        for s, peak in enumerate(e.stage_peak_bytes):
            ax_m.barh(y + 0.4 - height * (s + 0.5), peak / scale, height=height * 0.9, color=colour)
    ax_m.axvline(result.memory_per_rank / scale, color="black", linestyle="--", linewidth=1)
    ax_m.set_xlabel(f"predicted peak per rank, a bar per stage ({unit}); dashed: budget")
    fig.suptitle(
        f"smp.plan: {result.world_size} ranks, {result.memory_per_rank / scale:.4g} {unit} per rank "
        f"(blue fits, red does not)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
