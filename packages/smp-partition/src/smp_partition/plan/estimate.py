"""Predicted step time and peak memory of one candidate configuration.

The model (docs/design.md, "Planner"):

* every time scales with the samples a rank processes (smp's default, ``prescaled_batch``
  off: each of the ``tp * dp`` ranks of a stage keeps its own ``batch / (tp * dp)``
  samples, and a split module runs its tp peers' samples on 1/tp of the weights, the same
  work): a microbatch on a stage costs ``(forward + backward + recompute)`` of the
  profile's measured times scaled by its samples, plus the fixed per-microbatch overhead, tp's two
  all-reduces per tensor-parallel module (three with checkpointing, whose recompute
  repeats the forward one) and the point-to-point messages of the stage's pipeline cuts,
  with the CPU of each request it serves or sends (``CommModel.request_s``; counted as
  smp's ``fast_mode`` sends them, ``stages.count_requests``);
* the pipeline takes one microbatch's time through every stage plus ``microbatches - 1``
  of the slowest stage's (:func:`pipeline_s`; with equal stages the ``microbatches + pp -
  1`` slots of 1F1B, the bubble ``(pp - 1) / (microbatches + pp - 1)``);
* after the pipeline: the data-parallel gradient all-reduce (sharded: reduce-scatter over
  the sdp group, all-reduce over the replicas, plus two all-gathers of the parameters per
  microbatch, and FSDP2's per-tensor copies and the optimizer's per-tensor DTensor
  dispatch, both measured by the profile) and the optimizer step;
* peak memory of a stage's rank: the runtime's fixed bytes, parameters, gradients and
  optimizer state (divided by sdp, plus the largest unit gathered in full), and the saved
  activations of the microbatches in flight (``min(microbatches, active_microbatches)``);
  with checkpointing only each unit's input stays per microbatch, plus one unit's saved
  bytes while it is recomputed; plus one microbatch's backward temporaries (the measured
  peak allocation of a step beyond its saved bytes, the stage's share; of its fixed part,
  the gradient of the stage's own largest module) and the optimizer step's temporaries
  for the parameters the rank steps.

Everything errs on the side of more memory: a configuration it says fits must fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from smp_partition.plan.profile import Profile
from smp_partition.plan.stages import StageSums


@dataclass(frozen=True)
class Candidate:
    """One configuration: degrees, microbatches and checkpointing."""

    pp: int
    tp: int
    dp: int
    sdp: int
    microbatches: int
    checkpointing: bool

    def config(self) -> dict[str, int]:
        """The keys ``smp.init`` takes for this candidate (dp follows from the world size;
        checkpointing is applied with ``smp.set_activation_checkpointing``, not a key)."""
        return {
            "pipeline_parallel_degree": self.pp,
            "tensor_parallel_degree": self.tp,
            "sharded_data_parallel_degree": self.sdp,
            "microbatches": self.microbatches,
        }

    def label(self) -> str:
        ck = "ckpt" if self.checkpointing else "-"
        return f"pp={self.pp} tp={self.tp} dp={self.dp} sdp={self.sdp} mb={self.microbatches} {ck}"


@dataclass(frozen=True)
class Estimate:
    """The planner's prediction for one candidate; ``reason`` is None when it fits."""

    candidate: Candidate
    step_s: float
    bubble: float
    stage_peak_bytes: tuple[float, ...]
    reason: str | None = None

    @property
    def fits(self) -> bool:
        return self.reason is None

    @property
    def config(self) -> dict[str, int]:
        """The ``smp.init`` keys of this candidate (see :meth:`Candidate.config`)."""
        return self.candidate.config()

    @property
    def peak_bytes(self) -> float:
        """The largest predicted peak over the stages (every rank of a stage is alike)."""
        return max(self.stage_peak_bytes) if self.stage_peak_bytes else 0.0


