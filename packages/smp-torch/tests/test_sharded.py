"""Sharded data parallelism (issue 17): real MPI jobs against one process, checkpoints that
change the sharding degree, and bad configurations on every rank.

Each equivalence job runs several configurations in turn (``scripts/sharded.py``): every step
the mean loss and every parameter of the gathered model are compared with one process
training the unwrapped model on the global batch (fp32: SPEC §8's ``rtol=1e-5, atol=1e-6``;
bf16/fp16 autocast: a norm bound explained in the script), and every parameter, gradient
and optimizer-state tensor must be a 1/sdp shard.
"""

from __future__ import annotations

import re

from conftest import CHECKPOINT_FOUR, SharedJob, launch, ok_cases

# Tests of one script and world size share a launch (conftest.SharedJob), their groups in
# the order the tests run; two 4-rank jobs of sharded.py, so that each job's bound (the sum
# of its groups') stays within pytest's per-test timeout.
TWO = SharedJob("sharded.py", 2)
FOUR_A = SharedJob("sharded.py", 4)
FOUR_B = SharedJob("sharded.py", 4)

# Threshold 100 elements: TinyLM's four Linear layers become units; the tied embedding/head
# and the layer norm stay in the root's unit (a shared parameter cannot leave their ancestor).
LINEAR_UNITS = ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", ""]
SMALL = {"sdp_param_persistence_threshold": 100}


def _case(name: str, sdp: int, **kw: object) -> dict:
    extra = {k: kw.pop(k) for k in list(kw) if k in ("optimizer", "steps", "units", "nodes", "reshard_after_forward", "forward_prefetch", "static_loss_scale", "tied", "model", "pin", "error", "routes")}
    return {"name": name, "config": {"sharded_data_parallel_degree": sdp, **kw}, **extra}


SDP2_CASES = [
    _case("sdp2", 2, **SMALL, units=LINEAR_UNITS),
    _case("sdp2-mb2-sgd", 2, **SMALL, microbatches=2, optimizer="sgd"),
    _case("sdp2-root-only", 2, units=[""]),  # default threshold: one unit
    _case("sdp2-bucket", 2, sdp_param_persistence_threshold=1000, sdp_reduce_bucket_size=300,
          units=["blocks.0.fc1", "blocks.1.fc1", "blocks.0", ""]),  # fmt: skip
    _case("sdp2-clip", 2, **SMALL, sdp_gradient_clipping=0.05),
    _case("sdp2-bf16", 2, **SMALL, bf16=True),
    _case("sdp2-bf16-clip", 2, **SMALL, bf16=True, sdp_gradient_clipping=0.05, steps=4),
    _case("sdp2-fp16", 2, **SMALL, fp16=True),
]


TWO.add("sdp2", SDP2_CASES, timeout=240)


def test_sharded_2_ranks() -> None:
    TWO.check("sdp2")


SDP4_CASES = [
    _case("sdp4", 4, **SMALL, units=LINEAR_UNITS),
    # dp=4 with sdp=2: shards reduce-scattered in each pair, all-reduced across pairs (HSDP).
    _case("sdp2-dp4-mb2", 2, **SMALL, microbatches=2),
    _case("sdp4-bf16-clip", 4, **SMALL, bf16=True, sdp_gradient_clipping=0.05, steps=4),
    # Two pretend nodes of 2 ranks: units reshard to the node after forward.
    _case("sdp4-hierarchical", 4, **SMALL, sdp_hierarchical_allgather=True, nodes=2, reshard_after_forward=2),
    # root 144 + 288 + 264 + 288 <= 1200 elements: the first Linear prefetches two units.
    _case("sdp4-live-1200", 4, **SMALL, sdp_max_live_parameters=1200,
          forward_prefetch={"blocks.0.fc1": ["blocks.0.fc2", "blocks.1.fc1"], "blocks.0.fc2": ["blocks.1.fc1", "blocks.1.fc2"],
                            "blocks.1.fc1": ["blocks.1.fc2"], "blocks.1.fc2": []}),  # fmt: skip
]


FOUR_A.add("sdp4", SDP4_CASES, timeout=300)


def test_sharded_4_ranks() -> None:
    FOUR_A.check("sdp4")


