import subprocess
import sys

import smp_torch


def test_version() -> None:
    assert smp_torch.__version__.count(".") == 2


def test_import_leaves_fsdp_and_dtensor_unloaded() -> None:
    """``import smp_torch`` does not import FSDP2 or DTensor (~0.6 s a process, paid by every
    rank of every job): only a job with sharded data parallelism imports them."""
    code = (
        "import sys, smp_torch; "
        "print(sorted(m for m in ('torch.distributed.tensor', 'torch.distributed.fsdp') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
