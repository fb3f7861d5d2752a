"""Issue 42: every tensor smp hands to a collective lives on the device its group serves.

On CUDA smp's groups are NCCL groups, which take device tensors only; no GPU runs here, so
``scripts/devcheck.py`` makes a CPU run tell them apart: tensors that would sit on the host
on a GPU machine (made without a device, ``.cpu()``, loaded from a file, ...) are marked,
and every ``torch.distributed`` collective refuses a marked tensor, naming the collective,
its caller and where the tensor was put on the host, as an NCCL group would (with a clearer
message). ``scripts/devices.py`` trains a tiny model on 2 ranks under that check, once per
path, and reports which call sites it checked, so each case is shown to have reached the
collectives it claims.

The check can fail: the self-test feeds each checked entry point a host tensor, and the
mutants re-create issue 42's mistake (factories without a device) in smp's own modules.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile

from conftest import launch, ok_cases

# case -> call sites ("caller-file:function:collective") its run must have checked.
CASES = {
    "dp": ["grads.py:_launch:all_reduce", "grads.py:finish:all_reduce"],
    "dp-no-overlap": ["grads.py:_launch:all_reduce"],
    "fp16": ["precision.py:unscale_and_check:all_reduce", "grads.py:finish:all_reduce"],
    "bf16": ["grads.py:_launch:all_reduce", "grads.py:finish:all_reduce"],
    "clip-pp2": ["model.py:clip_grad_norm_:all_reduce"],
    "clip-tp2": ["model.py:clip_grad_norm_:all_reduce", "mappings.py:_all_reduce:all_reduce"],
    "sdp2-clip": ["sharded.py:grad_norm:all_reduce"],
    "shard-opt": ["optimizer.py:_broadcast_owned:broadcast", "grads.py:finish:all_reduce"],
    "checkpoint-tp2": ["grads.py:finish:all_reduce", "mappings.py:_all_gather:all_gather_single"],
}

# mutant -> the file whose collective (or CUDA-refused op) must be named.
MUTANTS = {"grads": "smp_torch/grads.py", "model": "smp_torch/model.py", "sharded": "smp_torch/sharded.py"}


def _checked(out: str) -> dict[str, list[str]]:
    """``CHECKED <case> <json>`` lines: the call sites, without their counts."""
    found = {}
    for line in out.splitlines():
        if line.startswith("CHECKED "):
            _, name, calls = line.split(" ", 2)
            found[name] = [c.rsplit(" x", 1)[0] for c in json.loads(calls)]
    return found


@functools.cache
def _job() -> str:
    """One 2-rank job: the self-test, every case, then the mutants (each mutant's failed step
    is followed by a fresh ``smp.init``, as between the mutants before): the launch and the
    ranks' imports cost more than most cases. The bound is the two former jobs' together."""
    root = tempfile.mkdtemp(prefix="smp-devices-")
    try:
        names = ["selftest", *CASES, *(f"mutant:{m}" for m in MUTANTS)]
        return launch("devices.py", 2, root, *names, timeout=300 + 240)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_every_path_keeps_collectives_on_the_device() -> None:
    out = _job()
    assert ok_cases(out) == ["selftest", *CASES], out
    checked = _checked(out)
    for name, sites in CASES.items():
        missing = [s for s in sites if s not in checked.get(name, [])]
        assert not missing, f"{name}: never checked {missing}; checked {checked.get(name)}\n{out}"


def test_the_check_catches_a_forgotten_device() -> None:
    """Each mutant makes host tensors in one module; the run must refuse one there."""
    out = _job()
    caught = {
        line.split()[1]: line
        for line in out.splitlines()
        if line.startswith("CAUGHT ")
    }
    for module, path in MUTANTS.items():
        line = caught.get(f"mutant:{module}")
        assert line is not None, f"mutant:{module} was not caught\n{out}"
        assert path in line and "device check" in line, line
