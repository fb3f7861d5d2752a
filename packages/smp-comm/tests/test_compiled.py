"""The compiled fast path (smp_comm.compiled): same frames as the Python one, and a clean
fallback to Python when it cannot be built."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from smp_comm import compiled, fastpath

LIMIT = 4096

if os.environ.get("SMP_COMM_COMPILED", "1") == "0":
    pytest.skip("SMP_COMM_COMPILED=0: the compiled fast path is turned off", allow_module_level=True)


@pytest.fixture(scope="module")
def lane():
    """The compiled module. Where the test suite runs, a C compiler, the Python headers and
    the mpich wheel's mpi.h are present: failing to build is a failure, not a skip."""
    module = compiled.load()
    assert module is not None, f"the compiled fast path did not build: {compiled.why_not()}"
    return module


def _quantized():
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)


OBJECTS = [
    lambda: torch.randn(256),
    lambda: torch.randn(4, 8, 2),
    lambda: torch.randn(5, 7).to(torch.bfloat16).requires_grad_(),
    lambda: torch.randn(3, 3).requires_grad_(),
    lambda: torch.randn(6, 4).t(),
    lambda: torch.randn(10)[1::3],
    lambda: torch.empty(0, 3),
    lambda: torch.tensor(3.25),
    lambda: torch.randint(-(2**40), 2**40, (11,)),
    lambda: torch.rand(9) > 0.5,
    lambda: torch.randn(4, dtype=torch.complex128),
    lambda: torch.randn(4, dtype=torch.complex64).requires_grad_(),
    lambda: torch.randn(4).half(),
    lambda: torch.randint(0, 255, (2, 2, 2, 2, 2), dtype=torch.uint8),
    lambda: torch.arange(7, dtype=torch.int32).requires_grad_(False),
    lambda: np.arange(12, dtype=np.int64).reshape(3, 4),
    lambda: np.random.default_rng(0).standard_normal(100).astype(np.float32),
    lambda: np.zeros((0, 4), dtype=np.float16),
    lambda: np.array(7, dtype=np.uint32),
    lambda: np.arange(20, dtype=np.uint16)[::3],
    lambda: np.ones(3, dtype=np.complex64),
    # not fast-path objects: both must say so
    lambda: torch.randn(LIMIT // 4 + 1),
    lambda: torch.nn.Parameter(torch.randn(3)),
    lambda: torch.randn(4, dtype=torch.complex64).conj(),
    lambda: torch.randn(3, dtype=torch.complex64).conj().imag,
    lambda: torch.randn(4).to_sparse(),
    _quantized,
    lambda: np.arange(4, dtype=">i4"),
    lambda: np.array(["x", 1], dtype=object),
    lambda: [torch.randn(2)],
    lambda: {"a": 1},
    lambda: None,
]


def _norm(x):
    if isinstance(x, np.ndarray):
        return ("np", x.dtype, x.shape, x.tobytes())
    flat = x.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat
    return ("torch", x.dtype, tuple(x.shape), x.requires_grad, bytes(raw.numpy().tobytes()))


@pytest.mark.parametrize("make", OBJECTS)
def test_same_frames_and_objects_as_python(lane, make) -> None:
    obj = make()
    parts = fastpath.encode(obj, LIMIT)
    frame = lane.encode(obj, LIMIT)
    if parts is None:
        assert frame is None
        return
    assert frame == fastpath.frame(parts, 0)
    py_obj, py_n = fastpath.decode(bytearray(frame), 0)
    c_obj, c_n = lane.decode(bytearray(frame), 0)
    assert type(c_obj) is type(py_obj) and c_n == py_n == fastpath.payload_bytes(parts)
    assert _norm(c_obj) == _norm(py_obj)


def test_decode_errors_match_python(lane) -> None:
    frame = bytearray(lane.encode(torch.randn(8), LIMIT))
    frame[9] = 200  # no such dtype code
    with pytest.raises(IndexError):
        fastpath.decode(bytearray(frame), 0)
    with pytest.raises(IndexError):
        lane.decode(bytearray(frame), 0)


def test_bytes_are_copied_at_encode(lane) -> None:
    t = torch.zeros(4)
    frame = lane.encode(t, LIMIT)
    t.fill_(5.0)
    got, _ = lane.decode(bytearray(frame), 0)
    assert torch.equal(got, torch.zeros(4))


def test_communicator_uses_it_and_self_send_completes(lane) -> None:
    """A self-send stays pending until received: the pending-request branch."""
    from mpi4py import MPI
    from smp_comm import Communicator

    with Communicator(MPI.COMM_SELF) as comm:
        assert comm.fast_path == "compiled"
        sends = [comm.isend(torch.full((5,), float(i)), dest=0, tag=i % 3) for i in range(50)]
        for i in range(50):
            got, src, tag = comm.irecv(0, i % 3).wait(timeout=30)
            assert torch.equal(got, torch.full((5,), float(i))) and (src, tag) == (0, i % 3)
        for h in sends:
            h.wait(timeout=30)
        assert comm.stats()["mpi"]["fast_sent"] == 50
    with Communicator(MPI.COMM_SELF, compiled=False) as comm:
        assert comm.fast_path == "python"
    with Communicator(MPI.COMM_SELF, small_message_bytes=0) as comm:
        assert comm.fast_path == "off"


def test_build_failure_falls_back_to_python(tmp_path, monkeypatch) -> None:
    """A source that does not compile (as a missing compiler or header would): load() says
    why, and a communicator still works on the Python fast path."""
    from mpi4py import MPI
    from smp_comm import Communicator

    broken = tmp_path / "_fastlane.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(compiled, "_SOURCE", broken)
    monkeypatch.setattr(compiled, "_state", {})
    monkeypatch.setenv("SMP_COMM_CACHE_DIR", str(tmp_path / "cache"))
    assert compiled.load() is None
    assert "compiling _fastlane.c failed" in compiled.why_not()
    with Communicator(MPI.COMM_SELF) as comm:
        assert comm.fast_path == "python"
        h = comm.isend(torch.arange(3), dest=0, tag=1)
        got, _, _ = comm.irecv(0, 1).wait(timeout=30)
        h.wait(timeout=30)
        assert torch.equal(got, torch.arange(3))


def test_cache_is_reused(lane, tmp_path, monkeypatch) -> None:
    """The second build with the same inputs loads the cached file."""
    monkeypatch.setenv("SMP_COMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "_state", {})
    assert compiled.load() is not None
    built = list(tmp_path.rglob("_fastlane*"))
    assert len(built) == 1, built
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(compiled, "_state", {})
    assert compiled.load() is not None
    assert list(tmp_path.rglob("_fastlane*")) == built and built[0].stat().st_mtime_ns == stamp


def test_huge_shapes_do_not_overflow(lane) -> None:
    """A view with a zero dimension after huge ones: 0 bytes, like the Python encoder."""
    t = torch.empty(0).as_strided((2**31, 2**31, 0), (0, 0, 1))
    parts = fastpath.encode(t, LIMIT)
    assert parts is not None and lane.encode(t, LIMIT) == fastpath.frame(parts, 0)
    big = torch.empty(1).as_strided((2**31, 2**31), (0, 0))  # 2**64 bytes as a dense tensor
    assert lane.encode(big, LIMIT) is None
