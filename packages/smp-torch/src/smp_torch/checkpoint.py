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

import hashlib
import io
import json
import os
import pickle
import shutil
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from smp_torch.comm import CommGroup, allgather, barrier
from smp_torch.config import SMPConfig
from smp_torch.context import SMPContext
from smp_torch.errors import PeerFailedError, SMPError
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

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "smp-checkpoint@1"
#: The manifest's checksum of itself (optional: manifests written before it have none).
SELF_SHA256 = "manifest_sha256"


class CheckpointError(SMPError):
    """A checkpoint could not be written or is missing, incomplete, corrupt or unsafe."""


class CheckpointPeerError(CheckpointError, PeerFailedError):
    """Saving or loading a checkpoint failed on another rank (``rank``): raised on every
    rank where it did not fail. Catchable as either base class; its message is
    :class:`~smp_torch.errors.PeerFailedError`'s (the failed rank, its error, what it and
    this rank were doing)."""


# ---------------------------------------------------------------------------- files


class _HashingWriter:
    """A binary file that hashes and counts what ``torch.save`` writes through it, so the
    manifest records the bytes as written without reading the file again."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += view.nbytes
        self._f.write(view)
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _fsync_dir(path: str) -> None:
    """Make a rename or creation in directory ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def _write_file(obj: Any, path: str) -> dict[str, Any]:
    """``torch.save(obj)`` to ``path`` (in the private staging directory), fsynced; returns
    its manifest entry."""
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": writer.hexdigest(), "bytes": writer.size}


def _atomic_text(text: str, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != SELF_SHA256}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _old_dir(path: str, tag: str) -> str:
    return os.path.join(path, f".{tag}.old")


def _complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MANIFEST))


def recover(path: str, tag: str) -> None:
    """Before saving ``tag`` (rank 0): finish what a save killed while replacing it left.

    Killed between its two renames, a save leaves ``PATH/TAG`` missing and the previous
    checkpoint complete in ``PATH/.TAG.old``: put it back. Killed after them, it leaves a
    stale ``.TAG.old`` next to a complete ``PATH/TAG``: remove it."""
    final, old = os.path.join(path, tag), _old_dir(path, tag)
    if not os.path.isdir(old):
        return
    if not os.path.exists(final) and _complete(old):
        os.replace(old, final)
        _fsync_dir(path)
    else:
        shutil.rmtree(old, ignore_errors=True)


