"""The data-parallel reduction overlapped with backward stays exact under data-dependent
control flow (late accumulations after a bucket left, parameters unused in a step)."""

from __future__ import annotations

from conftest import launch, ok_cases


def test_overlap_with_control_flow_dp2() -> None:
    out = launch("dp_overlap.py", 2, "1", timeout=120)
    assert ok_cases(out) == ["dp-overlap-pp1"], out


def test_overlap_with_control_flow_pp2_dp2() -> None:
    out = launch("dp_overlap.py", 4, "2", timeout=180)
    assert ok_cases(out) == ["dp-overlap-pp2"], out
