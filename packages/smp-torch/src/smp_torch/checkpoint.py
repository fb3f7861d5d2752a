"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``: atomic, verified, re-shardable.

Layout of a checkpoint ``PATH/TAG/``::

    manifest.json          written last; lists every file with its sha256 and size
    model.pt               partial=False: the full model (unwrapped names), from rank 0
    optimizer.pt           partial=False: the full optimizer state (unwrapped names)
    model_pp{p}.pt         partial=True: pipeline stage p's part of the full model
    optimizer_pp{p}.pt     partial=True: stage p's part of the full optimizer state
    user_content.pt        whatever ``user_content`` was (tensors, numbers, strings, containers)

Both forms hold the model in the unwrapped model's naming with tensor-parallel shards
gathered, so either one resumes onto any pipeline / tensor-parallel layout. A partial
checkpoint is written by one rank per pipeline stage in parallel and never gathers the whole
model on one rank.

Atomicity: every file is written into ``PATH/.TAG.tmp`` and fsynced; its writer hashes the
bytes as they are written. Once every rank reports success, rank 0 writes the manifest
(temp file, fsync, rename) and renames the directory to ``PATH/TAG`` — replacing an older
one by renaming it to ``PATH/.TAG.old`` first, so that a rank killed between the two
renames leaves the old checkpoint complete there (loading falls back to it, the next save
puts it back) — then points ``PATH/latest`` at it. If any rank fails, the staging directory
is removed and every rank raises; a save killed half-way leaves a staging directory without
a manifest, which nothing loads. No half-written checkpoint is ever visible.

Loading reads each file once, checks its size and sha256 against the manifest (and the
manifest against its own ``manifest_sha256``), and only then unpickles it with
``torch.load(weights_only=True)``: a file replaced by a pickle that would run code is
refused. Every rank reports how its reading went before anything is loaded into the model,
so a missing, truncated, corrupt or refused file raises :class:`CheckpointError` on every
rank, naming the file and the rank that found it.

Errors: the rank where saving or loading failed raises :class:`CheckpointError`; every other
rank raises :class:`CheckpointPeerError`, which is both a :class:`CheckpointError` and a
:class:`~smp_torch.errors.PeerFailedError` naming that rank. A failure while writing or
reading files (local work, after every collective) leaves the ranks in step: the program may
catch the error and carry on. A failure inside the collective phases (gathering the state to
save, loading it into the model) is announced on smp's failure channel like a failed step:
the other ranks may be blocked in a collective the failed rank will never join.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from smp_torch.checkpoint_files import (
    FORMAT,
    MANIFEST,
    SELF_SHA256,
    atomic_text,
    check_tag,
    fsync_dir,
    load_file,
    manifest_digest,
    publish,
    read_manifest,
    recover,
    write_file,
)
from smp_torch.comm import CommGroup, allgather, barrier
from smp_torch.config import SMPConfig
from smp_torch.context import SMPContext
from smp_torch.errors import CheckpointError, CheckpointPeerError, PeerFailedError
from smp_torch.model import current_model
from smp_torch.notices import first_line
from smp_torch.optimizer import current_optimizer

__all__ = [
    "save_checkpoint",
    "resume_from_checkpoint",
    "read_manifest",
    "CheckpointError",
    "CheckpointPeerError",
]

# ---------------------------------------------------------------------------- agreement


def _describe(error: BaseException) -> str:
    # Our own errors are written to be read whole; others by their first line.
    return str(error) if isinstance(error, CheckpointError) else first_line(error)


def _agree(
    ctx: SMPContext,
    doing: str,
    error: BaseException | None,
    what: str,
    payload: Any = None,
) -> list[Any]:
    """Collective: every rank's outcome of a local phase. Raise on every rank if the phase
    failed anywhere (:class:`CheckpointError` where it did, :class:`CheckpointPeerError`
    naming the first rank where it did elsewhere); else return every rank's ``payload``."""
    mine = None if error is None else (what, _describe(error))
    reports = allgather((mine, payload))
    failed = [(r, rep) for r, (rep, _) in enumerate(reports) if rep is not None]
    if not failed:
        return [p for _, p in reports]
    ranks = [r for r, _ in failed]
    also = f" (it failed on ranks {ranks})" if len(ranks) > 1 else ""
    if error is not None:
        raise CheckpointError(
            f"rank {ctx.rank}: {doing} failed while {what}: {_describe(error)}{also}"
        ) from error
    rank, (their_what, text) = failed[0]
    raise CheckpointPeerError(
        rank,
        text + also,
        f"in {doing}, {their_what}",
        f"in {doing}, waiting for the other ranks",
        ctx.rank,
    )


