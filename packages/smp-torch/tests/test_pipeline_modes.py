"""The equivalence suite's pipeline-mode overlay (tests/pipeline_modes.py), without processes."""

from __future__ import annotations

import pipeline_modes
import pytest
import test_equivalence as eq


def _names(cases: list[dict]) -> list[str]:
    return [c["name"] for c in cases]


def test_unset_mode_launches_the_cases_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pipeline_modes.ENV_MODE, raising=False)
    run, skipped, mode = pipeline_modes.from_env(eq.PP2_CASES)
    assert mode is None and skipped == [] and run == eq.PP2_CASES


def test_unknown_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pipeline_modes.ENV_MODE, "static_mode")
    with pytest.raises(ValueError, match="SMP_EQ_PIPELINE_MODE='static_mode'"):
        pipeline_modes.from_env(eq.PP2_CASES)


def test_static_overlay_compares_with_dynamic_mode() -> None:
    run, skipped = pipeline_modes.apply(eq.PP2_CASES, "static")
    # (the CI subset's static case is not run twice)
    assert skipped == [("pp2-list-chained-checkpointing", "the suite runs it in this mode already (the CI subset)")]
    assert len(set(_names(run))) == len(run)
    by_name = {c["name"]: c for c in run}
    case = by_name["pp2-mb2@static"]
    assert case["config"] == {"pipeline_parallel_degree": 2, "microbatches": 2, "static_mode": True}
    assert case["bitwise_vs"] == {"static_mode": False}
    # a case that sets the mode itself runs as written
    assert "pp2-seq-static" in by_name and by_name["pp2-seq-static"]["config"]["static_mode"]
    # the case lists are not modified in place
    assert "static_mode" not in eq.PP2_CASES[0]["config"]


def test_static_overlay_runs_tensor_parallel_cases_and_skips_unpipelined_ones() -> None:
    run, skipped = pipeline_modes.apply(eq.LLAMA_CASES, "static")
    reasons = dict(skipped)
    names = {c["name"] for c in run}
    assert {"llama-pp2-tp2@static", "llama-pp2-tp2-zero-bubble@static"} <= names, names
    assert reasons["llama-tp2-dp2"] == pipeline_modes.NO_PIPELINE
    # T5's zero-bubble case: its own bitwise_vs merged, so the other run is fully dynamic
    zb = next(c for c in run if c["name"] == "t5-pp2-dp2-zero-bubble@static")
    assert zb["bitwise_vs"] == {"pipeline": "interleaved", "static_mode": False}


def test_zero_bubble_overlay_skips_conflicting_configurations() -> None:
    run, skipped = pipeline_modes.apply(eq.PP2_CASES, "zero_bubble", bitwise=False)
    reasons = dict(skipped)
    assert set(reasons) == {"pp2-simple-mb4", "pp2-seq-offload-simple", "pp2-checkpointing-offload",
                            "pp2-mb1-sgd-untied"}  # fmt: skip
    assert "pipeline='simple'" in reasons["pp2-simple-mb4"]
    assert "already" in reasons["pp2-mb1-sgd-untied"]
    assert len(run) + len(skipped) == len(eq.PP2_CASES)
    assert all(c["config"]["pipeline"] == "zero_bubble" for c in run)
    assert "bitwise_vs" not in next(c for c in run if c["name"] == "pp2-mb2@zb")
    # with the bitwise comparison: against the schedule the case had
    compared = {c["name"]: c for c in pipeline_modes.apply(eq.PP2_CASES, "zero_bubble")[0]}
    assert compared["pp2-mb2@zb"]["bitwise_vs"] == {"pipeline": "interleaved"}
    conflict = eq._case("x", pipeline_parallel_degree=2, deterministic_accumulation=False)
    _, skipped = pipeline_modes.apply([conflict], "zero_bubble")
    assert "deterministic_accumulation" in skipped[0][1]
    with pytest.raises(ValueError, match="cannot run in zero_bubble"):
        pipeline_modes.overlay_case(conflict, "zero_bubble")
