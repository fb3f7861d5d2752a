"""The cuda_ipc path (and GPU host staging): needs CUDA, skipped without it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tensors_over_cuda_ipc_shm_and_mpi(mpi_script) -> None:
    out = mpi_script("gpu_paths.py", n=2, timeout=180)
    assert out.count("OK cuda") == 2, out
