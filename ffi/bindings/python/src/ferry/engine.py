"""``ferry.engine``: a drop-in for ``mooncake.engine`` (``TransferEngine``, ``TransferNotify``,
``TransferOpcode``) over Ferry's C API.

Method names, arguments and return conventions follow ``mooncake.engine.TransferEngine``:
integer results are 0 on success and negative on failure, with Mooncake's values (transfers
and ``initialize`` return -1; ``register_memory`` and friends return Mooncake's error codes
such as -7 for an overlapping registration). Arguments of the wrong type raise ``TypeError``
and invalid values (negative lengths, lists of different lengths) raise ``ValueError``.
The library's readable message of the last failure is :meth:`TransferEngine.last_error`
(also logged at debug level on the ``ferry`` logger).

Beyond Mooncake, the same class offers a Pythonic layer that raises :class:`ferry.FerryError`
subclasses: :meth:`TransferEngine.from_config`, :meth:`~TransferEngine.register_kv_layout`,
:meth:`~TransferEngine.transfer_blocks`, :meth:`~TransferEngine.notify`.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import json
import logging
import os
import threading
from ctypes import byref, c_size_t, c_uint16, c_uint32, c_uint64
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from . import _capi
from .errors import (
    E_BUSY,
    E_INVALID_ARGUMENT,
    E_NOT_FOUND,
    E_OUT_OF_BOUNDS,
    E_PEER_UNREACHABLE,
    E_SHUTDOWN,
    E_TIMEOUT,
    E_UNSUPPORTED,
    MC_ERR_INVALID_ARGUMENT,
    MC_ERR_METADATA,
    MC_ERR_NOT_IMPLEMENTED,
    MC_ERR_SOCKET,
    OK,
    FerryError,
    code_name,
    error_for,
    mooncake_code,
)
from .kv import U32_MAX, Batch, KvLayout, check_int, check_ints

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode", "Read", "Write", "RegisteredKvLayout"]

_log = logging.getLogger("ferry")

P2PHANDSHAKE = "P2PHANDSHAKE"
"""Mooncake's name for the peer-to-peer handshake metadata mode."""


