"""The planner's search (smp_partition.plan): candidates, predictions, reasons, pins."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from smp_partition import Module, ModuleGraph, PartitionError, partition
from smp_partition.plan import Candidate, CommModel, Profile, search, synthetic_profile
from smp_partition.plan.estimate import (
    busy_scale,
    estimate,
    in_flight,
    pipeline_s,
    shard_units,
    stage_after_s,
    stage_memory,
    stage_microbatch_s,
    stage_tops,
)
from smp_partition.plan.search import _Planner, candidates, divisors
from smp_partition.plan.stages import Split, StageSums, count_requests, module_facts, stage_sums

MiB = 1 << 20


def two_block_profile(**overrides: object) -> Profile:
    """Two equal blocks, each one tensor-parallel linear with 4 heads, numbers easy to add."""
    mods = [
        Module("", children=("b0", "b1"), forward_ms=2.0),
        Module("b0", params={"b0.w": 1000}, activation_bytes=400, forward_ms=1.0),
        Module("b1", params={"b1.w": 1000}, activation_bytes=400, forward_ms=1.0),
    ]
    kw: dict[str, object] = dict(
        graph=ModuleGraph(mods),
        batch_size=8,
        forward_s=1.0,
        backward_s=2.0,
        saved_bytes={"b0": 8000, "b1": 8000},
        tp_divisors={"b0": 4, "b1": 4},
        checkpoint_units=("b0", "b1"),
        base_bytes=100_000,
    )
    kw.update(overrides)
    return Profile(**kw)  # type: ignore[arg-type]


def test_candidates_cover_every_degree_split_of_the_world() -> None:
    cands = candidates(4, [1, 2], True)
    triples = {(c.pp, c.tp, c.dp) for c in cands}
    assert triples == {(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)}
    assert all(c.pp * c.tp * c.dp == 4 and c.dp % c.sdp == 0 for c in cands)
    # sdp on/off where dp > 1: dp=4 gives sdp 1, 2, 4; dp=2 gives 1, 2; dp=1 only 1.
    assert len(cands) == (3 + 2 + 1 + 2 + 1 + 1) * 2 * 2
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_memory_prediction_is_the_documented_sum() -> None:
    p = two_block_profile()
    stages = stage_sums(p, module_facts(p), 1)[0]
    c = Candidate(pp=1, tp=1, dp=1, sdp=1, microbatches=2, checkpointing=False)
    _, bubble, peaks = estimate(p, stages, c)
    state = 2000 * (4 + 4 + 8)
    acts = 16000 / 2  # without a pipeline one microbatch (half the batch) at a time
    assert peaks == (100_000 + state + acts,)
    assert bubble == 0.0
    # tp=2 halves the parameters of the tensor-parallel blocks; each rank keeps its own
    # samples (smp's default), and a split module runs its tp peers' samples on half the
    # channels: its saved bytes are those of this rank's samples at full width.
    c2 = Candidate(pp=1, tp=2, dp=1, sdp=1, microbatches=2, checkpointing=False)
    own = 16000 / 4  # a quarter of the batch per rank and microbatch
    assert estimate(p, stages, c2)[2] == (100_000 + state / 2 + own,)
    # ... except the input a Megatron block gathers from its tp peers: tp times the samples,
    # tp - 1 copies more than the profile saw (b0 gathers 1000 bytes at the full batch)
    g = two_block_profile(tp_gathered_bytes={"b0": 1000})
    g_stages = stage_sums(g, module_facts(g), 1)[0]
    assert estimate(g, g_stages, c2)[2] == (100_000 + state / 2 + own + (2 - 1) * 1000 / 4,)
    c2k = Candidate(pp=1, tp=2, dp=1, sdp=1, microbatches=2, checkpointing=True)
    assert estimate(g, g_stages, c2k)[2][0] - estimate(p, stages, c2k)[2][0] == pytest.approx(1000 / 4)
    # a whole (not tensor-parallel) module keeps its parameters in full
    q = two_block_profile(tp_divisors={"b0": 4})
    q_stages = stage_sums(q, module_facts(q), 1)[0]
    assert estimate(q, q_stages, c2)[2] == (100_000 + (1000 + 500) * 16 + (8000 + 8000) / 4,)
    # the step's temporaries: one microbatch's share of the per-sample part, plus the fixed
    r = two_block_profile(step_transient_bytes=4000.0, step_transient_fixed_bytes=50.0)
    r_stages = stage_sums(r, module_facts(r), 1)[0]
    assert estimate(r, r_stages, c2)[2] == (100_000 + state / 2 + own + 4000 * 2 / 4 + 50,)
    # sdp=2 shards the state, and counts two full copies of parameters and of gradients
    # (FSDP2's all-gather buffer and unsharded parameters; full gradients and the
    # reduce-scatter's flat input).
    c3 = Candidate(pp=1, tp=1, dp=2, sdp=2, microbatches=1, checkpointing=False)
    assert estimate(p, stages, c3)[2] == (100_000 + state / 2 + 2 * 2000 * 8 + 16000 / 2,)
    # replicas (dp > sdp) add one copy of the gradients: the all-reduce's flat buckets
    c4 = Candidate(pp=1, tp=1, dp=2, sdp=1, microbatches=1, checkpointing=False)
    assert estimate(p, stages, c4)[2] == (100_000 + state + 2000 * 4 + 16000 / 2,)
    # the margin scales the peak but for the persistent tensors (parameters, gradients,
    # optimizer state: long-lived, of fixed sizes)
    m = two_block_profile(memory_margin=0.1)
    m_stages = stage_sums(m, module_facts(m), 1)[0]
    assert estimate(m, m_stages, c)[2] == pytest.approx(((100_000 + acts) * 1.1 + state,))
    # a pipeline stage also keeps what crosses its cuts, per microbatch in flight: the
    # activations received and sent and their gradients, each with its message buffer
    p2 = stage_sums(p, module_facts(p), 2)[0]
    assert sum(st.received_bytes for st in p2) == sum(st.boundary_bytes for st in p2) > 0
    c5 = Candidate(pp=2, tp=1, dp=1, sdp=1, microbatches=4, checkpointing=False)
    for i, st in enumerate(p2):
        plain = st.params.at(1) * 16 + in_flight(2, 4) * st.saved.at(1) / 4
        cut = in_flight(2, 4) * 4 * (st.received_bytes + st.boundary_bytes) / 4
        # and a gradient buffer per microbatch in flight beyond the first (deterministic
        # accumulation, on the driver's stage: a later microbatch's backward before the
        # earlier one is folded; serving stages stream)
        buffers = (in_flight(2, 4) - 1) * st.params.at(1) * 4 if i == 0 else 0
        assert stage_memory(p, st, c5, driver=i == 0) == 100_000 + plain + cut + buffers
    # a pipeline keeps at most pp + 2 microbatches in flight; pp = 1 keeps one at a time
    assert in_flight(1, 8) == 1 and in_flight(2, 8) == 4 and in_flight(4, 2) == 2


def test_checkpointing_trades_time_for_memory() -> None:
    p = two_block_profile()
    stages = stage_sums(p, module_facts(p), 1)[0]
    plain = Candidate(1, 1, 1, 1, 4, False)
    ck = Candidate(1, 1, 1, 1, 4, True)
    t0, _, m0 = estimate(p, stages, plain)
    t1, _, m1 = estimate(p, stages, ck)
    assert t1 == pytest.approx(t0 + 1.0)  # the whole forward is recomputed once
    # kept: each unit's input for the microbatch, plus one microbatch's saved bytes (the
    # recompute chain's): without a pipeline, no saving (as measured)
    assert m1[0] == 100_000 + 2000 * 16 + (800 + 16000) / 4
    assert m1[0] >= m0[0]
    # with a pipeline, the microbatches in flight keep only their units' inputs
    p2 = stage_sums(p, module_facts(p), 2)[0]
    _, _, n0 = estimate(p, p2, Candidate(2, 1, 1, 1, 4, False))
    _, _, n1 = estimate(p, p2, Candidate(2, 1, 1, 1, 4, True))
    assert all(b < a for a, b in zip(n0, n1))


def test_checkpointing_overhead_is_per_unit_and_microbatch() -> None:
    p = two_block_profile(checkpoint_unit_overhead_s=0.01)
    stages = stage_sums(p, module_facts(p), 1)[0]
    t0 = estimate(p, stages, Candidate(1, 1, 1, 1, 4, False))[0]
    t1 = estimate(p, stages, Candidate(1, 1, 1, 1, 4, True))[0]
    assert t1 == pytest.approx(t0 + 1.0 + 4 * 2 * 0.01)  # 4 microbatches x 2 units


def test_collectives_cost_their_wait_once_each() -> None:
    comm = CommModel(latency_s=1e-3, bandwidth=1e6, sync_s=0.5)
    assert comm.allreduce_s(4e6, 4) == pytest.approx(0.5 + 6e-3 + 6 / 4 * 4.0)
    assert comm.gather_s(4e6, 4) == pytest.approx(0.5 + 3e-3 + 3 / 4 * 4.0)
    assert comm.message_s(1e6) == pytest.approx(0.5 + 1e-3 + 1.0)
    assert comm.allreduce_s(4e6, 1) == comm.gather_s(4e6, 1) == 0.0  # nothing to wait for
    # tp: two collectives per split module per microbatch (three with checkpointing)
    p = two_block_profile(comm=CommModel(latency_s=0.0, bandwidth=1e30, sync_s=0.5))
    st = stage_sums(p, module_facts(p), 1)[0][0]
    base = stage_microbatch_s(p, st, Candidate(1, 1, 2, 1, 1, False))
    assert stage_microbatch_s(p, st, Candidate(1, 2, 1, 1, 1, False)) == pytest.approx(base + 2 * 2 * 0.5)
    assert stage_microbatch_s(p, st, Candidate(1, 2, 1, 1, 1, True)) == pytest.approx(
        stage_microbatch_s(p, st, Candidate(1, 1, 2, 1, 1, True)) + 2 * 3 * 0.5
    )
    # sdp: two all-gathers and a reduce-scatter per microbatch for the root unit
    assert stage_microbatch_s(p, st, Candidate(1, 1, 2, 2, 1, False)) == pytest.approx(base + 3 * 0.5)
    # smp-tp's own cost per collective (tp_call_s) on each of them, and on nothing else
    called = replace(p, comm=replace(p.comm, tp_call_s=0.25))
    assert stage_microbatch_s(called, st, Candidate(1, 2, 1, 1, 1, False)) == pytest.approx(base + 2 * 2 * 0.75)
    assert stage_microbatch_s(called, st, Candidate(1, 2, 1, 1, 1, True)) == pytest.approx(
        stage_microbatch_s(p, st, Candidate(1, 1, 2, 1, 1, True)) + 2 * 3 * 0.75
    )
    assert stage_microbatch_s(called, st, Candidate(1, 1, 2, 2, 1, False)) == pytest.approx(base + 3 * 0.5)
    # a pipeline stage waits twice per microbatch (forward input, backward gradient), for
    # the excess contention of its busy ranks only: with compute_scale 3, pp=2 with one
    # microbatch keeps half the ranks busy (slowdown 1.5 of 3: a quarter of the wait);
    # pp=4 with one microbatch keeps a quarter busy (0.75: they fit the cores, no wait)
    p3 = replace(p, compute_scale=3.0)
    quiet = replace(p3, comm=CommModel(latency_s=0.0, bandwidth=1e30, sync_s=0.0))
    for pp, share in ((2, 0.25), (4, 0.0)):
        c = Candidate(pp, 1, 1, 1, 1, False)
        for s in stage_sums(p3, module_facts(p3), pp)[0]:
            assert stage_microbatch_s(p3, s, c) == pytest.approx(stage_microbatch_s(quiet, s, c) + 2 * 0.5 * share)


def test_sharding_under_a_pipeline_gathers_once_per_step() -> None:
    # smp_torch.sharded_pp: with pp > 1 each stage top is gathered once before the step and
    # reduce-scattered once after it, not per microbatch as without a pipeline. (A busy
    # machine, compute_scale 3, so the in-pipeline wait for peers is not zero.)
    p = two_block_profile(comm=CommModel(latency_s=0.0, bandwidth=1e30, sync_s=0.5), compute_scale=3.0)
    stages = stage_sums(p, module_facts(p), 2)[0]
    assert [(s.owns_root, stage_tops(s)) for s in stages] == [(True, 1), (False, 1)]
    for st in stages:
        plain, sharded = Candidate(2, 1, 2, 1, 4, False), Candidate(2, 1, 2, 2, 4, False)
        assert stage_microbatch_s(p, st, sharded) == stage_microbatch_s(p, st, plain)
    # after the step: one gather, one reduce-scatter, two rounds per further top (a stage
    # holding the root and three modules whose parents are elsewhere: four tops)
    st = StageSums(cuts=3, owns_root=True, params=Split(whole=1000.0))
    assert stage_tops(st) == 4
    optimizer = 1000 / 2 * p.optimizer_s_per_param * p.compute_scale
    assert stage_after_s(p, st, Candidate(2, 1, 2, 2, 4, False)) == pytest.approx(0.5 + 0.5 + 2 * 3 * 0.5 + optimizer)
    # without a pipeline the per-microbatch cost stays
    one = stage_sums(p, module_facts(p), 1)[0][0]
    assert stage_microbatch_s(p, one, Candidate(1, 1, 4, 4, 1, False)) > stage_microbatch_s(
        p, one, Candidate(1, 1, 4, 1, 1, False)
    )


def test_busy_scale_and_shard_units() -> None:
    p = two_block_profile(compute_scale=3.0, shard_unit_elements=1000)
    assert busy_scale(p, Candidate(1, 1, 4, 1, 8, False)) == 3.0  # every rank busy
    # time-sharing: the busy share of the ranks times the all-busy slowdown, never below 1.
    # pp=4, 4 microbatches: bubble 3/7, 4/7 of the ranks busy -> 3 * 4/7
    assert busy_scale(p, Candidate(4, 1, 1, 1, 4, False)) == pytest.approx(3 * 4 / 7)
    # pp=4, 2 microbatches: 2/5 busy -> 1.2; pp=2, 1 microbatch: half busy -> 1.5
    assert busy_scale(p, Candidate(4, 1, 1, 1, 2, False)) == pytest.approx(1.2)
    assert busy_scale(p, Candidate(2, 1, 2, 1, 1, False)) == pytest.approx(1.5)
    # pp=4, 1 microbatch: a quarter busy would be 0.75: the busy ranks fit the cores -> 1
    assert busy_scale(p, Candidate(4, 1, 1, 1, 1, False)) == 1.0
    st = stage_sums(p, module_facts(p), 1)[0][0]
    assert shard_units(p, st, 1) == 3  # both blocks reach 1000 elements, plus the root
    assert shard_units(p, st, 2) == 1  # split in half, neither does
    # the per-microbatch overhead: a stage's share of the modules
    q = two_block_profile(microbatch_overhead_s=0.3)
    q1 = stage_sums(q, module_facts(q), 1)[0][0]
    c = Candidate(1, 1, 1, 1, 1, False)
    assert stage_microbatch_s(q, q1, c) == pytest.approx(stage_microbatch_s(two_block_profile(), q1, c) + 0.3)


def test_pipeline_bubble_and_stages_follow_smps_partition() -> None:
    p = synthetic_profile(8, width=64, heads=4, seq=16, batch_size=8, vocab=100)
    facts = module_facts(p)
    stages, stage_of = stage_sums(p, facts, 2)
    expect = partition(p.graph, 2, p.memory_weight, "default", p.balance_slack).assignment
    assert stage_of == [expect[m.name] for m in p.graph.modules]
    assert sum(st.params.at(1) for st in stages) == sum(facts.params)
    c1 = Candidate(2, 1, 1, 1, 1, False)
    c8 = Candidate(2, 1, 1, 1, 8, False)
    for c in (c1, c8):
        per = [stage_microbatch_s(p, st, c) for st in stages]
        whole = sum(per) + (c.microbatches - 1) * max(per)
        assert estimate(p, stages, c)[1] == pytest.approx(1 - c.microbatches * max(per) / whole)


def test_pipeline_time_is_one_microbatch_through_all_stages_then_the_slowest() -> None:
    """``sum + (microbatches - 1) * max`` of the stages' times per microbatch: equal stages
    give 1F1B's ``microbatches + pp - 1`` slots; unequal ones charge the fill and drain at
    each stage's own time, not the slowest's (the slots formula put llama-tied's and
    gpt2-small's unbalanced pp = 4 with checkpointing 30-50 % over, bench_plan's grids)."""
    assert pipeline_s([2.0] * 4, 8) == pytest.approx(2.0 * (8 + 4 - 1))
    assert pipeline_s([3.0, 1.0], 4) == pytest.approx(4.0 + 3 * 3.0)  # slots: 5 * 3.0
    assert pipeline_s([5.0], 3) == pytest.approx(15.0)  # no pipeline: microbatches in turn
    # through estimate: a two-stage model whose first block has 3x the second's work
    mods = [
        Module("", children=("b0", "b1"), forward_ms=4.0),
        Module("b0", params={"b0.w": 3000}, activation_bytes=400, forward_ms=3.0),
        Module("b1", params={"b1.w": 1000}, activation_bytes=400, forward_ms=1.0),
    ]
    p = two_block_profile(graph=ModuleGraph(mods), comm=CommModel(latency_s=0.0, bandwidth=1e30))
    stages = stage_sums(p, module_facts(p), 2)[0]
    c = Candidate(2, 1, 2, 1, 4, False)
    per = [stage_microbatch_s(p, st, c) for st in stages]
    assert max(per) > 2 * min(per)
    after = max(stage_after_s(p, st, c) for st in stages)
    assert estimate(p, stages, c)[0] == pytest.approx(sum(per) + 3 * max(per) + after)


def test_rejections_name_the_binding_reason() -> None:
    p = synthetic_profile(4, width=96, heads=6, seq=16, batch_size=6, vocab=100)
    plan = search(p, 4, 1 << 40)
    reasons = {e.candidate.label(): e.reason for e in plan.estimates}
    assert reasons["pp=1 tp=4 dp=1 sdp=1 mb=1 -"] == "tp=4 does not divide 6 of module 'blocks.0.attn'"
    assert reasons["pp=1 tp=1 dp=4 sdp=1 mb=1 -"] == "tp*dp=4 ranks do not divide the batch of 6 samples"
    assert reasons["pp=1 tp=2 dp=2 sdp=1 mb=1 -"] == "tp*dp=4 ranks do not divide the batch of 6 samples"
    assert reasons["pp=2 tp=1 dp=2 sdp=1 mb=2 -"] == "microbatches=2 does not divide the 3 samples per rank"
    p8 = synthetic_profile(4, width=96, heads=6, seq=16, batch_size=8, vocab=100)
    tight = search(p8, 4, p8.base_bytes + 1)
    with pytest.raises(PartitionError, match="no configuration fits"):
        _ = tight.best
    mem = [e.reason for e in tight.estimates if e.reason and "budget" in e.reason]
    assert mem and all("needs" in r and "> budget" in r for r in mem)
    assert any(re.match(r"stage \d needs", r) for r in mem)
    assert any(r.startswith("each rank needs") for r in mem)


def test_best_is_fastest_that_fits_and_memory_budget_binds() -> None:
    p = synthetic_profile(8, width=128, heads=4, seq=64, batch_size=16, vocab=1000)
    loose = search(p, 4, 1 << 40)
    times = [e.step_s for e in loose.feasible]
    assert times == sorted(times) and loose.best.step_s == times[0]
    assert all(e.fits for e in loose.estimates if e.reason is None)
    budget = sorted(e.peak_bytes for e in loose.feasible)[len(loose.feasible) // 3]
    tight = search(p, 4, budget)
    assert tight.best.peak_bytes <= budget
    assert all(e.peak_bytes <= budget for e in tight.feasible)
    assert all(e.peak_bytes > budget for e in tight.estimates if e.reason and "budget" in e.reason)
    assert set(tight.best.candidate.config()) == {
        "pipeline_parallel_degree", "tensor_parallel_degree", "sharded_data_parallel_degree", "microbatches"
    }  # fmt: skip


def test_pins_and_why_not() -> None:
    p = synthetic_profile(8, width=128, heads=4, seq=64, batch_size=16, vocab=1000)
    plan = search(p, 4, 1 << 40, pinned={"pipeline_parallel_degree": 2, "activation_checkpointing": True})
    assert {(e.candidate.pp, e.candidate.checkpointing) for e in plan.estimates} == {(2, True)}
    with pytest.raises(PartitionError, match="cannot pin 'data_parallel_degree'"):
        search(p, 4, 1 << 40, pinned={"data_parallel_degree": 2})
    with pytest.raises(PartitionError, match="pinned microbatches must be an integer"):
        search(p, 4, 1 << 40, pinned={"microbatches": 0})
    full = search(p, 4, 1 << 40)
    best = full.best.candidate
    assert "is the best pick" in full.why_not({**best.config(), "activation_checkpointing": best.checkpointing})
    other = full.why_not({"tensor_parallel_degree": 4, "microbatches": 1})
    assert "fits, but predicted" in other and "rank" in other
    assert "does not divide the world size" in full.why_not({"pipeline_parallel_degree": 3})
    assert "tp=4 does not divide 6" in search(
        synthetic_profile(2, width=96, heads=6, seq=8, batch_size=4, vocab=50), 4, 1 << 40
    ).why_not({"tensor_parallel_degree": 4})


def test_table_lists_fitting_then_rejected() -> None:
    p = synthetic_profile(4, width=96, heads=6, seq=16, batch_size=6, vocab=100)
    text = search(p, 4, 1 << 40).table(limit=3, rejected=2)
    lines = text.splitlines()
    assert lines[0].startswith("smp.plan: 4 ranks") and "candidates fit" in lines[0]
    assert lines[2].lstrip().startswith("1 ") and "rejected" in lines[5]
    assert len(lines) == 8


def test_bad_profile_and_arguments_get_named_errors() -> None:
    with pytest.raises(PartitionError, match="saved_bytes: 'nope' is not a module"):
        two_block_profile(saved_bytes={"nope": 1})
    with pytest.raises(PartitionError, match="batch_size must be"):
        two_block_profile(batch_size=0)
    with pytest.raises(PartitionError, match="world_size must be"):
        search(two_block_profile(), 0, 1.0)
    with pytest.raises(PartitionError, match="memory_per_rank"):
        search(two_block_profile(), 2, -1)


@pytest.mark.timeout(120)
def test_large_synthetic_search_finishes() -> None:
    """1,024 ranks, 128 layers: only bounds a hang (the speed figure is in bench_plan)."""
    plan = search(synthetic_profile(128), 1024, 80 << 30, microbatch_options=range(1, 65))
    assert len(plan.estimates) > 1000 and plan.best.fits
    assert _Planner  # (the planner caches one partition per pp)


def test_the_search_imports_neither_torch_nor_numpy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, smp_partition.plan as p; "
        "p.search(p.synthetic_profile(2, width=8, heads=2, seq=4, batch_size=2, vocab=8), 2, 1 << 40); "
        "bad = {'torch', 'numpy'} & set(sys.modules); assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_sharding_charges_its_per_tensor_costs() -> None:
    """FSDP2's per-tensor work (measured by the profile on a one-rank mesh): the optimizer's
    DTensor dispatch once per step, the copies per microbatch at pp = 1 and once per step in
    a pipeline, each scaled by the stage's parameter tensors; unsharded candidates pay none.
    (Without the terms, pp = 1 sdp = 4 ran 23-34 % slower than predicted on bench_plan's
    gpt2-small grid, 76 parameter tensors, and 24-27 % on llama-tied's, 37.)"""
    mods = [
        Module("", children=("b0", "b1"), forward_ms=2.0),
        Module("b0", params={"b0.w": 1000, "b0.b": 10}, activation_bytes=400, forward_ms=1.0),
        Module("b1", params={"b1.w": 1000, "b1.b": 10, "b0.w": 1000}, activation_bytes=400, forward_ms=1.0),
    ]
    plain = two_block_profile(graph=ModuleGraph(mods), compute_scale=2.0)
    per_opt, per_mb = 1e-3, 1e-4
    p = replace(plain, shard_optimizer_s_per_tensor=per_opt, shard_microbatch_s_per_tensor=per_mb)
    one = stage_sums(p, module_facts(p), 1)[0]
    assert one[0].param_tensors == 4  # the shared b0.w once
    most = max(st.param_tensors for st in stage_sums(p, module_facts(p), 2)[0])

    def step(prof: Profile, c: Candidate) -> float:
        return estimate(prof, stage_sums(prof, module_facts(prof), c.pp)[0], c)[0]

    sharded = Candidate(pp=1, tp=1, dp=4, sdp=4, microbatches=2, checkpointing=False)
    extra = step(p, sharded) - step(plain, sharded)
    mb_scale = busy_scale(p, sharded)
    assert extra == pytest.approx(4 * per_opt * 2.0 + 2 * 4 * per_mb * mb_scale)
    piped = Candidate(pp=2, tp=1, dp=2, sdp=2, microbatches=4, checkpointing=False)
    # the stage holding the most tensors: the optimizer's dispatch and the copies once per step
    assert step(p, piped) - step(plain, piped) == pytest.approx(most * (per_opt + per_mb) * 2.0)
    unsharded = Candidate(pp=1, tp=1, dp=4, sdp=1, microbatches=2, checkpointing=False)
    assert step(p, unsharded) == step(plain, unsharded)
    with pytest.raises(PartitionError, match="shard_optimizer_s_per_tensor"):
        replace(plain, shard_optimizer_s_per_tensor=-1.0)


def test_stages_keep_checkpoint_units_and_split_modules_whole_as_smp_does() -> None:
    """smp moves a checkpointed module's subtree, and an smp-tp module's, onto that module's
    stage after partitioning (smp_torch.pipeline.keep_whole); the planner's stages for such
    candidates are the ones smp builds (the partition alone cut a block across stages)."""
    p = synthetic_profile(3, width=64, heads=4, seq=16, batch_size=8, vocab=100)
    facts = module_facts(p)
    names = [m.name for m in p.graph.modules]
    _, plain = stage_sums(p, facts, 4)
    # the partition alone puts some block's attention or MLP on another stage than the block
    cut = [u for u in p.checkpoint_units if len({plain[i] for i, n in enumerate(names) if n.startswith(u)}) > 1]
    assert cut, "the example must have a block the partition cuts"
    _, whole = stage_sums(p, facts, 4, p.checkpoint_units)
    for u in p.checkpoint_units:
        assert len({whole[i] for i, n in enumerate(names) if n == u or n.startswith(u + ".")}) == 1
        assert whole[names.index(u)] == plain[names.index(u)]  # the unit itself stays
    planner = _Planner(p)
    assert planner.stages(4, True) is not planner.stages(4, False)
    assert sum(st.params.at(1) for st in planner.stages(4, True)) == sum(facts.params)


def test_every_call_across_a_cut_costs_its_requests() -> None:
    """A module called on another stage is a request and a response forward and again
    backward; each stage pays ``request_s`` per call across its cuts, in or out, scaled by
    its time-sharing (Llama's layers, called one by one from the model on another stage,
    made pp = 2 run 23-36 % slower than predicted on bench_plan's llama-tied grid)."""
    quiet = CommModel(latency_s=0.0, bandwidth=1e30, sync_s=0.0)
    p = two_block_profile(comm=quiet, compute_scale=3.0)
    q = replace(p, comm=replace(quiet, request_s=0.01))
    stages = stage_sums(p, module_facts(p), 2)[0]
    assert sum(st.cuts for st in stages) > 0
    c = Candidate(2, 1, 2, 1, 4, False)
    for st in stages:
        extra = stage_microbatch_s(q, st, c) - stage_microbatch_s(p, st, c)
        assert st.requests_in + st.requests_out > 0
        assert extra == pytest.approx((st.requests_in + st.requests_out) * 0.01 * busy_scale(p, c))
    one = stage_sums(p, module_facts(p), 1)[0][0]
    c1 = Candidate(1, 1, 4, 1, 4, False)
    assert stage_microbatch_s(q, one, c1) == stage_microbatch_s(p, one, c1)  # no cuts, no requests


def test_requests_are_counted_as_fast_mode_sends_them() -> None:
    """smp's fast_mode sends a run of consecutive children of an ``nn.Sequential`` or of a
    loop over an ``nn.ModuleList`` owned by one other stage as one request, and an
    ``nn.Sequential``'s runs on several other stages in a row as one relay (one request
    sent, one served by each owner); any other parent calls each child on its own, and a
    call nested in a served one is a request from the serving stage (counting one request
    per cut module charged gpt2-small's pp = 2 three requests per microbatch for one)."""
    mods = [
        Module("", children=("emb", "seq", "list", "head")),
        Module("emb", params={"emb.w": 10}),
        Module("seq", type="Sequential", children=("seq.0", "seq.1", "seq.2", "seq.3", "seq.4")),
        *(Module(f"seq.{k}", params={f"seq.{k}.w": 10}) for k in (0, 1, 3, 4)),
        Module("seq.2", children=("seq.2.a", "seq.2.b")),
        Module("seq.2.a", params={"a.w": 10}),
        Module("seq.2.b", params={"b.w": 10}),
        Module("list", type="ModuleList", children=("l0", "l1", "l2")),
        *(Module(f"l{k}", params={f"l{k}.w": 10}) for k in range(3)),
        Module("head", params={"head.w": 10}),
    ]
    p = Profile(graph=ModuleGraph(mods), batch_size=1, forward_s=1.0, backward_s=1.0)
    where = {"": 0, "emb": 3, "seq": 0, "seq.0": 0, "seq.1": 1, "seq.2": 1, "seq.2.a": 2, "seq.2.b": 2,
             "seq.3": 2, "seq.4": 3, "list": 0, "l0": 1, "l1": 1, "l2": 0, "head": 3}  # fmt: skip
    stage_of = [where[m.name] for m in p.graph.modules]
    served, sent = count_requests(p, module_facts(p), stage_of, 4)
    # relay seq.1-2 -> seq.3 -> seq.4 (one sent by 0, one served by each of 1, 2, 3); seq.2's
    # two children from stage 1 (two each way); l0-l1 one request; emb and head one each
    assert served == [0, 2, 3, 3]
    assert sent == [4, 2, 0, 0]
    # without fast_mode's runs every cut module would be its own request: 10 of them
    plain = [Module(m.name, children=m.children, params=m.params) for m in mods]
    q = replace(p, graph=ModuleGraph(plain))
    served, sent = count_requests(q, module_facts(q), stage_of, 4)
    assert sum(served) == sum(sent) == 10


def _embedding_profile(**overrides: object) -> Profile:
    """A huge embedding (1e6 elements) and two small blocks: the parameter-dominated shape."""
    mods = [
        Module("", children=("emb", "b0", "b1"), forward_ms=3.0),
        Module("emb", params={"emb.w": 1_000_000}, activation_bytes=400, forward_ms=1.0),
        Module("b0", params={"b0.w": 1000}, activation_bytes=400, forward_ms=1.0),
        Module("b1", params={"b1.w": 1000}, activation_bytes=400, forward_ms=1.0),
    ]
    kw: dict[str, object] = dict(
        graph=ModuleGraph(mods), batch_size=8, forward_s=1.0, backward_s=2.0,
        saved_bytes={"emb": 800, "b0": 800, "b1": 800}, base_bytes=100_000,
    )  # fmt: skip
    kw.update(overrides)
    return Profile(**kw)  # type: ignore[arg-type]


def test_a_stage_holds_its_own_largest_gradient_and_its_own_optimizer_temporaries() -> None:
    # The backward's fixed temporary is the largest module's gradient (the embedding's,
    # 4e6 bytes): at pp = 3 only the embedding's stage holds it; the others hold their own
    # largest module's (1000 elements), and the rest of the fixed part (500) everywhere.
    p = _embedding_profile(step_transient_fixed_bytes=4_000_500.0, step_transient_gradient_bytes=4_000_000.0)
    stages = stage_sums(p, module_facts(p), 3)[0]
    held = [st.largest_params_at(1) for st in stages]
    assert sorted(held) == [1000, 1000, 1_000_000]
    c = Candidate(pp=3, tp=1, dp=1, sdp=1, microbatches=1, checkpointing=False)
    base = _embedding_profile()  # the same without the temporaries
    for st, a, b in zip(stages, estimate(p, stages, c)[2], estimate(base, stages, c)[2]):
        if st.largest_params_at(1) == 1_000_000:  # the embedding's stage: all of it
            assert a - b == pytest.approx(4_000_500)
        else:  # its own largest gradient and the rest, on the whole-model floor (below)
            assert a == pytest.approx(100_000 + 1_002_000 * 4 + 1000 * 4 + 500)
    # The optimizer's temporaries scale with the parameters a rank steps (sharded by sdp).
    q = _embedding_profile(optimizer_transient_bytes=8)
    one = stage_sums(q, module_facts(q), 1)[0]
    plain = estimate(_embedding_profile(), one, Candidate(1, 1, 2, 2, 1, False))[2][0]
    assert estimate(q, one, Candidate(1, 1, 2, 2, 1, False))[2][0] == pytest.approx(plain + 1_002_000 * 8 / 2)


def test_every_rank_holds_the_whole_model_until_the_first_step_places_it() -> None:
    # pp = 3: the stages without the embedding still peak at the runtime's bytes plus the
    # whole model's parameters (built on every rank, kept until the first step's trace).
    p = _embedding_profile()
    stages = stage_sums(p, module_facts(p), 3)[0]
    peaks = estimate(p, stages, Candidate(3, 1, 1, 1, 1, False))[2]
    whole = 100_000 + 1_002_000 * 4
    small = [pk for st, pk in zip(stages, peaks) if st.largest_params_at(1) < 1e6]
    assert len(small) == 2 and all(pk == pytest.approx(whole) for pk in small)
    # the embedding's own stage is above the floor (its state: 16 bytes an element)
    assert max(peaks) > whole
