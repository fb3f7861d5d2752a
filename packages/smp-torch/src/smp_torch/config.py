"""The smp configuration: one dataclass, parsed and validated without any communication.

:func:`parse_config` turns a dict, a JSON file path, or the ``SMP_CONFIG`` environment variable
(either form) into an :class:`SMPConfig`. Every check here is local to the process, so a bad
configuration raises :class:`~smp_torch.errors.ConfigError` on every rank before any rank starts
talking to another.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from smp_torch.errors import ConfigError
from smp_torch.topology import with_context_axis

__all__ = ["SMPConfig", "parse_config", "resolve_placement", "CONFIG_ENV", "TRACE_DEVICES"]

CONFIG_ENV = "SMP_CONFIG"

_PIPELINES = ("simple", "interleaved", "zero_bubble")
_COLLECTIVE_BACKENDS = ("auto", "gloo", "smp")
_OPTIMIZE = ("speed", "memory")
CP_ATTENTION = ("auto", "ring", "all_to_all")
PARTITION_COSTS = ("flops", "measured")
TRACE_DEVICES = ("cpu", "meta", "cuda")
# Keys whose name differs from the dataclass field (SageMaker v1 spellings).
_ALIASES = {"partitions": "pipeline_parallel_degree", "_prescaled_batch": "prescaled_batch"}
# The longest timeout accepted (about 3 years): far below what every consumer of timeout_s
# can hold (datetime.timedelta, threading waits, the c10d stores' milliseconds), so a huge
# finite value is refused here by name instead of overflowing later inside smp.init.
MAX_TIMEOUT_S = 1e8
# tensor_parallel_seed plus a small per-rank offset seeds a torch.Generator (at most 2**64 - 1).
_MAX_SEED = 2**63


@dataclass
class SMPConfig:
    """Every smp option with its default (the smp-torch README lists them). Build it with :func:`parse_config`."""

    pipeline_parallel_degree: int = 1
    tensor_parallel_degree: int = 1
    microbatches: int = 1
    pipeline: str = "interleaved"
    active_microbatches: int | None = None  # None: pipeline_parallel_degree + 2
    deterministic_accumulation: bool = True
    placement_strategy: str = "cluster"
    auto_partition: bool = True
    default_partition: int = 0
    memory_weight: float = 0.8
    # How the first step's trace measures each module's forward cost for the automatic
    # partition: "flops" (counted, so the same model, configuration and world size give the
    # same partition on every run) or "measured" (timed: this machine's truth, but noise
    # can flip near-equal splits from run to run). See smp_pipeline.partition.COSTS.
    partition_costs: str = "flops"
    # A saved partition (JSON, schema smp-partition/assignment@1, as smp_partition writes
    # it): when the file exists, rank 0 reads it and the model is split as it says (no
    # trace); when it does not, rank 0 writes the automatic partition there. So one run's
    # partition pins every later one, whatever the costs.
    partition_file: str | None = None
    optimize: str = "speed"
    ddp: bool = True
    prescaled_batch: bool = False
    fp16: bool = False
    bf16: bool = False
    shard_optimizer_state: bool = False
    offload_activations: bool = False
    activation_loading_horizon: int = 4
    static_mode: bool = False
    # On by default: exact (smp_pipeline.seqruns), and the runtime's behaviour before the key
    # did anything (Sequential runs were already one request).
    fast_mode: bool = True
    tensor_parallel_seed: int = 0
    delayed_parameter_initialization: bool = False
    trace_device: str = "cpu"
    timeout_s: float = 300.0
    timeline: str | None = None
    # Rank 0 prints model.report() (what smp did to each module) once it exists.
    print_report: bool = False
    # The torch.distributed backend of the data-, tensor- and pipeline-parallel groups.
    collective_backend: str = "auto"
    # Sharded data parallelism (smp_torch.sharded, on FSDP2's fully_shard).
    sharded_data_parallel_degree: int = 1
    sdp_reduce_bucket_size: int = 500_000_000
    sdp_param_persistence_threshold: int = 1_000_000
    sdp_max_live_parameters: int = 1_000_000_000
    sdp_hierarchical_allgather: bool = False
    sdp_gradient_clipping: float = 0.0
    # Expert parallelism (smp_tp.expert_parallelize): the routed experts of every MoE layer
    # are split over groups of this many data-parallel ranks (each keeps num_experts / ep of
    # them and its own samples; tokens travel by all-to-all).
    expert_parallel_degree: int = 1
    # None: no token is dropped (exact). A number > 0 caps the slots each rank sends to an
    # expert at ceil(factor * tokens * top_k / num_experts): faster, changes results.
    expert_capacity_factor: float | None = None
    # Context parallelism (smp_torch.context_parallel): every sequence is split over this
    # many ranks, which receive the same full batch; a new axis outside data parallelism.
    context_parallel_degree: int = 1
    # How attention sees the other ranks' tokens: "ring" (k/v blocks passed round the group,
    # any head count), "all_to_all" (one all-to-all over heads, DeepSpeed-Ulysses: cp must
    # divide the query and key/value heads of every attention) or "auto" (all_to_all where
    # the heads divide, the ring elsewhere). See smp_torch.context_parallel.
    context_parallel_attention: str = "auto"
    # Derived by validation, not a user key.
    data_parallel_degree: int = field(default=1, metadata={"derived": True})

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_degree

    @property
    def tp(self) -> int:
        return self.tensor_parallel_degree

    @property
    def sdp(self) -> int:
        """Sharded data-parallel degree: ranks that each keep 1/sdp of every parameter."""
        return self.sharded_data_parallel_degree

    @property
    def ep(self) -> int:
        """Expert-parallel degree: data-parallel ranks that split the routed experts."""
        return self.expert_parallel_degree

    @property
    def cp(self) -> int:
        """Context-parallel degree: ranks that split every sequence between them."""
        return self.context_parallel_degree

    @property
    def rdp(self) -> int:
        """Reduced data-parallel degree: number of identical model replicas."""
        return self.data_parallel_degree

    @property
    def placement(self) -> str:
        """The placement as a permutation of ``"CDPT"`` (right-most letter varies fastest)."""
        return resolve_placement(self.placement_strategy)

    def to_dict(self) -> dict[str, Any]:
        """The user-visible keys and their values (derived fields left out)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not f.metadata.get("derived")
        }