def in_flight(pp: int, microbatches: int) -> int:
    """Microbatches whose activations a stage may hold at once: with a pipeline, smp's
    default ``active_microbatches`` (pp + 2); without one, one (``@smp.step`` runs the
    forward and backward of each microbatch in turn; measured: at tp = 4 a rank's peak
    falls by 28 MiB from 1 to 8 microbatches, bench_plan's gpt2-small grid)."""
    return 1 if pp == 1 else min(microbatches, pp + 2)


def stage_memory(
    profile: Profile, st: StageSums, c: Candidate, model_params: float = 0.0, driver: bool = False
) -> float:
    """Predicted peak bytes of one rank of stage ``st`` under ``c``; ``model_params``: the
    whole model's parameter elements on one rank at ``c.tp`` (every rank holds them until
    the first step partitions the model); ``driver``: the stage is pipeline rank 0's, which
    runs the step function."""
    tp, sdp = c.tp, c.sdp
    params = st.params.at(tp)
    # what persists through the step: parameters, gradients and optimizer state (no margin:
    # long-lived tensors of fixed sizes, which the allocator keeps exactly)
    persistent = params * (profile.param_bytes + profile.grad_bytes + profile.optimizer_bytes) / sdp
    # parameter-sized buffers beside them (copies, temporaries, buckets)
    buffers = 0.0
    if sdp > 1:
        # FSDP2 all-gathers each unit into a flat buffer and copies it out to unsharded
        # parameters, and reduce-scatters full gradients from a flat copy: two full copies
        # of the parameters and two of the gradients, counted as if every unit of the stage
        # were unsharded at once (safe: the runtime frees a unit's after its use).
        buffers += 2 * params * (profile.param_bytes + profile.grad_bytes)
    # the optimizer step's temporaries, for the parameters this rank steps
    buffers += params * profile.optimizer_transient_bytes / sdp
    if c.pp > 1 and driver:
        # deterministic accumulation (smp_pipeline.accumulation): on the driver's stage the
        # microbatches' step functions run their backward concurrently, and one that reaches
        # a parameter before the earlier ones are folded keeps its gradient in a buffer of
        # its own, full size (a pipeline's sharded stage reduces once, after the step): up to
        # one per microbatch in flight beyond the first. (bench_plan's huge-embedding, its 64
        # MiB table on the driver's stage of pp = 2: 794 MiB at 2 microbatches, 985 at 8
        # with sdp = 2, 800-806 and 870-928 without; on pp = 4's stage 1, which serves its
        # requests in order and streams, 717-718 MiB at 2, 4 and 8.)
        buffers += (in_flight(c.pp, c.microbatches) - 1) * params * profile.grad_bytes
    if c.dp // sdp > 1:
        # the replicas' gradient all-reduce packs gradients into flat buckets, several in
        # flight while backward runs: up to one more copy of the stage's gradients
        buffers += params * profile.grad_bytes
    # smp's default (prescaled_batch off): each rank keeps its own batch / (tp * dp) samples
    # in the modules tp does not split; a split module runs its tp peers' samples on 1/tp
    # of the channels, so what it saves inside is as many bytes as its own samples at full
    # width (a per-linear split's input, exchanged by all-to-all, likewise), except the
    # input a Megatron block or the vocabulary head all-gathers: full width, tp times the
    # samples (``gathered``, tp - 1 copies beyond the one the profile saw). (Counted
    # before at tp times for the whole module: tp = 2 over-predicted by 4-6 % against
    # tp = 1, bench_plan's llama-tied grid.)
    own = c.microbatches * c.tp * c.dp  # microbatch slices of the profiled batch, per rank
    live = in_flight(c.pp, c.microbatches)
    gathered = (tp - 1) * st.gathered
    if c.checkpointing and st.unit_saved:
        per_mb = st.saved_outside_units.at(1) + (tp - 1) * st.gathered_outside_units + st.unit_inputs
        # While a microbatch's backward recomputes its units one at a time, what the
        # recompute chain allocated stays in the process (measured: at pp = 1 a rank's peak
        # with checkpointing equals the one without, bench_plan's gpt2-small grid): one
        # microbatch's full saved bytes, on top of the kept unit inputs.
        recompute = st.saved.at(1) + gathered
        acts = (live * per_mb + recompute) / own
    else:
        acts = live * (st.saved.at(1) + gathered) / own
    if c.pp > 1:
        # what crosses the stage's cuts, per microbatch in flight: the activations it
        # received (kept for backward) and sent, and the gradients of both coming back,
        # each also in its serialised message buffer
        acts += live * 4 * (st.received_bytes + st.boundary_bytes) / (c.microbatches * c.dp)
    # One microbatch's backward temporaries on top (the stage's share, by saved bytes).
    total = sum(profile.saved_bytes.values())
    share = st.saved.at(1) / total if total else 1.0 / c.pp
    # The fixed part: the model's largest module gradient (made before it is added into
    # .grad) replaced by this stage's own largest module's, and the rest as measured.
    grad_part = profile.step_transient_gradient_bytes
    gradient = min(grad_part, st.largest_params_at(tp) * profile.grad_bytes)
    fixed_rest = profile.step_transient_fixed_bytes - grad_part
    acts += profile.step_transient_bytes * share * tp / own + fixed_rest
    # The margin (what the allocator keeps of freed small buffers, the rank-to-rank spread)
    # goes on the runtime's bytes and the activations and temporaries; not on the
    # parameter-sized tensors: the persistent ones and the parameter-sized buffers above
    # (copies, buckets, the optimizer's temporaries, a module's gradient), whose sizes are
    # exact and which the allocator maps and returns whole. (On bench_plan's huge-embedding
    # grid, whose 64 MiB table's buffers dominate, the model needs 0.6 % where the small
    # models need 15 %.)
    retained = (profile.base_bytes + acts) * (1.0 + profile.memory_margin)
    training = retained + persistent + buffers + gradient
    # Without delayed initialisation every rank builds the whole model (tensor parallelism's
    # split modules already split when smp wraps it) and keeps it until the first step's
    # trace has placed the modules: then its peak is at least the runtime's with the whole
    # model's parameters (measured on bench_plan's huge-embedding at pp = 4: the stages
    # without the 64 MiB embedding peak 52-65 MiB above the runtime's bytes).
    placing = (profile.base_bytes + fixed_rest) * (1.0 + profile.memory_margin)
    return max(training, placing + gradient + model_params * profile.param_bytes)


