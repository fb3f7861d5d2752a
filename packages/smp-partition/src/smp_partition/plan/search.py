"""The search: every candidate configuration for a world size, checked and ranked.

``search(profile, world_size, memory_per_rank)`` enumerates pipeline, tensor, data and
sharded-data degrees (``pp * tp * dp == world_size``, sdp dividing dp), microbatches and
activation checkpointing, rejects each candidate that cannot run with the first reason that
binds (a divisibility, an empty stage, a stage over the memory budget), predicts the rest
(:mod:`smp_partition.plan.estimate`) and ranks them by predicted step time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from smp_partition.errors import PartitionError
from smp_partition.plan.estimate import Candidate, Estimate, estimate
from smp_partition.plan.profile import Profile
from smp_partition.plan.stages import ModuleFacts, StageSums, module_facts, stage_sums

#: The keys a user may pin (smp.init's names, plus ``activation_checkpointing``).
PIN_KEYS = (
    "pipeline_parallel_degree",
    "tensor_parallel_degree",
    "sharded_data_parallel_degree",
    "microbatches",
    "activation_checkpointing",
)
GiB = 1 << 30


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB or MiB, one decimal (as the tables print them)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _bar(share: float, width: int = 10) -> str:
    """``share`` of the budget as a bar and a percentage (the table's picture)."""
    full = min(width, round(share * width))
    return f"{'#' * full}{'.' * (width - full)} {share:>4.0%}"


def _check_pins(pinned: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pinned.items():
        if key not in PIN_KEYS:
            raise PartitionError(f"cannot pin {key!r}: the planner chooses {', '.join(PIN_KEYS)}")
        if key == "activation_checkpointing":
            if not isinstance(value, bool):
                raise PartitionError(f"pinned {key} must be True or False, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PartitionError(f"pinned {key} must be an integer >= 1, got {value!r}")
        out[key] = value
    return out


def _matches(c: Candidate, pins: Mapping[str, Any]) -> bool:
    values = {
        "pipeline_parallel_degree": c.pp,
        "tensor_parallel_degree": c.tp,
        "sharded_data_parallel_degree": c.sdp,
        "microbatches": c.microbatches,
        "activation_checkpointing": c.checkpointing,
    }
    return all(values[k] == v for k, v in pins.items())


@dataclass(frozen=True)
class Plan:
    """The ranked candidates: those that fit by predicted step time, then the rejected."""

    world_size: int
    memory_per_rank: float
    estimates: tuple[Estimate, ...]
    pinned: Mapping[str, Any]
    _planner: _Planner

    @property
    def profile(self) -> Profile:
        """The profile the candidates were predicted from."""
        return self._planner.profile

    @property
    def feasible(self) -> list[Estimate]:
        return [e for e in self.estimates if e.fits]

    @property
    def best(self) -> Estimate:
        """The fastest candidate that fits; PartitionError naming why when none does."""
        for e in self.estimates:
            if e.fits:
                return e
        reasons = sorted({e.reason or "" for e in self.estimates})
        raise PartitionError(
            f"no configuration fits {format_bytes(self.memory_per_rank)} per rank on "
            f"{self.world_size} ranks; e.g. " + "; ".join(reasons[:3])
        )

    def why_not(self, config: Mapping[str, Any]) -> str:
        """Why ``config`` (smp.init keys, plus ``activation_checkpointing``) is not the pick:
        its binding reason, or its predicted time against the best."""
        pins = _check_pins(config)
        dp_total = self.world_size
        pp = pins.get("pipeline_parallel_degree", 1)
        tp = pins.get("tensor_parallel_degree", 1)
        if pp * tp == 0 or dp_total % (pp * tp):
            return f"pp={pp} x tp={tp} does not divide the world size {self.world_size}"
        c = Candidate(
            pp=pp,
            tp=tp,
            dp=dp_total // (pp * tp),
            sdp=pins.get("sharded_data_parallel_degree", 1),
            microbatches=pins.get("microbatches", 1),
            checkpointing=pins.get("activation_checkpointing", False),
        )
        e = self._planner.evaluate(c, self.memory_per_rank)
        if not e.fits:
            return f"{c.label()}: {e.reason}"
        try:
            best = self.best
        except PartitionError:
            return f"{c.label()}: fits (predicted {e.step_s:.4g} s)"
        if best.candidate == c:
            return f"{c.label()} is the best pick (predicted {e.step_s:.4g} s)"
        rank = 1 + sum(1 for x in self.feasible if x.step_s < e.step_s)
        return (
            f"{c.label()}: fits, but predicted {e.step_s:.4g} s per step vs {best.step_s:.4g} s "
            f"for {best.candidate.label()} ({e.step_s / best.step_s:.2f}x; rank {rank} of "
            f"{len(self.feasible)} that fit)"
        )

    def table(self, limit: int | None = 10, rejected: int = 5) -> str:
        """The ranked table as text: the first ``limit`` that fit, ``rejected`` rejected ones."""
        head = (f"{'#':>3}  {'candidate':<40} {'step s':>9} {'bubble':>6} {'peak/rank':>11}  "
                f"{'peak vs budget':<16} stage peaks")  # fmt: skip
        lines = [
            f"smp.plan: {self.world_size} ranks, budget {format_bytes(self.memory_per_rank)} per rank; "
            f"{len(self.feasible)} of {len(self.estimates)} candidates fit"
            + (f" (pinned: {dict(self.pinned)})" if self.pinned else ""),
            head,
        ]
        fit = self.feasible[:limit] if limit is not None else self.feasible
        for i, e in enumerate(fit, 1):
            stages = ", ".join(format_bytes(b) for b in e.stage_peak_bytes[:8])
            if len(e.stage_peak_bytes) > 8:
                stages += ", ..."
            lines.append(
                f"{i:>3}  {e.candidate.label():<40} {e.step_s:>9.4g} {e.bubble:>6.0%} "
                f"{format_bytes(e.peak_bytes):>11}  {_bar(e.peak_bytes / self.memory_per_rank)} {stages}"
            )
        # Those over the budget first (closest to fitting first): the informative rejections.
        bad = sorted((e for e in self.estimates if not e.fits),
                     key=lambda e: (not e.stage_peak_bytes, e.peak_bytes))[:rejected]  # fmt: skip
        if bad:
            lines.append("rejected (first few):")
            lines += [f"  -  {e.candidate.label():<40} {e.reason}" for e in bad]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every candidate with its prediction or reason."""
        return {
            "world_size": self.world_size,
            "memory_per_rank": self.memory_per_rank,
            "pinned": dict(self.pinned),
            "candidates": [
                {
                    **e.candidate.config(),
                    "dp": e.candidate.dp,
                    "activation_checkpointing": e.candidate.checkpointing,
                    "step_s": e.step_s,
                    "bubble": e.bubble,
                    "stage_peak_bytes": list(e.stage_peak_bytes),
                    "reason": e.reason,
                }
                for e in self.estimates
            ],
        }


class _Planner:
    """Caches one partition per pipeline degree; evaluates candidates against them."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.facts: ModuleFacts = module_facts(profile)
        self._stages: dict[tuple[int, bool, bool], list[StageSums]] = {}

    def stages(self, pp: int, checkpointing: bool = False, tp: int = 1) -> list[StageSums]:
        """The stages smp builds for ``pp``: its partition, with the checkpoint units kept
        whole under checkpointing and the tensor-parallel modules under tp > 1 (smp moves
        their submodules onto their stage)."""
        key = (pp, checkpointing and pp > 1, tp > 1 and pp > 1)
        if key not in self._stages:
            p = self.profile
            whole = (p.checkpoint_units if key[1] else ()) + (tuple(p.tp_divisors) if key[2] else ())
            self._stages[key] = stage_sums(p, self.facts, pp, whole)[0]
        return self._stages[key]

    def structural_reason(self, c: Candidate) -> str | None:
        """The first divisibility or partition problem of ``c``, or None."""
        p = self.profile
        if c.dp % c.sdp:
            return f"sdp={c.sdp} does not divide dp={c.dp}"
        if c.tp > 1:
            if not p.tp_divisors:
                return f"tp={c.tp}: no module of the model is tensor-parallel"
            for name, d in p.tp_divisors.items():
                if d % c.tp:
                    return f"tp={c.tp} does not divide {d} of module {name!r}"
        ranks = c.tp * c.dp  # ranks of a stage, each with its own samples
        if p.batch_size % ranks:
            return f"tp*dp={ranks} ranks do not divide the batch of {p.batch_size} samples"
        per_rank = p.batch_size // ranks
        if per_rank % c.microbatches:
            return f"microbatches={c.microbatches} does not divide the {per_rank} samples per rank"
        if c.checkpointing and not p.checkpoint_units:
            return "activation checkpointing: the profile names no checkpoint units"
        if c.pp > 1:
            if c.pp > len(p.graph):
                return f"pp={c.pp} exceeds the model's {len(p.graph)} modules"
            for s, st in enumerate(self.stages(c.pp, c.checkpointing, c.tp)):
                if st.modules == 0 or st.forward.at(1) == 0 and st.params.at(1) == 0:
                    return f"pp={c.pp}: the partition leaves stage {s} without work"
        return None

    def evaluate(self, c: Candidate, budget: float) -> Estimate:
        reason = self.structural_reason(c)
        if reason is not None:
            return Estimate(c, float("inf"), 0.0, (), reason)
        step, bubble, peaks = estimate(self.profile, self.stages(c.pp, c.checkpointing, c.tp), c)
        worst = max(range(len(peaks)), key=peaks.__getitem__)
        if peaks[worst] > budget:
            where = f"stage {worst}" if c.pp > 1 else "each rank"
            reason = f"{where} needs {format_bytes(peaks[worst])} > budget {format_bytes(budget)}"
        return Estimate(c, step, bubble, peaks, reason)


def candidates(
    world_size: int,
    microbatch_options: Iterable[int],
    checkpointing: bool,
    pins: Mapping[str, Any] | None = None,
) -> list[Candidate]:
    """Every (pp, tp, dp, sdp, microbatches, checkpointing) for ``world_size``, matching ``pins``."""
    out: list[Candidate] = []
    mbs = sorted(set(microbatch_options))
    for pp in divisors(world_size):
        for tp in divisors(world_size // pp):
            dp = world_size // (pp * tp)
            for sdp in divisors(dp):
                for m in mbs:
                    for ck in (False, True) if checkpointing else (False,):
                        c = Candidate(pp, tp, dp, sdp, m, ck)
                        if pins is None or _matches(c, pins):
                            out.append(c)
    return out


def search(
    profile: Profile,
    world_size: int,
    memory_per_rank: float,
    pinned: Mapping[str, Any] | None = None,
    microbatch_options: Iterable[int] | None = None,
) -> Plan:
    """Rank every candidate for ``world_size`` ranks of ``memory_per_rank`` bytes each.

    ``pinned`` fixes keys (:data:`PIN_KEYS`); the planner fills the rest.
    ``microbatch_options`` defaults to the powers of two up to the batch size.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PartitionError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(memory_per_rank, (int, float)) or not memory_per_rank > 0:
        raise PartitionError(f"memory_per_rank must be a number of bytes > 0, got {memory_per_rank!r}")
    pins = _check_pins(pinned or {})
    if microbatch_options is None:
        microbatch_options = [1 << k for k in range(profile.batch_size.bit_length()) if 1 << k <= profile.batch_size]
    options = list(microbatch_options)
    for m in options:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise PartitionError(f"microbatch options must be integers >= 1, got {m!r}")
    planner = _Planner(profile)
    cands = candidates(world_size, options, bool(profile.checkpoint_units), pins)
    if not cands:
        raise PartitionError(f"no candidate matches the pinned keys {pins} on {world_size} ranks")
    estimates = [planner.evaluate(c, float(memory_per_rank)) for c in cands]
    estimates.sort(key=lambda e: (not e.fits, e.step_s, e.peak_bytes, e.candidate.label()))
    return Plan(world_size, float(memory_per_rank), tuple(estimates), pins, planner)
