"""Ferry's Python package: a drop-in for ``mooncake.engine.TransferEngine`` plus a Pythonic
KV-block layer, bound with ctypes over Ferry's C API (``libferry_c.so``).

Replace ``from mooncake.engine import TransferEngine`` with ``from ferry import TransferEngine``
(or ``from ferry.engine import ...``, the module that mirrors ``mooncake.engine``)::

    from ferry import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = engine.allocate_managed_buffer(1 << 20)
    rc = engine.transfer_sync_read(peer_segment, buf, peer_addr, 4096)   # 0 on success

See ``docs/python.md`` in the Ferry repository.
"""

from . import _capi
from .engine import Read, RegisteredKvLayout, TransferEngine, TransferNotify, TransferOpcode, Write
from .errors import (
    AlreadyExistsError,
    BusyError,
    CancelledError,
    ConfigError,
    FerryError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfBoundsError,
    PeerUnreachableError,
    PluginError,
    ShutdownError,
    TransferTimeoutError,
    TransportError,
    UnsupportedError,
)
from .kv import Batch, KvLayout, RequestStatus, TransferState

__version__ = "0.1.0"

__all__ = [
    "AlreadyExistsError",
    "Batch",
    "BusyError",
    "CancelledError",
    "ConfigError",
    "FerryError",
    "InternalError",
    "InvalidArgumentError",
    "KvLayout",
    "NotFoundError",
    "OutOfBoundsError",
    "PeerUnreachableError",
    "PluginError",
    "Read",
    "RegisteredKvLayout",
    "RequestStatus",
    "ShutdownError",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
    "TransferState",
    "TransferTimeoutError",
    "TransportError",
    "UnsupportedError",
    "Write",
    "capi_version",
    "library_path",
]


def capi_version() -> str:
    """Version of the loaded C library (``ferry_version()``)."""
    return _capi.version()


def library_path() -> str:
    """Path of the loaded ``libferry_c.so``."""
    return str(_capi.PATH)
