"""Actions as data and per-rank programs: the vocabulary, the recorder and the validator
without processes; then every rank's recorded program under ``mpiexec`` (program_cases.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from smp_pipeline import Action, ActionKind, Phase, parse_program, validate_programs
from smp_pipeline.actions import ProgramRecorder, as_phase, format_program
from smp_pipeline.errors import PipelineConfigError
from smp_pipeline.schedule import Scheduler

F, B, S, R = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.SEND, ActionKind.RECV

# Two ranks, one microbatch: the driver's step function calls "body" on rank 1.
GOOD = [
    parse_program("""
        F0 <step>
        S0>1 fq 2x8 body
        R0<1 fr 2x8
        B0 <step>
        S0>1 bq 2x8 body
        R0<1 br 2x8
    """),
    parse_program("""
        R0<0 fq 2x8 body
        F0 body
        S0>0 fr 2x8
        R0<0 bq 2x8 body
        B0 body
        S0>0 br 2x8
        W0 linear
    """),
]


# ------------------------------------------------------------------ the vocabulary
@pytest.mark.parametrize(
    "action",
    [
        Action(F, 0, "<step>"),
        Action(B, 12, "blocks.3"),
        Action(ActionKind.WEIGHT_GRAD, 1, "a b"),  # a module name may hold a space
        Action(S, 3, "blocks.0..blocks.2", 1, "fq", ((4, 8), (), (2,))),
        Action(R, 0, "", 2, "br", ()),
        Action(F, 7),
    ],
)
def test_action_prints_compactly_and_parses_back(action: Action) -> None:
    text = str(action)
    assert "\n" not in text and text[0] == action.kind.code
    again = Action.parse(text)
    assert again == action and hash(again) == hash(action)


def test_action_strings() -> None:
    assert str(Action(S, 3, "blocks.1", 1, "fq", ((4, 8),))) == "S3>1 fq 4x8 blocks.1"
    assert str(Action(R, 0, "", 2, "fr", ((), (3,)))) == "R0<2 fr (),3"
    assert str(Action(B, 2, "<step>")) == "B2 <step>"
    assert Action(F, 1, "x") == Action(F, 1, "x") != Action(F, 2, "x") != Action(B, 2, "x")
    assert len({Action(F, 1, "x"), Action(F, 1, "x"), Action(F, 1, "y")}) == 2


@pytest.mark.parametrize("text", ["", "X0 a", "F", "Fa", "S0 fq 2x8 a", "R0>1 fr 2x8", "F0<1 a",
                                  "S0>1 zz 2x8", "F0x", "S0>1 fq"])  # fmt: skip
def test_malformed_actions_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Action.parse(text)


def test_inconsistent_actions_are_refused() -> None:
    with pytest.raises(ValueError):
        Action(S, 0, "a")  # a send needs a peer and a message kind
    with pytest.raises(ValueError):
        Action(F, 0, "a", peer=1)
    with pytest.raises(ValueError):
        Action(F, -1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Action(F, 0).mb = 1  # type: ignore[misc]


def test_phase_is_the_enum_and_equals_the_old_strings() -> None:
    assert Phase is ActionKind
    assert F == "forward" and B == "backward" and f"{F}" == "forward"
    assert {"forward": 1}[F] == 1 and hash(B) == hash("backward")
    assert as_phase("backward") is B and as_phase(F) is F
    with pytest.raises(ValueError):
        as_phase("send")
    with pytest.raises(ValueError):
        as_phase("sideways")


def test_schedules_take_old_strings_and_give_the_enum() -> None:
    s = Scheduler([(0, "forward"), (0, "backward"), (1, F), (1, "backward")], 2, 2)
    first = s.next_action()
    assert first == (0, "forward") and first is not None and first[1] is F
    s.ready_for_backward(0)
    assert s.next_action() == (0, B)
    s.take(1, "forward")  # a tensor-parallel leader's choice, old or new spelling
    s.take(1, B)
    with pytest.raises(PipelineConfigError, match="unknown phase 'sideways'"):
        Scheduler([(0, "sideways")], 1, 1)
    with pytest.raises(PipelineConfigError, match="lacks \\(0, 'backward'\\)"):
        Scheduler([(0, "forward")], 1, 1)
    s2 = Scheduler("interleaved", 1, 1)
    action = s2.next_action()
    assert action is not None and action[1] is F


# ------------------------------------------------------------------ the recorder
def test_recorder_files_actions_by_step_and_forgets_old_steps() -> None:
    rec = ProgramRecorder()
    rec.begin(1)
    rec.task(1, F, 0, "<step>")
    rec.message(1, S, 1, "fq", 0, "body", [torch.zeros(2, 8)])
    rec.message(2, R, 1, "fq", 0, "body", [torch.zeros(3)])  # taken early: the next step's
    rec.task(1, B, 0, "<step>")
    assert format_program(rec.program(1)) == "F0 <step>\nS0>1 fq 2x8 body\nB0 <step>"
    assert rec.program(2) == (Action(R, 0, "body", 1, "fq", ((3,),)),)
    assert all(type(d) is int for a in rec.program(1) for s in a.shapes for d in s)
    rec.begin(3)
    assert rec.program(1) == () and rec.program(2)
    off = ProgramRecorder(enabled=False)
    off.task(1, F, 0, "x")
    assert off.program(1) == ()


# ------------------------------------------------------------------ the validator
def test_a_consistent_program_passes() -> None:
    assert validate_programs(GOOD) == []


def _without(program: tuple[Action, ...], text: str) -> list[Action]:
    out = list(program)
    out.remove(Action.parse(text))
    return out


@pytest.mark.parametrize(
    ("rank", "edit", "says"),
    [
        # a receive lost: the send has no match
        (1, lambda p: _without(p, "R0<0 bq 2x8 body"), "message 1 from rank 0 to rank 1"),
        # a send lost: something received that was never sent
        (0, lambda p: _without(p, "S0>1 fq 2x8 body"), "message 0 from rank 0 to rank 1"),
        # messages of one pair of ranks received in another order
        (1, lambda p: [p[3], p[1], p[2], p[0], p[4], p[5]], "from rank 0 to rank 1"),
        # shapes differ
        (1, lambda p: [Action.parse("R0<0 fq 2x9 body"), *p[1:]], "sent S0>1 fq 2x8 body"),
        # backward before its forward
        (1, lambda p: [p[0], p[3], p[4], p[1], p[2], p[5]], "backward B0 body before"),
        # a zero-bubble weight-gradient task before its microbatch's backward
        (1, lambda p: [*p[:4], p[6], p[4], p[5]], "weight-gradient task W0 linear before"),
        # the driver's step function never ran forward for microbatch 0
        (0, lambda p: p[1:], "forward for no microbatch"),
        # the backward of a microbatch whose backward the driver never started
        (0, lambda p: _without(p, "B0 <step>"), "never started its backward"),
    ],
)
def test_broken_programs_are_caught(rank: int, edit, says: str) -> None:  # noqa: ANN001
    programs = list(GOOD)
    programs[rank] = tuple(edit(programs[rank]))
    problems = validate_programs(programs)
    assert problems and any(says in p for p in problems), problems


def test_microbatches_are_numbered_from_zero() -> None:
    shifted = [parse_program(format_program(p).replace("0", "1", 1)) for p in GOOD[:1]]
    assert any("not 0..0" in p for p in validate_programs([*shifted, GOOD[1]]))


# ------------------------------------------------------------------ recorded under mpiexec
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("pp", [2, 4])
def test_recorded_programs_are_valid_and_repeat(pp: int) -> None:
    """Every rank's program of every step validates; equal control flow records the same
    programs step after step; the other branch of a data-dependent model records another
    (chain and branch models, joined and segments backward, fast_mode off, and overlapping
    schedules validated)."""
    pytest.importorskip("mpi4py")
    from smp_comm.testing import run_mpi

    out = run_mpi([os.path.join(HERE, "program_cases.py")], pp, timeout=360,
                  env={"OMP_NUM_THREADS": "1"}, fast_exit=True)  # fmt: skip
    assert f"SUITE-OK program pp{pp}" in out, out
