"""A few hundred generated malformed inputs: one-line error, exit 2, no traceback, no hang.

The cases come from ``malformed.py`` (seeded, deterministic). All of them run through the
console script's own function in one helper interpreter (``cli_batch.py``); a spread of
them also runs as real ``smp-partition`` processes; and the graph cases go through the API,
which must raise ``GraphError``/``PartitionError``, never ``KeyError``, ``TypeError``,
``OverflowError`` or ``RecursionError``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from malformed import DEFAULT_ARGS, HANG_TIMEOUT_S, Case, argv_for, cases, positive
from smp_partition import GraphError, Module, ModuleGraph, PartitionError, partition
from smp_partition.cli import main

PREFIX = "smp-partition: error: "
CASES = cases()
BY_ID = {c.id: c for c in CASES}
POSITIVE = positive()
HERE = Path(__file__).parent


def check_error(case: Case, rc: int, stdout: str, stderr: str, seconds: float) -> None:
    """What every malformed case must give: exit 2, one line naming the fault, quickly."""
    where = f"case {case.id}: rc={rc} stderr={stderr[-500:]!r}"
    assert seconds < HANG_TIMEOUT_S, where
    assert "Traceback" not in stdout and "Traceback" not in stderr, where
    assert rc == case.rc, where
    if case.rc == 0:
        return
    assert stderr.startswith(PREFIX), where
    assert stderr.endswith("\n") and stderr.count("\n") == 1, where
    for fragment in case.expect:
        assert fragment in stderr, f"{where}: missing {fragment!r}"


def test_there_are_a_few_hundred_distinct_cases() -> None:
    assert len(CASES) >= 250
    assert [c.id for c in cases()] == [c.id for c in CASES]  # same seed, same cases
    assert all(c.expect for c in CASES) and all(c.rc == 2 for c in CASES)


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every case (and the positive controls) through cli_batch.py: id -> its report."""
    root = tmp_path_factory.mktemp("malformed")
    jobs = []
    for n, case in enumerate([*CASES, *POSITIVE]):
        tmp = root / str(n)
        tmp.mkdir()
        jobs.append([case.id, argv_for(case, tmp)])
    # The alarm stops a hung case after HANG_TIMEOUT_S; this outer limit only guards
    # against the helper itself never finishing.
    done = subprocess.run(
        [sys.executable, str(HERE / "cli_batch.py"), "--timeout", str(HANG_TIMEOUT_S)],
        input=json.dumps(jobs), capture_output=True, text=True,
        timeout=HANG_TIMEOUT_S * 20, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(reports) == len(jobs), done.stderr[-3000:]
    return {r["id"]: r for r in reports}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_in_process(case: Case, batch: dict[str, dict[str, Any]]) -> None:
    r = batch[case.id]
    assert r["exception"] is None, f"case {case.id}: {r['exception']}"
    check_error(case, r["rc"], r["stdout"], r["stderr"], r["seconds"])


@pytest.mark.parametrize("case", POSITIVE, ids=[c.id for c in POSITIVE])
def test_valid_extremes_succeed(case: Case, batch: dict[str, dict[str, Any]]) -> None:
    r = batch[case.id]
    assert r["exception"] is None, f"case {case.id}: {r['exception']}"
    check_error(case, r["rc"], r["stdout"], r["stderr"], r["seconds"])
    assert r["stderr"] == ""


def test_batch_runs_the_console_scripts_function() -> None:
    """cli_batch.py must exercise exactly what the installed ``smp-partition`` runs."""
    sys.path.insert(0, str(HERE))
    try:
        from cli_batch import console_main
    finally:
        sys.path.remove(str(HERE))
    assert console_main() is main


def _spread() -> list[Case]:
    """~20 cases for real processes: the first of each kind of defect, then a seeded few."""
    kinds: dict[str, Case] = {}
    for c in CASES:
        kinds.setdefault(c.id.split("-")[0], c)
    picked = list(kinds.values())
    for must in ("deep-lists", "not-utf8-ff", "chain-cycle", "surrogate-type", "newline-path"):
        if BY_ID[must] not in picked:
            picked.append(BY_ID[must])
    return picked[:24]


def _script() -> list[str]:
    """The installed console script, else ``python -m smp_partition`` (same main)."""
    script = Path(sys.executable).with_name("smp-partition")
    if script.exists():
        return [str(script)]
    found = shutil.which("smp-partition")
    return [found] if found else [sys.executable, "-m", "smp_partition"]


SPREAD = _spread()


@pytest.mark.parametrize("case", SPREAD, ids=[c.id for c in SPREAD])
def test_cli_real_process(case: Case, tmp_path: Path) -> None:
    argv = argv_for(case, tmp_path)
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run(
        [*_script(), *argv], capture_output=True, timeout=HANG_TIMEOUT_S, cwd=tmp_path, env=env
    )
    # The error line may quote the input; decode as a terminal would, never fail on it.
    out = done.stdout.decode("utf-8", "replace")
    err = done.stderr.decode("utf-8", "replace")
    # timeout= above raises on a hang, so reaching here means it finished in time.
    check_error(case, done.returncode, out, err, 0.0)


# ---------------------------------------------------------------------------- the API
API_CASES = [c for c in CASES if c.api]


@pytest.mark.parametrize("case", API_CASES, ids=[c.id for c in API_CASES])
def test_api_raises_graph_error(case: Case, tmp_path: Path) -> None:
    path, *args = argv_for(case, tmp_path)
    assert tuple(args) == DEFAULT_ARGS  # only the graph is at fault
    with pytest.raises(GraphError) as info:
        partition(ModuleGraph.from_json(path), num_devices=2)
    text = str(info.value)
    assert "\n" not in text
    for fragment in case.expect:
        assert fragment in text, f"{case.id}: {text!r} lacks {fragment!r}"
    if case.content is None:
        return
    try:
        data = json.loads(case.content.decode("utf-8"))
    except (ValueError, RecursionError):
        return  # not a JSON document: only from_json can see it
    with pytest.raises(GraphError):
        ModuleGraph.from_dict(data)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"num_devices": 0}, "num_devices"), ({"num_devices": -1}, "num_devices"),
        ({"num_devices": 2.0}, "num_devices"), ({"num_devices": True}, "num_devices"),
        ({"num_devices": "2"}, "num_devices"), ({"num_devices": 2**21}, "num_devices"),
        ({"num_devices": 2, "alpha": float("nan")}, "alpha"),
        ({"num_devices": 2, "alpha": 1.5}, "alpha"), ({"num_devices": 2, "alpha": "1"}, "alpha"),
        ({"num_devices": 2, "method": "greedy"}, "method"),
        ({"num_devices": 2, "balance_slack": float("nan")}, "balance_slack"),
        ({"num_devices": 2, "balance_slack": -1}, "balance_slack"),
    ],
)  # fmt: skip
def test_api_raises_partition_error(kwargs: dict[str, Any], fragment: str) -> None:
    graph = ModuleGraph([Module("", children=("a",)), Module("a", params={"w": 1})])
    with pytest.raises(PartitionError, match=fragment):
        partition(graph, **kwargs)


