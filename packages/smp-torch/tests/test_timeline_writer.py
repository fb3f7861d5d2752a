"""Only one pipeline replica writes the timeline files (``DistributedModel.write_timeline``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from smp_torch.model import DistributedModel


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []

    def write_timeline(self, json_path: Any, png_path: Any) -> list[str]:
        self.calls.append((json_path, png_path))
        return ["events"]


def _write(pipeline: list[int], *paths: str) -> tuple[list[tuple[Any, Any]], Any]:
    engine = _Engine()
    model = SimpleNamespace(
        _cfg=SimpleNamespace(pp=2, timeline="/tmp/run/timeline"),
        context=SimpleNamespace(groups={"pp": pipeline}),
        engine=engine,
    )
    out = DistributedModel.write_timeline(model, *paths)  # type: ignore[arg-type]
    return engine.calls, out


def test_the_pipeline_of_rank_0_writes_the_files() -> None:
    calls, out = _write([0, 2])
    assert calls == [("/tmp/run/timeline.json", "/tmp/run/timeline.png")]
    assert out == ["events"]


def test_other_replicas_gather_but_write_nothing() -> None:
    """At pp = 2 x dp = 2 both pipelines wrote the same paths at once (a corrupt JSON)."""
    calls, out = _write([1, 3])
    assert calls == [(None, None)]  # still the collective gather: its pp ranks wait for it
    assert out == ["events"]


def test_other_replicas_write_paths_given_to_them() -> None:
    """An argument is never accepted and ignored: paths a replica is given, it writes."""
    calls, _ = _write([1, 3], "/tmp/run/tl_dp1.json", "/tmp/run/tl_dp1.png")
    assert calls == [("/tmp/run/tl_dp1.json", "/tmp/run/tl_dp1.png")]