class TransferOpcode(enum.IntEnum):
    """Direction of a transfer (``mooncake.engine.TransferOpcode``)."""

    Read = _capi.OPCODE_READ
    Write = _capi.OPCODE_WRITE
    READ = _capi.OPCODE_READ  # alias: Mooncake's documentation spells them in capitals
    WRITE = _capi.OPCODE_WRITE


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification (``mooncake.engine.TransferNotify``): ``name`` and ``msg``.

    Both travel as given, as in Mooncake: the receiver's ``get_notifies`` sees the ``name`` the
    sender put here (:meth:`TransferEngine.notify`, the Pythonic call, sends the sender's segment
    name). ``notify_msg`` is an alias of ``msg`` (the field's name on the wire).
    """

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = "") -> None:
        if not isinstance(name, str) or not isinstance(msg, str):
            raise TypeError("TransferNotify(name, msg) takes two strings")
        self.name = name
        self.msg = msg

    @property
    def notify_msg(self) -> str:
        """Alias of :attr:`msg`."""
        return self.msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferNotify):
            return NotImplemented
        return (self.name, self.msg) == (other.name, other.msg)

    def __hash__(self) -> int:
        return hash((self.name, self.msg))


class RegisteredKvLayout(NamedTuple):
    """A local KV layout registered with an engine (:meth:`TransferEngine.register_kv_layout`)."""

    id: int
    """The C API's layout handle."""
    layout: KvLayout
    """The layout."""


# --- argument checks -------------------------------------------------------------------------


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    if "\0" in value:
        raise ValueError(f"{name} must not contain NUL characters")
    return value


def _opcode(value: object) -> int:
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in ("read", "write"):
            return _capi.OPCODE_READ if lowered == "read" else _capi.OPCODE_WRITE
        raise ValueError(f"op must be 'read' or 'write' (got {value!r})")
    op = check_int(value, "opcode", maximum=1 << 32)
    if op not in (_capi.OPCODE_READ, _capi.OPCODE_WRITE):
        raise ValueError(f"opcode must be TransferOpcode.Read (0) or TransferOpcode.Write (1), got {op}")
    return op


def _triples(buffers: object, peer_buffer_addresses: object, lengths: object) -> List[Tuple[int, int, int]]:
    local = check_ints(buffers, "buffers")
    remote = check_ints(peer_buffer_addresses, "peer_buffer_addresses")
    lens = check_ints(lengths, "lengths")
    if not len(local) == len(remote) == len(lens):
        raise ValueError(
            f"buffers, peer_buffer_addresses and lengths differ in length ({len(local)}, {len(remote)}, {len(lens)})"
        )
    return list(zip(local, remote, lens))


_MAX_TIMEOUT_S = 86_400
"""The longest ``transfer_timeout_ms`` Ferry accepts (24 h), in seconds."""


def _mooncake_timeout_ms() -> Optional[int]:
    """Mooncake's ``MC_TRANSFER_TIMEOUT`` (whole seconds, at least 5) in milliseconds. Mooncake
    takes any larger number; Ferry's ``transfer_timeout_ms`` is at most 24 h, which a larger
    value becomes (as long a wait as Mooncake's, in practice)."""
    raw = os.environ.get("MC_TRANSFER_TIMEOUT", "").strip()
    if not raw:
        return None
    try:
        seconds = int(raw)
    except ValueError:
        _log.warning("ignoring MC_TRANSFER_TIMEOUT=%r: not a whole number of seconds", raw)
        return None
    return min(max(5, seconds), _MAX_TIMEOUT_S) * 1000


def _metadata_conn(metadata_server: str, metadata_type: Optional[str]) -> str:
    """The metadata connection string Mooncake builds from ``initialize``'s arguments."""
    server = metadata_server.strip()
    if not server or server == P2PHANDSHAKE or "://" in server or not metadata_type:
        return server
    if metadata_type.lower() in ("p2p", "p2phandshake"):
        return P2PHANDSHAKE
    return f"{metadata_type}://{server}"


_BOUNDS_WARNINGS = 8
"""Transfers refused for unregistered (or out-of-range) memory that are logged at WARNING per
engine; later ones are logged at DEBUG."""


class TransferEngine:
    """Ferry's transfer engine with the interface of ``mooncake.engine.TransferEngine``.

    Create it, then :meth:`initialize` it (Mooncake style), or build one from a config in one
    step with :meth:`from_config`. :meth:`close` (or leaving a ``with`` block, or garbage
    collection) destroys the engine; memory it allocated with :meth:`allocate_managed_buffer`
    is released then too.

    Every method may be called from any thread. Foreign calls release the GIL.
    """

    def __init__(self) -> None:
        self._handle = 0
        self._lock = threading.Lock()
        self._segments: Dict[str, int] = {}
        self._pending: Dict[int, int] = {}  # batch id -> C batch (0: nothing to move)
        self._ids = itertools.count(1)
        self._regions: Dict[int, int] = {}
        self._managed: Dict[int, int] = {}
        self._layouts: Dict[int, RegisteredKvLayout] = {}
        self._tls = threading.local()
        self._bounds_warnings = 0

    # --- lifetime ----------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Union[None, str, Mapping[str, Any]] = None) -> TransferEngine:
        """An engine built from a ``mooncake.json``-style config (a dict or JSON text; ``None``:
        the embedded default — in-process metadata, ``local`` transport). Environment overrides
        (``FERRY_*``, ``MC_*``) apply. Raises :class:`ferry.FerryError` on failure."""
        if config is None:
            text = ""
        elif isinstance(config, str):
            text = config
        elif isinstance(config, Mapping):
            text = json.dumps(dict(config))
        else:
            raise TypeError(f"config must be a dict, a JSON string or None, not {type(config).__name__}")
        engine = cls()
        rc = engine._create(text)
        if rc != OK:
            raise engine._error(rc)
        return engine

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike[str]]) -> TransferEngine:
        """An engine built from a ``mooncake.json`` file. Raises :class:`ferry.FerryError`."""
        p = _text(os.fspath(path), "path")
        engine = cls()
        out = c_uint64()
        rc = _capi.lib.ferry_engine_create_from_file(p.encode(), byref(out))
        if rc != OK:
            engine._fail(rc, "from_file")
            raise engine._error(rc)
        engine._handle = out.value
        return engine

    @classmethod
    def from_env(cls) -> TransferEngine:
        """An engine configured the way Mooncake finds its config: the file named by
        ``MOONCAKE_CONFIG_PATH`` if set (else the embedded default), then the environment
        overrides. Raises :class:`ferry.FerryError`."""
        engine = cls()
        out = c_uint64()
        rc = _capi.lib.ferry_engine_create_from_env(byref(out))
        if rc != OK:
            engine._fail(rc, "from_env")
            raise engine._error(rc)
        engine._handle = out.value
        return engine

    def _create(self, config_json: str) -> int:
        already = "the engine is already initialized; close() it first"
        if self._handle:
            return self._fail(E_INVALID_ARGUMENT, "initialize", already)
        out = c_uint64()
        rc = _capi.lib.ferry_engine_create(config_json.encode("utf-8"), byref(out))
        if rc != OK:
            return self._fail(rc, "initialize")
        with self._lock:
            raced = bool(self._handle)
            if not raced:
                self._handle = out.value
        if raced:  # another thread initialized this object meanwhile: keep its engine
            _capi.lib.ferry_engine_destroy(out.value)
            return self._fail(E_INVALID_ARGUMENT, "initialize", already)
        _log.debug("engine %#x created from %s", out.value, config_json or "the embedded default")
        return OK

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        """Starts the engine (Mooncake's ``initialize``). Returns 0, or -1 on failure.

        ``local_hostname`` is this engine's address (``ip`` or ``ip:port``; with
        ``P2PHANDSHAKE`` the segment name becomes ``ip:<rpc port>``); ``metadata_server`` is
        ``P2PHANDSHAKE``, ``http://…``, ``etcd://…``, ``redis://…``, bare ``host:port``
        (etcd) or ``""`` (Ferry's in-process store); ``device_name`` is passed to
        non-``tcp`` transports.
        """
        args = [
            _text(v, n)
            for v, n in (
                (local_hostname, "local_hostname"),
                (metadata_server, "metadata_server"),
                (protocol, "protocol"),
                (device_name, "device_name"),
            )
        ]
        return self._initialize(*args, metadata_type=None)

    def initialize_ext(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, metadata_type: str
    ) -> int:
        """:meth:`initialize` with the metadata type (``etcd``, ``redis``, ``http``, ``p2p``) for a
        ``metadata_server`` given without a scheme. Returns 0, or -1 on failure."""
        args = [
            _text(v, n)
            for v, n in (
                (local_hostname, "local_hostname"),
                (metadata_server, "metadata_server"),
                (protocol, "protocol"),
                (device_name, "device_name"),
                (metadata_type, "metadata_type"),
            )
        ]
        return self._initialize(*args[:4], metadata_type=args[4])

    def _initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, metadata_type: Optional[str]
    ) -> int:
        if self._handle:
            # A second initialize replaces the engine, as in Mooncake: the old one is destroyed
            # first (so a store-published name is free again). Managed buffers stay allocated
            # (as they were: a buffer keeps the allocator it got) and are registered with the new
            # engine; regions of register_memory are not (Mooncake's
            # new engine does not know them either).
            _log.info("initialize on an initialized engine: replacing %r", self)
            self._close(keep_managed=True)
        config: Dict[str, Any] = {}
        if local_hostname.strip():
            config["local_hostname"] = local_hostname.strip()
        conn = _metadata_conn(metadata_server, metadata_type)
        if conn:
            config["metadata_server"] = conn
        if protocol.strip():
            config["protocol"] = protocol.strip()
        if device_name.strip() and protocol.strip() != "tcp":
            config["device_name"] = device_name.strip()
        timeout = _mooncake_timeout_ms()
        if timeout is not None:
            config["transfer_timeout_ms"] = timeout
        if self._create(json.dumps(config)) != OK:
            return -1
        self._adopt_managed()
        return 0

    def _adopt_managed(self) -> None:
        """Registers the managed buffers kept from a replaced engine with the new one."""
        with self._lock:
            managed = list(self._managed.items())
        for addr, size in managed:
            rc = _capi.lib.ferry_register_memory(self._handle, addr, size, b"*")
            if rc != OK:
                self._fail(rc, "initialize (managed buffer)")
                _log.warning("managed buffer %#x could not be registered with the new engine: %s", addr, self.last_error())

    def close(self) -> None:
        """Destroys the engine: pending batches are cancelled and freed, registrations dropped,
        managed buffers freed. Idempotent."""
        self._close(keep_managed=False)

    def _close(self, keep_managed: bool) -> None:
        with self._lock:
            handle, self._handle = self._handle, 0
            pending = list(self._pending.values())
            managed = [] if keep_managed else list(self._managed.items())
            self._pending.clear()
            self._segments.clear()
            self._regions.clear()
            if not keep_managed:
                self._managed.clear()
            self._layouts.clear()
        for batch in pending:
            if batch:
                _release_batch(batch)
        if handle:
            rc = _capi.lib.ferry_engine_destroy(handle)
            if rc != OK:
                _log.warning("destroying engine %#x failed (%s): %s", handle, code_name(rc), _capi.last_error())
                if rc == E_BUSY and managed:
                    # Transfers still held registered memory at the deadline: freeing it now
                    # could let them write into freed pages. Leak it instead (ferry_free_buffer
                    # would refuse anyway while the destroyed engine still holds it).
                    _log.warning("leaking %d managed buffer(s) still in use by transfers", len(managed))
                    return
        # After the engine is gone no transfer can touch the managed buffers any more (with
        # keep_managed they stay allocated for the engine that replaces this one).
        for addr, _length in managed:
            if _capi.lib.ferry_free_buffer(addr) != OK:
                _log.warning("managed buffer %#x was not freed: %s", addr, _capi.last_error())

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
            pass

    def __repr__(self) -> str:
        if not self._handle:
            return "<ferry.TransferEngine (not initialized)>"
        try:
            return f"<ferry.TransferEngine {self.get_local_segment_name()}>"
        except FerryError:
            return f"<ferry.TransferEngine handle={self._handle:#x}>"

    # --- errors ------------------------------------------------------------------------------

    def _fail(self, code: int, what: str, message: Optional[str] = None) -> int:
        """Records a failure (call right after the failing C call: it reads the C last error).
        Returns ``code``."""
        text = message if message is not None else _capi.last_error()
        if not text:
            text = f"failed with {code_name(code)}"
        self._tls.error = (code, f"{what}: {text}")
        if code == E_OUT_OF_BOUNDS and "transfer" in what and self._bounds_warnings < _BOUNDS_WARNINGS:
            # Unregistered local memory is a set-up mistake that Mooncake's TCP path hides and
            # callers such as SGLang only debug-log at registration: say it loudly (the first few
            # times per engine; later ones at debug level).
            self._bounds_warnings += 1
            _log.warning("%s failed: %s", what, text)
        else:
            _log.debug("%s failed (%s): %s", what, code_name(code), text)
        return code

    def _error(self, code: int) -> FerryError:
        return error_for(code, self.last_error())

    def _raise_on(self, rc: int, what: str) -> None:
        if rc != OK:
            self._fail(rc, what)
            raise self._error(rc)

    def last_error(self) -> str:
        """The readable message of the last failure of this engine in the calling thread
        (``""`` if none). A later success does not clear it."""
        err = getattr(self._tls, "error", None)
        return err[1] if err else ""

    def last_error_code(self) -> int:
        """The ``FERRY_E_*`` code of the failure :meth:`last_error` describes (0 if none)."""
        err = getattr(self._tls, "error", None)
        return err[0] if err else OK

    def _live(self, what: str) -> int:
        handle = self._handle
        if not handle:
            self._fail(E_SHUTDOWN, what, "the engine is not initialized (or was closed)")
        return handle

    def _need(self, what: str) -> int:
        handle = self._live(what)
        if not handle:
            raise self._error(E_SHUTDOWN)
        return handle

    # --- information -------------------------------------------------------------------------

    def get_rpc_port(self) -> int:
        """The port of this engine's RPC (handshake) listener, or -1 on failure."""
        handle = self._live("get_rpc_port")
        if not handle:
            return -1
        port = c_uint16()
        rc = _capi.lib.ferry_engine_rpc_port(handle, byref(port))
        if rc != OK:
            self._fail(rc, "get_rpc_port")
            return -1
        return port.value

    def get_engine_ptr(self) -> int:
        """The C API handle of this engine (``FerryEngine``, for ``ferry_*`` calls from C or
        another binding in this process), or 0 when it is not initialized. Mooncake returns the
        address of its C++ ``TransferEngine``; no Ferry object lives at such an address, so the
        handle (a table index that cannot be dereferenced) is what is returned instead."""
        return self._handle

    def get_local_topology(self, device_name: Optional[str] = None) -> str:
        """What this engine sees, as JSON text in Mooncake's topology format: every host memory
        location (``cpu:<numa node>``) mapped to ``[preferred NICs, other NICs]``. Ferry has no
        RDMA transport, so both lists are empty, as Mooncake reports on a host without RDMA
        NICs. ``device_name`` (Mooncake's NIC filter) is accepted and changes nothing."""
        if device_name is not None:
            _text(device_name, "device_name")
        return json.dumps({loc: [[], []] for loc in _numa_locations()}, indent=1)

    def send_probe(self, peer_server_name: str) -> int:
        """Checks that the engine owning segment ``peer_server_name`` is alive: a Probe frame to
        its handshake listener, answered within 10 s (Mooncake's ``send_probe``). Returns 0, or
        Mooncake's code: -200 no such segment in the metadata, -102 its listener did not answer,
        -303 the in-process metadata (no control channel), -1 otherwise."""
        name = _text(peer_server_name, "peer_server_name")
        handle = self._live("send_probe")
        if not handle:
            return -1
        if not name:
            self._fail(E_INVALID_ARGUMENT, "send_probe", "peer_server_name is empty")
            return MC_ERR_INVALID_ARGUMENT
        rc = _capi.lib.ferry_probe(handle, name.encode("utf-8"))
        if rc == OK:
            return 0
        self._fail(rc, "send_probe")
        return _PROBE_CODES.get(rc, MC_ERR_INVALID_ARGUMENT)

    def warmup_efa_segment(self, segment_name: str) -> int:
        """Mooncake's EFA connection warm-up: Ferry has no EFA transport, so there is nothing to
        warm up and it returns 0, as Mooncake does when its EFA transport is not installed."""
        _text(segment_name, "segment_name")
        return 0

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first buffer ``segment_name``'s descriptor lists: its first
        registered buffer still registered (Ferry and Mooncake engines both list them in
        registration order), a remote address for transfers to that segment. A peer's list is
        the one fetched when this engine first opened the segment; this engine's own is live.
        Returns 0 on failure (no such segment, or no buffer); :meth:`last_error` says why."""
        name = _text(segment_name, "segment_name")
        handle = self._live("get_first_buffer_address")
        seg = self._segment(name, "get_first_buffer_address") if handle else 0
        if not seg:
            return 0
        addr, length, count = c_uint64(), c_uint64(), c_size_t()
        rc = _capi.lib.ferry_segment_buffers(handle, seg, byref(addr), byref(length), 1, byref(count))
        if rc != OK:
            self._fail(rc, "get_first_buffer_address")
            return 0
        if count.value == 0:
            msg = f"segment `{name}` publishes no buffer (as this engine last fetched its descriptor)"
            self._fail(E_NOT_FOUND, "get_first_buffer_address", msg)
            return 0
        return addr.value

    def get_local_segment_name(self) -> str:
        """This engine's segment name (``ip:port``): what peers pass as ``target_hostname``.
        Raises :class:`ferry.FerryError` on failure."""
        text = self._read_text("get_local_segment_name", _capi.lib.ferry_engine_segment_name, 256, 1)
        return text.decode("utf-8", errors="replace")

    @property
    def segment_name(self) -> str:
        """Same as :meth:`get_local_segment_name`."""
        return self.get_local_segment_name()

    def get_stats(self) -> Dict[str, Any]:
        """A snapshot of this engine's counters, as a dict (Ferry's own; Mooncake has none):
        ``segment``; ``transfers``, a list of dicts with ``transport``, ``peer``, ``opcode``
        (``"read"``/``"write"``), ``requests``, ``bytes`` and ``failed_requests`` of the requests
        this engine initiated; ``failures`` and ``rejected_submissions``, counts by error kind
        (``"timeout"``, ``"peer_unreachable"``, ...); ``batch_latency`` with ``count``,
        ``sum_seconds``, ``p50_us``, ``p90_us``, ``p99_us``, ``p999_us``, ``max_us`` and
        ``buckets``; ``open_segments``, ``registered_bytes``, ``registered_regions``;
        ``tail_polls`` and ``tail_polls_caught`` (blocking waits that polled a device-completed
        batch's expected end, and those that saw it end). Counters are totals since the engine started. docs/metrics.md describes every field. Raises
        :class:`ferry.FerryError` on failure (the engine is not initialized, or was closed)."""
        # The text may grow between two calls: leave room.
        return json.loads(self._read_text("get_stats", _capi.lib.ferry_engine_stats, 4096, 1024).decode("utf-8"))

    def _read_text(self, what: str, call, cap: int, slack: int) -> bytes:
        """The text the C function ``call(handle, buf, cap, &length)`` writes, in a buffer grown to
        the length it reports (plus ``slack``) when ``cap`` is too small; raises on any other
        error, naming ``what``."""
        handle = self._need(what)
        while True:
            buf = ctypes.create_string_buffer(cap)
            length = c_size_t()
            rc = call(handle, buf, cap, byref(length))
            if rc == OK:
                return buf.value
            if rc == E_INVALID_ARGUMENT and length.value >= cap:
                cap = length.value + slack
                continue
            self._raise_on(rc, what)

    # --- memory ------------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers ``[buffer_addr, buffer_addr + capacity)`` so transfers may use it and peers
        may address it. Returns 0 or a Mooncake error code (-1 invalid argument, -7 overlap)."""
        addr = check_int(buffer_addr, "buffer_addr")
        length = check_int(capacity, "capacity")
        loc = _text(location, "location")
        return self._register(addr, length, loc, "register_memory")

    def _register(self, addr: int, length: int, location: str, what: str) -> int:
        handle = self._live(what)
        if not handle:
            return mooncake_code(E_SHUTDOWN)
        rc = _capi.lib.ferry_register_memory(handle, addr, length, location.encode())
        if rc != OK:
            return mooncake_code(self._fail(rc, what))
        with self._lock:
            self._regions[addr] = length
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        """Unregisters the region starting at ``buffer_addr`` (waits for transfers using it).
        Returns 0 or a Mooncake error code (-3 not registered, -4 busy)."""
        addr = check_int(buffer_addr, "buffer_addr")
        return self._unregister(addr, "unregister_memory")

    def _unregister(self, addr: int, what: str) -> int:
        handle = self._live(what)
        if not handle:
            return mooncake_code(E_SHUTDOWN)
        rc = _capi.lib.ferry_unregister_memory(handle, addr)
        if rc != OK:
            return mooncake_code(self._fail(rc, what))
        with self._lock:
            self._regions.pop(addr, None)
        return 0

    def batch_register_memory(
        self, buffer_addresses: Sequence[int], capacities: Sequence[int], location: str = "*"
    ) -> int:
        """Registers several regions; on a failure the ones registered by this call are
        unregistered again. Returns 0 or a Mooncake error code."""
        addrs = check_ints(buffer_addresses, "buffer_addresses")
        lens = check_ints(capacities, "capacities")
        loc = _text(location, "location")
        if len(addrs) != len(lens):
            raise ValueError(f"buffer_addresses and capacities differ in length ({len(addrs)}, {len(lens)})")
        done: List[int] = []
        for addr, length in zip(addrs, lens):
            rc = self._register(addr, length, loc, "batch_register_memory")
            if rc != 0:
                message, code = self.last_error(), self.last_error_code()
                for a in done:
                    self._unregister(a, "batch_register_memory (rollback)")
                self._tls.error = (code, message)
                return rc
            done.append(addr)
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Unregisters several regions (all are tried). Returns 0 or the first failure's
        Mooncake error code."""
        addrs = check_ints(buffer_addresses, "buffer_addresses")
        first = 0
        for addr in addrs:
            rc = self._unregister(addr, "batch_unregister_memory")
            if rc != 0 and first == 0:
                first = rc
        return first

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocates ``length`` bytes (page-aligned, zero-filled) of host memory suited to the
        engine's transport and registers them. With ``protocol="ascend"`` the memory comes from
        ``aclrtMallocHost``, the only host memory HCCL can move; with other transports from the
        process allocator (``ferry_allocate_buffer``). Returns the address, or 0 on failure.
        Free it with :meth:`free_managed_buffer` (or let :meth:`close` release it)."""
        size = max(1, check_int(length, "length"))
        handle = self._live("allocate_managed_buffer")
        if not handle:
            return 0
        out = c_uint64()
        rc = _capi.lib.ferry_allocate_buffer(handle, size, byref(out))
        if rc != OK:
            self._fail(rc, "allocate_managed_buffer")
            return 0
        addr = out.value
        rc = _capi.lib.ferry_register_memory(handle, addr, size, b"*")
        if rc != OK:
            self._fail(rc, "allocate_managed_buffer")
            if _capi.lib.ferry_free_buffer(addr) != OK:
                _log.warning("managed buffer %#x was not freed: %s", addr, _capi.last_error())
            return 0
        with self._lock:
            self._managed[addr] = size
        return addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Unregisters and frees a buffer of :meth:`allocate_managed_buffer`. Returns 0, or a
        negative code (the buffer is kept when transfers still use it)."""
        addr = check_int(buffer_addr, "buffer_addr")
        check_int(length, "length")
        # Taken out of the table first: a concurrent free or close() cannot free it twice.
        with self._lock:
            size = self._managed.pop(addr, None)
        if size is None:
            self._fail(E_NOT_FOUND, "free_managed_buffer", f"{addr:#x} is not a managed buffer of this engine")
            return -1
        handle = self._live("free_managed_buffer")
        if not handle:
            # close() ran between the two steps and destroyed the engine without seeing this
            # buffer; whether transfers still touched it is unknown here, so it is leaked rather
            # than freed.
            _log.warning("free_managed_buffer raced with close(); leaking %#x (%d bytes)", addr, size)
            return -1
        rc = _capi.lib.ferry_unregister_memory(handle, addr)
        if rc != OK:
            with self._lock:
                self._managed[addr] = size  # still registered: kept for a later free or close()
            return mooncake_code(self._fail(rc, "free_managed_buffer"))
        rc = _capi.lib.ferry_free_buffer(addr)
        if rc != OK:
            # Registered elsewhere (another engine of this process): kept for close().
            with self._lock:
                self._managed[addr] = size
            return mooncake_code(self._fail(rc, "free_managed_buffer"))
        return 0

    def _registered(self, addr: int, length: int) -> bool:
        end = addr + length
        with self._lock:
            regions = list(self._regions.items()) + list(self._managed.items())
        return any(base <= addr and end <= base + size for base, size in regions)

    def write_bytes_to_buffer(
        self, dest_address: int, src_ptr: Union[bytes, bytearray, memoryview, str], length: int
    ) -> int:
        """Copies the first ``length`` bytes of ``src_ptr`` to ``dest_address``, which must lie in
        memory registered with this engine. Returns 0, or -3 for an unregistered range."""
        dest = check_int(dest_address, "dest_address")
        n = check_int(length, "length")
        if isinstance(src_ptr, str):
            data = src_ptr.encode("utf-8")
        elif isinstance(src_ptr, (bytes, bytearray, memoryview)):
            data = bytes(src_ptr) if not isinstance(src_ptr, bytes) else src_ptr
        else:
            raise TypeError(f"src_ptr must be bytes, bytearray, memoryview or str, not {type(src_ptr).__name__}")
        if n > len(data):
            raise ValueError(f"length {n} exceeds the {len(data)} bytes given")
        if n == 0:
            return 0
        if not self._registered(dest, n):
            msg = f"[{dest:#x}, +{n}) is not inside memory registered with this engine"
            return mooncake_code(self._fail(E_OUT_OF_BOUNDS, "write_bytes_to_buffer", msg))
        ctypes.memmove(dest, data, n)
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """The ``length`` bytes at ``source_address``, which must lie in memory registered with
        this engine (else :class:`ferry.OutOfBoundsError`, a ``ValueError``)."""
        src = check_int(source_address, "source_address")
        n = check_int(length, "length")
        if n == 0:
            return b""
        if not self._registered(src, n):
            msg = f"[{src:#x}, +{n}) is not inside memory registered with this engine"
            self._fail(E_OUT_OF_BOUNDS, "read_bytes_from_buffer", msg)
            raise self._error(E_OUT_OF_BOUNDS)
        return ctypes.string_at(src, n)

    # --- segments ----------------------------------------------------------------------------

    def _segment(self, name: str, what: str) -> int:
        """The segment handle of ``name`` (opened once and cached), or 0 after recording why."""
        seg = self._segments.get(name)
        if seg:
            return seg
        handle = self._live(what)
        if not handle:
            return 0
        out = c_uint64()
        rc = _capi.lib.ferry_open_segment(handle, name.encode("utf-8"), byref(out))
        if rc != OK:
            self._fail(rc, what)
            return 0
        with self._lock:
            return self._segments.setdefault(name, out.value)

    @staticmethod
    def _requests(opcode: int, segment: int, triples: Sequence[Tuple[int, int, int]]) -> Any:
        if len(triples) == 1:
            local, remote, length = triples[0]
            return _capi.TransferRequest(opcode, 0, segment, local, remote, length)
        arr = (_capi.TransferRequest * len(triples))()
        for i, (local, remote, length) in enumerate(triples):
            r = arr[i]
            r.opcode, r.target, r.local_addr, r.remote_addr, r.length = opcode, segment, local, remote, length
        return arr

    # --- Mooncake transfers ------------------------------------------------------------------

    def _sync(
        self, what: str, target: str, opcode: int, triples: List[Tuple[int, int, int]], notify: Optional[TransferNotify]
    ) -> int:
        handle = self._live(what)
        if not handle:
            return -1
        # Zero-length requests move nothing; Mooncake accepts them and so does this binding.
        triples = [t for t in triples if t[2]]
        if triples:
            seg = self._segment(target, what)
            if not seg:
                return -1
            rc = _capi.lib.ferry_transfer_sync(handle, self._requests(opcode, seg, triples), len(triples), 0)
            if rc != OK:
                self._fail(rc, what)
                return -1
        if notify is not None:
            rc = _capi.lib.ferry_notify_as(
                handle, target.encode("utf-8"), notify.name.encode("utf-8"), notify.msg.encode("utf-8")
            )
            if rc != OK:
                self._fail(rc, f"{what} (notification)")
                return -1
        return 0

    def _submit(self, what: str, target: str, opcode: int, triples: List[Tuple[int, int, int]]) -> int:
        """Submits asynchronously; returns the Python-side batch id (> 0), or 0 on failure."""
        handle = self._live(what)
        if not handle:
            return 0
        triples = [t for t in triples if t[2]]
        batch = 0
        if triples:
            seg = self._segment(target, what)
            if not seg:
                return 0
            out = c_uint64()
            rc = _capi.lib.ferry_submit(handle, self._requests(opcode, seg, triples), len(triples), byref(out))
            if rc != OK:
                self._fail(rc, what)
                return 0
            batch = out.value
        with self._lock:
            batch_id = next(self._ids)
            self._pending[batch_id] = batch
        return batch_id

    def transfer_sync_read(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int:
        """Reads ``length`` bytes at ``peer_buffer_address`` of segment ``target_hostname`` into
        local ``buffer``; returns when done. 0, or -1 on failure (see :meth:`last_error`)."""
        target = _text(target_hostname, "target_hostname")
        triple = (
            check_int(buffer, "buffer"),
            check_int(peer_buffer_address, "peer_buffer_address"),
            check_int(length, "length"),
        )
        _hint(transport_hint)
        return self._sync("transfer_sync_read", target, _capi.OPCODE_READ, [triple], None)

    def transfer_sync_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int:
        """Writes ``length`` bytes of local ``buffer`` to ``peer_buffer_address`` of segment
        ``target_hostname``; returns when done. 0, or -1 on failure."""
        target = _text(target_hostname, "target_hostname")
        triple = (
            check_int(buffer, "buffer"),
            check_int(peer_buffer_address, "peer_buffer_address"),
            check_int(length, "length"),
        )
        _hint(transport_hint)
        return self._sync("transfer_sync_write", target, _capi.OPCODE_WRITE, [triple], None)

    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: Union[TransferOpcode, int],
        notify: Optional[TransferNotify] = None,
        transport_hint: str = "",
    ) -> int:
        """One transfer in direction ``opcode``; after it completed, ``notify.msg`` (if given) is
        sent to the peer. 0, or -1 on failure."""
        target = _text(target_hostname, "target_hostname")
        triple = (
            check_int(buffer, "buffer"),
            check_int(peer_buffer_address, "peer_buffer_address"),
            check_int(length, "length"),
        )
        op = _opcode(opcode)
        return self._sync("transfer_sync", target, op, [triple], _notify_arg(notify, transport_hint))

    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Reads several ranges of ``target_hostname`` in one batch. 0, or -1 on failure."""
        target = _text(target_hostname, "target_hostname")
        triples = _triples(buffers, peer_buffer_addresses, lengths)
        _hint(transport_hint)
        return self._sync("batch_transfer_sync_read", target, _capi.OPCODE_READ, triples, None)

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Writes several ranges to ``target_hostname`` in one batch. 0, or -1 on failure."""
        target = _text(target_hostname, "target_hostname")
        triples = _triples(buffers, peer_buffer_addresses, lengths)
        _hint(transport_hint)
        return self._sync("batch_transfer_sync_write", target, _capi.OPCODE_WRITE, triples, None)

    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: Union[TransferOpcode, int],
        notify: Optional[TransferNotify] = None,
        transport_hint: str = "",
    ) -> int:
        """A batch in direction ``opcode``, then ``notify`` (if given). 0, or -1 on failure."""
        target = _text(target_hostname, "target_hostname")
        triples = _triples(buffers, peer_buffer_addresses, lengths)
        op = _opcode(opcode)
        return self._sync("batch_transfer_sync", target, op, triples, _notify_arg(notify, transport_hint))

    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Starts a batch of reads. Returns its batch id (for :meth:`get_batch_transfer_status`
        or :meth:`transfer_check_status`), or 0 on failure."""
        target = _text(target_hostname, "target_hostname")
        triples = _triples(buffers, peer_buffer_addresses, lengths)
        _hint(transport_hint)
        return self._submit("batch_transfer_async_read", target, _capi.OPCODE_READ, triples)

    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Starts a batch of writes. Returns its batch id, or 0 on failure."""
        target = _text(target_hostname, "target_hostname")
        triples = _triples(buffers, peer_buffer_addresses, lengths)
        _hint(transport_hint)
        return self._submit("batch_transfer_async_write", target, _capi.OPCODE_WRITE, triples)

    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: Union[TransferOpcode, int],
        transport_hint: str = "",
    ) -> int:
        """Starts a batch in direction ``opcode``. Returns its batch id, or 0 on failure."""
        target = _text(target_hostname, "target_hostname")
        triples = _triples(buffers, peer_buffer_addresses, lengths)
        op = _opcode(opcode)
        _hint(transport_hint)
        return self._submit("batch_transfer_async", target, op, triples)

    def transfer_submit_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int:
        """Starts one write. Returns its batch id (for :meth:`transfer_check_status`), or 0 on
        failure (Mooncake's documented failure sentinel for every async submit)."""
        target = _text(target_hostname, "target_hostname")
        triple = (
            check_int(buffer, "buffer"),
            check_int(peer_buffer_address, "peer_buffer_address"),
            check_int(length, "length"),
        )
        _hint(transport_hint)
        return self._submit("transfer_submit_write", target, _capi.OPCODE_WRITE, [triple])

    def transfer_check_status(self, batch_id: int) -> int:
        """Polls a batch without blocking: 1 completed, 0 still in progress, -1 failed, -2
        timed out. A completed or failed batch is released (its id becomes unknown: -1);
        a timed-out one is kept until :meth:`close`."""
        bid = check_int(batch_id, "batch_id")
        with self._lock:
            batch = self._pending.get(bid)
        if batch is None:
            self._fail(
                E_NOT_FOUND, "transfer_check_status", f"unknown batch id {bid} (never issued, or already finished)"
            )
            return -1
        if not batch:
            self._forget(bid)
            return 1
        pending = c_size_t()
        rc = _capi.lib.ferry_batch_poll(batch, None, 0, byref(pending))
        if rc != OK:
            self._fail(rc, "transfer_check_status")
            self._forget(bid)
            return -1
        if pending.value:
            return 0
        # Every request finished: a zero-timeout wait reports the first failure with its message.
        rc = _capi.lib.ferry_batch_wait(batch, 1)
        if rc == OK:
            self._forget(bid)
            return 1
        self._fail(rc, "transfer_check_status")
        if rc == E_TIMEOUT:
            return -2
        self._forget(bid)
        return -1

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Waits for every batch (the GIL is released meanwhile) and releases them. 0 if all
        completed, -1 if any failed, timed out or is unknown (the others are then cancelled)."""
        ids = check_ints(batch_ids, "batch_ids")
        with self._lock:
            batches = [(bid, self._pending.pop(bid, None)) for bid in ids]
        result = 0
        for bid, batch in batches:
            if batch is None:
                if result == 0:
                    self._fail(E_NOT_FOUND, "get_batch_transfer_status", f"unknown batch id {bid}")
                result = -1
                continue
            if not batch:
                continue
            if result == 0:
                rc = _capi.lib.ferry_batch_wait(batch, 0)
                if rc != OK:
                    self._fail(rc, "get_batch_transfer_status")
                    result = -1
            _release_batch(batch)
        return result

    def _forget(self, batch_id: int) -> None:
        with self._lock:
            batch = self._pending.pop(batch_id, None)
        if batch:
            _release_batch(batch)

    # --- notifications -----------------------------------------------------------------------

    def get_notifies(self) -> List[TransferNotify]:
        """Takes the notifications received so far, oldest first: ``name`` as the sender set it
        (a Ferry sender's :meth:`notify` sets its segment name), ``msg`` the message."""
        handle = self._live("get_notifies")
        if not handle:
            return []
        got: List[TransferNotify] = []

        def collect(_ctx: Optional[int], sender: Optional[bytes], message: Optional[bytes]) -> None:
            got.append(
                TransferNotify(
                    (sender or b"").decode("utf-8", errors="replace"),
                    (message or b"").decode("utf-8", errors="replace"),
                )
            )

        callback = _capi.NotificationFn(collect)
        count = c_size_t()
        rc = _capi.lib.ferry_drain_notifications(handle, callback, None, byref(count))
        if rc != OK:
            self._fail(rc, "get_notifies")
        return got

    def notify(self, target_hostname: str, message: str) -> None:
        """Sends a notification to the owner of segment ``target_hostname`` (Pythonic: raises
        :class:`ferry.FerryError` on failure)."""
        target = _text(target_hostname, "target_hostname")
        msg = _text(message, "message")
        handle = self._need("notify")
        self._raise_on(_capi.lib.ferry_notify(handle, target.encode("utf-8"), msg.encode("utf-8")), "notify")

    # --- KV blocks (Pythonic) ----------------------------------------------------------------

    def register_kv_layout(self, layout: KvLayout) -> RegisteredKvLayout:
        """Registers a local KV layout (its memory must be registered already). Raises
        :class:`ferry.FerryError` on failure."""
        if not isinstance(layout, KvLayout):
            raise TypeError(f"layout must be a ferry.KvLayout, not {type(layout).__name__}")
        handle = self._need("register_kv_layout")
        bases = (c_uint64 * len(layout.bases))(*layout.bases)
        out = c_uint64()
        rc = _capi.lib.ferry_kv_layout_register(
            handle, bases, len(layout.bases), layout.block_count, layout.block_len, byref(out)
        )
        self._raise_on(rc, "register_kv_layout")
        registered = RegisteredKvLayout(out.value, layout)
        with self._lock:
            self._layouts[out.value] = registered
        return registered

    def publish_kv_layout(self, name: str, layout: KvLayout) -> RegisteredKvLayout:
        """Registers a local KV layout (as :meth:`register_kv_layout`) and publishes it under
        ``name`` in this engine's segment descriptor, where a peer reads it with
        :meth:`remote_kv_layout`. Returns once the descriptor naming it is published. Raises
        :class:`ferry.AlreadyExistsError` when a layout of that name is published already."""
        text = _text(name, "name")
        if not isinstance(layout, KvLayout):
            raise TypeError(f"layout must be a ferry.KvLayout, not {type(layout).__name__}")
        handle = self._need("publish_kv_layout")
        bases = (c_uint64 * len(layout.bases))(*layout.bases)
        out = c_uint64()
        rc = _capi.lib.ferry_kv_layout_publish(
            handle, text.encode("utf-8"), bases, len(layout.bases), layout.block_count, layout.block_len, byref(out)
        )
        self._raise_on(rc, "publish_kv_layout")
        registered = RegisteredKvLayout(out.value, layout)
        with self._lock:
            self._layouts[out.value] = registered
        return registered

    def remote_kv_layout(self, peer: str, name: str) -> KvLayout:
        """The KV layout segment ``peer`` publishes as ``name`` (:meth:`publish_kv_layout`), to
        pass to :meth:`transfer_blocks`. Raises :class:`ferry.NotFoundError` naming the layouts
        the peer does publish."""
        target = _text(peer, "peer")
        text = _text(name, "name").encode("utf-8")
        handle = self._need("remote_kv_layout")
        seg = self._segment(target, "remote_kv_layout")
        if not seg:
            raise self._error(self.last_error_code())
        count, blocks, length = c_size_t(), c_uint32(), c_uint64()
        bases = (c_uint64 * 8)()
        rc = _capi.lib.ferry_kv_remote_layout(
            handle, seg, text, bases, 8, byref(count), byref(blocks), byref(length)
        )
        if rc != 0 and count.value > 8:
            bases = (c_uint64 * count.value)()
            rc = _capi.lib.ferry_kv_remote_layout(
                handle, seg, text, bases, count.value, byref(count), byref(blocks), byref(length)
            )
        self._raise_on(rc, "remote_kv_layout")
        return KvLayout(list(bases[: count.value]), blocks.value, length.value)

    def unregister_kv_layout(self, layout: RegisteredKvLayout) -> None:
        """Unregisters a layout of :meth:`register_kv_layout` or :meth:`publish_kv_layout`
        (a published one leaves the descriptor)."""
        if not isinstance(layout, RegisteredKvLayout):
            raise TypeError(f"layout must be a RegisteredKvLayout, not {type(layout).__name__}")
        handle = self._need("unregister_kv_layout")
        self._raise_on(_capi.lib.ferry_kv_layout_unregister(handle, layout.id), "unregister_kv_layout")
        with self._lock:
            self._layouts.pop(layout.id, None)

    def transfer_blocks(
        self,
        peer: str,
        remote_layout: KvLayout,
        local_blocks: Iterable[int],
        remote_blocks: Iterable[int],
        op: Union[str, TransferOpcode, int] = "read",
        wait: bool = True,
        local_layout: Optional[RegisteredKvLayout] = None,
        timeout: Optional[float] = None,
        regions: Optional[Iterable[int]] = None,
    ) -> Batch:
        """Moves blocks between the local layout and segment ``peer`` laid out as
        ``remote_layout``: ``local_blocks[i]`` pairs with ``remote_blocks[i]``; ``op`` is
        ``"read"`` (pull) or ``"write"`` (push).

        ``local_layout`` defaults to the one layout registered with this engine. With
        ``wait=True`` the call returns the finished :class:`ferry.Batch` once every block
        moved, or raises the first failure with ``failed_blocks`` (local ids) attached —
        requests still pending at the deadline (``timeout`` seconds, default the engine's
        transfer timeout) are cancelled first, so it lists every block that did not arrive.
        With ``wait=False`` it returns the running batch.

        ``regions`` (region indices into both layouts, each at most once) moves only those
        regions: a layer subset, for layer-wise transfers (layer ``l``'s K and V are regions
        ``2*l`` and ``2*l + 1`` in a layout listing K and V per layer).
        """
        target = _text(peer, "peer")
        if not isinstance(remote_layout, KvLayout):
            raise TypeError(f"remote_layout must be a ferry.KvLayout, not {type(remote_layout).__name__}")
        lb = check_ints(local_blocks, "local_blocks", U32_MAX)
        rb = check_ints(remote_blocks, "remote_blocks", U32_MAX)
        if len(lb) != len(rb):
            raise ValueError(f"{len(lb)} local block ids but {len(rb)} remote block ids")
        if not lb:
            raise ValueError("no blocks to transfer")
        opcode = _opcode(op)
        subset = None if regions is None else check_ints(regions, "regions", U32_MAX)
        if subset is not None and not subset:
            raise ValueError("regions is empty: name at least one region, or leave it None for all")
        local = self._pick_layout(local_layout)
        handle = self._need("transfer_blocks")
        seg = self._segment(target, "transfer_blocks")
        if not seg:
            raise self._error(self.last_error_code())
        n = len(lb)
        out = c_uint64()
        common = (
            handle,
            local.id,
            seg,
            (c_uint64 * len(remote_layout.bases))(*remote_layout.bases),
            len(remote_layout.bases),
            remote_layout.block_count,
            remote_layout.block_len,
            opcode,
            (c_uint32 * n)(*lb),
            (c_uint32 * n)(*rb),
            n,
        )
        if subset is None:
            rc = _capi.lib.ferry_kv_submit_blocks(*common, byref(out))
        else:
            regs = (c_uint32 * len(subset))(*subset)
            rc = _capi.lib.ferry_kv_submit_block_regions(*common, regs, len(subset), byref(out))
        self._raise_on(rc, "transfer_blocks")
        batch = Batch(out.value, blocks=True)
        if wait:
            try:
                batch.wait(timeout)
            except FerryError as e:
                self._tls.error = (e.code, f"transfer_blocks: {e.message}")
                try:
                    # Past the deadline: cancel what is still pending (as ferry_transfer_sync
                    # does), so every block that did not arrive is reported.
                    if batch.pending():
                        batch.cancel()
                    e.failed_blocks = batch.failed_blocks()  # type: ignore[attr-defined]
                finally:
                    batch.free()
                raise
        return batch

    def _pick_layout(self, layout: Optional[RegisteredKvLayout]) -> RegisteredKvLayout:
        if layout is not None:
            if not isinstance(layout, RegisteredKvLayout):
                raise TypeError(f"local_layout must be a RegisteredKvLayout, not {type(layout).__name__}")
            return layout
        with self._lock:
            layouts = list(self._layouts.values())
        if len(layouts) == 1:
            return layouts[0]
        if not layouts:
            raise error_for(E_NOT_FOUND, "transfer_blocks: no KV layout is registered (call register_kv_layout first)")
        raise ValueError(f"{len(layouts)} KV layouts are registered: pass local_layout=")


def _hint(transport_hint: object) -> None:
    """Checks Mooncake's ``transport_hint`` (a TENT-only option, ignored here as by Mooncake's
    classic backend)."""
    _text(transport_hint, "transport_hint")


def _notify_arg(notify: object, transport_hint: object) -> Optional[TransferNotify]:
    _hint(transport_hint)
    if notify is None:
        return None
    msg = getattr(notify, "msg", None)
    if not isinstance(msg, str):
        raise TypeError(f"notify must be a TransferNotify (with a str msg), not {type(notify).__name__}")
    if isinstance(notify, TransferNotify):
        return notify
    return TransferNotify(str(getattr(notify, "name", "")), msg)


def _release_batch(handle: int) -> None:
    """Frees a C batch, cancelling it first when it is still pending."""
    if _capi.lib.ferry_batch_free(handle) != OK:
        _capi.lib.ferry_batch_cancel(handle)
        _capi.lib.ferry_batch_free(handle)


_PROBE_CODES = {
    E_NOT_FOUND: MC_ERR_METADATA,
    E_PEER_UNREACHABLE: MC_ERR_SOCKET,
    E_TIMEOUT: MC_ERR_SOCKET,
    E_UNSUPPORTED: MC_ERR_NOT_IMPLEMENTED,
}
"""Mooncake's ``send_probe`` codes for Ferry's errors (others: -1)."""


def _numa_locations() -> List[str]:
    """``cpu:<n>`` for every NUMA node of this host (``["cpu:0"]`` when sysfs does not say)."""
    nodes = []
    try:
        for entry in os.listdir("/sys/devices/system/node"):
            if entry.startswith("node") and entry[4:].isdigit():
                nodes.append(int(entry[4:]))
    except OSError:
        pass
    return [f"cpu:{n}" for n in sorted(nodes)] or ["cpu:0"]