@pytest.mark.parametrize(
    "modules,fragment",
    [
        ([Module("", children=None)], "children"),  # type: ignore[arg-type]
        ([Module("", children="abc")], "children"),  # a str would be its characters
        ([Module("", children=(3,))], "child 3"),  # type: ignore[arg-type]
        ([Module("", children=([],))], "child a list"),  # type: ignore[arg-type]
        ([Module("", type=None)], "'type'"),  # type: ignore[arg-type]
        ([Module("", params=None)], "params"),  # type: ignore[arg-type]
        ([Module("", params={"w": 10**400})], "too large"),
        ([Module("", activation_bytes=10**400)], "too large"),
        ([Module("", forward_ms=float("inf"))], "finite"),
        ([Module("", activation_bytes=None)], "activation_bytes"),  # type: ignore[arg-type]
        ([Module(3)], "name"),  # type: ignore[arg-type]
        ([Module("\ud800")], "Unicode"),
        (["not a module"], "modules[0]"),
    ],
)  # fmt: skip
def test_api_module_records(modules: list[Any], fragment: str) -> None:
    """Module records built in code meet the same validation as JSON (no TypeError)."""
    with pytest.raises(GraphError) as info:
        ModuleGraph(modules)
    assert fragment in str(info.value)


def test_recursion_limit_untouched_by_deep_chain() -> None:
    """A 10,000-deep chain validates and partitions with the default recursion limit."""
    mods = [Module("", children=("c0",))] + [
        Module(f"c{i}", children=(f"c{i + 1}",) if i < 9_999 else (), params={f"c{i}": 1})
        for i in range(10_000)
    ]
    assert sys.getrecursionlimit() <= 10_000
    result = partition(ModuleGraph(mods), num_devices=4)
    assert result.max_load == pytest.approx(0.25, abs=1e-3)
