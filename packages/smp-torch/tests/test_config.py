"""Configuration parsing and validation (pure, no MPI job)."""

from __future__ import annotations

import json

import pytest
from smp_torch.config import SMPConfig, parse_config
from smp_torch.errors import ConfigError


def test_defaults_follow_the_spec() -> None:
    cfg = parse_config({}, world_size=4)
    assert cfg.pp == 1 and cfg.tp == 1 and cfg.rdp == 4
    assert cfg.microbatches == 1 and cfg.pipeline == "interleaved"
    assert cfg.active_microbatches == 3  # pp + 2
    assert cfg.placement == "DPT" and cfg.auto_partition and cfg.default_partition == 0
    assert cfg.memory_weight == 0.8 and cfg.optimize == "speed" and cfg.ddp
    assert not any([cfg.prescaled_batch, cfg.fp16, cfg.bf16, cfg.shard_optimizer_state])
    assert not any([cfg.offload_activations, cfg.static_mode])
    assert cfg.fast_mode  # on where exact (issue 15): Sequential runs as one request
    assert cfg.activation_loading_horizon == 4 and cfg.tensor_parallel_seed == 0
    assert cfg.trace_device == "cpu" and cfg.timeline is None
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
    ],
)
def test_bad_values_name_the_key(config: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config, world_size=4)
    assert info.value.key == key
    assert repr(key) in str(info.value)


def test_permutations_of_dpt_are_accepted() -> None:
    for p in ("DPT", "DTP", "PDT", "PTD", "TDP", "TPD", "tpd"):
        assert parse_config({"placement_strategy": p}, 4).placement == p.upper()
    assert parse_config({"placement_strategy": "spread"}, 4).placement == "TPD"


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
