"""What the planner knows about a model and a machine: a :class:`Profile`.

A profile is measured once, on one process (``smp_torch.plan`` does it with torch), and
holds everything the search needs, in plain numbers, so the search itself runs anywhere
(no torch): the module graph smp's automatic partition sees, each module's share of the
forward time, the bytes each module saves for backward, which modules tensor parallelism
splits, which ones activation checkpointing wraps, and the machine's communication constants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from smp_partition.errors import PartitionError
from smp_partition.graph import Module, ModuleGraph


@dataclass(frozen=True)
class CommModel:
    """Measured (or assumed) costs of moving bytes between ranks.

    A collective over ``n`` ranks of ``b`` bytes costs ``sync_s + latency_s * steps + volume
    / bandwidth`` with the ring algorithm's steps and volume (all-reduce: ``2(n-1)`` steps,
    ``2(n-1)/n * b``); a point-to-point message ``sync_s + latency_s + b / bandwidth``.
    """

    latency_s: float = 50e-6
    bandwidth: float = 2e9
    """Bytes per second one rank sends or receives in a collective or a message."""
    sync_s: float = 0.0
    """Seconds each collective or message costs inside a computing job beyond its
    transfer: its peers are waited for (a peer still computing, or descheduled where ranks
    outnumber cores). Measured by bench_plan's calibration: a loop of a kernel and a
    4-byte all-reduce on every rank at once, less the kernel alone and the latency."""
    request_s: float = 0.0
    """CPU seconds one pipeline request costs, both ranks together: a module called on
    another stage (or its backward) is a request and a response, each a few thread
    hand-offs and a message (``benchmarks/bench_pipeline.py`` measures it at zero
    compute: about 0.5 ms on the 2-core development machine)."""

    tp_call_s: float = 0.0
    """Seconds each tensor-parallel collective smp-tp issues costs beyond a bare collective of
    the same group: its autograd function, the copies around the gather and the Python
    between them, which the one-process profile (the model unsplit) never runs. Measured by
    bench_plan's calibration: a loop of kernels with smp-tp's all-gather and its backward
    reduce-scatter, less the loop with a bare 4-byte all-reduce, per collective (0.5-0.9 ms
    on the 2-core development machine)."""

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        """Seconds of one ring all-reduce of ``nbytes`` over ``ranks`` ranks (0 for one)."""
        if ranks <= 1:
            return 0.0
        steps = 2 * (ranks - 1)
        return self.sync_s + steps * self.latency_s + steps / ranks * nbytes / self.bandwidth

    def gather_s(self, nbytes: float, ranks: int) -> float:
        """Seconds of one all-gather (or reduce-scatter) producing ``nbytes`` in total."""
        if ranks <= 1:
            return 0.0
        return self.sync_s + (ranks - 1) * self.latency_s + (ranks - 1) / ranks * nbytes / self.bandwidth

    def message_s(self, nbytes: float) -> float:
        """Seconds of one point-to-point message of ``nbytes``."""
        return self.sync_s + self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Profile:
    """One model's measured costs at global batch ``batch_size`` (all ranks together).

    Times and activation bytes scale linearly with the samples a rank processes; parameter
    bytes do not. ``graph`` is the module graph smp's own automatic partition would see
    (``smp_pipeline.trace``), so the planner's stages are the ones smp will build.
    """

    graph: ModuleGraph
    batch_size: int
    forward_s: float
    """Forward time of the whole model on ``batch_size`` samples, on one process."""
    backward_s: float
    """Backward time of the whole model on ``batch_size`` samples, on one process."""
    saved_bytes: Mapping[str, int] = field(default_factory=dict)
    """Bytes each module itself (children excluded) keeps for backward at ``batch_size``."""
    tp_divisors: Mapping[str, int] = field(default_factory=dict)
    """Modules tensor parallelism splits, each with the number the degree must divide
    (attention heads, features); their parameters, time and saved bytes split by tp."""
    tp_gathered_bytes: Mapping[str, int] = field(default_factory=dict)
    """Bytes (at ``batch_size``) of the input each split module all-gathers from its
    tensor-parallel peers and keeps for backward: smp-tp's Megatron blocks and its
    vocabulary-parallel head run their column linears on the tp group's samples at full
    width. A module that exchanges channel slices instead (a per-linear split) keeps only
    as many bytes as its own samples would."""
    checkpoint_units: tuple[str, ...] = ()
    """Modules activation checkpointing wraps (e.g. the transformer blocks)."""
    checkpoint_unit_overhead_s: float = 0.0
    """Seconds a checkpointed unit adds to each microbatch beyond recomputing its forward
    (saving and restoring state, the extra autograd nodes)."""
    param_bytes: int = 4
    grad_bytes: int = 4
    optimizer_bytes: int = 8
    """Optimizer state bytes per parameter element (Adam: two fp32 moments)."""
    optimizer_transient_bytes: int = 0
    """Bytes per parameter element the optimizer step allocates while it runs and frees
    after (torch's foreach Adam: a parameter-sized temporary): a rank holds them for the
    parameters it steps (its stage's, sharded by sdp)."""
    optimizer_s_per_param: float = 0.0
    """Seconds of the optimizer step per parameter element a rank holds."""
    shard_optimizer_s_per_tensor: float = 0.0
    """Seconds the optimizer step adds per parameter tensor when the parameters are
    sharded (FSDP2's DTensors: every optimizer op is dispatched per tensor through DTensor),
    beyond ``optimizer_s_per_param``'s plain step."""
    shard_microbatch_s_per_tensor: float = 0.0
    """Seconds sharding adds to a forward+backward per parameter tensor beyond the
    collectives' transfer (FSDP2 copies each parameter out of the gathered flat buffer
    and each gradient into the reduce-scatter's, and runs its hooks per unit)."""
    step_transient_bytes: float = 0.0
    """Peak bytes a forward+backward of ``batch_size`` samples allocates beyond the saved
    ones (gradients of activations, temporaries), in the part growing with the samples;
    spread over the modules like the saved bytes."""
    step_transient_fixed_bytes: float = 0.0
    """The part of that peak that does not grow with the samples (per microbatch)."""
    step_transient_gradient_bytes: float = 0.0
    """The part of ``step_transient_fixed_bytes`` that is one module's parameter gradient:
    the backward computes a module's gradient before adding it into ``.grad``, one module
    at a time, so the peak holds the largest module's once more. A stage holds its own
    largest module's instead (a huge embedding's on its stage only)."""
    base_bytes: int = 0
    """Memory a rank uses whatever the model (interpreter, libraries, runtime buffers)."""
    memory_margin: float = 0.0
    """Fraction added to every predicted peak: what the allocator keeps resident beyond
    the live bytes, and its rank-to-rank spread (the same work measures up to 3% apart)."""
    step_overhead_s: float = 0.0
    """Fixed seconds per step (synchronisation, bookkeeping)."""
    microbatch_overhead_s: float = 0.0
    """Fixed seconds per microbatch per stage (a pipeline request round, small-op overhead)."""
    comm: CommModel = field(default_factory=CommModel)
    compute_scale: float = 1.0
    """How much slower a rank computes in the job than the profiling process did (more
    ranks than cores: measured once per machine); multiplies every compute time."""
    memory_weight: float = 0.8
    """``alpha`` of smp's automatic partition (the ``memory_weight`` key)."""
    shard_unit_elements: int = 1_000_000
    """smp's ``sdp_param_persistence_threshold``: a checkpoint unit holding this many
    parameter elements is a shard unit of its own (one all-gather, one reduce-scatter);
    smaller ones go to the stage's root unit."""
    balance_slack: float = 0.15
    """smp's ``balance_slack`` for the automatic partition (smp_pipeline.partition)."""

    def __post_init__(self) -> None:
        if not isinstance(self.graph, ModuleGraph):
            raise PartitionError(f"graph must be a ModuleGraph, got {type(self.graph).__name__}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise PartitionError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        for key in ("forward_s", "backward_s", "optimizer_s_per_param", "step_overhead_s",
                    "shard_optimizer_s_per_tensor", "shard_microbatch_s_per_tensor",
                    "microbatch_overhead_s", "memory_weight", "balance_slack", "compute_scale",
                    "step_transient_bytes", "step_transient_fixed_bytes", "memory_margin",
                    "step_transient_gradient_bytes",
                    "checkpoint_unit_overhead_s"):  # fmt: skip
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PartitionError(f"{key} must be a finite number >= 0, got {v!r}")
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "base_bytes", "shard_unit_elements",
                    "optimizer_transient_bytes"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 0:
                raise PartitionError(f"{key} must be an integer >= 0, got {v!r}")
        for what, table in (("saved_bytes", self.saved_bytes), ("tp_divisors", self.tp_divisors),
                            ("tp_gathered_bytes", self.tp_gathered_bytes)):  # fmt: skip
            for name, v in table.items():
                if name not in self.graph:
                    raise PartitionError(f"{what}: {name!r} is not a module of the graph")
                if not isinstance(v, int) or v < (1 if what == "tp_divisors" else 0):
                    raise PartitionError(f"{what}[{name!r}] must be a non-negative integer, got {v!r}")
        for name in self.checkpoint_units:
            if name not in self.graph:
                raise PartitionError(f"checkpoint_units: {name!r} is not a module of the graph")


def synthetic_profile(
    layers: int,
    width: int = 1024,
    heads: int = 16,
    seq: int = 1024,
    batch_size: int = 64,
    vocab: int = 50257,
    layer_forward_s: float = 0.02,
) -> Profile:
    """A GPT-like profile on paper (no measurement): embedding, ``layers`` blocks of
    attention + MLP, head. For tests and the planner's speed benchmark."""
    w = width
    act_block = batch_size * seq * w * 4  # one (batch, seq, width) fp32 tensor
    mods = [Module("", children=("wte", "blocks", "ln_f", "head"))]
    mods.append(Module("wte", params={"wte.weight": vocab * w}, activation_bytes=act_block, forward_ms=1.0))
    names = [f"blocks.{i}" for i in range(layers)]
    mods.append(Module("blocks", children=tuple(names), forward_ms=layer_forward_s * 1e3 * layers))
    saved: dict[str, int] = {}
    tp: dict[str, int] = {}
    for n in names:
        mods.append(Module(n, children=(f"{n}.attn", f"{n}.mlp"), activation_bytes=act_block,
                           forward_ms=layer_forward_s * 1e3))  # fmt: skip
        mods.append(Module(f"{n}.attn", params={f"{n}.attn.w": 4 * w * w}, activation_bytes=act_block,
                           forward_ms=layer_forward_s * 1e3 / 3))  # fmt: skip
        mods.append(Module(f"{n}.mlp", params={f"{n}.mlp.w": 8 * w * w}, activation_bytes=act_block,
                           forward_ms=layer_forward_s * 2e3 / 3))  # fmt: skip
        saved[f"{n}.attn"] = 6 * act_block
        saved[f"{n}.mlp"] = 9 * act_block
        tp[f"{n}.attn"] = heads
        tp[f"{n}.mlp"] = 4 * w
    mods.append(Module("ln_f", params={"ln_f.weight": w}, activation_bytes=act_block, forward_ms=0.5))
    mods.append(Module("head", params={"wte.weight": vocab * w}, activation_bytes=act_block * vocab // w,
                       forward_ms=layer_forward_s * 1e3))  # fmt: skip
    total_ms = 1.0 + layer_forward_s * 1e3 * layers + 0.5 + layer_forward_s * 1e3
    mods[0] = Module("", children=("wte", "blocks", "ln_f", "head"), forward_ms=total_ms)
    saved["head"] = act_block * vocab // w
    return Profile(
        graph=ModuleGraph(mods),
        batch_size=batch_size,
        forward_s=total_ms / 1e3,
        backward_s=2 * total_ms / 1e3,
        saved_bytes=saved,
        tp_divisors=tp,
        checkpoint_units=tuple(names),
        optimizer_s_per_param=1e-9,
        base_bytes=500 << 20,
        microbatch_overhead_s=1e-3,
    )
