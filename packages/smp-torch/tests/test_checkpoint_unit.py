"""Checkpoint files and the ranks' agreement helpers, in one process (no MPI job).

The multi-rank behaviour (every rank raising, timings, a killed save) is in ``tests/faults``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from smp_torch import checkpoint_files as ck
from smp_torch.consistency import StepInputs, agreement_values, batch_error, batch_mismatch
from smp_torch.step import step_inputs


def _make(root: Path, tag: str, value: float) -> str:
    """A complete checkpoint directory ``root/tag`` (one file), as a save writes it."""
    staging = root / f".{tag}.tmp"
    staging.mkdir(parents=True)
    entry = ck.write_file({"w": torch.full((3,), value)}, str(staging / "model.pt"))
    manifest = {"format": ck.FORMAT, "tag": tag, "partial": False, "files": {"model.pt": entry}}
    manifest[ck.SELF_SHA256] = ck.manifest_digest(manifest)
    (staging / ck.MANIFEST).write_text(json.dumps(manifest))
    ck.recover(str(root), tag)
    return ck.publish(str(staging), str(root), tag)


def _load(root: Path, tag: str | None = None) -> torch.Tensor:
    directory, manifest = ck.read_manifest(str(root), tag)
    return ck.load_file(directory, "model.pt", manifest)["w"]


def test_hashing_writer_records_the_bytes_written(tmp_path: Path) -> None:
    entry = ck.write_file({"a": torch.arange(100)}, str(tmp_path / "f.pt"))
    data = (tmp_path / "f.pt").read_bytes()
    assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_replace_keeps_a_complete_checkpoint_at_every_point(tmp_path: Path) -> None:
    _make(tmp_path, "ck", 1.0)
    assert _load(tmp_path).tolist() == [1.0] * 3
    _make(tmp_path, "ck", 2.0)
    assert _load(tmp_path, "ck").tolist() == [2.0] * 3
    assert sorted(os.listdir(tmp_path)) == ["ck", "latest"]
    # Killed between the two renames of a replacement: ck is gone, .ck.old is complete.
    os.replace(tmp_path / "ck", tmp_path / ".ck.old")
    assert _load(tmp_path).tolist() == [2.0] * 3  # read from where the save left it
    _make(tmp_path, "ck", 3.0)  # the next save puts it back first, then replaces it
    assert _load(tmp_path).tolist() == [3.0] * 3
    assert sorted(os.listdir(tmp_path)) == ["ck", "latest"]


def test_damaged_files_are_refused_naming_them(tmp_path: Path) -> None:
    _make(tmp_path, "ck", 1.0)
    path = tmp_path / "ck" / "model.pt"
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(ck.CheckpointError, match=r"model\.pt has \d+ bytes where the manifest"):
        _load(tmp_path)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(ck.CheckpointError, match=r"checksum mismatch for \S*model\.pt"):
        _load(tmp_path)
    path.unlink()
    with pytest.raises(ck.CheckpointError, match=r"model\.pt is missing"):
        _load(tmp_path)
    (tmp_path / "ck" / ck.MANIFEST).unlink()
    with pytest.raises(ck.CheckpointError, match=r"ck/manifest\.json is missing"):
        ck.read_manifest(str(tmp_path))


def test_manifest_checks_itself(tmp_path: Path) -> None:
    _make(tmp_path, "ck", 1.0)
    mpath = tmp_path / "ck" / ck.MANIFEST
    manifest = json.loads(mpath.read_text())
    manifest["partial"] = True
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(ck.CheckpointError, match="does not match its own manifest_sha256"):
        ck.read_manifest(str(tmp_path))
    mpath.write_text("{not json")
    with pytest.raises(ck.CheckpointError, match="unreadable or corrupt"):
        ck.read_manifest(str(tmp_path))
    # Manifests written before the self-checksum still load.
    del manifest[ck.SELF_SHA256]
    manifest["partial"] = False
    mpath.write_text(json.dumps(manifest))
    assert _load(tmp_path).tolist() == [1.0] * 3


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mknod, (self.path,))


def test_a_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    marker = str(tmp_path / "PWNED")
    data = pickle.dumps({"w": _Marker(marker)}, protocol=2)
    with pytest.raises(ck.CheckpointError, match=r"refused to load x\.pt.*GLOBAL posix\.mknod"):
        ck.unpickle(data, "x.pt")
    assert not os.path.exists(marker)
    pickle.loads(data)  # (the test's own check: unpickling it does create the marker)
    assert os.path.exists(marker)


def test_step_inputs_and_the_batch_agreement() -> None:
    def fn(x, y, mask=None):  # type: ignore[no-untyped-def]
        return x

    x, y, mask = torch.zeros(4, 7), torch.zeros(3, 4), torch.ones(9)
    got = step_inputs(fn, (x,), {"y": y, "mask": mask}, ["mask"], {})
    assert got.batch == 4
    assert got.shapes == ("x(4, 7):float32", "y(3, 4):float32", "mask(9,):float32")
    assert step_inputs(fn, (x, y), {}, [], {"x": 1}).batch == 7
    assert step_inputs(fn, (x, y), {}, ["x"], {}).batch == 3
    # The agreement's allreduce of maxima: two drivers (4 and 2) and one pipeline server.
    ranks = [StepInputs(4, ()), StepInputs(2, ()), None]
    agreed = [max(v) for v in zip(*(agreement_values(r) for r in ranks))]
    assert batch_mismatch(agreed)
    same = [max(v) for v in zip(*(agreement_values(r) for r in [ranks[0], ranks[0], None]))]
    assert not batch_mismatch(same)
    assert not batch_mismatch(agreement_values(None))
    message = str(batch_error(3, [4, 2, None, 4]))
    assert "step 3:" in message and "2 on rank [1], 4 on ranks [0, 3]" in message
