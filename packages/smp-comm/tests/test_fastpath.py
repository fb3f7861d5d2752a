"""The small-message fast path: frame encoding in-process, and real MPI traffic."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from smp_comm import fastpath
from smp_comm.settings import CommSettings

LIMIT = 4096


def roundtrip(obj):
    parts = fastpath.encode(obj, LIMIT)
    assert parts is not None, f"{type(obj)} should take the fast path"
    buf = bytearray(fastpath.frame(parts, 41))
    assert fastpath.frame_seq(buf) == 41
    got, nbytes = fastpath.decode(buf, rank=0)
    assert nbytes == fastpath.payload_bytes(parts)
    return got


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
    assert a.requires_grad == b.requires_grad
    x, y = a.detach().contiguous(), b.detach().contiguous()
    assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(256),
        lambda: torch.randn(4, 8, 2),
        lambda: torch.randn(5, 7).to(torch.bfloat16).requires_grad_(),
        lambda: torch.randn(3, 3).requires_grad_(),
        lambda: torch.randn(6, 4).t(),  # non-contiguous: sent contiguous
        lambda: torch.randn(10)[1::3],
        lambda: torch.empty(0, 3),
        lambda: torch.tensor(3.25),  # 0-d
        lambda: torch.randint(-(2**40), 2**40, (11,)),
        lambda: torch.rand(9) > 0.5,
        lambda: torch.randn(4, dtype=torch.complex128),
        lambda: torch.randn(4).half(),
        lambda: torch.randint(0, 255, (2, 2, 2, 2, 2), dtype=torch.uint8),
    ],
)
def test_tensor_frames_roundtrip(make) -> None:
    t = make()
    got = roundtrip(t)
    same_tensor(got, t)
    assert got.is_contiguous()
    if got.numel() and not got.requires_grad:  # writable memory of its own
        flat = got.reshape(-1)
        flat[0] = flat[-1]


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.int64).reshape(3, 4),
        np.random.default_rng(0).standard_normal(100).astype(np.float32),
        np.zeros((0, 4), dtype=np.float16),
        np.array(7, dtype=np.uint32),
        np.arange(20, dtype=np.uint16)[::3],  # non-contiguous
        np.array([True, False]),
        np.ones(3, dtype=np.complex64),
    ],
)
def test_array_frames_roundtrip(arr: np.ndarray) -> None:
    got = roundtrip(arr)
    assert type(got) is np.ndarray and got.dtype == arr.dtype and got.shape == arr.shape
    assert got.tobytes() == np.ascontiguousarray(arr).tobytes()
    assert got.flags.writeable


def test_what_does_not_qualify() -> None:
    assert fastpath.encode(torch.randn(LIMIT // 4 + 1), LIMIT) is None  # too big
    assert fastpath.encode(torch.randn(LIMIT // 4), LIMIT) is not None  # exactly the limit
    assert fastpath.encode(torch.nn.Parameter(torch.randn(3)), LIMIT) is None  # subclass
    assert fastpath.encode(torch.randn(4, dtype=torch.complex64).conj(), LIMIT) is None
    assert fastpath.encode(torch.randn(4).to_sparse(), LIMIT) is None
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    assert fastpath.encode(q, LIMIT) is None
    assert fastpath.encode(np.arange(4, dtype=">i4"), LIMIT) is None  # non-native byte order
    assert fastpath.encode(np.array(["x", 1], dtype=object), LIMIT) is None
    assert fastpath.encode([torch.randn(2)], LIMIT) is None  # structures take the general path
    assert fastpath.encode({"a": 1}, LIMIT) is None


def test_negative_bit_tensor_is_not_sent_raw() -> None:
    z = torch.randn(3, dtype=torch.complex64)
    imag = z.conj().imag  # a real tensor carrying the lazy negation bit
    if imag.is_neg():
        assert fastpath.encode(imag, LIMIT) is None


def test_bytes_are_copied_at_encode() -> None:
    t = torch.zeros(4)
    parts = fastpath.encode(t, LIMIT)
    t.fill_(5.0)  # the caller may reuse the tensor once isend returns
    got, _ = fastpath.decode(bytearray(fastpath.frame(parts, 0)), rank=0)
    assert torch.equal(got, torch.zeros(4))


def test_small_message_setting(monkeypatch) -> None:
    assert CommSettings.resolve(0).small_message_bytes == 192 << 10
    monkeypatch.setenv("SMP_COMM_SMALL_MESSAGE_BYTES", "8K")
    assert CommSettings.resolve(0).small_message_bytes == 8192
    assert CommSettings.resolve(0, small_message_bytes=0).small_message_bytes == 0
    monkeypatch.setenv("SMP_COMM_SMALL_MESSAGE_BYTES", "lots")
    with pytest.raises(ValueError, match="SMP_COMM_SMALL_MESSAGE_BYTES"):
        CommSettings.resolve(0)


FAST_TRAFFIC_CASES = [
    "threaded-streams",
    "any-source",
    "first-posted-wins",
    "timeout-names-peer",
    "stats",
    "fast-path-off-on-one-rank",
    "compiled-and-python",
]


@pytest.mark.parametrize("case", FAST_TRAFFIC_CASES)
@pytest.mark.parametrize("kind", ["compiled", "python"])
def test_fast_path_traffic(mpi_job, assert_case, kind: str, case: str) -> None:
    """Mixed fast/general traffic from several threads, ANY_SOURCE, first-posted-wins,
    timeouts naming the peer, stats, ranks with the fast path off, ranks mixing the
    compiled and the Python fast path; the main communicator's fast path is ``kind``.
    One job per ``kind``, one item per case."""
    env = {"EXPECT_FAST_PATH": kind, "SMP_COMM_COMPILED": "1" if kind == "compiled" else "0"}
    job = mpi_job("fast_traffic.py", n=3, timeout=180, env=env)
    assert_case(job, case, range(3))


def test_fast_path_self_send_and_order_with_general_path() -> None:
    """In one process: lone tensors take the fast path, and a fast message sent after a
    general one with the same tag is received after it."""
    from mpi4py import MPI
    from smp_comm import Communicator

    with Communicator(MPI.COMM_SELF, small_message_bytes=LIMIT) as comm:
        big = torch.randn(LIMIT)  # 4 * LIMIT bytes: general path
        small = torch.arange(6, dtype=torch.int16).reshape(2, 3)
        h1 = comm.isend(big, dest=0, tag=3)
        h2 = comm.isend(small, dest=0, tag=3)
        first, _, _ = comm.irecv(0, 3).wait(timeout=30)
        second, src, tag = comm.irecv(0, 3).wait(timeout=30)
        h1.wait(timeout=30)
        h2.wait(timeout=30)
        assert torch.equal(first, big) and torch.equal(second, small) and (src, tag) == (0, 3)
        stats = comm.stats()["mpi"]
        assert stats["fast_sent"] == 1 and stats["fast_received"] == 1, stats