def publish(staging: str, path: str, tag: str) -> str:
    """Rename the complete ``staging`` directory to ``PATH/TAG`` (replacing an older one,
    which stays complete under ``.TAG.old`` until the new one is in place) and point
    ``PATH/latest`` at it. Returns the checkpoint directory."""
    final, old = os.path.join(path, tag), _old_dir(path, tag)
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)  # stale: recover() ran before this save
        os.replace(final, old)
        os.replace(staging, final)
        _fsync_dir(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
        _fsync_dir(path)
    _atomic_text(tag, os.path.join(path, LATEST))
    return final


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
    ``smp.DistributedOptimizer``. Returns the checkpoint directory. Raises
    :class:`CheckpointError` on every rank if saving failed on any (see the module
    docstring); the previous checkpoint of ``tag``, if any, is then left as it was.
    """
    _check_tag(tag)
    model = model if model is not None else current_model()
    s = model.context
    if optimizer is None:
        optimizer = current_optimizer()
    staging = os.path.join(path, f".{tag}.tmp")
    doing = f"smp.save_checkpoint({os.path.join(path, tag)!r})"
    try:
        with s.watch.waiting(f"in {doing}"):
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
    writer_of_stage = s.index("tp") == 0 and s.index("rdp") == 0

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
            entries[name] = _write_file(obj, os.path.join(staging, name))
        _fsync_dir(staging)
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
            manifest[SELF_SHA256] = _manifest_digest(manifest)
            text = json.dumps(manifest, indent=1, sort_keys=True)
            _atomic_text(text, os.path.join(staging, MANIFEST))
            what = f"renaming {staging} to {final}"
            publish(staging, path, tag)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
            error = exc
    _agree(s, doing, error, what)
    return final


# ---------------------------------------------------------------------------- loading


def _read_verified(directory: str, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of ``name``, checked against its manifest entry."""
    full = os.path.join(directory, name)
    entry = manifest["files"].get(name)
    if not isinstance(entry, dict):
        raise CheckpointError(f"{full} is not listed in {os.path.join(directory, MANIFEST)}")
    try:
        with open(full, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{full} is missing (listed in the manifest)") from None
    if len(data) != entry.get("bytes"):
        raise CheckpointError(
            f"{full} has {len(data)} bytes where the manifest records {entry.get('bytes')}: "
            "the file is truncated or was overwritten"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.get("sha256"):
        raise CheckpointError(
            f"checksum mismatch for {full}: sha256 {digest[:16]}… where the manifest "
            f"records {str(entry.get('sha256'))[:16]}…: the file is corrupt or was replaced"
        )
    return data


def _unpickle(data: bytes, full: str) -> Any:
    """``torch.load(weights_only=True)`` of checked bytes, with a clear refusal."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message suggests weights_only=False; keep only the line saying what was
        # refused.
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[-1] if lines else "")
        raise CheckpointError(
            f"refused to load {full}: it holds objects other than tensors and plain "
            f"containers, and unpickling them could run code (torch.load weights_only=True: "
            f"{why})"
        ) from None
    except Exception as exc:
        raise CheckpointError(f"{full} could not be loaded: {first_line(exc)}") from exc


def _load(directory: str, name: str, manifest: dict[str, Any]) -> Any:
    return _unpickle(_read_verified(directory, name, manifest), os.path.join(directory, name))


def read_manifest(path: str, tag: str | None = None) -> tuple[str, dict[str, Any]]:
    """Resolve ``tag`` (``None``: the latest) and return ``(directory, manifest)``, the
    manifest checked (format, its own checksum). A checkpoint whose replacement was killed
    half-way is read from where the save left it complete (``PATH/.TAG.old``)."""
    if tag is None:
        latest = os.path.join(path, LATEST)
        if not os.path.exists(latest):
            raise CheckpointError(f"no checkpoint in {path!r} (no {LATEST} file)")
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    _check_tag(tag)
    directory = os.path.join(path, tag)
    if not os.path.exists(directory) and _complete(_old_dir(path, tag)):
        directory = _old_dir(path, tag)
    mpath = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint {tag!r} in {path!r} ({directory} does not exist)")
    if not os.path.exists(mpath):
        raise CheckpointError(
            f"{mpath} is missing: {directory!r} is not a complete smp checkpoint (its save did "
            "not finish, or the manifest was deleted)"
        )
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{mpath} is unreadable or corrupt: {first_line(exc)}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{mpath}: unknown format {got!r}")
    if SELF_SHA256 in manifest and manifest[SELF_SHA256] != _manifest_digest(manifest):
        raise CheckpointError(f"{mpath} is corrupt: it does not match its own {SELF_SHA256}")
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{mpath} lists no files")
    return directory, manifest


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
                model_sd.update(_load(directory, name, manifest))
            elif name.startswith("optimizer_pp"):
                opt_parts.append(_load(directory, name, manifest))
        if not model_sd:
            raise CheckpointError(f"{os.path.join(directory, MANIFEST)} lists no model file")
        opt_sd = _merge_optimizer_parts(opt_parts) if opt_parts else None
    else:
        model_sd = _load(directory, "model.pt", manifest)
        opt_sd = _load(directory, "optimizer.pt", manifest) if "optimizer.pt" in names else None
    if need_optimizer and opt_sd is None:
        raise CheckpointError(f"{directory} holds no optimizer state")
    user = _load(directory, "user_content.pt", manifest) if "user_content.pt" in names else None
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
    with s.watch.waiting(f"in {doing}"):
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
