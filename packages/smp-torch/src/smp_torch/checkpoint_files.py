"""The on-disk side of smp checkpoints: files written atomically and hashed as they are
written, a manifest that lists them (and checks itself), and reads that verify size and
sha256 before unpickling with ``torch.load(weights_only=True)``. No collectives: the
orchestration across ranks (who writes what, agreeing on outcomes) is
:mod:`smp_torch.checkpoint`'s.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from typing import Any, BinaryIO

import torch

from smp_torch.errors import CheckpointError
from smp_torch.notices import first_line

__all__ = [
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "SELF_SHA256",
    "HashingWriter",
    "atomic_text",
    "check_tag",
    "fsync_dir",
    "is_complete",
    "load_file",
    "manifest_digest",
    "old_dir",
    "publish",
    "read_manifest",
    "read_verified",
    "recover",
    "unpickle",
    "write_file",
]

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "smp-checkpoint@1"
#: The manifest's checksum of itself (optional: manifests written before it have none).
SELF_SHA256 = "manifest_sha256"


class HashingWriter:
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


def fsync_dir(path: str) -> None:
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


def write_file(obj: Any, path: str) -> dict[str, Any]:
    """``torch.save(obj)`` to ``path`` (in the private staging directory), fsynced; returns
    its manifest entry."""
    with open(path, "wb") as f:
        writer = HashingWriter(f)
        torch.save(obj, writer)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": writer.hexdigest(), "bytes": writer.size}


def atomic_text(text: str, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != SELF_SHA256}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def old_dir(path: str, tag: str) -> str:
    return os.path.join(path, f".{tag}.old")


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MANIFEST))


def recover(path: str, tag: str) -> None:
    """Before saving ``tag`` (rank 0): finish what a save killed while replacing it left.

    Killed between its two renames, a save leaves ``PATH/TAG`` missing and the previous
    checkpoint complete in ``PATH/.TAG.old``: put it back. Killed after them, it leaves a
    stale ``.TAG.old`` next to a complete ``PATH/TAG``: remove it."""
    final, old = os.path.join(path, tag), old_dir(path, tag)
    if not os.path.isdir(old):
        return
    if not os.path.exists(final) and is_complete(old):
        os.replace(old, final)
        fsync_dir(path)
    else:
        shutil.rmtree(old, ignore_errors=True)


def publish(staging: str, path: str, tag: str) -> str:
    """Rename the complete ``staging`` directory to ``PATH/TAG`` (replacing an older one,
    which stays complete under ``.TAG.old`` until the new one is in place) and point
    ``PATH/latest`` at it. Returns the checkpoint directory."""
    final, old = os.path.join(path, tag), old_dir(path, tag)
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)  # stale: recover() ran before this save
        os.replace(final, old)
        os.replace(staging, final)
        fsync_dir(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
        fsync_dir(path)
    atomic_text(tag, os.path.join(path, LATEST))
    return final


def read_verified(directory: str, name: str, manifest: dict[str, Any]) -> bytes:
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


def unpickle(data: bytes, full: str) -> Any:
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


def load_file(directory: str, name: str, manifest: dict[str, Any]) -> Any:
    return unpickle(read_verified(directory, name, manifest), os.path.join(directory, name))


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
    check_tag(tag)
    directory = os.path.join(path, tag)
    if not os.path.exists(directory) and is_complete(old_dir(path, tag)):
        directory = old_dir(path, tag)
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
    if SELF_SHA256 in manifest and manifest[SELF_SHA256] != manifest_digest(manifest):
        raise CheckpointError(f"{mpath} is corrupt: it does not match its own {SELF_SHA256}")
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{mpath} lists no files")
    return directory, manifest


def check_tag(tag: str) -> None:
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"invalid checkpoint tag {tag!r}")
