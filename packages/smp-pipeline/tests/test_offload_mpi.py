"""Activation offloading across processes equals one process (see offload_cases.py).

One ``mpiexec`` job per suite (pp=2 and pp=4), launched once per test session; each case is
its own test item, so a failure names its case."""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import pytest

pytest.importorskip("mpi4py")
from smp_comm.testing import run_mpi  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "offload_cases.py")
ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
SUITES = {"offload": (2, 200), "offload4": (4, 200)}  # processes, job timeout (s)

OFFLOAD_CASES = [
    *(f"chain-offload-{s}-h{h}" for s, h in (("simple", 1), ("simple", 3), ("interleaved", 1),
                                              ("interleaved", 4))),
    "chain-offload-custom", "seqrun-offload", "seqrun-offload-fast-off", "seq-contiguous-offload",
    "tied-offload-each", "tied-offload-group_2", "branch-offload", "chain-offload-segments",
    "gpt2-offload",
]  # fmt: skip
OFFLOAD4_CASES = [
    "chain4-offload-simple-h2", "chain4-offload-interleaved-h1", "seq4-offload", "branch4-offload",
]

_OUTPUTS: dict[str, str | Exception] = {}


@pytest.fixture(scope="module")
def suite_output() -> Callable[[str], str]:
    """``suite_output(name)``: the output of suite ``name``'s job, launched on first use."""

    def get(name: str) -> str:
        if name not in _OUTPUTS:
            nprocs, timeout = SUITES[name]
            try:
                _OUTPUTS[name] = run_mpi([SCRIPT, name], nprocs, timeout=timeout, env=ENV, fast_exit=True)
            except Exception as exc:  # noqa: BLE001 - every item of the suite reports it
                _OUTPUTS[name] = exc
        got = _OUTPUTS[name]
        if isinstance(got, Exception):
            pytest.fail(f"the {name} suite's job failed: {got}", pytrace=False)
        return got

    return get


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("suite", "case"),
    [*(("offload", c) for c in [*OFFLOAD_CASES, "SUITE-OK"]),
     *(("offload4", c) for c in [*OFFLOAD4_CASES, "SUITE-OK"])],
)  # fmt: skip
def test_offloading_equals_one_process(
    suite_output: Callable[[str], str], suite: str, case: str
) -> None:
    """Bit for bit, with every rank's counters checked (offloaded, reloaded, prefetched,
    within the horizon, pool empty after each step)."""
    out = suite_output(suite)
    if case == "SUITE-OK":
        assert f"SUITE-OK {suite}" in out, out
    else:
        assert case in re.findall(r"^CASE-OK (\S+)", out, flags=re.M), (case, out)
