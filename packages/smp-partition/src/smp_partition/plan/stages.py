"""Per-stage sums of a :class:`~smp_partition.plan.profile.Profile` for one pipeline degree.

The stages are those smp's automatic partition builds (``smp_partition.partition`` with the
profile's ``memory_weight`` and ``balance_slack``). Every quantity is kept in two parts:
the part tensor parallelism splits (divided by tp later) and the part it does not, so one
partition serves every tensor-parallel degree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from smp_partition.api import partition
from smp_partition.costs import compute_costs
from smp_partition.plan.profile import Profile
from smp_partition.tree import build_tree


@dataclass
class Split:
    """A quantity as (part tensor parallelism does not split, part it splits)."""

    whole: float = 0.0
    split: float = 0.0

    def at(self, tp: int) -> float:
        """The per-rank value at tensor-parallel degree ``tp``."""
        return self.whole + self.split / tp

    def add(self, value: float, is_split: bool) -> None:
        if is_split:
            self.split += value
        else:
            self.whole += value


@dataclass
class StageSums:
    """One pipeline stage's costs at the profile's batch (times as fractions of the
    model's forward time, bytes at ``batch_size`` samples)."""

    modules: int = 0
    forward: Split = field(default_factory=Split)
    """Share of the model's forward time (recomputation excluded)."""
    params: Split = field(default_factory=Split)
    """Parameter elements (shared ones counted once, on the stage smp gives them)."""
    saved: Split = field(default_factory=Split)
    """Bytes saved for backward without checkpointing."""
    saved_outside_units: Split = field(default_factory=Split)
    """Bytes saved for backward by modules outside every checkpoint unit."""
    gathered: float = 0.0
    """Bytes the stage's split modules gather from their tp peers (``tp_gathered_bytes``),
    kept for backward at tp times the samples."""
    gathered_outside_units: float = 0.0
    """The part of ``gathered`` outside every checkpoint unit."""
    unit_inputs: float = 0.0
    """Bytes checkpointing keeps per unit (its input, taken as its output's size)."""
    unit_saved: list[Split] = field(default_factory=list)
    """Saved bytes of each checkpoint unit of the stage (one is live during its recompute)."""
    unit_params: list[Split] = field(default_factory=list)
    """Parameter elements of each checkpoint unit of the stage (what makes it a shard unit)."""
    unit_forward: Split = field(default_factory=Split)
    """Share of the forward time inside checkpoint units (what checkpointing recomputes)."""
    tp_modules: int = 0
    tp_output_bytes: float = 0.0
    """Output bytes of the tensor-parallel modules (each all-reduced in forward and backward)."""
    boundary_bytes: float = 0.0
    """Bytes this stage sends across pipeline cuts per step (outputs to other stages)."""
    cuts: int = 0
    received_bytes: float = 0.0
    """Bytes this stage receives across pipeline cuts per step (other stages' outputs to
    its modules)."""
    owns_root: bool = False
    """Whether the model's root module (the step function's driver) is on this stage."""
    requests_in: int = 0
    """Requests this stage serves per microbatch forward (each has its backward too): one
    per call into the stage, except that smp's ``fast_mode`` sends a run of consecutive
    children of an ``nn.Sequential`` or an ``nn.ModuleList`` loop owned by one other stage
    as one request (:func:`count_requests`)."""
    requests_out: int = 0
    """Requests this stage sends per microbatch forward (a relay through several stages,
    an ``nn.Sequential``'s runs on two or more other stages in a row, is one)."""
    largest_params: Split = field(default_factory=Split)
    """The most parameter elements one module of the stage holds itself (children
    excluded), kept as the largest whole module and the largest split one (its elements
    before the split): :meth:`largest_params_at`."""
    param_tensors: int = 0
    """Parameter tensors the stage holds (a tensor shared by modules on two stages counts
    on both: safe), what per-tensor costs of sharding scale with."""

    def largest_params_at(self, tp: int) -> float:
        """The most parameter elements one module of the stage holds on a rank at ``tp``."""
        return max(self.largest_params.whole, self.largest_params.split / tp)


def _first_parent(profile: Profile) -> list[int]:
    graph = profile.graph
    parent = [-1] * len(graph)
    seen = [False] * len(graph)
    seen[0] = True
    queue = [0]
    for i in queue:  # BFS: the first parent found wins (module reuse keeps a tree)
        for c in graph.child_indices(i):
            if not seen[c]:
                seen[c] = True
                parent[c] = i
                queue.append(c)
    return parent


@dataclass(frozen=True)
class ModuleFacts:
    """Per-module facts that do not depend on the pipeline degree."""

    forward_share: list[float]
    params: list[int]
    tp_split: list[bool]
    unit: list[int]
    """Index of the checkpoint unit a module belongs to, or -1."""
    parent: list[int]


def module_facts(profile: Profile) -> ModuleFacts:
    """Exclusive forward share, parameters, tensor-parallel split and checkpoint unit per module."""
    graph = profile.graph
    mods = graph.modules
    n = len(mods)
    params = compute_costs(graph, build_tree(graph), profile.memory_weight).module_params
    if any(m.forward_ms is not None for m in mods):
        incl = [float(m.forward_ms or 0.0) for m in mods]
        excl = [max(0.0, incl[i] - sum(incl[c] for c in graph.child_indices(i))) for i in range(n)]
    else:
        excl = [0.0] * n
    total = sum(excl)
    share = [x / total for x in excl] if total > 0 else [1.0 / n] * n
    parent = _first_parent(profile)
    tp_split = [False] * n
    unit = [-1] * n
    unit_of = {graph.index_of(u): k for k, u in enumerate(profile.checkpoint_units)}
    tp_roots = {graph.index_of(name) for name in profile.tp_divisors}
    order = [0]
    for i in order:  # BFS from the root: a parent's flags reach its subtree
        for c in graph.child_indices(i):
            if parent[c] == i:
                order.append(c)
    for i in order:
        p = parent[i]
        tp_split[i] = i in tp_roots or (p >= 0 and tp_split[p])
        unit[i] = unit_of.get(i, unit[p] if p >= 0 else -1)
    return ModuleFacts(share, params, tp_split, unit, parent)


def keep_whole(facts: ModuleFacts, stage_of: list[int], roots: set[int]) -> list[int]:
    """``stage_of`` with the subtree of every module in ``roots`` moved onto that module's
    stage, as smp does after partitioning (``smp_torch.pipeline.keep_whole``): a
    checkpointed module is recomputed where it runs, and an smp-tp module uses its
    submodules' parameters directly. An outer root wins over a nested one (smp walks the
    modules parents first, and so does this)."""
    out = list(stage_of)
    children: list[list[int]] = [[] for _ in out]
    for i, p in enumerate(facts.parent):
        if p >= 0:
            children[p].append(i)
    order = [0]
    for i in order:  # BFS from the root: a parent's stage is settled before its subtree
        order += children[i]
    pinned = [-1] * len(out)
    for i in order:
        p = facts.parent[i]
        if p >= 0 and pinned[p] >= 0:
            pinned[i] = pinned[p]
        elif i in roots:
            pinned[i] = out[i]
        if pinned[i] >= 0:
            out[i] = pinned[i]
    return out


#: Containers whose consecutive children smp's ``fast_mode`` calls as one request per run
#: owned by another stage: an ``nn.Sequential``'s forward (``smp_pipeline.seqruns``, whose
#: runs on two or more other stages in a row are one relay) and a model's loop over an
#: ``nn.ModuleList`` (``smp_pipeline.chains``: one request per run, no relay).
RUN_CONTAINERS = {"Sequential": True, "ModuleList": False}


def count_requests(
    profile: Profile, facts: ModuleFacts, stage_of: list[int], pp: int
) -> tuple[list[int], list[int]]:
    """(requests served, requests sent) per stage per microbatch forward, as smp issues them.

    A module whose parent runs on another stage is called by a request, answered by a
    response; a nested call (a block on stage 1 whose attention is on stage 2) is one more
    request, from the block's stage. Under ``fast_mode`` (smp's default) the children of
    an ``nn.Sequential`` or of a loop over an ``nn.ModuleList`` (:data:`RUN_CONTAINERS`)
    go as one request per run of consecutive children on one other stage; an
    ``nn.Sequential``'s consecutive runs on several other stages are one relay, each owner
    passing its output to the next: one request sent by the caller, one served by each
    owner. (Counting every cut module as its own request charged gpt2-small's pp = 2,
    whose blocks 3-5 on stage 1 are one run, three requests per microbatch.)
    """
    served, sent = [0] * pp, [0] * pp
    graph = profile.graph
    for p, m in enumerate(graph.modules):
        here = stage_of[p]
        relay = RUN_CONTAINERS.get(m.type)
        prev_owner = here  # the stage of the previous child (here: none, or a local one)
        for c in graph.child_indices(p):  # the graph's children are in execution order
            if facts.parent[c] != p:
                continue  # a module reused here, placed (and called) under its first parent
            owner = stage_of[c]
            if owner == here:
                prev_owner = here
                continue
            if relay is None or owner != prev_owner:
                served[owner] += 1  # a new request, or a new run (a hop of a relay)
                if relay is None or not relay or prev_owner == here:
                    sent[here] += 1  # a relay's later hops come from the previous owner
            prev_owner = owner
    return served, sent


def stage_sums(
    profile: Profile, facts: ModuleFacts, pp: int, whole: tuple[str, ...] = ()
) -> tuple[list[StageSums], list[int]]:
    """The stages of smp's automatic partition into ``pp`` stages, and each module's stage;
    ``whole``: modules whose subtree smp keeps on their own stage (the checkpoint units
    with checkpointing on, the tensor-parallel modules with tp > 1: :func:`keep_whole`)."""
    graph = profile.graph
    mods = graph.modules
    if pp == 1:
        stage_of = [0] * len(mods)
    else:
        result = partition(graph, pp, profile.memory_weight, "default", profile.balance_slack)
        stage_of = [result.assignment[m.name] for m in mods]
        if whole:
            stage_of = keep_whole(facts, stage_of, {graph.index_of(n) for n in whole})
    stages = [StageSums() for _ in range(pp)]
    units: list[dict[int, Split]] = [{} for _ in range(pp)]
    unit_params: list[dict[int, Split]] = [{} for _ in range(pp)]
    tp_names = profile.tp_divisors
    saved = profile.saved_bytes
    tensors: list[set[str]] = [set() for _ in range(pp)]
    for i, m in enumerate(mods):
        st = stages[stage_of[i]]
        split = facts.tp_split[i]
        st.modules += 1
        tensors[stage_of[i]].update(m.params)
        st.forward.add(facts.forward_share[i], split)
        st.params.add(facts.params[i], split)
        if split:
            st.largest_params.split = max(st.largest_params.split, facts.params[i])
        else:
            st.largest_params.whole = max(st.largest_params.whole, facts.params[i])
        b = saved.get(m.name, 0)
        st.saved.add(b, split)
        k = facts.unit[i]
        if k < 0:
            st.saved_outside_units.add(b, split)
        else:
            units[stage_of[i]].setdefault(k, Split()).add(b, split)
            unit_params[stage_of[i]].setdefault(k, Split()).add(facts.params[i], split)
            st.unit_forward.add(facts.forward_share[i], split)
            if m.name == profile.checkpoint_units[k]:
                st.unit_inputs += m.activation_bytes
        g = profile.tp_gathered_bytes.get(m.name, 0)
        st.gathered += g
        if k < 0:
            st.gathered_outside_units += g
        if m.name in tp_names:
            st.tp_modules += 1
            st.tp_output_bytes += m.activation_bytes
        p = facts.parent[i]
        if p >= 0 and stage_of[p] != stage_of[i]:
            st.cuts += 1
            st.boundary_bytes += m.activation_bytes
            stages[stage_of[p]].received_bytes += m.activation_bytes
    stages[stage_of[0]].owns_root = True
    served, sent = count_requests(profile, facts, stage_of, pp)
    for s, st in enumerate(stages):
        st.param_tensors = len(tensors[s])
        st.requests_in, st.requests_out = served[s], sent[s]
        st.unit_saved = list(units[s].values())
        st.unit_params = list(unit_params[s].values())
    return stages, stage_of
