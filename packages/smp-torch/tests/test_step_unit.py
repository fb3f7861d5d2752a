"""Microbatch splitting and StepOutput (single process)."""

from __future__ import annotations

import pytest
import torch
from smp_torch.errors import SMPError
from smp_torch.step import StepOutput, collect_outputs, split_inputs


def f(x, y, mask=None, scale=1.0):  # type: ignore[no-untyped-def]
    return x


def test_split_along_axes_and_non_split() -> None:
    x = torch.arange(12).reshape(4, 3)
    y = torch.arange(8).reshape(2, 4)
    mask = torch.ones(4)
    mbs = split_inputs(f, (x, y), {"mask": mask, "scale": 2.0}, 2, ["mask"], {"y": 1})
    assert len(mbs) == 2
    (a0, k0), (a1, k1) = mbs
    assert torch.equal(a0[0], x[:2]) and torch.equal(a1[0], x[2:])
    assert torch.equal(a0[1], y[:, :2]) and torch.equal(a1[1], y[:, 2:])
    # Arguments come back bound to the signature (here: all positional).
    call0 = {**dict(zip(["x", "y", "mask", "scale"], a0)), **k0}
    call1 = {**dict(zip(["x", "y", "mask", "scale"], a1)), **k1}
    assert torch.equal(call0["mask"], mask) and call1["scale"] == 2.0


def test_nested_structures_are_split() -> None:
    batch = {"ids": torch.arange(4), "pair": (torch.zeros(4, 2), "tag")}
    mbs = split_inputs(lambda b: b, (batch,), {}, 4)
    assert [m[0][0]["ids"].tolist() for m in mbs] == [[0], [1], [2], [3]]
    assert mbs[3][0][0]["pair"][1] == "tag"


def test_indivisible_batch_is_a_clear_error() -> None:
    # smp-pipeline's splitter, its errors as smp's own type, naming the argument.
    with pytest.raises(
        SMPError, match="input 'x': size 3 along axis 0 is not divisible by microbatches=2"
    ):
        split_inputs(f, (torch.zeros(3), torch.zeros(4)), {}, 2)
    with pytest.raises(
        SMPError, match="'nope' in non_split_inputs/input_split_axes is not an argument"
    ):
        split_inputs(f, (torch.zeros(2), torch.zeros(2)), {}, 2, ["nope"])


def test_step_output_reductions() -> None:
    out = collect_outputs(
        [(torch.tensor(1.0), torch.ones(2, 3)), (torch.tensor(3.0), torch.zeros(2, 3))]
    )
    loss, pred = out
    assert isinstance(loss, StepOutput) and len(loss) == 2
    assert loss.reduce_mean().item() == 2.0 and loss.reduce_sum().item() == 4.0
    assert pred.concat().shape == (4, 3) and pred.stack().shape == (2, 2, 3)
    assert pred.outputs[0].sum().item() == 6.0
