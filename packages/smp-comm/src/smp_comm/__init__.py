"""On-demand tensor message backend over MPI with shared-memory, RMA and CUDA-IPC direct paths.

>>> from smp_comm import Communicator, ANY_SOURCE, ANY_TAG   # doctest: +SKIP
"""

from smp_comm.__about__ import __version__
from smp_comm.communicator import ANY_SOURCE, ANY_TAG, Communicator
from smp_comm.errors import CommClosedError, CommError, CommTimeoutError, PeerClosedError
from smp_comm.handles import Handle, RecvHandle, SendHandle
from smp_comm.serialize import TensorStub
from smp_comm.settings import CommSettings

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "CommClosedError",
    "CommError",
    "CommSettings",
    "CommTimeoutError",
    "Communicator",
    "Handle",
    "PeerClosedError",
    "RecvHandle",
    "SendHandle",
    "TensorStub",
    "__version__",
]
