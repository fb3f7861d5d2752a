"""Configuration parsing and validation (pure, no MPI job), and the ranks' agreement on it in
``smp.init`` (2-rank MPI jobs: ``scripts/init_agree.py``)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time

import pytest
from conftest import launch, ok_cases
from smp_comm.testing import MPIRunError
from smp_torch.config import SMPConfig, parse_config
from smp_torch.errors import ConfigError


def test_defaults_follow_the_spec() -> None:
    cfg = parse_config({}, world_size=4)
    assert cfg.pp == 1 and cfg.tp == 1 and cfg.rdp == 4
    assert cfg.microbatches == 1 and cfg.pipeline == "interleaved"
    assert cfg.active_microbatches == 3  # pp + 2
    assert cfg.placement == "DPCT" and cfg.auto_partition and cfg.default_partition == 0
    assert cfg.memory_weight == 0.8 and cfg.optimize == "speed" and cfg.ddp
    assert not any([cfg.prescaled_batch, cfg.fp16, cfg.bf16, cfg.shard_optimizer_state])
    assert not any([cfg.offload_activations, cfg.static_mode])
    assert cfg.fast_mode  # on where exact (issue 15): Sequential runs as one request
    assert cfg.activation_loading_horizon == 4 and cfg.tensor_parallel_seed == 0
    assert cfg.trace_device == "cpu" and cfg.timeline is None
    # Reproducible partitions by default (issue 48): counted costs, nothing pinned.
    assert cfg.partition_costs == "flops" and cfg.partition_file is None
    assert set(cfg.to_dict()) == {
        f for f in SMPConfig.__dataclass_fields__ if f != "data_parallel_degree"
    }


def test_alias_partitions_and_derived_degree() -> None:
    cfg = parse_config({"partitions": 2, "tensor_parallel_degree": 2}, world_size=8)
    assert (cfg.pp, cfg.tp, cfg.rdp, cfg.active_microbatches) == (2, 2, 2, 4)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"pipeline_parallel_degree": 3}, "pipeline_parallel_degree"),
        ({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 4}, "tensor_parallel_degree"),
        ({"bogus": 1}, "bogus"),
        ({"microbatches": 0}, "microbatches"),
        ({"microbatches": 2.0}, "microbatches"),
        ({"fp16": "yes"}, "fp16"),
        ({"placement_strategy": "DDT"}, "placement_strategy"),
        ({"placement_strategy": 3}, "placement_strategy"),
        ({"optimize": "fast"}, "optimize"),
        ({"fast_mode": "yes"}, "fast_mode"),
        ({"fast_mode": 1}, "fast_mode"),
        ({"trace_device": "tpu"}, "trace_device"),
        ({"default_partition": 1}, "default_partition"),
        ({"fp16": True, "bf16": True}, "bf16"),
        ({"tensor_parallel_degree": 2, "ddp": False}, "ddp"),
        ({"partitions": 2, "pipeline_parallel_degree": 2}, "pipeline_parallel_degree"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"timeline": 5}, "timeline"),
        ({"partition_costs": "timed"}, "partition_costs"),
        ({"partition_file": 3}, "partition_file"),
        ({"expert_parallel_degree": 3}, "expert_parallel_degree"),
        ({"expert_parallel_degree": 0}, "expert_parallel_degree"),
        ({"expert_parallel_degree": 4, "pipeline_parallel_degree": 2}, "expert_parallel_degree"),
        ({"expert_parallel_degree": 2, "sharded_data_parallel_degree": 2}, "sharded_data_parallel_degree"),
        ({"expert_parallel_degree": 2, "expert_capacity_factor": 0}, "expert_capacity_factor"),
        ({"expert_capacity_factor": 1.5}, "expert_capacity_factor"),
        ({"context_parallel_degree": 3}, "context_parallel_degree"),
        ({"context_parallel_degree": 0}, "context_parallel_degree"),
        ({"context_parallel_degree": 2, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2},
         "context_parallel_degree"),
        ({"context_parallel_degree": 2, "sharded_data_parallel_degree": 2}, "sharded_data_parallel_degree"),
        ({"context_parallel_degree": 2, "expert_parallel_degree": 2}, "expert_parallel_degree"),
        ({"context_parallel_degree": 2, "ddp": False}, "ddp"),
        ({"placement_strategy": "CDPP"}, "placement_strategy"),
        ({"context_parallel_degree": 2, "context_parallel_attention": "ulysses"}, "context_parallel_attention"),
        ({"context_parallel_attention": "ring"}, "context_parallel_attention"),
        ({"pipeline": "zero-bubble"}, "pipeline"),
        ({"pipeline": "zero_bubble", "deterministic_accumulation": False}, "deterministic_accumulation"),
    ],
)
def test_bad_values_name_the_key(config: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config, world_size=4)
    assert info.value.key == key
    assert repr(key) in str(info.value)


def test_pipeline_accepts_zero_bubble() -> None:
    assert parse_config({"pipeline": "zero_bubble"}, world_size=2).pipeline == "zero_bubble"


def test_permutations_of_dpt_are_accepted() -> None:
    # C (context parallelism) goes just left of T: cp peers next to the TP peers.
    for p, full in (("DPT", "DPCT"), ("DTP", "DCTP"), ("PDT", "PDCT"), ("PTD", "PCTD"),
                    ("TDP", "CTDP"), ("TPD", "CTPD"), ("tpd", "CTPD"), ("TCDP", "TCDP"), ("cdpt", "CDPT")):
        assert parse_config({"placement_strategy": p}, 4).placement == full
    assert parse_config({"placement_strategy": "spread"}, 4).placement == "CTPD"


def test_context_parallel_degree_is_outside_data_parallelism() -> None:
    cfg = parse_config({"context_parallel_degree": 2, "tensor_parallel_degree": 2}, 8)
    assert (cfg.cp, cfg.tp, cfg.pp, cfg.rdp) == (2, 2, 1, 2)
    assert parse_config({"context_parallel_degree": 4}, 4).rdp == 1


def test_json_file_and_environment(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"microbatches": 4}))
    assert parse_config(str(path), 2).microbatches == 4
    monkeypatch.setenv("SMP_CONFIG", json.dumps({"microbatches": 2}))
    assert parse_config(None, 2).microbatches == 2
    monkeypatch.setenv("SMP_CONFIG", str(path))
    assert parse_config(None, 2).microbatches == 4
    monkeypatch.setenv("SMP_CONFIG", "{not json")
    with pytest.raises(ConfigError):
        parse_config(None, 2)
    with pytest.raises(ConfigError, match="cannot read"):
        parse_config(str(tmp_path / "missing.json"), 2)


# Every float-valued key, read from the dataclass so that a key added later is covered too.
FLOAT_KEYS = sorted(
    f.name
    for f in dataclasses.fields(SMPConfig)
    if str(f.type) == "float" and not f.metadata.get("derived")
)


def test_float_keys_are_the_known_ones() -> None:
    # A guard on the discovery above: if it found nothing, the tests below would pass vacuously.
    assert FLOAT_KEYS == ["memory_weight", "sdp_gradient_clipping", "timeout_s"]


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, 10**400], ids=["nan", "inf", "-inf", "int1e400"]
)
def test_non_finite_floats_raise_config_error(key: str, value: float) -> None:
    """NaN passes ``nan <= 0``-style checks, and inf overflowed later in smp.init
    (``timedelta``) with a raw ValueError / OverflowError instead of naming the key."""
    with pytest.raises(ConfigError, match="finite") as info:
        parse_config({key: value}, world_size=4)
    assert info.value.key == key


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_json_literals_raise_config_error(key: str, literal: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # json.loads accepts these non-standard literals; SMP_CONFIG text goes through it.
    monkeypatch.setenv("SMP_CONFIG", f'{{"{key}": {literal}}}')
    with pytest.raises(ConfigError) as info:
        parse_config(None, world_size=4)
    assert info.value.key == key


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_numbers_as_strings_are_refused(key: str) -> None:
    with pytest.raises(ConfigError, match="must be a number") as info:
        parse_config({key: "nan"}, world_size=4)
    assert info.value.key == key


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"timeout_s": 1e300}, "timeout_s"),  # finite, but timedelta() overflowed on it
        ({"timeout_s": 0}, "timeout_s"),
        ({"sdp_gradient_clipping": -0.5}, "sdp_gradient_clipping"),
        ({"memory_weight": -0.1}, "memory_weight"),
        ({"tensor_parallel_seed": 2**64}, "tensor_parallel_seed"),  # beyond a torch seed
    ],
)
def test_out_of_range_numbers_name_the_key(config: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config, world_size=4)
    assert info.value.key == key


def test_large_finite_values_within_range_are_kept() -> None:
    cfg = parse_config({"timeout_s": 86400 * 30, "sdp_gradient_clipping": 1e30}, world_size=4)
    assert cfg.timeout_s == 86400.0 * 30 and cfg.sdp_gradient_clipping == 1e30


def _cases(out: str) -> dict[tuple[int, str], tuple[float, str]]:
    """``(rank, case) -> (seconds in smp.init, what it printed)`` from ``init_agree.py``."""
    found = re.findall(r"^RANK (\d) CASE (\w+) ([\d.]+) (.*)$", out, re.MULTILINE)
    return {(int(r), name): (float(took), said) for r, name, took, said in found}


def test_init_agrees_on_validity_and_values_on_2_ranks() -> None:
    """A configuration invalid on one rank only used to raise there alone while the other
    ranks waited for it in an allgather for good (issue 49): now every rank raises, naming the
    rank and the key, within a second; a late rank is named instead of waited for."""
    out = launch("init_agree.py", 2, timeout=90)
    got = _cases(out)
    unknown = "ConfigError: smp config key 'microbatchs': invalid on rank [1]: unknown key"
    expected = {  # case -> (rank 0 says, rank 1 says): regexes
        "typo": (re.escape(unknown) + r".*cause -", re.escape(unknown) + r".*cause ConfigError"),
        "value0": (
            r"ConfigError: smp config key 'microbatches': invalid on rank \[0\]: must be >= 1.*"
            r"cause ConfigError",
            r"ConfigError: smp config key 'microbatches': invalid on rank \[0\]: must be >= 1",
        ),
        # Each invalid rank leads with its own key and text; the other's follows.
        "two_keys": (
            r"key 'bogus': invalid on rank \[0\]: unknown key.*also key 'microbatches' invalid "
            r"on rank \[1\]: must be an int",
            r"key 'microbatches': invalid on rank \[1\]: must be an int.*also key 'bogus' "
            r"invalid on rank \[0\]: unknown key",
        ),
        "both": (r"key 'bogus': invalid on every rank \(2\)",) * 2,
        "disagree": (
            r"ConfigError: smp config key 'microbatches': ranks disagree: "
            r"2 on rank \[0\], 4 on rank \[1\]; every rank must pass the same configuration",
        )
        * 2,
        "late1": (r"SMPError: rank \[1\] did not reach smp.init within 1 s",) * 2,
        "late0": (
            r"SMPError: rank 1 stopped waiting for rank 0 in smp.init after 1 s",
            r"SMPError: rank 0 did not reach smp.init within 1 s",
        ),
        "ok": ("OK", "OK"),
    }
    for case, patterns in expected.items():
        for rank, pattern in enumerate(patterns):
            assert (rank, case) in got, f"rank {rank} printed nothing for {case}:\n{out}"
            took, said = got[rank, case]
            assert re.search(pattern, said), f"rank {rank}, {case}: {said!r}\n{out}"
            # Errors found in the exchange come at once (< 0.1 s unloaded); a timeout after
            # timeout_s (1 s). Generous bounds: the old code never returned at all.
            assert took < (4.0 if case.startswith("late") else 3.0), (rank, case, took, out)
    assert out.count("DONE initialized=True") == 2, out


def test_init_typo_on_one_rank_uncaught_fails_the_job_on_both_ranks() -> None:
    start = time.monotonic()
    with pytest.raises(MPIRunError) as info:
        launch("init_agree.py", 2, "--uncaught", "typo", timeout=60, fast_exit=False)
    out = str(info.value)
    assert "timed out" not in out, out  # the job exited (non-zero), it did not hang
    assert time.monotonic() - start < 45, out
    said = r"CASE typo [\d.]+ ConfigError: smp config key 'microbatchs': invalid on rank \[1\]"
    for rank in (0, 1):
        assert re.search(f"RANK {rank} {said}", out), out


def test_partitions_are_reproducible_and_pinned_by_partition_file() -> None:
    out = launch("partition_pin.py", 2, timeout=300)
    assert ok_cases(out) == ["five-constructions", "partition-file-written", "partition-file-read"], out


def test_expert_parallel_degree_divides_the_data_parallel_degree() -> None:
    cfg = parse_config({"expert_parallel_degree": 2}, world_size=4)
    assert (cfg.ep, cfg.rdp) == (2, 4)  # taken from the data-parallel ranks: dp unchanged
    assert parse_config({"expert_parallel_degree": 4}, world_size=4).ep == 4
    assert parse_config({}, world_size=4).ep == 1