# Sharded data x tensor parallelism (tp=2: two ranks per tensor-parallel slice, sharded by
# FSDP2 over those two). The blocks and the norm are smp-tp's layers; the tied embedding/head
# is an ordinary parameter, averaged over the tensor-parallel group after FSDP2's reduce-scatter.
TP2 = {"tensor_parallel_degree": 2, **SMALL}
SDP2_TP2_CASES = [
    _case("sdp2-tp2", 2, **TP2, units=LINEAR_UNITS),
    _case("sdp2-tp2-mb2-sgd", 2, **TP2, microbatches=2, optimizer="sgd"),
    _case("sdp2-tp2-clip", 2, **TP2, sdp_gradient_clipping=0.05),
    _case("sdp2-tp2-prescaled", 2, **TP2, prescaled_batch=True),
    _case("sdp2-tp2-spread-root", 2, tensor_parallel_degree=2, placement_strategy="spread", units=[""]),
    # bf16 with SGD: under bf16 autocast smp-tp rounds each rank's partial products to bf16
    # before summing them over the tensor-parallel group, so gradient entries near zero differ
    # from one process by O(1) relative; Adam's first step (about lr * sign(g)) turns those into
    # whole-size update differences. That happens at tp=2 without sharding alike (measured: the
    # same |diff| 0.02 on blocks.1.fc2.weight with and without sdp); SGD keeps the update
    # proportional to the gradient, so the script's norm bound applies.
    _case("sdp2-tp2-bf16", 2, **TP2, bf16=True, optimizer="sgd"),
    _case("sdp2-tp2-bf16-clip", 2, **TP2, bf16=True, sdp_gradient_clipping=0.05, steps=4, optimizer="sgd"),
    # A static loss scale: at the default dynamic 2**16 smp-tp's fp16 collectives overflow in
    # the first step, which is then skipped (with or without sharding) unlike the reference.
    _case("sdp2-tp2-fp16", 2, **TP2, fp16=True, static_loss_scale=1024.0),
    # Issue 42: a data-dependent branch under tensor parallelism (each of the 4 ranks has its
    # own samples): expert 1 runs on one rank only in steps 0 and 1, so its tensor-parallel
    # peer gets its gradient from the tensor-parallel sum alone, and on none in step 2.
    _case("sdp2-tp2-moe", 2, tensor_parallel_degree=2, sdp_param_persistence_threshold=1100,
          model="moe", routes=[[1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]], units=["moe", ""]),
]


FOUR_A.add("sdp2-tp2", SDP2_TP2_CASES, timeout=300)


def test_sharded_with_tensor_parallel_4_ranks() -> None:
    FOUR_A.check("sdp2-tp2")


# Sharded data x pipeline parallelism (pp=2: each stage's parameters sharded over its two
# data-parallel ranks; gathered once per step, the stage's in-order gradient sums
# reduce-scattered after it). Units are the stage's top modules, per pp rank.
PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}
SDP2_PP2_CASES = [
    _case("sdp2-pp2", 2, **PP2),
    _case("sdp2-pp2-mb4-sgd", 2, pipeline_parallel_degree=2, microbatches=4, optimizer="sgd"),
    _case("sdp2-pp2-untied", 2, **PP2, tied=False),
    _case("sdp2-pp2-clip", 2, **PP2, sdp_gradient_clipping=0.05),
    _case("sdp2-pp2-bf16", 2, **PP2, bf16=True),
    _case("sdp2-pp2-bf16-clip", 2, **PP2, bf16=True, sdp_gradient_clipping=0.05, steps=4),
]


FOUR_A.add("sdp2-pp2", SDP2_PP2_CASES, timeout=300)


def test_sharded_with_pipeline_4_ranks() -> None:
    FOUR_A.check("sdp2-pp2")


