"""The examples in the monorepo's examples/ folder run under MPI and learn (short runs)."""

from __future__ import annotations

import json
import os

import pytest
from smp_comm.testing import run_mpi

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
pytestmark = pytest.mark.skipif(
    not os.path.isdir(EXAMPLES), reason="examples/ is not beside this package (installed copy)"
)
ENV = {"OMP_NUM_THREADS": "1", "SMP_CONFIG": ""}


def _run(script: str, nprocs: int, *args: str) -> str:
    return run_mpi([os.path.join(EXAMPLES, script), *args], nprocs, timeout=240, env=ENV, fast_exit=True)


def test_gpt_pipeline_writes_table_timeline_and_learns(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = _run(
        "gpt/train.py", 2, "--pp", "2", "--microbatches", "2", "--steps", "8", "--batch", "8",
        "--seq", "32", "--layers", "2", "--out", str(tmp_path), "--timeline", "--sample", "5",
    )  # fmt: skip
    assert "pipeline stages" in out and "lower bound" in out  # the partition table
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["losses"][-1] < metrics["losses"][0]
    assert len(metrics["sample"]) == len("It is a truth ") + 5
    for name in ("partition.svg", "timeline.json", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    trace = json.loads((tmp_path / "timeline.json").read_text())
    assert any(e.get("cat") == "backward" for e in trace["traceEvents"])


def test_control_flow_equals_one_process() -> None:
    out = _run("control_flow/train.py", 2, "--pp", "2", "--steps", "8", "--check")
    assert "equal to one process at every step" in out


def test_t5_tied_embeddings_pipeline() -> None:
    out = _run("t5/train.py", 2, "--pp", "2", "--steps", "6", "--batch", "4", "--seq", "16")
    first, last = out.split("loss ")[1].split(" -> ")
    assert float(last.split()[0]) < float(first)


def test_recsys_tensor_parallel_embeddings() -> None:
    out = _run("recsys/train.py", 2, "--tp", "2", "--steps", "20", "--users", "2000", "--items", "3000")
    assert "recsys: 20 steps on 2 processes (tp=2)" in out
    first, last = out.split("loss ")[1].split(" -> ")
    assert float(last.split()[0]) < float(first)


def test_sharded_gpt_fits_the_budget() -> None:
    out = _run("sharded/train.py", 4, "--sdp", "4", "--steps", "6", "--dim", "128", "--layers", "2",
               "--seq", "32", "--batch", "8", "--budget-mib", "2.5")  # fmt: skip
    assert "sdp=4" in out and "within the budget (plain data parallelism would not fit)" in out, out
    first, last = out.split("loss ")[1].split(" -> ")
    assert float(last.split()[0].rstrip(";")) < float(first)


def test_long_context_cp2_learns_and_splits_activations() -> None:
    pytest.importorskip("transformers")
    out = _run("long_context/train.py", 2, "--cp", "2", "--seq", "64", "--steps", "8", "--dim", "32",
               "--attention", "ring")
    assert "(cp=2 dp=1, attention ring), 64 tokens per sequence, 32 per rank" in out and "loss fell from" in out, out
    first, last = out.split("loss fell from ")[1].split(" to ")
    assert float(last.split()[0]) < float(first)
    ratios = [float(line.rsplit("(", 1)[1].rstrip("x)")) for line in out.splitlines() if "saved for backward" in line]
    assert len(ratios) == 2 and all(r < 0.75 for r in ratios), out  # each rank keeps about half
