"""Loads ``libferry_c.so`` and declares the prototypes of Ferry's C API (``ferry.h``).

The library is the file named by the environment variable ``FERRY_CAPI_LIB`` when it is set,
else the copy shipped inside this package (``pip install ./ffi/bindings/python`` builds and bundles it).

Foreign calls go through :class:`ctypes.CDLL`, which releases the GIL for the duration of every
call: a thread waiting in ``ferry_batch_wait`` or ``ferry_transfer_sync`` never blocks other
Python threads. The one callback (``ferry_drain_notifications``) takes the GIL back while it
runs, as ctypes callbacks do.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, c_char_p, c_int32, c_size_t, c_uint16, c_uint32, c_uint64, c_void_p
from pathlib import Path
from typing import Optional

LIB_NAME = "libferry_c.so"
"""File name of the C API library."""

LIB_ENV = "FERRY_CAPI_LIB"
"""Environment variable that names the library to load instead of the bundled one."""

OPCODE_READ = 0
OPCODE_WRITE = 1

STATE_PENDING = 0
STATE_COMPLETED = 1
STATE_FAILED = 2
STATE_CANCELLED = 3


class TransferRequest(ctypes.Structure):
    """``FerryTransferRequest`` (40 bytes)."""

    _fields_ = [
        ("opcode", c_uint32),
        ("flags", c_uint32),
        ("target", c_uint64),
        ("local_addr", c_uint64),
        ("remote_addr", c_uint64),
        ("length", c_uint64),
    ]


class TransferStatus(ctypes.Structure):
    """``FerryTransferStatus`` (16 bytes)."""

    _fields_ = [("state", c_int32), ("code", c_int32), ("transferred", c_uint64)]


NotificationFn = ctypes.CFUNCTYPE(None, c_void_p, c_char_p, c_char_p)
"""``FerryNotificationFn``: ``void (*)(void *ctx, const char *from, const char *message)``."""

# name -> (restype, argtypes)
_PROTOTYPES = {
    "ferry_version": (c_char_p, []),
    "ferry_last_error": (c_char_p, []),
    "ferry_last_error_copy": (c_size_t, [c_char_p, c_size_t]),
    "ferry_engine_create": (c_int32, [c_char_p, POINTER(c_uint64)]),
    "ferry_engine_create_from_file": (c_int32, [c_char_p, POINTER(c_uint64)]),
    "ferry_engine_create_from_env": (c_int32, [POINTER(c_uint64)]),
    "ferry_engine_destroy": (c_int32, [c_uint64]),
    "ferry_engine_segment_name": (c_int32, [c_uint64, c_char_p, c_size_t, POINTER(c_size_t)]),
    "ferry_engine_rpc_port": (c_int32, [c_uint64, POINTER(c_uint16)]),
    "ferry_engine_stats": (c_int32, [c_uint64, c_char_p, c_size_t, POINTER(c_size_t)]),
    "ferry_register_memory": (c_int32, [c_uint64, c_uint64, c_uint64, c_char_p]),
    "ferry_unregister_memory": (c_int32, [c_uint64, c_uint64]),
    "ferry_allocate_buffer": (c_int32, [c_uint64, c_uint64, POINTER(c_uint64)]),
    "ferry_free_buffer": (c_int32, [c_uint64]),
    "ferry_open_segment": (c_int32, [c_uint64, c_char_p, POINTER(c_uint64)]),
    "ferry_close_segment": (c_int32, [c_uint64, c_uint64]),
    "ferry_segment_buffers": (
        c_int32,
        [c_uint64, c_uint64, POINTER(c_uint64), POINTER(c_uint64), c_size_t, POINTER(c_size_t)],
    ),
    "ferry_submit": (c_int32, [c_uint64, POINTER(TransferRequest), c_size_t, POINTER(c_uint64)]),
    "ferry_batch_poll": (c_int32, [c_uint64, POINTER(TransferStatus), c_size_t, POINTER(c_size_t)]),
    "ferry_batch_wait": (c_int32, [c_uint64, c_uint64]),
    "ferry_batch_cancel": (c_int32, [c_uint64]),
    "ferry_batch_free": (c_int32, [c_uint64]),
    "ferry_batch_len": (c_int32, [c_uint64, POINTER(c_size_t)]),
    "ferry_batch_failed_blocks": (c_int32, [c_uint64, POINTER(c_uint32), c_size_t, POINTER(c_size_t)]),
    "ferry_transfer_sync": (c_int32, [c_uint64, POINTER(TransferRequest), c_size_t, c_uint64]),
    "ferry_notify": (c_int32, [c_uint64, c_char_p, c_char_p]),
    "ferry_notify_as": (c_int32, [c_uint64, c_char_p, c_char_p, c_char_p]),
    "ferry_probe": (c_int32, [c_uint64, c_char_p]),
    "ferry_drain_notifications": (c_int32, [c_uint64, NotificationFn, c_void_p, POINTER(c_size_t)]),
    "ferry_kv_layout_register": (
        c_int32,
        [c_uint64, POINTER(c_uint64), c_size_t, c_uint32, c_uint64, POINTER(c_uint64)],
    ),
    "ferry_kv_layout_unregister": (c_int32, [c_uint64, c_uint64]),
    "ferry_kv_layout_publish": (
        c_int32,
        [c_uint64, c_char_p, POINTER(c_uint64), c_size_t, c_uint32, c_uint64, POINTER(c_uint64)],
    ),
    "ferry_kv_remote_layout": (
        c_int32,
        [
            c_uint64,  # engine
            c_uint64,  # segment
            c_char_p,  # name
            POINTER(c_uint64),  # bases
            c_size_t,  # cap
            POINTER(c_size_t),  # base count
            POINTER(c_uint32),  # block count
            POINTER(c_uint64),  # block length
        ],
    ),
    "ferry_kv_submit_block_regions": (
        c_int32,
        [
            c_uint64,  # engine
            c_uint64,  # local layout
            c_uint64,  # segment
            POINTER(c_uint64),  # remote bases
            c_size_t,  # remote base count
            c_uint32,  # remote block count
            c_uint64,  # remote block length
            c_uint32,  # opcode
            POINTER(c_uint32),  # local blocks
            POINTER(c_uint32),  # remote blocks
            c_size_t,  # block count
            POINTER(c_uint32),  # regions
            c_size_t,  # region count
            POINTER(c_uint64),  # out batch
        ],
    ),
    "ferry_kv_submit_blocks": (
        c_int32,
        [
            c_uint64,  # engine
            c_uint64,  # local layout
            c_uint64,  # segment
            POINTER(c_uint64),  # remote bases
            c_size_t,  # remote base count
            c_uint32,  # remote block count
            c_uint64,  # remote block length
            c_uint32,  # opcode
            POINTER(c_uint32),  # local blocks
            POINTER(c_uint32),  # remote blocks
            c_size_t,  # block count
            POINTER(c_uint64),  # out batch
        ],
    ),
}


def library_path() -> Path:
    """Where the C API library is loaded from (``$FERRY_CAPI_LIB``, else the bundled copy)."""
    override = os.environ.get(LIB_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise ImportError(f"{LIB_ENV}={override!r} does not name a file")
        return path
    path = Path(__file__).resolve().with_name(LIB_NAME)
    if not path.is_file():
        raise ImportError(
            f"{LIB_NAME} is not inside the installed ferry package ({path.parent}); install the "
            f"package with `pip install ./ffi/bindings/python` from the Ferry repository (its build runs "
            f"cargo), or set {LIB_ENV} to the path of a built libferry_c.so"
        )
    return path


def _load(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise ImportError(f"cannot load the Ferry C API from {path}: {e}") from e
    missing = [name for name in _PROTOTYPES if not hasattr(lib, name)]
    if missing:
        raise ImportError(
            f"{path} is not a complete Ferry C API library: it lacks {', '.join(missing)} "
            f"(rebuild it with `cargo build -p ferry-capi`)"
        )
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


PATH: Path = library_path()
"""The library file in use."""

lib: ctypes.CDLL = _load(PATH)
"""The loaded library, with every prototype declared."""


def last_error() -> str:
    """The calling thread's last C API error message (``""`` if none)."""
    raw: Optional[bytes] = lib.ferry_last_error()
    return raw.decode("utf-8", errors="replace") if raw else ""


def version() -> str:
    """The C library's version string."""
    raw: Optional[bytes] = lib.ferry_version()
    return raw.decode("utf-8", errors="replace") if raw else ""
