"""Ferry's exceptions: one class per C API status code, all deriving from :class:`FerryError`.

The Mooncake-compatible methods of :class:`ferry.TransferEngine` return integer codes the way
Mooncake does; the Pythonic layer (:mod:`ferry.kv`, :class:`ferry.Batch`) raises these instead.
Each exception carries the C API's code (``FERRY_E_*``, a negative integer) and the library's
readable message.
"""

from __future__ import annotations

from typing import Dict, Type

# Status codes of the C API (ferry-abi: FERRY_OK and the negated ferry_core::ErrorKind codes).
OK = 0
E_PEER_UNREACHABLE = -1
E_NOT_FOUND = -2
E_INVALID_ARGUMENT = -3
E_OUT_OF_BOUNDS = -4
E_TIMEOUT = -5
E_TRANSPORT = -6
E_CONFIG = -7
E_ALREADY_EXISTS = -8
E_CANCELLED = -9
E_BUSY = -10
E_UNSUPPORTED = -11
E_SHUTDOWN = -12
E_PLUGIN = -13
E_INTERNAL = -14


class FerryError(Exception):
    """A Ferry C API call failed.

    Attributes:
        code: the ``FERRY_E_*`` status (negative), or 0 when the failure was found in Python.
        message: the library's readable message.
    """

    code: int
    message: str

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class PeerUnreachableError(FerryError, ConnectionError):
    """The peer (or the metadata service) could not be reached (``FERRY_E_PEER_UNREACHABLE``)."""


class NotFoundError(FerryError, LookupError):
    """A segment, region, layout, batch or handle does not exist (``FERRY_E_NOT_FOUND``)."""


class InvalidArgumentError(FerryError, ValueError):
    """An argument was malformed (``FERRY_E_INVALID_ARGUMENT``)."""


class OutOfBoundsError(FerryError, ValueError):
    """An address range lies outside every registered region (``FERRY_E_OUT_OF_BOUNDS``)."""


class TransferTimeoutError(FerryError, TimeoutError):
    """An operation did not finish within its deadline (``FERRY_E_TIMEOUT``)."""


class TransportError(FerryError):
    """A transport failed while moving data (``FERRY_E_TRANSPORT``)."""


class ConfigError(FerryError):
    """A configuration value is invalid (``FERRY_E_CONFIG``)."""


class AlreadyExistsError(FerryError):
    """A registration overlaps an existing one, or a name is taken (``FERRY_E_ALREADY_EXISTS``)."""


class CancelledError(FerryError):
    """The request was cancelled (``FERRY_E_CANCELLED``)."""


class BusyError(FerryError):
    """The resource is in use, e.g. memory with transfers in flight (``FERRY_E_BUSY``)."""


class UnsupportedError(FerryError):
    """Not supported by the selected transport or metadata backend (``FERRY_E_UNSUPPORTED``)."""


class ShutdownError(FerryError):
    """The engine has been shut down or destroyed (``FERRY_E_SHUTDOWN``)."""


class PluginError(FerryError):
    """A transport plugin could not be loaded or broke its contract (``FERRY_E_PLUGIN``)."""


class InternalError(FerryError):
    """A bug inside Ferry, caught at the C boundary (``FERRY_E_INTERNAL``)."""


_BY_CODE: Dict[int, Type[FerryError]] = {
    E_PEER_UNREACHABLE: PeerUnreachableError,
    E_NOT_FOUND: NotFoundError,
    E_INVALID_ARGUMENT: InvalidArgumentError,
    E_OUT_OF_BOUNDS: OutOfBoundsError,
    E_TIMEOUT: TransferTimeoutError,
    E_TRANSPORT: TransportError,
    E_CONFIG: ConfigError,
    E_ALREADY_EXISTS: AlreadyExistsError,
    E_CANCELLED: CancelledError,
    E_BUSY: BusyError,
    E_UNSUPPORTED: UnsupportedError,
    E_SHUTDOWN: ShutdownError,
    E_PLUGIN: PluginError,
    E_INTERNAL: InternalError,
}

_NAMES: Dict[int, str] = {
    E_PEER_UNREACHABLE: "PEER_UNREACHABLE",
    E_NOT_FOUND: "NOT_FOUND",
    E_INVALID_ARGUMENT: "INVALID_ARGUMENT",
    E_OUT_OF_BOUNDS: "OUT_OF_BOUNDS",
    E_TIMEOUT: "TIMEOUT",
    E_TRANSPORT: "TRANSPORT",
    E_CONFIG: "CONFIG",
    E_ALREADY_EXISTS: "ALREADY_EXISTS",
    E_CANCELLED: "CANCELLED",
    E_BUSY: "BUSY",
    E_UNSUPPORTED: "UNSUPPORTED",
    E_SHUTDOWN: "SHUTDOWN",
    E_PLUGIN: "PLUGIN",
    E_INTERNAL: "INTERNAL",
}


def code_name(code: int) -> str:
    """``FERRY_E_*`` name of a status code (``"OK"`` for 0, ``"UNKNOWN(n)"`` otherwise)."""
    if code == OK:
        return "OK"
    return _NAMES.get(code, f"UNKNOWN({code})")


def error_for(code: int, message: str) -> FerryError:
    """The exception for a C API status code (a plain :class:`FerryError` for unknown codes)."""
    cls = _BY_CODE.get(code, FerryError)
    return cls(message or f"ferry call failed with {code_name(code)}", code)


# Mooncake's transfer-engine error codes (mooncake-transfer-engine/include/error.h), returned by
# the Mooncake-compatible methods that pass the engine's code through (register_memory and
# friends). Transfers return -1 for every failure, as Mooncake's Python binding does.
MC_ERR_INVALID_ARGUMENT = -1
MC_ERR_ADDRESS_NOT_REGISTERED = -3
MC_ERR_BATCH_BUSY = -4
MC_ERR_ADDRESS_OVERLAPPED = -7
MC_ERR_SOCKET = -102
MC_ERR_METADATA = -200
MC_ERR_CONTEXT = -202
MC_ERR_NOT_IMPLEMENTED = -303

_TO_MOONCAKE: Dict[int, int] = {
    E_PEER_UNREACHABLE: MC_ERR_SOCKET,
    E_NOT_FOUND: MC_ERR_ADDRESS_NOT_REGISTERED,
    E_INVALID_ARGUMENT: MC_ERR_INVALID_ARGUMENT,
    E_OUT_OF_BOUNDS: MC_ERR_ADDRESS_NOT_REGISTERED,
    E_ALREADY_EXISTS: MC_ERR_ADDRESS_OVERLAPPED,
    E_BUSY: MC_ERR_BATCH_BUSY,
    E_UNSUPPORTED: MC_ERR_NOT_IMPLEMENTED,
    E_SHUTDOWN: MC_ERR_CONTEXT,
}


def mooncake_code(code: int) -> int:
    """Mooncake's error code for a Ferry status code (``-1`` when Mooncake has no closer one)."""
    if code == OK:
        return 0
    return _TO_MOONCAKE.get(code, MC_ERR_INVALID_ARGUMENT)