# Issue 42: a tiny Hugging Face Llama with tied embeddings (embedding and head one parameter)
# at sdp=2 x pp=2, the tied pair pinned to stage 0 (with the root: one unit holds both) and to
# stage 1 (separate stage tops: the pair must still be one sharded parameter, one gradient).
MANUAL_PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False}
TIED_ON_0 = {"model.layers.1": 1, "model.norm": 1}
TIED_ON_1 = {"model.embed_tokens": 1, "lm_head": 1, "model.layers.1": 1, "model.norm": 1}
SDP2_PP2_TIED_CASES = [
    _case("sdp2-pp2-llama-tied-stage0", 2, **MANUAL_PP2, model="llama", pin=TIED_ON_0,
          units={"0": [""], "1": ["model.norm", "model.layers.1"]}),
    # Stage 1's tops lm_head and model.embed_tokens share the weight: one grouped unit.
    _case("sdp2-pp2-llama-tied-stage1", 2, **MANUAL_PP2, model="llama", pin=TIED_ON_1,
          units={"0": [""], "1": ["lm_head+model.embed_tokens", "model.norm", "model.layers.1"]}),
]  # fmt: skip


FOUR_B.add("sdp2-pp2-tied", SDP2_PP2_TIED_CASES, timeout=400)


def test_sharded_pipeline_tied_embeddings_on_either_stage_4_ranks() -> None:
    FOUR_B.check("sdp2-pp2-tied")


# Issue 42: a data-dependent branch (models.MoELM: each sample's first token picks one of two
# experts; the batches send one data-parallel rank's samples to expert 0 and the other's to
# expert 1, then the other way round, then all to expert 0, so that expert 1 has a gradient
# on no rank and must keep none). Exact: a parameter with a gradient on some ranks only joins
# the reduce-scatter with zeros elsewhere. Threshold 1100: the experts (552 each) stay inside
# the always-run "moe" unit (the ModuleList holding them is never called: no unit).
MOE = {"model": "moe"}
SDP2_BRANCH_CASES = [
    _case("sdp2-moe", 2, sdp_param_persistence_threshold=1100, **MOE, units=["moe", ""]),
    _case("sdp2-moe-root-mb2-sgd", 2, microbatches=2, optimizer="sgd", **MOE, units=[""]),
    # Threshold 100: each expert's Linear layers are units of their own, which one rank runs
    # and the other does not: cannot be exact; every rank must raise, naming both units.
    _case("sdp2-moe-expert-units", 2, **SMALL, **MOE,
          error=["ran different modules", "rank 0: all-gather unit 'moe.experts.0.fc1' for forward",
                 "rank 1: all-gather unit 'moe.experts.1.fc1' for forward"]),
]  # fmt: skip


# Last in its job: the case that must raise ends the job (sharded.py runs nothing after it).
TWO.add("sdp2-branch", SDP2_BRANCH_CASES, timeout=400)


def test_sharded_data_dependent_branch_2_ranks() -> None:
    exact = [c["name"] for c in SDP2_BRANCH_CASES if "error" not in c]
    out = TWO.check("sdp2-branch", exact)
    raised = re.findall(r"RANK (\d) RAISED sdp2-moe-expert-units: SMPError", out)
    assert sorted(raised) == ["0", "1"], out


# With a pipeline every unit is gathered before the step and reduced after it, so a branch
# trains exactly even where a whole unit runs on one rank only: expert 1 is a stage-1 top (its
# own unit), expert 0 sits in stage 0's root unit.
SDP2_PP2_BRANCH_CASES = [
    _case("sdp2-pp2-moe", 2, **MANUAL_PP2, **MOE, pin={"moe.experts.1": 1, "ln": 1, "head": 1},
          units={"0": [""], "1": ["head", "ln", "moe.experts.1"]}),
]  # fmt: skip


FOUR_B.add("sdp2-pp2-branch", SDP2_PP2_BRANCH_CASES, timeout=400)


def test_sharded_pipeline_data_dependent_branch_4_ranks() -> None:
    FOUR_B.check("sdp2-pp2-branch")


# Issue 42: sharded data x pipeline x tensor parallelism (8 ranks: pp=2, tp=2, sdp=2): each
# stage's tensor-parallel slice is sharded over its two data-parallel ranks; smp-tp's spec
# rides on the sharded parameters and its gradient rules apply after the reduce-scatter.
PP2_TP2 = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}
SDP2_PP2_TP2_CASES = [
    _case("sdp2-pp2-tp2", 2, **PP2_TP2),
    # The tied embedding/head pinned to stage 1 (two stage tops there), with clipping.
    _case("sdp2-pp2-tp2-tied-stage1-clip", 2, **PP2_TP2, auto_partition=False, optimizer="sgd",
          sdp_gradient_clipping=0.05, pin={"emb": 1, "head": 1, "blocks.1": 1, "ln": 1}),
]  # fmt: skip