def busy_scale(profile: Profile, c: Candidate) -> float:
    """How much slower a rank computes in this job than the profile did. ``compute_scale``
    is measured with every rank computing at once (more ranks than cores time-share them).
    In a pipeline only the busy share ``1 - bubble`` of the ranks competes for the cores at
    a time, and time-sharing slows a process by (processes wanting a core) / cores, never
    below 1: the slowdown is ``compute_scale`` times the busy share, floored at 1 (a
    pipeline whose busy ranks fit the cores runs at the profile's speed; measured: pp = 2
    with one microbatch and pp = 4 with two run at about that speed, bench_plan's
    gpt2-small grid). The former linear blend ``1 + (compute_scale - 1) * busy`` charged
    half the contention to a pipeline whose busy half fits the cores."""
    bubble = (c.pp - 1) / (c.microbatches + c.pp - 1)
    return max(1.0, profile.compute_scale * (1.0 - bubble))


def peer_wait_share(profile: Profile, c: Candidate) -> float:
    """The share of ``CommModel.sync_s`` (the wait for peers descheduled where ranks
    outnumber cores) that this job pays: the excess of its time-sharing slowdown over the
    all-busy one's, so 1 without a pipeline and 0 where the busy ranks fit the cores
    (no peer is descheduled then)."""
    if profile.compute_scale <= 1.0:
        return 1.0 if c.pp == 1 else 0.0
    return (busy_scale(profile, c) - 1.0) / (profile.compute_scale - 1.0)


