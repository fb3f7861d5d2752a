"""What smp did to the model: per module, its pipeline stage, tensor-parallel treatment,
sharding unit and parameter bytes per rank (``model.report()``).

The report is built once, on every rank, when parameters are assigned to pipeline stages
(at wrap time with pp = 1, a pinned or static partition; on the first step otherwise). Its
bytes come from every rank (one allgather over the world), so every rank holds the same
report. Rank 0 then tells the user: one :class:`TPFallbackWarning` per fallback kind (once
per model class and process), the table when ``print_report`` asks for it, and the table as a file next to
the timeline when ``timeline`` is set.

Rows are the model's modules, each once (the first path of a module used at several
places), without the insides of smp-tp's distributed modules (their own row stands for
them). A row's bytes are those of the parameters of its whole subtree that the rank holding
it keeps in memory: a tensor-parallel shard, a sharded data-parallel shard, nothing for the
stand-ins of other pipeline stages. Where ranks differ (stages, uneven shards) the row shows
the most any rank holds.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import smp_tp
from torch import nn

from smp_torch import sharded

__all__ = ["ModuleReport", "ModelReport", "TPFallbackWarning", "build_report", "tell"]


class TPFallbackWarning(UserWarning):
    """Tensor parallelism fell back to a slower or replicated treatment for some modules
    (the message names them and the registration that avoids it)."""


@dataclass(frozen=True)
class ModuleReport:
    """One module of the report."""

    #: The module's path in the wrapped model (``""``: the model itself).
    path: str
    #: Its class name before smp replaced it (``LlamaAttention``, not ``DistributedBlock``).
    module_type: str
    #: The pipeline stage that runs it (None without pipeline parallelism).
    stage: int | None
    #: Its tensor-parallel treatment (:class:`smp_tp.Treatment` value: ``"block"``,
    #: ``"vocab-parallel"``, ``"layer"``, ``"per-linear"``, ``"replicated"``), or ``""``
    #: for a container smp-tp made no decision about (and with tp = 1).
    tp: str
    #: Why, in words (for a fallback: the registration that avoids it).
    tp_reason: str
    #: The sharded data-parallel (FSDP2) unit holding its parameters, None without one.
    shard_unit: str | None
    #: Bytes of the parameters of its subtree on the rank that holds it (the most over ranks).
    bytes_per_rank: int
    #: For a fallback, the registration that avoids it (see :class:`smp_tp.TPDecision`).
    remedy: str | None = None


@dataclass(frozen=True)
class ModelReport:
    """What smp did to one model (see the module docstring); ``str()`` is a table."""

    model_type: str
    pipeline_parallel_degree: int
    tensor_parallel_degree: int
    sharded_data_parallel_degree: int
    data_parallel_degree: int
    modules: tuple[ModuleReport, ...] = field(default=())

    def row(self, path: str) -> ModuleReport:
        """The row of the module at ``path`` (KeyError if the report has none)."""
        for r in self.modules:
            if r.path == path:
                return r
        raise KeyError(f"the report has no module {path!r}")

    def fallbacks(self) -> dict[str, list[ModuleReport]]:
        """The rows smp-tp fell back on, by remedy (``"tp_register_block"``, ...)."""
        out: dict[str, list[ModuleReport]] = {}
        for r in self.modules:
            if r.remedy is not None:
                out.setdefault(r.remedy, []).append(r)
        return out

    def to_dict(self) -> dict[str, object]:
        """Plain data (for JSON)."""
        return asdict(self)

    def __str__(self) -> str:
        head = (f"smp: {self.model_type}: pp={self.pipeline_parallel_degree} "
                f"tp={self.tensor_parallel_degree} sdp={self.sharded_data_parallel_degree} "
                f"rdp={self.data_parallel_degree}")
        cols = ("module", "type", "stage", "tensor parallel", "shard unit", "bytes/rank", "why")
        body = [
            (r.path or "<model>", r.module_type, "-" if r.stage is None else str(r.stage),
             r.tp or "-", r.shard_unit if r.shard_unit is not None else "-",
             f"{r.bytes_per_rank:,}", r.tp_reason)
            for r in self.modules
        ]
        widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]
        numeric = {2, 5}

        def line(cells: Iterable[str]) -> str:
            parts = [c.rjust(w) if i in numeric else c.ljust(w)
                     for i, (c, w) in enumerate(zip(cells, widths))]
            return "  ".join(parts).rstrip()

        rule = "  ".join("-" * w for w in widths)
        return "\n".join([head, line(cols), rule, *(line(b) for b in body)])


def _rows(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules of the report: each once, not descending into smp-tp's distributed modules."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(m: nn.Module, path: str) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        out.append((path, m))
        if isinstance(m, smp_tp.DistributedModule):
            return
        for name, child in m.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(module, "")
    return out


def _local_bytes(m: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in m.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = sharded.local_tensor(p)
        if not t.is_meta:  # (delayed initialisation: other stages' tensors are never allocated)
            total += t.numel() * t.element_size()
    return total


def _unit_of(path: str, units: list[str]) -> str | None:
    """The innermost unit (possibly a group ``a+b``) whose member is ``path`` or encloses it."""
    best: tuple[int, str] | None = None
    for unit in units:
        for member in unit.split("+"):
            inside = member == "" or path == member or path.startswith(member + ".")
            if inside and (best is None or len(member) > best[0]):
                best = (len(member), unit)
    return best[1] if best is not None else None


def build_report(
    module: nn.Module,
    decisions: list[smp_tp.TPDecision],
    stages: dict[str, int] | None,
    units: list[str] | None,
    degrees: tuple[int, int, int, int],
    allgather: object,
) -> ModelReport:
    """Collective over the world (``allgather(obj) -> list``, one call): the report of
    ``module`` after smp prepared it. ``stages``: the pipeline assignment (None with pp = 1);
    ``units``: the sharded data-parallel units (None without); ``degrees``: pp, tp, sdp, rdp."""
    rows = _rows(module)
    mine = {path: _local_bytes(m) for path, m in rows}
    everyone = allgather(mine)  # type: ignore[operator]
    most = {path: max(d.get(path, 0) for d in everyone) for path in mine}
    by_path = {d.path: d for d in decisions}
    out: list[ModuleReport] = []
    for path, m in rows:
        d = by_path.get(path)
        stage = None if stages is None else stages.get(path)
        out.append(ModuleReport(
            path=path,
            module_type=d.module_type if d is not None else type(m).__name__,
            stage=stage,
            tp=d.treatment.value if d is not None else "",
            tp_reason=d.reason if d is not None else "",
            shard_unit=_unit_of(path, units) if units else None,
            bytes_per_rank=most[path],
            remedy=d.remedy if d is not None else None,
        ))
    pp, tp, sdp, rdp = degrees
    return ModelReport(type(module).__name__, pp, tp, sdp, rdp, tuple(out))


# What each fallback costs and what to do about it: one warning per kind.
_REMEDIES = {
    "tp_register_block": (
        "tensor parallelism fell back to one collective per nn.Linear (the slow path)",
        "give the blocks a Megatron column -> row mapping with smp.tp_register_block(cls, "
        "column=[...], row=[...])",
    ),
    "tp_register_vocab_parallel": (
        "the vocabulary modules are not vocabulary-parallel (whole, or split over the hidden "
        "dimension)",
        "register the model with smp.tp_register_vocab_parallel(model_cls, hf_causal_lm=True) "
        "(a tied embedding and head stay one shard)",
    ),
    "tp_register_with_module": (
        "modules smp-tp has no usable implementation for stay whole on every tensor-parallel "
        "rank (a subclass of a replaced type, which may change the maths, so only exact types "
        "are replaced; or a layer whose configuration the built-in implementation does not "
        "cover, as the report's reason says)",
        "register a distributed implementation for the class with "
        "smp.tp_register_with_module(cls, dist_cls)",
    ),
}

_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()
_SMP_PACKAGES = ("smp_torch", "smp_tp", "smp_pipeline", "smp_comm", "smp_partition")


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside smp (the user's
    ``DistributedModel(...)`` or step call), not at a line of smp's own source."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _SMP_PACKAGES:
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def fallback_messages(report: ModelReport) -> dict[str, str]:
    """Remedy → the warning text (what fell back, examples, the remedy)."""
    out: dict[str, str] = {}
    for remedy, rows in report.fallbacks().items():
        what, fix = _REMEDIES.get(remedy, ("tensor parallelism fell back", f"see smp.{remedy}"))
        types = sorted({r.module_type for r in rows})
        paths = [r.path or "<model>" for r in rows]
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        out[remedy] = (f"smp: {what} for {len(rows)} module(s) of {report.model_type} "
                       f"({', '.join(types)}: {shown}); {fix}. model.report() lists them.")
    return out


def tell(report: ModelReport, rank: int, print_table: bool, timeline: str | None) -> str | None:
    """Rank 0: warn once per fallback kind (per model class and process), print the table if asked, and
    write it next to the timeline (``<timeline>.report.txt``) if one is recorded. Returns
    the path written, if any."""
    if rank != 0:
        return None
    for remedy, text in fallback_messages(report).items():
        # Once per kind and model class: wrapping the same model again says nothing new.
        key = (report.model_type, remedy)
        with _lock:
            if key in _warned:
                continue
            _warned.add(key)
        warnings.warn(text, TPFallbackWarning, stacklevel=_user_stacklevel())
    if print_table:
        print(str(report), flush=True)
    if not timeline:
        return None
    base = timeline[:-5] if timeline.endswith(".json") else timeline
    folder = os.path.dirname(base)
    if folder:
        os.makedirs(folder, exist_ok=True)
    path = base + ".report.txt"
    with open(path, "w", encoding="utf-8") as f:
        f.write(str(report) + "\n")
    with open(base + ".report.json", "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=1)
    return path
