"""static_mode's replay (smp_pipeline.replay): later steps replay each serving rank's
recorded one, bit for bit like dynamic mode, and a step that differs from the recording
falls back to dynamic mode, counted (replay_cases.py under ``mpiexec``)."""

from __future__ import annotations

import os

import pytest
import torch
from smp_pipeline.messages import pack
from smp_pipeline.protocol import BwdReq, FwdReq
from smp_pipeline.replay import request_signature

HERE = os.path.dirname(os.path.abspath(__file__))


def _request(shape=(4, 8), dtype=torch.float32, path="blocks.1", span=None, scale=1.0) -> FwdReq:
    t = torch.zeros(shape, dtype=dtype, requires_grad=True)
    return FwdReq(0, (0, 3), path, 5, 1, True, [], False, span, (), (), pack(((t, scale), {}), True))


def test_a_request_signature_ignores_the_step_and_call_but_not_what_runs() -> None:
    base = request_signature(_request())
    t = torch.ones(4, 8, requires_grad=True)
    again = FwdReq(0, (0, 99), "blocks.1", 9, 1, True, [], False, None, (), (), pack(((t, 1.0), {}), True))
    assert request_signature(again) == base  # another step, call key and values: the same
    for other in (
        _request(shape=(2, 8)),
        _request(dtype=torch.float64),
        _request(path="blocks.2"),
        _request(span=("blocks.1", "blocks.2")),
        _request(scale=2.0),  # a non-tensor argument
    ):
        assert request_signature(other) != base
    # requires_grad and the grad mode
    no_grad = FwdReq(0, (0, 3), "blocks.1", 5, 1, False, [], False, None, (), (),
                     pack(((torch.zeros(4, 8), 1.0), {}), False))  # fmt: skip
    assert request_signature(no_grad) != base
    grads = pack([torch.zeros(4, 8)], False)
    bwd = BwdReq(1, (0, 3), 0, "blocks.1", 5, 1, True, True, grads)
    assert request_signature(bwd)[0] == "bq" and request_signature(bwd) != base


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [2, 4])
def test_static_mode_replays_bitwise_and_falls_back_on_a_changed_branch(pp: int) -> None:
    """An MLP nn.Sequential over contiguous stages (fast_mode on and off, interleaved and
    simple schedules, checkpointed blocks): every step after the first is replayed on every
    serving rank, results bitwise equal to dynamic mode; a step with a new microbatch size
    falls back on every serving rank, and the Branch model whose branches flip between steps
    where a rank serves a branch's module (counted, with the reason, and drawn in the
    timeline), still bitwise."""
    pytest.importorskip("mpi4py")
    from smp_comm.testing import run_mpi

    out = run_mpi([os.path.join(HERE, "replay_cases.py")], pp, timeout=240,
                  env={"OMP_NUM_THREADS": "1"}, fast_exit=True)  # fmt: skip
    assert f"SUITE-OK replay pp{pp}" in out, out
    # Each fallback's reason names what differed.
    assert "arguments '2x16 float32', recorded '4x16 float32'" in out, out
    if pp == 2:
        assert "module 'right.1', recorded 'left'" in out, out