def _user_fields() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(SMPConfig) if not f.metadata.get("derived")}


def resolve_placement(strategy: str) -> str:
    """``"cluster"`` → ``"DPCT"``, ``"spread"`` → ``"CTPD"``, a permutation of CDPT → itself,
    a permutation of DPT → itself with ``C`` just left of ``T`` (:mod:`smp_torch.topology`)."""
    if strategy == "cluster":
        return "DPCT"
    if strategy == "spread":
        return "CTPD"
    if isinstance(strategy, str):
        letters = strategy.upper()
        if sorted(letters) == ["C", "D", "P", "T"]:
            return letters
        if sorted(letters) == ["D", "P", "T"]:
            return with_context_axis(letters)
    raise ConfigError(
        "placement_strategy",
        f"must be 'cluster', 'spread' or a permutation of 'DPT' or 'CDPT', got {strategy!r}",
    )


def _load_source(config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    if config is None:
        env = os.environ.get(CONFIG_ENV)
        if env is None or not env.strip():
            return {}
        text = env.strip()
        if text.startswith("{"):
            try:
                loaded = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(CONFIG_ENV, f"is not valid JSON: {exc}") from None
        else:
            return _load_source(text)
    elif isinstance(config, Mapping):
        loaded = dict(config)
    elif isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except OSError as exc:
            raise ConfigError("config", f"cannot read config file {path!r}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError("config", f"file {path!r} is not valid JSON: {exc}") from None
    else:
        raise ConfigError(
            "config", f"must be a dict, a JSON file path or None, got {type(config).__name__}"
        )
    if not isinstance(loaded, dict):
        raise ConfigError("config", f"must be a JSON object, got {type(loaded).__name__}")
    return loaded


def _check_type(key: str, value: Any, annotation: str) -> Any:
    """Check ``value`` against the dataclass annotation (given as a string)."""
    optional = annotation.endswith("| None")
    base = annotation.replace("| None", "").strip()
    if value is None:
        if optional:
            return None
        raise ConfigError(key, f"must be {base}, got None")
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be a bool, got {value!r} ({type(value).__name__})")
        return value
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an int, got {value!r} ({type(value).__name__})")
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"must be a number, got {value!r} ({type(value).__name__})")
        # NaN passes every comparison the value checks make (nan <= 0 is False) and json.loads
        # accepts NaN and Infinity literals: refuse them here, for every float key at once.
        try:
            number = float(value)
        except OverflowError:  # an int beyond the float range
            raise ConfigError(key, f"must be a finite number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(key, f"must be a finite number, got {value!r}")
        return number
    if base == "str":
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r} ({type(value).__name__})")
        return value
    raise AssertionError(f"unhandled annotation {annotation}")  # pragma: no cover


def parse_config(
    config: Mapping[str, Any] | str | os.PathLike[str] | None, world_size: int
) -> SMPConfig:
    """Parse and validate a configuration for a job of ``world_size`` processes.

    Raises :class:`ConfigError` naming the offending key. Performs no communication.
    """
    raw = _load_source(config)
    fields = _user_fields()
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ConfigError(str(key), "config keys must be strings")
        name = _ALIASES.get(key, key)
        if name not in fields:
            known = ", ".join(sorted([*fields, *_ALIASES]))
            raise ConfigError(key, f"unknown key (known keys: {known})")
        if name in values:
            raise ConfigError(key, f"given twice (also as {name!r} or its alias)")
        values[name] = _check_type(key, value, str(fields[name].type))
    cfg = SMPConfig(**values)
    _validate_values(cfg, world_size)
    return cfg


def _positive(cfg: SMPConfig, key: str) -> None:
    if getattr(cfg, key) < 1:
        raise ConfigError(key, f"must be >= 1, got {getattr(cfg, key)}")


def _validate_values(cfg: SMPConfig, world_size: int) -> None:
    for key in ("pipeline_parallel_degree", "tensor_parallel_degree", "microbatches"):
        _positive(cfg, key)
    if cfg.active_microbatches is None:
        cfg.active_microbatches = cfg.pipeline_parallel_degree + 2
    _positive(cfg, "active_microbatches")
    if cfg.activation_loading_horizon < 1:
        raise ConfigError("activation_loading_horizon", "must be >= 1")
    if cfg.pipeline not in _PIPELINES:
        raise ConfigError("pipeline", f"must be one of {_PIPELINES}, got {cfg.pipeline!r}")
    if cfg.pipeline == "zero_bubble" and not cfg.deterministic_accumulation:
        raise ConfigError(
            "deterministic_accumulation",
            "must be True with pipeline 'zero_bubble' (its weight gradients are folded in "
            "microbatch order)",
        )
    if cfg.optimize not in _OPTIMIZE:
        raise ConfigError("optimize", f"must be one of {_OPTIMIZE}, got {cfg.optimize!r}")
    if cfg.trace_device not in TRACE_DEVICES:
        raise ConfigError(
            "trace_device", f"must be one of {TRACE_DEVICES}, got {cfg.trace_device!r}"
        )
    resolve_placement(cfg.placement_strategy)
    if cfg.partition_costs not in PARTITION_COSTS:
        raise ConfigError(
            "partition_costs", f"must be one of {PARTITION_COSTS}, got {cfg.partition_costs!r}"
        )
    if not 0.0 <= cfg.memory_weight <= 1.0:
        raise ConfigError("memory_weight", f"must be within [0, 1], got {cfg.memory_weight}")
    if not 0 <= cfg.default_partition < cfg.pipeline_parallel_degree:
        raise ConfigError(
            "default_partition",
            f"must be within [0, pipeline_parallel_degree={cfg.pipeline_parallel_degree}), "
            f"got {cfg.default_partition}",
        )
    if not 0 < cfg.timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(
            "timeout_s", f"must be > 0 and at most {MAX_TIMEOUT_S:g} s, got {cfg.timeout_s}"
        )
    if cfg.collective_backend not in _COLLECTIVE_BACKENDS:
        raise ConfigError(
            "collective_backend",
            f"must be one of {_COLLECTIVE_BACKENDS}, got {cfg.collective_backend!r}",
        )
    if cfg.fp16 and cfg.bf16:
        raise ConfigError("bf16", "fp16 and bf16 cannot both be enabled")
    if cfg.tensor_parallel_degree > 1 and not cfg.ddp:
        raise ConfigError("ddp", "tensor_parallel_degree > 1 requires ddp=True")
    if not 0 <= cfg.tensor_parallel_seed < _MAX_SEED:
        raise ConfigError(
            "tensor_parallel_seed", f"must be within [0, 2**63), got {cfg.tensor_parallel_seed}"
        )
    if cfg.context_parallel_degree < 1:
        raise ConfigError("context_parallel_degree", f"must be >= 1, got {cfg.context_parallel_degree}")
    mp = cfg.pipeline_parallel_degree * cfg.tensor_parallel_degree
    if world_size % cfg.pipeline_parallel_degree:
        raise ConfigError(
            "pipeline_parallel_degree",
            f"{cfg.pipeline_parallel_degree} does not divide the world size {world_size}",
        )
    if world_size % cfg.tensor_parallel_degree:
        raise ConfigError(
            "tensor_parallel_degree",
            f"{cfg.tensor_parallel_degree} does not divide the world size {world_size}",
        )
    if world_size % mp:
        raise ConfigError(
            "tensor_parallel_degree",
            f"pipeline_parallel_degree * tensor_parallel_degree = {mp} does not divide the "
            f"world size {world_size}",
        )
    cp = cfg.context_parallel_degree
    if (world_size // mp) % cp:
        raise ConfigError(
            "context_parallel_degree",
            f"pipeline_parallel_degree * tensor_parallel_degree * context_parallel_degree = "
            f"{mp * cp} does not divide the world size {world_size}",
        )
    cfg.data_parallel_degree = world_size // (mp * cp)
    _validate_sharding(cfg)
    _validate_experts(cfg)
    _validate_context(cfg)


def _validate_context(cfg: SMPConfig) -> None:
    """``context_parallel_degree``: combinations not supported yet are refused by name."""
    if cfg.context_parallel_attention not in CP_ATTENTION:
        raise ConfigError(
            "context_parallel_attention",
            f"must be one of {CP_ATTENTION}, got {cfg.context_parallel_attention!r}",
        )
    if cfg.cp == 1:
        if cfg.context_parallel_attention != "auto":  # (nothing would read it)
            raise ConfigError("context_parallel_attention", "needs context_parallel_degree > 1")
        return
    for key, degree in (("sharded_data_parallel_degree", cfg.sdp), ("expert_parallel_degree", cfg.ep)):
        if degree > 1:
            raise ConfigError(key, f"cannot be combined with context_parallel_degree > 1 yet (got {degree})")
    if not cfg.ddp:
        raise ConfigError("ddp", "context_parallel_degree > 1 requires ddp=True")


def _validate_experts(cfg: SMPConfig) -> None:
    """``expert_parallel_degree``: ep groups are taken from the data-parallel ranks (with
    tensor parallelism, of each TP rank's replicas). Not with sharded data parallelism so
    far: refused here rather than computed wrongly."""
    ep = cfg.expert_parallel_degree
    if ep < 1:
        raise ConfigError("expert_parallel_degree", f"must be >= 1, got {ep}")
    cf = cfg.expert_capacity_factor
    if cf is not None and not cf > 0:
        raise ConfigError("expert_capacity_factor", f"must be > 0 (or null: nothing dropped), got {cf}")
    if ep == 1:
        if cf is not None:  # (no experts are split, so nothing would read it)
            raise ConfigError("expert_capacity_factor", "needs expert_parallel_degree > 1")
        return
    if cfg.data_parallel_degree % ep:
        raise ConfigError(
            "expert_parallel_degree",
            f"{ep} does not divide the data-parallel degree {cfg.data_parallel_degree} "
            "(world size / (pipeline_parallel_degree * tensor_parallel_degree))",
        )
    if cfg.sdp > 1:
        raise ConfigError(
            "sharded_data_parallel_degree",
            f"cannot be combined with expert_parallel_degree > 1 yet (got {cfg.sdp})",
        )
    if not cfg.ddp:
        raise ConfigError("ddp", "expert_parallel_degree > 1 requires ddp=True")


def _validate_sharding(cfg: SMPConfig) -> None:
    """The ``sdp_*`` keys (see :mod:`smp_torch.sharded`); combinations not supported yet are
    refused here rather than ignored."""
    for key in ("sdp_reduce_bucket_size", "sdp_param_persistence_threshold", "sdp_max_live_parameters"):
        if getattr(cfg, key) < 0:
            raise ConfigError(key, f"must be >= 0, got {getattr(cfg, key)}")
    if cfg.sdp_gradient_clipping < 0:
        raise ConfigError("sdp_gradient_clipping", f"must be >= 0 (0: off), got {cfg.sdp_gradient_clipping}")
    sdp = cfg.sharded_data_parallel_degree
    if sdp < 1:
        raise ConfigError("sharded_data_parallel_degree", f"must be >= 1, got {sdp}")
    if sdp == 1:
        return
    if cfg.data_parallel_degree % sdp:
        raise ConfigError(
            "sharded_data_parallel_degree",
            f"{sdp} does not divide the data-parallel degree {cfg.data_parallel_degree} "
            "(world size / (pipeline_parallel_degree * tensor_parallel_degree))",
        )
    if cfg.shard_optimizer_state:
        raise ConfigError(
            "shard_optimizer_state",
            "cannot be combined with sharded_data_parallel_degree > 1 (sharded data "
            "parallelism already shards the optimizer state)",
        )
    if not cfg.ddp:
        raise ConfigError("ddp", "sharded_data_parallel_degree > 1 requires ddp=True")
