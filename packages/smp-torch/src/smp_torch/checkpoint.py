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

Atomicity: every file is written into ``PATH/.TAG.tmp``; once every rank reports success,
rank 0 writes the manifest (temp file + rename) and renames the directory to ``PATH/TAG``
(replacing an older one), then points ``PATH/latest`` at it. If any rank fails, the staging
directory is removed and every rank raises — no half-written checkpoint is ever visible.
Loading uses ``torch.load(weights_only=True)`` after checking every checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import traceback
from typing import Any

import torch

from smp_torch.comm import CommGroup, allgather, barrier
from smp_torch.config import SMPConfig
from smp_torch.errors import SMPError
from smp_torch.model import current_model
from smp_torch.optimizer import current_optimizer

__all__ = ["save_checkpoint", "resume_from_checkpoint", "CheckpointError"]

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "smp-checkpoint@1"


class CheckpointError(SMPError):
    """A checkpoint could not be written or is missing, incomplete or corrupt."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_torch_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_text(text: str, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _layout(cfg: SMPConfig) -> dict[str, Any]:
    return {
        "pipeline_parallel_degree": cfg.pp,
        "tensor_parallel_degree": cfg.tp,
        "data_parallel_degree": cfg.rdp,
        "placement_strategy": cfg.placement_strategy,
    }


def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"invalid checkpoint tag {tag!r}")


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
    ``smp.DistributedOptimizer``. Returns the checkpoint directory.
    """
    _check_tag(tag)
    model = model if model is not None else current_model()
    s = model.context
    if optimizer is None:
        optimizer = current_optimizer()
    final = os.path.join(path, tag)
    staging = os.path.join(path, f".{tag}.tmp")
    error: str | None = None
    if s.rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        except OSError:
            error = traceback.format_exc()
    barrier()
    files: list[str] = []
    if error is None:
        try:
            # Gathering is collective: every rank computes the pieces, one rank per piece writes.
            pp_rank = s.groups["pp"].index(s.rank)
            writer_of_stage = (
                s.groups["tp"].index(s.rank) == 0 and s.groups["rdp"].index(s.rank) == 0
            )
            if partial:
                model_sd = model.stage_full_state()
                opt_sd = optimizer.state_dict_stage() if optimizer is not None else None
                if writer_of_stage:
                    name = f"model_pp{pp_rank}.pt"
                    _atomic_torch_save(model_sd, os.path.join(staging, name))
                    files.append(name)
                    if opt_sd is not None:
                        name = f"optimizer_pp{pp_rank}.pt"
                        _atomic_torch_save(opt_sd, os.path.join(staging, name))
                        files.append(name)
            else:
                model_sd = model.state_dict()
                opt_sd = optimizer.state_dict() if optimizer is not None else None
                if s.rank == 0:
                    _atomic_torch_save(model_sd, os.path.join(staging, "model.pt"))
                    files.append("model.pt")
                    if opt_sd is not None:
                        _atomic_torch_save(opt_sd, os.path.join(staging, "optimizer.pt"))
                        files.append("optimizer.pt")
            if s.rank == 0 and user_content is not None:
                _atomic_torch_save(user_content, os.path.join(staging, "user_content.pt"))
                files.append("user_content.pt")
        except Exception:  # noqa: BLE001 - reported to every rank below
            error = f"rank {s.rank}: {traceback.format_exc()}"
    reports = allgather((error, files))
    errors = [e for e, _ in reports if e]
    if not errors and s.rank == 0:
        try:
            entries = {}
            for _, fs in reports:
                for name in fs:
                    full = os.path.join(staging, name)
                    entries[name] = {"sha256": _sha256(full), "bytes": os.path.getsize(full)}
            manifest = {
                "format": FORMAT,
                "tag": tag,
                "partial": partial,
                "layout": _layout(s.config),
                "files": entries,
                "torch": torch.__version__,
            }
            _atomic_text(
                json.dumps(manifest, indent=1, sort_keys=True), os.path.join(staging, MANIFEST)
            )
            if os.path.exists(final):
                old = os.path.join(path, f".{tag}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(staging, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staging, final)
            _atomic_text(tag, os.path.join(path, LATEST))
        except Exception:  # noqa: BLE001
            errors.append(f"rank 0 (manifest): {traceback.format_exc()}")
    errors = [e for e in allgather(errors[0] if errors else None) if e] or errors
    if errors:
        if s.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {final!r} failed:\n{errors[0]}")
    return final


def _load(path: str, name: str, manifest: dict[str, Any]) -> Any:
    full = os.path.join(path, name)
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{name} is not listed in {path}/{MANIFEST}")
    if not os.path.exists(full):
        raise CheckpointError(f"checkpoint file {full} is missing")
    digest = _sha256(full)
    if digest != entry["sha256"]:
        raise CheckpointError(f"checksum mismatch for {full}: the file is corrupt")
    return torch.load(full, map_location="cpu", weights_only=True)


def read_manifest(path: str, tag: str | None = None) -> tuple[str, dict[str, Any]]:
    """Resolve ``tag`` (``None``: the latest) and return ``(directory, manifest)``."""
    if tag is None:
        latest = os.path.join(path, LATEST)
        if not os.path.exists(latest):
            raise CheckpointError(f"no checkpoint in {path!r} (no {LATEST} file)")
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    _check_tag(tag)
    directory = os.path.join(path, tag)
    mpath = os.path.join(directory, MANIFEST)
    if not os.path.exists(mpath):
        raise CheckpointError(f"{directory!r} is not a complete smp checkpoint (no manifest)")
    with open(mpath, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: unknown format {manifest.get('format')!r}")
    return directory, manifest


def resume_from_checkpoint(
    path: str,
    tag: str | None = None,
    model: Any = None,
    optimizer: Any = None,
    strict: bool = True,
    load_optimizer: bool = True,
) -> Any:
    """Load ``path/tag`` (default: the latest) into the model and optimizer; return the
    saved ``user_content``. Works on any pipeline / tensor-parallel layout."""
    model = model if model is not None else current_model()
    if optimizer is None and load_optimizer:
        optimizer = current_optimizer()
    directory, manifest = read_manifest(path, tag)
    names = manifest["files"]
    if manifest["partial"]:
        model_sd: dict[str, torch.Tensor] = {}
        opt_parts = []
        for name in sorted(names):
            if name.startswith("model_pp"):
                model_sd.update(_load(directory, name, manifest))
            elif name.startswith("optimizer_pp"):
                opt_parts.append(_load(directory, name, manifest))
        opt_sd = _merge_optimizer_parts(opt_parts) if opt_parts else None
    else:
        model_sd = _load(directory, "model.pt", manifest)
        opt_sd = _load(directory, "optimizer.pt", manifest) if "optimizer.pt" in names else None
    model.load_state_dict(model_sd, strict=strict)
    if load_optimizer and optimizer is not None:
        if opt_sd is None:
            raise CheckpointError(f"{directory} holds no optimizer state")
        optimizer.load_state_dict(opt_sd)
    user = _load(directory, "user_content.pt", manifest) if "user_content.pt" in names else None
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