def test_sharded_pipeline_tensor_parallel_8_ranks() -> None:
    out = launch("sharded.py", 8, SDP2_PP2_TP2_CASES, timeout=400)
    assert ok_cases(out) == [c["name"] for c in SDP2_PP2_TP2_CASES], out


def _ck(name: str, save: dict, load: dict, partial: bool, optimizer: str = "adam") -> dict:
    return {"name": name, "save": save, "load": load, "partial": partial, "optimizer": optimizer}


SDP4 = {"sharded_data_parallel_degree": 4, **SMALL}
CK4 = [
    _ck("sdp4-to-sdp2", SDP4, {"sharded_data_parallel_degree": 2, **SMALL}, True),
    _ck("sdp4-to-dp4", SDP4, {}, False, "sgd"),
    _ck("dp4-to-sdp4", {}, SDP4, True),
]


CHECKPOINT_FOUR.add("sdp4", CK4, timeout=300)


def test_sharded_checkpoint_changes_degree_4_ranks() -> None:
    """Save with sdp=4, resume with sdp=2 and with plain dp=4 (and back): training continues
    exactly (scripts/checkpointing.py checks every step against one process)."""
    CHECKPOINT_FOUR.check("sdp4")


SDP2_TP2 = {"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, **SMALL}
CK_TP = [
    _ck("sdp2-tp2-to-tp2", SDP2_TP2, {"tensor_parallel_degree": 2}, True),
    _ck("tp2-to-sdp2-tp2", {"tensor_parallel_degree": 2}, SDP2_TP2, False),
    _ck("sdp2-tp2-to-sdp4", SDP2_TP2, SDP4, True, "sgd"),
]


CHECKPOINT_FOUR.add("sdp2-tp2", CK_TP, timeout=300)


def test_sharded_tensor_parallel_checkpoint_4_ranks() -> None:
    """Save at sdp=2 x tp=2, resume at tp=2 without sharding and at sdp=4 without tensor
    parallelism (and tp=2 -> sdp=2 x tp=2): training continues exactly."""
    CHECKPOINT_FOUR.check("sdp2-tp2")


SDP2_PP2 = {"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2}
CK_PP = [
    _ck("sdp2-pp2-to-sdp4", SDP2_PP2, {"sharded_data_parallel_degree": 4}, True),
    # The optimizer state is loaded before the first step partitions and shards the model.
    _ck("sdp4-to-sdp2-pp2", {"sharded_data_parallel_degree": 4}, SDP2_PP2, True),
    _ck("sdp2-pp2-to-pp2", SDP2_PP2, {"pipeline_parallel_degree": 2, "microbatches": 2}, True),
]


CHECKPOINT_FOUR.add("sdp2-pp2", CK_PP, timeout=300)


def test_sharded_pipeline_checkpoint_4_ranks() -> None:
    """Save at sdp=2 x pp=2, resume at sdp=4 and at pp=2 without sharding, and sdp=4 ->
    sdp=2 x pp=2: training continues exactly."""
    CHECKPOINT_FOUR.check("sdp2-pp2")


def test_bad_sharded_configs_raise_on_every_rank() -> None:
    """Each case of scripts/sharded_config.py (a degree that does not divide the data-parallel
    degree, a stage's or a tensor-parallel slice's ranks, with shard_optimizer_state, negative
    sizes, ...)."""
    out = launch("sharded_config.py", 4, timeout=60)
    hits = re.findall(r"RANK (\d) CONFIGERROR (\S+) (\S+)", out)
    total = re.findall(r"RANK (\d) ALL (\d+)", out)
    assert sorted(r for r, _ in total) == ["0", "1", "2", "3"], out
    n = int(total[0][1])
    assert n >= 12, out  # (sdp x pp x tp and sdp with delayed init are accepted since issue 42)
    for rank in "0123":
        cases = [c for r, c, _ in hits if r == rank]
        assert len(cases) == n == len(set(cases)), (rank, out)
