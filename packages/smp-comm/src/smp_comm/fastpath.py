"""The small-message fast path: a lone tensor or array as one self-describing MPI message.

The general path costs tens of microseconds per message: the object is pickled with tensor
stubs, a header travels by pickle-based ``isend``, and threads hand the message on. For the
commonest small message — one CPU tensor or numpy array of at most ``small_message_bytes``
— none of that is needed. Such a message is a *frame*::

    seq (int64) | kind, dtype code, requires_grad, ndim (4 x uint8) | shape (ndim x int64)
    | zero padding to a multiple of 16 bytes | the raw element bytes

sent with one ``Isend`` on a communicator of its own, with the user's tag as the MPI tag,
from the calling thread (small frames go out eagerly: the send is usually complete when
``isend`` returns; otherwise the tracker completes it). The
receiver takes it with a matched probe (``Improbe`` + ``Mrecv``: whoever probes a message
owns it, so the tracker and any waiting thread may all look) into a ``bytearray`` that
becomes the storage of the received tensor (no copy). ``seq`` is the same per-destination
sequence number the general path's headers carry, so per-sender order holds across both.

This module only encodes and decodes frames; :class:`~smp_comm.Communicator` sends, probes,
orders and matches them.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import numpy as np

from smp_comm.serialize import torch

__all__ = ["configure_compiled", "decode", "encode", "frame", "frame_seq", "payload_bytes"]

_ALIGN = 16  # the payload offset; a multiple of every element size
_FIXED = struct.Struct("<qBBBB")  # seq, kind, dtype code, requires_grad, ndim
_SEQ = struct.Struct("<q")
_MAX_NDIM = 32

_KIND_NUMPY, _KIND_TORCH = 0, 1

# dtype codes: the position in these tuples (the same on every rank of one installation).
_NP_DTYPES = tuple(
    np.dtype(n)
    for n in "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64 "
    "complex64 complex128".split()
)
_NP_CODE = {d: i for i, d in enumerate(_NP_DTYPES)}

if torch is not None:
    _T_DTYPES: tuple[Any, ...] = tuple(
        getattr(torch, n)
        for n in "bool int8 uint8 int16 int32 int64 float16 bfloat16 float32 float64 "
        "complex64 complex128".split()
    )
    _T_CODE = {d: i for i, d in enumerate(_T_DTYPES)}
    _T_COMPLEX = _T_CODE[torch.complex64]  # the complex dtypes come last
    # The numpy twin of each dtype, for building received tensors (bfloat16 has none).
    _T_AS_NP: tuple[Any, ...] = tuple(
        None if d == torch.bfloat16 else np.dtype(str(d).removeprefix("torch.")) for d in _T_DTYPES
    )
    _TENSOR: Any = torch.Tensor
    _STRIDED: Any = torch.strided
else:  # pragma: no cover - exercised by the no-torch test in a subprocess
    _T_DTYPES, _T_CODE, _T_AS_NP, _TENSOR, _STRIDED, _T_COMPLEX = (), {}, (), None, None, 0


def _layout(ndim: int) -> tuple[struct.Struct, int]:
    fixed = _FIXED.size + 8 * ndim
    pad = -fixed % _ALIGN
    return struct.Struct(f"<qBBBB{ndim}q{pad}x"), fixed + pad


_HEADS = [_layout(n) for n in range(_MAX_NDIM + 1)]


def encode(obj: Any, limit: int) -> tuple[Any, ...] | None:
    """The parts of ``obj``'s frame, or ``None`` if ``obj`` does not qualify.

    ``obj`` qualifies when it is exactly a CPU strided ``torch.Tensor`` (no conjugate or
    negative bit) or exactly a native-byte-order ``numpy.ndarray``, of a dtype listed here,
    with at most ``limit`` bytes. The element bytes are copied now, so the caller may
    reuse the tensor as soon as this returns. Pass the result to :func:`frame`.
    """
    tp = type(obj)
    if tp is _TENSOR:
        code = _T_CODE.get(obj.dtype)
        if code is None or obj.layout is not _STRIDED or not obj.is_cpu:
            return None
        nbytes = obj.nbytes  # (sparse tensors raise here: hence the layout test first)
        ndim = obj.dim()
        if (
            nbytes > limit
            or ndim > _MAX_NDIM
            or obj.is_neg()
            or (code >= _T_COMPLEX and obj.is_conj())  # only complex tensors have the bit
        ):
            return None
        grad = obj.requires_grad
        if not obj.is_contiguous():
            obj = obj.contiguous()
        # One C-level copy of the element bytes (cheaper than any numpy/torch route).
        data = ctypes.string_at(obj.data_ptr(), nbytes) if nbytes else b""
        return _HEADS[ndim][0], (_KIND_TORCH, code, grad, ndim, *obj.shape), data
    if tp is np.ndarray:
        code = _NP_CODE.get(obj.dtype)  # non-native byte order compares unequal: no code
        if code is None or obj.nbytes > limit or obj.ndim > _MAX_NDIM:
            return None
        fields = (_KIND_NUMPY, code, False, obj.ndim, *obj.shape)
        return _HEADS[obj.ndim][0], fields, obj.tobytes()
    return None


def configure_compiled(module: Any) -> None:
    """Give the compiled fast path (:mod:`smp_comm.compiled`) this module's dtype tables, so
    both encode the same frames."""
    module.configure(_TENSOR, _STRIDED, dict(_T_CODE), _T_COMPLEX if _T_CODE else 1 << 30,
                     np.ndarray, dict(_NP_CODE))  # fmt: skip
    if torch is not None:
        grads = tuple(c for d, c in _T_CODE.items() if d.is_floating_point or d.is_complex)
        module.configure_decode(torch.frombuffer, _T_DTYPES, grads, decode)
    else:  # pragma: no cover - exercised by the no-torch test in a subprocess
        module.configure_decode(None, (), (), decode)


def frame(parts: tuple[Any, ...], seq: int) -> bytes:
    """The bytes to send for :func:`encode`'s ``parts``, numbered ``seq``."""
    head, fields, data = parts
    return head.pack(seq, *fields) + data