def shard_units(profile: Profile, st: StageSums, tp: int) -> int:
    """FSDP2 units of a stage under smp's rule: each checkpoint unit holding at least
    ``shard_unit_elements`` parameter elements (at this tp), plus the stage's root unit."""
    return 1 + sum(1 for u in st.unit_params if u.at(tp) >= profile.shard_unit_elements)


def stage_microbatch_s(profile: Profile, st: StageSums, c: Candidate) -> float:
    """Seconds one microbatch spends on one stage (forward, backward, recompute, comm)."""
    frac = 1.0 / (c.microbatches * c.tp * c.dp)  # of the profiled batch, per rank
    # Whole modules run this rank's samples; split ones tp times the samples on 1/tp of the
    # weights: the same share of the work either way.
    fwd = st.forward.at(1) * profile.forward_s * frac
    bwd = st.forward.at(1) * profile.backward_s * frac
    recompute = 0.0
    if c.checkpointing:
        recompute = st.unit_forward.at(1) * profile.forward_s * frac
        recompute += len(st.unit_saved) * profile.checkpoint_unit_overhead_s
    # The wait for peers comes from ranks outnumbering cores: in a pipeline only its busy
    # ranks compete for them (as in busy_scale), so only the excess contention is paid.
    comm = replace(profile.comm, sync_s=profile.comm.sync_s * peer_wait_share(profile, c))
    # the fixed per-microbatch cost (Python and dispatch per module) of this stage's modules
    overhead = profile.microbatch_overhead_s * st.modules / max(len(profile.graph), 1)
    t = (fwd + bwd + recompute + overhead) * busy_scale(profile, c)
    if c.tp > 1 and st.tp_modules:
        # prescaled_batch off: each split linear all-gathers its input (column-parallel) or
        # reduce-scatters its output (row-parallel) in forward, the adjoint in backward,
        # and once more in a checkpointed forward's recompute; over the tp peers' samples.
        per_module = st.tp_output_bytes * frac * c.tp / st.tp_modules
        rounds = 3 if c.checkpointing else 2
        t += rounds * st.tp_modules * (comm.gather_s(per_module, c.tp) + comm.tp_call_s)
    if c.sdp > 1 and c.pp == 1:
        # FSDP2 per microbatch: each unit all-gathered for forward and again for backward,
        # its gradients reduce-scattered (no accumulation unsharded across microbatches).
        # (With a pipeline smp gathers and reduces once per step: stage_after_s.)
        params = st.params.at(c.tp)
        t += 2 * comm.gather_s(params * profile.param_bytes, c.sdp)
        t += comm.gather_s(params * profile.grad_bytes, c.sdp)
        t += 3 * (shard_units(profile, st, c.tp) - 1) * comm.gather_s(0.0, c.sdp)  # their own rounds
        # and FSDP2's own work per parameter tensor (copy-out after the gather, copy-in
        # before the reduce-scatter), compute that time-shares the cores like the rest
        t += st.param_tensors * profile.shard_microbatch_s_per_tensor * busy_scale(profile, c)
    if c.pp > 1:
        # every stage waits once for a microbatch's forward input or its first send, and
        # once for its backward gradient (the last stage: its loss's turn)
        t += 2 * comm.message_s(st.boundary_bytes * frac)
        # and works on every request it serves or sends, forward and backward: each
        # costing its two ranks request_s together (a stage whose modules a parent calls
        # one by one pays per module; a run smp's fast_mode sends as one request, once)
        t += (st.requests_in + st.requests_out) * comm.request_s * busy_scale(profile, c)
    return t


def stage_tops(st: StageSums) -> int:
    """The FSDP2 units smp gives a pipeline stage (``smp_torch.sharded_pp``): its modules
    whose parent is on another stage, plus the root on the stage that owns it (a tied pair
    of tops, grouped into one unit, is counted as two: safe)."""
    return st.cuts + (1 if st.owns_root else 0)


