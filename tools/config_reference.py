"""The configuration reference page, generated from smp-torch's config definition.

The keys, their types and their defaults come from :class:`smp_torch.config.SMPConfig` (and the
aliases ``parse_config`` accepts); only the one-line meaning of each key is written here. A key
of the dataclass without a meaning below, or a meaning for a key the dataclass no longer has,
is an error: the docs build (``nox -s docs``, through ``tools/docs_hooks.py``) and the test
``packages/smp-torch/tests/test_config_reference.py`` both fail, so the page cannot drift from
what ``smp.init`` accepts.

Run it alone to print the page: ``python tools/config_reference.py``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from smp_torch import config as smp_config

# Where the reference goes in the docs site (relative to docs/).
PAGE = "reference/configuration.md"

# What each key means. Figures (measured speed-ups, memory) live on docs/performance.md, not
# here; "pp", "tp", "dp" are the pipeline, tensor and data-parallel degrees.
MEANINGS: dict[str, str] = {
    "pipeline_parallel_degree": "Pipeline stages the model is split into.",
    "tensor_parallel_degree": (
        "Ranks a tensor-parallel layer is split over; they are data-parallel ranks too (each "
        "keeps its own samples unless `prescaled_batch`)."
    ),
    "microbatches": "Microbatches per step; every split tensor's batch axis must divide evenly.",
    "partition_costs": (
        "What the automatic partition weighs modules by: `flops` (counted, the same on every "
        "run: reproducible partitions) or `measured` (timed in the trace; can move run to run)."
    ),
    "partition_file": (
        "A saved `smp-partition/assignment@1` JSON: if it exists, the model is split as it "
        "says (no trace); if not, rank 0 writes the automatic partition there."
    ),
    "pipeline": (
        '`"interleaved"`: a microbatch ready for backward goes first; `"simple"`: all '
        "forwards, then all backwards."
    ),
    "active_microbatches": (
        "Microbatches in flight at once on the driver (pp rank 0). More hides more round trips "
        "between stages and keeps more saved activations alive; try `2 * pp` when a stage's "
        "compute per microbatch is about a millisecond."
    ),
    "deterministic_accumulation": (
        "pp > 1: each parameter's microbatch gradients are summed in microbatch order whatever "
        "the timing, so two runs give the same bits. Costs up to `active_microbatches` "
        "gradient-sized buffers for parameters with several contributions per microbatch on a "
        "stage. `False`: autograd's order (last bits differ run to run)."
    ),
    "placement_strategy": (
        '`"cluster"` (= `"DPCT"`: tensor-parallel peers neighbours, then context-parallel '
        'ones), `"spread"` (= `"CTPD"`), any permutation of `"CDPT"`, or of `"DPT"` (C goes '
        'just left of T); see [Ranks and groups](../packages/smp-torch.md#ranks-and-groups).'
    ),
    "auto_partition": (
        "Trace and partition the model automatically; `False`: use the `smp.partition` / "
        "`smp.set_partition` marks."
    ),
    "default_partition": "Stage of the root and of unmarked modules under manual partitioning.",
    "memory_weight": "The partitioner's alpha: weight of memory against compute, in [0, 1].",
    "optimize": (
        'smp-tp transformer layers: `"speed"` (Megatron column/row split) or `"memory"` '
        "(input-split linears, reduce-scatter, no replicated activations)."
    ),
    "ddp": (
        "Average gradients over the data-parallel ranks. `False` leaves reducing to you and "
        "requires tp = 1 and no sharding."
    ),
    "prescaled_batch": "Tensor-parallel peers receive the same samples (the Megatron mode).",
    "fp16": "Autocast the step to float16, with dynamic loss scaling in the optimizer.",
    "bf16": "Autocast the step to bfloat16 (not together with `fp16`).",
    "shard_optimizer_state": (
        "Each data-parallel rank keeps the optimizer state of its share of the parameters."
    ),
    "offload_activations": (
        "The saved inputs of checkpointed modules (`smp.set_activation_checkpointing`) move to "
        "host memory after their forward and come back ahead of their backward. Exact; does "
        "nothing without checkpointed modules."
    ),
    "activation_loading_horizon": (
        "With offloading: how many next microbatches' saved inputs are loaded back while a "
        "backward runs. At least 1."
    ),
    "static_mode": (
        "Replay what earlier steps recorded: a request that ran straight through on one stage "
        "is served on that stage's main loop instead of a worker thread. Exact; no effect "
        "under tensor parallelism."
    ),
    "fast_mode": (
        "pp > 1: a run of an `nn.Sequential`'s children owned by one stage is one request, and "
        "a loop over an `nn.ModuleList` is chained into one request per stage. Exact. `False`: "
        "one request per child (the paper's baseline)."
    ),
    "tensor_parallel_seed": "Seed of the tensor-parallel RNG stream (dropout inside TP regions).",
    "delayed_parameter_initialization": (
        "Accept models built under `smp.delay_param_initialization()`: each rank materialises "
        "only what it owns, bitwise as a normal construction."
    ),
    "trace_device": (
        'Where the partition is found: `"cpu"` traces the first microbatch on the host, '
        '`"meta"` partitions from parameter counts at wrap time, `"cuda"` traces on the '
        "device. Rank 0's value decides."
    ),
    "timeout_s": (
        "The longest any wait inside smp lasts; then every rank raises or exits, naming the "
        "rank that holds the job up. A finite number of seconds, > 0 and at most 1e8."
    ),
    "timeline": (
        "Path prefix: record the pipeline timeline; `model.write_timeline()` writes "
        "`<prefix>.json` (Chrome trace) and `<prefix>.png`."
    ),
    "print_report": (
        "Rank 0 prints `model.report()` (per module: stage, tensor-parallel treatment, shard "
        "unit, bytes per rank) once, when the model is partitioned. With `timeline` set the "
        "table is also written to `<prefix>.report.txt` (and `.report.json`), whatever this key."
    ),
    "collective_backend": (
        'The `torch.distributed` backend of smp\'s groups: `"auto"` (smp-comm\'s `smp` on '
        'CPU, NCCL on CUDA), `"gloo"` or `"smp"`. See [the smp backend](../how-to/smp-backend.md).'
    ),
    "sharded_data_parallel_degree": (
        "Sharded data parallelism on FSDP2: each rank of a group of this many data-parallel "
        "ranks keeps 1/N of every parameter, gradient and optimizer state. Must divide the "
        "data-parallel degree."
    ),
    "expert_parallel_degree": (
        "Expert parallelism: the routed experts of each MoE layer are split over groups of "
        "this many consecutive data-parallel ranks (each keeps 1/N of the experts and its own "
        "samples; tokens travel by all-to-all). Must divide the data-parallel degree and "
        "every MoE layer's number of experts; composes with pipeline and tensor parallelism and "
        "shard_optimizer_state, not yet with sharded data parallelism."
    ),
    "expert_capacity_factor": (
        "Expert parallelism only. null (default): no token is dropped, results are exact. A "
        "number > 0 caps the slots each rank sends to one expert at ceil(factor x tokens x "
        "top_k / num_experts), keeping the first in token order; a dropped slot contributes "
        "nothing to its token's output. Bounds the all-to-all's size; changes results."
    ),
    "context_parallel_degree": (
        "Context parallelism: every sequence is split over this many ranks, which receive "
        "the same full batch (a new axis outside data parallelism: `smp.dp_size()` excludes "
        "it). Each rank keeps two of 2 x cp equal chunks (load-balanced causal work); "
        "attention is ring attention over the cp group; the causal-LM loss is the full "
        "sequence's on every cp rank. Hugging Face models calling attention through "
        "transformers' attention interface (Llama, Mistral, Qwen2/3, ...); sequences "
        "divisible by 2 x cp, no padding mask, no soft-capping or shorter sliding window. "
        "Composes with tensor, pipeline and data parallelism; not yet with sharded data or "
        "expert parallelism. See [Context parallelism](../how-to/context-parallel.md)."
    ),
    "context_parallel_attention": (
        "Context parallelism only: how attention sees the other ranks' tokens. `\"ring\"`: "
        "k/v blocks passed round the cp group (any number of heads); `\"all_to_all\"`: one "
        "all-to-all over heads (DeepSpeed-Ulysses; cp must divide each rank's query and "
        "key/value heads, else `ConfigError`); `\"auto\"` (default): the all-to-all where the "
        "heads divide, the ring elsewhere. See [Context parallelism](../how-to/context-parallel.md)."
    ),
    "sdp_reduce_bucket_size": (
        "Elements: the largest shard unit made by keeping small children with their parent."
    ),
    "sdp_param_persistence_threshold": (
        "Elements: a module whose parameters reach this becomes its own shard unit."
    ),
    "sdp_max_live_parameters": (
        "Elements: FSDP2 prefetches ahead only while the gathered units stay within this; "
        "not applied on CPU."
    ),
    "sdp_hierarchical_allgather": (
        "After forward, units reshard to the sharding-group ranks on this node, so the "
        "backward all-gather stays within a node."
    ),
    "sdp_gradient_clipping": (
        "Max norm (0: off): gradients are clipped by the whole model's norm before each "
        "`optimizer.step()`; works without sharding too."
    ),
}

# Defaults that the dataclass cannot state as a value.
DEFAULT_NOTES = {"active_microbatches": "pp + 2"}


class ConfigReferenceError(RuntimeError):
    """The meanings above do not match the config definition."""


def config_keys(config_cls: type | None = None) -> list[str]:
    """The user keys of the config definition, in definition order (derived fields left out)."""
    config_cls = config_cls or smp_config.SMPConfig
    return [f.name for f in dataclasses.fields(config_cls) if not f.metadata.get("derived")]


def config_aliases() -> dict[str, str]:
    """Alias → key, as ``parse_config`` accepts them."""
    return dict(smp_config._ALIASES)


def _default(field: dataclasses.Field[Any]) -> str:
    if field.name in DEFAULT_NOTES:
        return DEFAULT_NOTES[field.name]
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        return f"`{value:_}`"
    return f"`{value!r}`"


def _type(field: dataclasses.Field[Any]) -> str:
    return str(field.type).replace("|", "or")


def render(
    config_cls: type | None = None,
    aliases: Mapping[str, str] | None = None,
    meanings: Mapping[str, str] = MEANINGS,
) -> str:
    """The page's Markdown. Raises :class:`ConfigReferenceError` when ``meanings`` and the config
    definition disagree on the keys."""
    config_cls = config_cls or smp_config.SMPConfig
    if aliases is None:
        aliases = config_aliases()
    fields = {f.name: f for f in dataclasses.fields(config_cls) if not f.metadata.get("derived")}
    undocumented = sorted(set(fields) - set(meanings))
    stale = sorted(set(meanings) - set(fields))
    if undocumented or stale:
        raise ConfigReferenceError(
            "tools/config_reference.py MEANINGS does not match smp_torch.config.SMPConfig: "
            f"keys without a meaning {undocumented}, meanings of no key {stale}"
        )
    by_key: dict[str, list[str]] = {}
    for alias, key in sorted(aliases.items()):
        by_key.setdefault(key, []).append(alias)
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated at build time by tools/config_reference.py from",
        "     smp_torch.config.SMPConfig: edit the meanings there, not this page. -->",
        "",
        "Every key `smp.init` accepts: pass a dict, a path to a JSON file, or nothing to read",
        "the `SMP_CONFIG` environment variable (JSON text or a path). An unknown key, a wrong",
        'type (`"4"` for an int, `1` for a bool), an impossible value, NaN or infinity, or',
        "degrees that do not divide the world size raise `smp.ConfigError` on every rank before",
        "any communication. This page is generated from `smp_torch.config.SMPConfig` when the",
        "site is built.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for name, field in fields.items():
        meaning = " ".join(meanings[name].split())
        lines.append(f"| `{name}` | {_type(field)} | {_default(field)} | {meaning} |")
    for alias, key in sorted(aliases.items()):
        lines.append(f"| `{alias}` | alias | | Another name for `{key}`. |")
    lines.append("")
    return "\n".join(lines)


_ROW = re.compile(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \|", re.MULTILINE)


def keys_on_page(markdown: str) -> list[str]:
    """The keys a rendered page lists (its table's first column), in order."""
    return _ROW.findall(markdown)


if __name__ == "__main__":  # pragma: no cover
    print(render())
