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

from conftest import launch, ok_cases

# Threshold 100 elements: TinyLM's four Linear layers become units; the tied embedding/head
# and the layer norm stay in the root's unit (a shared parameter cannot leave their ancestor).
LINEAR_UNITS = ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", ""]
SMALL = {"sdp_param_persistence_threshold": 100}


def _case(name: str, sdp: int, **kw: object) -> dict:
    extra = {k: kw.pop(k) for k in list(kw) if k in ("optimizer", "steps", "units", "nodes", "reshard_after_forward", "forward_prefetch")}
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


def test_sharded_2_ranks() -> None:
    out = launch("sharded.py", 2, SDP2_CASES, timeout=240)
    assert ok_cases(out) == [c["name"] for c in SDP2_CASES], out


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


def test_sharded_4_ranks() -> None:
    out = launch("sharded.py", 4, SDP4_CASES, timeout=300)
    assert ok_cases(out) == [c["name"] for c in SDP4_CASES], out


def _ck(name: str, save: dict, load: dict, partial: bool, optimizer: str = "adam") -> dict:
    return {"name": name, "save": save, "load": load, "partial": partial, "optimizer": optimizer}


SDP4 = {"sharded_data_parallel_degree": 4, **SMALL}
CK4 = [
    _ck("sdp4-to-sdp2", SDP4, {"sharded_data_parallel_degree": 2, **SMALL}, True),
    _ck("sdp4-to-dp4", SDP4, {}, False, "sgd"),
    _ck("dp4-to-sdp4", {}, SDP4, True),
]


def test_sharded_checkpoint_changes_degree_4_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Save with sdp=4, resume with sdp=2 and with plain dp=4 (and back): training continues
    exactly (scripts/checkpointing.py checks every step against one process)."""
    out = launch("checkpointing.py", 4, str(tmp_path), CK4, timeout=300)
    assert ok_cases(out) == [c["name"] for c in CK4], out


def test_bad_sharded_configs_raise_on_every_rank() -> None:
    """Each case of scripts/sharded_config.py (a degree that does not divide the data-parallel
    degree, with shard_optimizer_state, negative sizes, pp or tp not supported yet, ...)."""
    out = launch("sharded_config.py", 4, timeout=60)
    hits = re.findall(r"RANK (\d) CONFIGERROR (\S+) (\S+)", out)
    total = re.findall(r"RANK (\d) ALL (\d+)", out)
    assert sorted(r for r, _ in total) == ["0", "1", "2", "3"], out
    n = int(total[0][1])
    assert n >= 14, out
    for rank in "0123":
        cases = [c for r, c, _ in hits if r == rank]
        assert len(cases) == n == len(set(cases)), (rank, out)