def stage_after_s(profile: Profile, st: StageSums, c: Candidate) -> float:
    """Seconds after the pipeline: gradient synchronisation and the optimizer step."""
    params = st.params.at(c.tp)
    comm = profile.comm
    if c.sdp > 1:
        # the shards' gradients (reduce-scattered per microbatch) averaged over the replicas
        t = comm.allreduce_s(params * profile.grad_bytes / c.sdp, c.dp // c.sdp)
        if c.pp > 1:
            # smp_torch.sharded_pp: a pipeline stage gathers its units once before the
            # step's microbatches and keeps them whole through all of them (the pipeline's
            # ordered accumulation sums into the whole gradients), then reduce-scatters
            # those sums once after: one all-gather and one reduce-scatter per step, not
            # per microbatch, each unit (a stage top) in its own round.
            t += comm.gather_s(params * profile.param_bytes, c.sdp)
            t += comm.gather_s(params * profile.grad_bytes, c.sdp)
            t += 2 * max(0, stage_tops(st) - 1) * comm.gather_s(0.0, c.sdp)
            # FSDP2's per-tensor copies, once per step here (not per microbatch)
            t += st.param_tensors * profile.shard_microbatch_s_per_tensor * profile.compute_scale
        # the optimizer steps DTensor shards: its per-tensor dispatch on top of the plain step
        t += st.param_tensors * profile.shard_optimizer_s_per_tensor * profile.compute_scale
    else:
        # whole parameters are averaged over every rank sharing the batch (tp peers
        # included), split ones over the replicas of their slice
        t = comm.allreduce_s(st.params.whole * profile.grad_bytes, c.tp * c.dp)
        t += comm.allreduce_s(st.params.split / c.tp * profile.grad_bytes, c.dp)
    return t + params / c.sdp * profile.optimizer_s_per_param * profile.compute_scale


def pipeline_s(per_stage: list[float], microbatches: int) -> float:
    """Seconds of the pipeline: one microbatch through every stage, then the rest at the
    slowest stage's pace, ``sum + (microbatches - 1) * max`` of the stages' seconds per
    microbatch. A microbatch's forward and backward visit every stage in turn (and a stage
    a nested call returns to, again: its work for that microbatch is serial however often
    it is visited), so the first one takes the sum; after it the slowest stage paces the
    rest. With equal stages this is the ``(microbatches + pp - 1)`` slots of the slowest;
    with unequal ones those slots charge every stage's share of the fill and drain at the
    slowest stage's time (measured: llama-tied's pp = 4 with checkpointing, stages 0.23,
    0.46, 0.23, 0.08 of the forward, 30-50 % over; gpt2-small's, 0.34, 0.17, 0.33, 0.17,
    32-37 % over, bench_plan's grids)."""
    return sum(per_stage) + (microbatches - 1) * max(per_stage)


def estimate(profile: Profile, stages: list[StageSums], c: Candidate) -> tuple[float, float, tuple[float, ...]]:
    """(step seconds, bubble fraction, peak bytes per stage) of ``c`` on its stages."""
    per_stage = [stage_microbatch_s(profile, st, c) for st in stages]
    after = max(stage_after_s(profile, st, c) for st in stages)
    pipeline = pipeline_s(per_stage, c.microbatches)
    step = pipeline + after + profile.step_overhead_s
    # the slowest stage's idle share (equal stages: (pp - 1) / (microbatches + pp - 1))
    bubble = 1.0 - c.microbatches * max(per_stage) / pipeline if pipeline > 0 else 0.0
    model_params = sum(st.params.at(c.tp) for st in stages)
    peaks = tuple(stage_memory(profile, st, c, model_params, i == 0) for i, st in enumerate(stages))
    return step, bubble, peaks
