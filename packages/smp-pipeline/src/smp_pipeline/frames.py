"""Small pipeline messages as one byte frame, so smp-comm sends them on its fast path.

smp-comm's small-message fast path (no pickling inside smp-comm, no thread hand-off, one C
call each way) takes a message that is exactly **one** CPU tensor of at most
``small_message_bytes``; a tuple takes the general path: its skeleton is pickled through a
``persistent_id`` hook called on every object, its header is pickled again, and the
receiver's tracker thread matches, unpickles and hands it over. At zero compute that was
most of the CPU a pipeline request cost (docs/perf-notes.md, "Cost per request"). So a
message whose tensors are small travels as a 1-d ``uint8`` tensor, the *frame*:

=========  ================================================================================
bytes      content
=========  ================================================================================
0          the message's wire code (:func:`~smp_pipeline.protocol.to_wire`), readable
           before decoding (preemption looks at it on the communicator's thread)
1-3        zero
4-7        ``n``: length of the control part, little-endian
8..8+n     the control part: one C-pickled plain tuple of the message's fields (no tensors,
           no custom classes beyond the skeleton's placeholders), the payload's skeleton
           (a small code for the common ones) and flags, and per tensor its dtype code
           and shape
then       each tensor's element bytes (C order), each starting at a multiple of 16
=========  ================================================================================

A message whose tensors do not fit (larger than the limit, or on another device, or of a
kind this frame cannot hold) is sent as the plain tuple, as before; the receiver tells the
two apart by type. Received tensors are built over the frame's memory (no copy), each its
own tensor (``torch.frombuffer``/``from_numpy``, not views of one another: an in-place
change to one must not bump another's autograd version counter).
"""

from __future__ import annotations

import ctypes
import pickle
import struct
from typing import Any

import numpy as np
import torch

from smp_pipeline.messages import COMMON_SKELETONS
from smp_pipeline.protocol import Message, from_wire, has_payload, to_wire

__all__ = ["DEFAULT_LIMIT", "decode", "encode", "wire_code"]

# The frame size smp-comm's fast path takes by default (its ``small_message_bytes``).
DEFAULT_LIMIT = 192 << 10
_HEAD = struct.Struct("<B3xI")
_ALIGN = 16
_TENSOR = torch.Tensor
_STRIDED = torch.strided
# Dtypes a frame carries, by code (append only: the code travels).
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
# numpy's equivalent where there is one: a tensor made from a shaped ndarray is cheaper than
# a torch view (bfloat16 has none).
_NP: tuple[np.dtype | None, ...] = tuple(
    None if dt is torch.bfloat16 else torch.empty(0, dtype=dt).numpy().dtype for dt in _DTYPES
)
_COMPLEX = (torch.complex64, torch.complex128)
# A common skeleton travels as its index here (an int pickles ~8x cheaper than the
# skeleton's placeholder objects): see smp_pipeline.messages.COMMON_SKELETONS.
_SKELETON_CODE = {id(s): i for i, s in enumerate(COMMON_SKELETONS)}


def _pad(n: int) -> int:
    return -n % _ALIGN


def encode(msg: Message, limit: int = DEFAULT_LIMIT) -> Any:
    """What :meth:`Transport.send` hands to the communicator for ``msg``: a frame (a 1-d
    ``uint8`` tensor) of at most ``limit`` bytes when it fits, else the plain tuple."""
    wire = to_wire(msg)
    if limit <= 0:
        return wire
    if not has_payload(wire[0]):
        control = pickle.dumps(wire[1:], 5)
        blobs: list[bytes] = []
    else:
        skeleton, tensors, flags = wire[-1]
        specs = []
        blobs = []
        size = 0
        for t in tensors:
            if type(t) is not _TENSOR or t.layout is not _STRIDED or not t.is_cpu:
                return wire
            code = _CODE.get(t.dtype)
            if code is None or t.is_neg() or (t.dtype in _COMPLEX and t.is_conj()):
                return wire
            nbytes = t.nbytes
            size += nbytes + _pad(nbytes)
            if size > limit:
                return wire
            if not t.is_contiguous():
                t = t.contiguous()
            # One C-level copy of the element bytes (as smp-comm's fast path takes them).
            blobs.append(ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b"")
            specs.append((code, tuple(t.shape)))
        code = _SKELETON_CODE.get(id(skeleton), -1)
        carried = skeleton if code < 0 else code
        control = pickle.dumps((wire[1:-1], code, carried, flags, specs), 5)
    head = _HEAD.size + len(control)
    parts = [_HEAD.pack(wire[0], len(control)), control, bytes(_pad(head))]
    total = head + _pad(head)
    for blob in blobs:
        parts.append(blob)
        pad = _pad(len(blob))
        if pad:
            parts.append(bytes(pad))
        total += len(blob) + pad
    if total > limit:
        return wire
    # A bytearray: torch.frombuffer warns about read-only memory.
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


def wire_code(obj: Any) -> int:
    """The wire code of a received message (frame or tuple), without decoding it."""
    return int(obj[0])


def decode(obj: Any) -> Message:
    """The message a received frame or tuple holds (inverse of :func:`encode`)."""
    if type(obj) is tuple:
        return from_wire(obj)
    buf = obj.numpy() if isinstance(obj, _TENSOR) else obj  # (memory shared, no copy)
    view = memoryview(buf)  # type: ignore[arg-type]  # (a uint8 array is a buffer)
    code, n = _HEAD.unpack_from(view)
    control = pickle.loads(view[_HEAD.size : _HEAD.size + n])
    if not has_payload(code):
        return from_wire((code, *control))
    fields, skeleton_code, skeleton, flags, specs = control
    if skeleton_code >= 0:
        skeleton = COMMON_SKELETONS[skeleton_code]
    offset = _HEAD.size + n
    offset += _pad(offset)
    tensors = []
    for dtype_code, shape in specs:
        dtype = _DTYPES[dtype_code]
        numel = 1
        for d in shape:
            numel *= d
        if numel == 0:  # torch.frombuffer refuses empty buffers
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        npdt = _NP[dtype_code]
        if npdt is not None:
            t = torch.from_numpy(np.ndarray(shape, npdt, buf, offset))
        else:
            t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)
        tensors.append(t)
        nbytes = numel * dtype.itemsize
        offset += nbytes + _pad(nbytes)
    return from_wire((code, *fields, (skeleton, tensors, flags)))

