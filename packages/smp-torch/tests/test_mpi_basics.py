"""Real MPI jobs: groups and communication, configuration errors on every rank."""

from __future__ import annotations

import functools
import re
import time

import pytest
from conftest import launch
from smp_comm.testing import MPIRunError
from smp_torch.errors import ConfigError  # noqa: F401 - the error the scripts expect


def test_groups_and_comm_api_on_4_ranks() -> None:
    out = launch("groups.py", 4, timeout=120)
    assert out.count("LAYOUT-OK") == 10, out  # five layouts, initialised twice
    assert "REINIT-OK" in out, out
    assert out.count("REINIT-AFTER-FAILURE-OK") == 4, out


def test_bad_configs_raise_on_every_rank() -> None:
    out = launch("bad_config.py", 2, timeout=60)
    hits = re.findall(r"RANK (\d) CONFIGERROR ([a-z_]+)", out)
    keys = [
        "pipeline_parallel_degree",
        "tensor_parallel_degree",
        "no_such_key",
        "microbatches",
        "ddp",
        "placement_strategy",
        "pipeline",
        "memory_weight",
    ]
    for key in keys:
        for rank in ("0", "1"):
            assert (rank, key) in hits, (rank, key, out)


def test_uncaught_bad_config_fails_fast_on_both_ranks() -> None:
    # From the moment the ranks raise to the end of the job: a bound on a hang (a rank left
    # waiting for a peer that died would run into timeout_s, 300 s by default). The imports
    # before it are not counted: on a busy machine they took 47-79 s (load 16).
    with pytest.raises(MPIRunError) as info:
        launch("bad_config.py", 2, "--uncaught", "0", timeout=180, fast_exit=False)
    ended = time.time()
    out = str(info.value)
    assert "timed out" not in out.splitlines()[0], out
    raised = [float(t) for t in re.findall(r"RANK \d RAISING AT ([0-9.]+)", out)]
    assert len(raised) == 2, out
    assert ended - min(raised) < 30, (ended - min(raised), out)
    assert "ConfigError: smp config key 'pipeline_parallel_degree'" in out


LAYOUTS = [("1", "2"), ("2", "2"), ("1", "1"), ("2", "1")]


@functools.cache
def _failures() -> str:
    """One 4-rank job for every layout (scripts/failures.py re-initialises smp after each
    failure): the launch and the ranks' imports cost more than a layout's steps."""
    return launch(
        "failures.py", 4, *(f"{tp}:{pp}" for tp, pp in LAYOUTS), timeout=120 * len(LAYOUTS), fast_exit=False
    )


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_failure_in_one_pipeline_raises_on_every_rank(tp: str, pp: str) -> None:
    """4 ranks (pp=2 x dp=2, pp=2 x tp=2, dp=4, tp=2 x dp=2): the step function raises in one pipeline
    (one rank with dp=4) only; every rank of the job must raise (nobody waits in a
    collective), well within the timeout. Then, after every layout, every rank exits
    normally, status 0, although threads of the ranks that did not fail may still be blocked
    in a collective."""
    out = _failures()
    assert "terminate called" not in out, out
    layout = f"{tp}:{pp}"
    lines = re.findall(rf"RANK (\d) RAISED {layout} \w+ ([\d.]+): (.*)", out)
    raised = {rank: float(took) for rank, took, _ in lines}
    assert sorted(rank for rank, _, _ in lines) == ["0", "1", "2", "3"], out
    # From the layout's first step to the raise, on every rank: a rank left waiting in a
    # collective raises only when the layout's timeout_s (60 s) runs out. (The job as a whole
    # had to end within 90 s, its imports included; 0.1-13 s per layout at load 18.)
    assert all(took < 45 for took in raised.values()), (raised, out)
    assert any("boom in the last pipeline" in said for _, _, said in lines), out
    assert f"{layout} NO ERROR" not in out, out


def test_a_rank_waiting_for_a_slower_peer_does_not_spin() -> None:
    """``scripts/idle_wait.py``: rank 0 waits ~3 s in ``smp.DistributedModel`` for rank 1,
    and rank 1 ~3 s in the first step for rank 0's partition. The waiting rank's process must
    use well under the wait in CPU time (it sleeps between polls); a blocking MPI collective
    there spins (the whole wait in CPU seconds: 3.0-3.1 before the fix). CPU seconds, not a
    latency: a busy machine lengthens the wait, not the CPU a sleeping rank uses."""
    out = launch("idle_wait.py", 2, timeout=120)
    found = {
        (int(r), what): (float(wall), float(cpu))
        for r, what, wall, cpu in re.findall(r"RANK (\d) (MODEL|STEP) wall ([\d.]+) cpu ([\d.]+)", out)
    }
    for waiter, what in ((0, "MODEL"), (1, "STEP")):
        wall, cpu = found[(waiter, what)]
        assert wall >= 2.5, (waiter, what, wall, out)  # it did wait for its peer
        assert cpu < 0.2 * wall, f"rank {waiter} spun while waiting ({what}): {cpu:.2f} s CPU in {wall:.2f} s\n{out}"
