"""Issue 43's cross-check: every pipeline equivalence case again in static mode or zero-bubble.

``SMP_EQ_PIPELINE_MODE=static`` (or ``zero_bubble``) makes ``test_equivalence.py`` overlay
``static_mode=True`` (or ``pipeline="zero_bubble"``) on every case whose
``pipeline_parallel_degree`` is above 1 before the launch. Each overlaid case is also trained
again without the overlay in the same job and compared with it bit for bit (the equivalence
script's ``bitwise_vs``), unless ``SMP_EQ_BITWISE=0``. A case the overlay cannot apply to is
not silently dropped: it comes back as skipped by design, with the reason, and
``test_equivalence.py`` prints the table of them (``conftest.pytest_terminal_summary``).

CI does not set the variable (three times the pipeline suite does not fit its budget); the
few overlaid cases CI runs are written out in the case lists, built with :func:`overlay_case`.
"""

from __future__ import annotations

import copy
import os

MODES = ("static", "zero_bubble")
ENV_MODE = "SMP_EQ_PIPELINE_MODE"
ENV_BITWISE = "SMP_EQ_BITWISE"

# The suffix an overlaid case's name gets (its CASE-OK line names the mode it ran in).
SUFFIX = {"static": "@static", "zero_bubble": "@zb"}
NO_PIPELINE = "pipeline_parallel_degree 1: no pipeline to overlay (the plain suite runs it)"


def requested_mode() -> str | None:
    """The overlay ``SMP_EQ_PIPELINE_MODE`` asks for (None: unset or empty)."""
    mode = os.environ.get(ENV_MODE, "").strip()
    if not mode:
        return None
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE}={mode!r}: must be one of {MODES} (or unset)")
    return mode


def _skip_reason(config: dict, mode: str) -> str | None:
    """Why ``mode`` cannot be overlaid on a case with ``config`` (None: it can)."""
    if mode == "static":
        return None  # (under tp a stage's leader replays and its followers follow it)
    pipeline = config.get("pipeline", "interleaved")
    if pipeline != "interleaved":
        return (f"the case tests pipeline={pipeline!r}; zero_bubble would replace the schedule "
                "it is there for")  # fmt: skip
    if config.get("deterministic_accumulation") is False:
        return ("deterministic_accumulation=False conflicts with zero_bubble (ConfigError: "
                "W tasks fold into .grad in microbatch order)")  # fmt: skip
    return None


def _already(config: dict, mode: str) -> bool:
    if mode == "static":
        return bool(config.get("static_mode"))
    return config.get("pipeline") == "zero_bubble"


def overlay_case(case: dict, mode: str, bitwise: bool = True) -> dict:
    """``case`` with ``mode`` overlaid (a new dict, renamed with the mode's suffix), and, if
    ``bitwise``, compared bit for bit with the same case without the overlay (merged into the
    case's own ``bitwise_vs`` when it has one, so the other run is fully dynamic)."""
    if mode not in MODES:
        raise ValueError(f"pipeline mode {mode!r}: must be one of {MODES}")
    reason = _skip_reason(case["config"], mode)
    if reason is not None:
        raise ValueError(f"case {case['name']!r} cannot run in {mode}: {reason}")
    out = copy.deepcopy(case)
    out["name"] = case["name"] + SUFFIX[mode]
    config = out["config"]
    if mode == "static":
        config["static_mode"] = True
        undo: dict[str, object] = {"static_mode": False}
    else:
        undo = {"pipeline": config.get("pipeline", "interleaved")}
        config["pipeline"] = "zero_bubble"
    if bitwise or "bitwise_vs" in out:
        out["bitwise_vs"] = {**out.get("bitwise_vs", {}), **undo}
    return out


def apply(cases: list[dict], mode: str | None, bitwise: bool = True) -> tuple[list[dict], list[tuple[str, str]]]:
    """The cases to launch under ``mode`` and the ``(name, reason)`` of those skipped by design.

    Cases without a pipeline (``pipeline_parallel_degree`` 1) are left out (listed with that
    reason: the plain suite runs them); cases that already set the mode run unchanged (they
    are the suite's own coverage of it)."""
    if mode is None:
        return list(cases), []
    run: list[dict] = []
    skipped: list[tuple[str, str]] = []
    names = {c["name"] for c in cases}
    for case in cases:
        config = case["config"]
        if config.get("pipeline_parallel_degree", 1) <= 1:
            skipped.append((case["name"], NO_PIPELINE))
            continue
        if _already(config, mode):
            run.append(case)
            continue
        reason = _skip_reason(config, mode)
        if reason is None and case["name"] + SUFFIX[mode] in names:
            reason = "the suite runs it in this mode already (the CI subset)"
        if reason is not None:
            skipped.append((case["name"], reason))
        else:
            run.append(overlay_case(case, mode, bitwise))
    return run, skipped


def from_env(cases: list[dict]) -> tuple[list[dict], list[tuple[str, str]], str | None]:
    """:func:`apply` with the mode and bitwise switch the environment asks for."""
    mode = requested_mode()
    bitwise = os.environ.get(ENV_BITWISE, "1").strip() != "0"
    run, skipped = apply(cases, mode, bitwise)
    return run, skipped, mode


# What the overlaid launches of this pytest process ran and skipped, per test, for the
# terminal summary: (test, mode, cases launched, [(skipped case, reason)]).
REPORT: list[tuple[str, str, list[str], list[tuple[str, str]]]] = []


# The launches' REPLAY lines (static mode: per rank, steps replayed, fallbacks, why a stage
# cannot replay) and ZB-NOTHING-SPLIT lines (zero-bubble split no layer on any stage).
NOTES: list[str] = []


def summary_lines() -> list[str]:
    """The table of :data:`REPORT` and the :data:`NOTES` (empty when no launch was overlaid)."""
    lines = []
    for test, mode, ran, skipped in REPORT:
        lines.append(f"{test} [{mode}]: {len(ran)} case(s) launched, {len(skipped)} skipped by design")
        lines.extend(f"    skipped {name}: {reason}" for name, reason in skipped)
    return lines + NOTES