def payload_bytes(parts: tuple[Any, ...]) -> int:
    """Element bytes in :func:`encode`'s ``parts``."""
    return len(parts[-1])


def frame_seq(buf: bytearray) -> int:
    """The sequence number of a received frame."""
    return _SEQ.unpack_from(buf)[0]  # type: ignore[no-any-return]


def decode(buf: bytearray, rank: int) -> tuple[Any, int]:
    """``(object, payload bytes)`` of a received frame; the object's memory is ``buf``.

    The cheapest constructor per case (tensor creation dominates a small receive):
    ``torch.frombuffer`` for 1-d tensors, ``torch.from_numpy`` of an ``np.ndarray`` made
    straight in its shape for others (cheaper than a torch ``view``: docs/perf-notes.md).
    """
    _, kind, code, grad, ndim = _FIXED.unpack_from(buf)
    head, offset = _HEADS[ndim]
    nbytes = len(buf) - offset
    if kind == _KIND_NUMPY:
        return np.ndarray(head.unpack_from(buf)[5:], _NP_DTYPES[code], buf, offset), nbytes
    if torch is None:
        raise ImportError(
            f"smp-comm rank {rank}: a message holds a torch tensor but torch is not importable"
        )
    if nbytes and ndim == 1:
        t = torch.frombuffer(buf, dtype=_T_DTYPES[code], offset=offset)
    elif nbytes:
        shape = head.unpack_from(buf)[5:]
        npdt = _T_AS_NP[code]
        if npdt is not None:
            t = torch.from_numpy(np.ndarray(shape, npdt, buf, offset))
        else:
            t = torch.frombuffer(buf, dtype=_T_DTYPES[code], offset=offset).view(shape)
    else:  # torch.frombuffer refuses empty buffers
        t = torch.empty(head.unpack_from(buf)[5:], dtype=_T_DTYPES[code])
    if grad and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_(True)
    return t, nbytes