def _collective(ctx: SMPContext, doing: str, what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` — collective work the other ranks do too (gathering or loading state) —
    so that this rank raises :class:`PeerFailedError` as soon as another one fails (it runs
    on a helper thread, which may stay blocked in the collective). Its own failure is
    announced on the failure channel: the others may be blocked in a collective this rank
    will never join."""
    box: dict[str, Any] = {}

    def run() -> None:
        box["result"] = fn()

    watch = ctx.watch
    try:
        with watch.waiting(f"in {doing}, {what}"):
            watch.run(run)
    except PeerFailedError:
        raise
    except Exception as exc:
        watch.announce(exc, where=f"in {doing}, {what}")
        raise CheckpointError(
            f"rank {ctx.rank}: {doing} failed while {what}: {_describe(exc)}"
        ) from exc
    return box["result"]


# ---------------------------------------------------------------------------- saving


def _layout(cfg: SMPConfig) -> dict[str, Any]:
    return {
        "pipeline_parallel_degree": cfg.pp,
        "tensor_parallel_degree": cfg.tp,
        "data_parallel_degree": cfg.rdp,
        "expert_parallel_degree": cfg.ep,
        "sharded_data_parallel_degree": cfg.sdp,
        "placement_strategy": cfg.placement_strategy,
    }


def save_checkpoint(
    path: str,
    tag: str,
    partial: bool = True,
    model: Any = None,
    optimizer: Any = None,
    user_content: Any = None,
) -> str:
    """Save model, optimizer and ``user_content`` under ``path/tag``; call on every rank.

    ``model``/``optimizer`` default to the current ``smp.DistributedModel`` /
    ``smp.DistributedOptimizer``. Returns the checkpoint directory. Raises
    :class:`CheckpointError` on every rank if saving failed on any (see the module
    docstring); the previous checkpoint of ``tag``, if any, is then left as it was.
    """
    check_tag(tag)
    model = model if model is not None else current_model()
    s = model.context
    if optimizer is None:
        optimizer = current_optimizer()
    staging = os.path.join(path, f".{tag}.tmp")
    doing = f"smp.save_checkpoint({os.path.join(path, tag)!r})"
    try:
        # (Not bounded by timeout_s: writing files may take long, and a save must not be cut.)
        with s.watch.waiting(f"in {doing}"), s.watch.patient():
            return _save(s, doing, path, tag, staging, partial, model, optimizer, user_content)
    except BaseException:
        if s.rank == 0:  # (a rank killed meanwhile leaves it: nothing loads it, recover() ends it)
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _save(
    s: SMPContext,
    doing: str,
    path: str,
    tag: str,
    staging: str,
    partial: bool,
    model: Any,
    optimizer: Any,
    user_content: Any,
) -> str:
    error: BaseException | None = None
    if s.rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
            recover(path, tag)
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        except OSError as exc:
            error = exc
    _agree(s, doing, error, "preparing the staging directory")  # (also the barrier)

    # Gathering is collective: every rank computes the pieces, one rank per piece writes.
    pp_rank = s.index("pp")
    writer_of_stage = s.index("tp") == 0 and s.index("rdp") == 0 and s.index("cp") == 0

    def gather() -> tuple[Any, Any]:
        if partial:
            opt = optimizer.state_dict_stage() if optimizer is not None else None
            return model.stage_full_state(), opt
        opt = optimizer.state_dict() if optimizer is not None else None
        return model.state_dict(), opt

    model_sd, opt_sd = _collective(s, doing, "gathering the model and optimizer state", gather)
    pieces: list[tuple[str, Any]] = []
    if partial and writer_of_stage:
        pieces.append((f"model_pp{pp_rank}.pt", model_sd))
        if opt_sd is not None:
            pieces.append((f"optimizer_pp{pp_rank}.pt", opt_sd))
    elif not partial and s.rank == 0:
        pieces.append(("model.pt", model_sd))
        if opt_sd is not None:
            pieces.append(("optimizer.pt", opt_sd))
    if s.rank == 0 and user_content is not None:
        pieces.append(("user_content.pt", user_content))

    entries: dict[str, dict[str, Any]] = {}
    what = "writing its files"
    error = None
    try:
        for name, obj in pieces:
            what = f"writing {os.path.join(staging, name)}"
            entries[name] = write_file(obj, os.path.join(staging, name))
        fsync_dir(staging)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
        error = exc
    with s.watch.waiting(f"in {doing}, waiting for the other ranks' files"):
        reports = _agree(s, doing, error, what, entries)

    final = os.path.join(path, tag)
    error, what = None, "writing the manifest"
    if s.rank == 0:
        try:
            files: dict[str, dict[str, Any]] = {}
            for part in reports:
                files.update(part)
            manifest: dict[str, Any] = {
                "format": FORMAT,
                "tag": tag,
                "partial": partial,
                "layout": _layout(s.config),
                "files": files,
                "torch": torch.__version__,
            }
            manifest[SELF_SHA256] = manifest_digest(manifest)
            text = json.dumps(manifest, indent=1, sort_keys=True)
            atomic_text(text, os.path.join(staging, MANIFEST))
            what = f"renaming {staging} to {final}"
            publish(staging, path, tag)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
            error = exc
    _agree(s, doing, error, what)
    return final


# ---------------------------------------------------------------------------- loading


def _read_checkpoint(
    path: str, tag: str | None, need_optimizer: bool
) -> tuple[str, dict[str, Any], Any, Any]:
    """Every file of the checkpoint, verified and unpickled: ``(directory, model state,
    optimizer state or None, user content or None)``."""
    directory, manifest = read_manifest(path, tag)
    names = manifest["files"]
    if manifest.get("partial"):
        model_sd: dict[str, Any] = {}
        opt_parts = []
        for name in sorted(names):
            if name.startswith("model_pp"):
                model_sd.update(load_file(directory, name, manifest))
            elif name.startswith("optimizer_pp"):
                opt_parts.append(load_file(directory, name, manifest))
        if not model_sd:
            raise CheckpointError(f"{os.path.join(directory, MANIFEST)} lists no model file")
        opt_sd = _merge_optimizer_parts(opt_parts) if opt_parts else None
    else:
        model_sd = load_file(directory, "model.pt", manifest)
        opt_sd = load_file(directory, "optimizer.pt", manifest) if "optimizer.pt" in names else None
    if need_optimizer and opt_sd is None:
        raise CheckpointError(f"{directory} holds no optimizer state")
    user = load_file(directory, "user_content.pt", manifest) if "user_content.pt" in names else None
    return directory, model_sd, opt_sd, user


def resume_from_checkpoint(
    path: str,
    tag: str | None = None,
    model: Any = None,
    optimizer: Any = None,
    strict: bool = True,
    load_optimizer: bool = True,
) -> Any:
    """Load ``path/tag`` (default: the latest) into the model and optimizer; return the
    saved ``user_content``. Works on any pipeline / tensor-parallel layout. Call on every
    rank; a missing, incomplete, corrupt or unsafe checkpoint raises
    :class:`CheckpointError` on every rank before anything is loaded."""
    model = model if model is not None else current_model()
    if optimizer is None and load_optimizer:
        optimizer = current_optimizer()
    s = model.context
    doing = f"smp.resume_from_checkpoint({path!r}, tag={tag!r})"
    with s.watch.waiting(f"in {doing}"), s.watch.patient():  # (reading files may take long)
        error: BaseException | None = None
        loaded: tuple[str, dict[str, Any], Any, Any] | None = None
        try:
            need = load_optimizer and optimizer is not None
            loaded = _read_checkpoint(path, tag, need)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
            error = exc
        _agree(s, doing, error, "reading the checkpoint")
        assert loaded is not None
        _, model_sd, opt_sd, user = loaded

        def apply() -> None:
            model.load_state_dict(model_sd, strict=strict)
            if load_optimizer and optimizer is not None:
                optimizer.load_state_dict(opt_sd)

        _collective(s, doing, "loading the state into the model and optimizer", apply)
        barrier(CommGroup.WORLD)
    return user


def _merge_optimizer_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"format": parts[0]["format"], "state": {}, "param_groups": []}
    for part in parts:
        merged["state"].update(part["state"])
        for i, g in enumerate(part["param_groups"]):
            if i < len(merged["param_groups"]):
                merged["param_groups"][i]["params"] += list(g["params"])
            else:
                merged["param_groups"].append({**g, "params": list(g["params"])})
        if "loss_scaler" in part:
            merged["loss_scaler"] = part["loss_scaler"]
    return merged
