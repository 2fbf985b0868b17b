"""The Pythonic KV-block layer: layouts, block transfers and the batches they return.

A KV cache is described as regions × blocks (:class:`KvLayout`: one base address per region —
for example one per layer's K and V tensor — every region holding ``block_count`` blocks of
``block_len`` bytes). Register the local layout once with
:meth:`ferry.TransferEngine.register_kv_layout`, then move exactly the blocks a request owns::

    local = engine.register_kv_layout(KvLayout(my_bases, num_blocks, block_len))
    batch = engine.transfer_blocks(peer, KvLayout(peer_bases, num_blocks, block_len),
                                   local_blocks=[0, 1, 2], remote_blocks=[7, 8, 9], op="read")

Ferry merges adjacent block pairs into one request per run and region. Failures raise
:class:`ferry.FerryError` subclasses carrying the library's message.
"""

from __future__ import annotations

import enum
import operator
from ctypes import byref, c_size_t, c_uint32
from dataclasses import dataclass
from typing import Iterable, List, NamedTuple, Optional, Tuple

from . import _capi
from .errors import E_INVALID_ARGUMENT, E_NOT_FOUND, OK, FerryError, error_for

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1


def check_int(value: object, name: str, maximum: int = U64_MAX, minimum: int = 0) -> int:
    """``value`` as an int in ``[minimum, maximum]``: TypeError if it is not an integer,
    ValueError if it is out of range."""
    if isinstance(value, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}")
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}") from None
    if v < minimum:
        if minimum == 0:
            raise ValueError(f"{name} must not be negative (got {v})")
        raise ValueError(f"{name} must be at least {minimum} (got {v})")
    if v > maximum:
        raise ValueError(f"{name} must be at most {maximum} (got {v})")
    return v


def check_ints(values: object, name: str, maximum: int = U64_MAX) -> List[int]:
    """A list of ints from any iterable of integers (not a string or bytes)."""
    if isinstance(values, (str, bytes, bytearray)) or isinstance(values, dict):
        raise TypeError(f"{name} must be a list of integers, not {type(values).__name__}")
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{name} must be a list of integers, not {type(values).__name__}") from None
    return [check_int(v, f"{name}[{i}]", maximum) for i, v in enumerate(items)]


@dataclass(frozen=True)
class KvLayout:
    """A KV cache layout: ``len(bases)`` regions of ``block_count`` blocks of ``block_len``
    bytes; block ``i`` of the cache is block ``i`` of every region.

    Used for the local side (registered with :meth:`ferry.TransferEngine.register_kv_layout`)
    and, as plain data, for the peer's side of :meth:`ferry.TransferEngine.transfer_blocks`.
    Regions must be listed in the same order on both sides.
    """

    bases: Tuple[int, ...]
    block_count: int
    block_len: int

    def __init__(self, bases: Iterable[int], block_count: int, block_len: int) -> None:
        checked = tuple(check_ints(bases, "bases"))
        if not checked:
            raise ValueError("a KvLayout needs at least one region base")
        count = check_int(block_count, "block_count", U32_MAX)
        if count == 0:
            raise ValueError("block_count must be positive")
        length = check_int(block_len, "block_len")
        if length == 0:
            raise ValueError("block_len must be positive")
        for i, base in enumerate(checked):
            if base + count * length > U64_MAX:
                raise ValueError(f"region {i} ({count} blocks of {length} bytes at {base:#x}) wraps around")
        object.__setattr__(self, "bases", checked)
        object.__setattr__(self, "block_count", count)
        object.__setattr__(self, "block_len", length)

    @property
    def region_len(self) -> int:
        """Bytes per region (``block_count * block_len``)."""
        return self.block_count * self.block_len

    def block_addr(self, region: int, block: int) -> int:
        """Address of ``block`` in ``region``."""
        if not 0 <= region < len(self.bases):
            raise IndexError(f"region {region} is out of range: the layout has {len(self.bases)}")
        if not 0 <= block < self.block_count:
            raise IndexError(f"block {block} is out of range: the layout has {self.block_count}")
        return self.bases[region] + block * self.block_len


class TransferState(enum.IntEnum):
    """State of one request of a batch (``FERRY_STATE_*``)."""

    PENDING = _capi.STATE_PENDING
    COMPLETED = _capi.STATE_COMPLETED
    FAILED = _capi.STATE_FAILED
    CANCELLED = _capi.STATE_CANCELLED


class RequestStatus(NamedTuple):
    """Status of one request: its state, the ``FERRY_E_*`` code when it failed or was
    cancelled (0 otherwise), and the bytes moved so far."""

    state: TransferState
    code: int
    transferred: int


class Batch:
    """A submitted batch of transfers (``FerryBatch``). Free it with :meth:`free` or a ``with``
    block; it is freed when garbage-collected too.

    Batches of :meth:`ferry.TransferEngine.transfer_blocks` hold one request per merged run of
    blocks and region, and report failures per block (:meth:`failed_blocks`).
    """

    def __init__(self, handle: int, blocks: bool = False) -> None:
        """Wraps C batch ``handle`` (taking ownership); ``blocks``: it came from
        ``ferry_kv_submit_blocks``."""
        self._handle = handle
        self._blocks = blocks
        count = c_size_t()
        rc = _capi.lib.ferry_batch_len(handle, byref(count))
        if rc != OK:
            message = _capi.last_error()
            self.free()
            raise error_for(rc, f"Batch: {message}")
        self._count = count.value

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        state = "freed" if not self._handle else f"handle={self._handle:#x}"
        return f"<ferry.Batch {self._count} requests {state}>"

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
            pass

    @property
    def handle(self) -> int:
        """The C API batch handle (0 once freed)."""
        return self._handle

    def _live(self, what: str) -> int:
        if not self._handle:
            raise error_for(E_NOT_FOUND, f"{what}: the batch was already freed")
        return self._handle

    def status(self) -> List[RequestStatus]:
        """The state of every request, in submission order."""
        handle = self._live("Batch.status")
        statuses = (_capi.TransferStatus * self._count)()
        pending = c_size_t()
        rc = _capi.lib.ferry_batch_poll(handle, statuses, self._count, byref(pending))
        if rc != OK:
            raise error_for(rc, f"Batch.status: {_capi.last_error()}")
        return [RequestStatus(TransferState(s.state), s.code, s.transferred) for s in statuses]

    def pending(self) -> int:
        """How many requests have not finished yet."""
        handle = self._live("Batch.pending")
        pending = c_size_t()
        rc = _capi.lib.ferry_batch_poll(handle, None, 0, byref(pending))
        if rc != OK:
            raise error_for(rc, f"Batch.pending: {_capi.last_error()}")
        return pending.value

    def done(self) -> bool:
        """True when no request is pending."""
        return self.pending() == 0

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every request finished (the GIL is released meanwhile).

        ``timeout`` is in seconds; ``None`` means the engine's transfer timeout. Raises the
        :class:`ferry.FerryError` subclass of the first failed request (with
        ``failed_blocks`` set for block transfers), or :class:`ferry.TransferTimeoutError`
        when requests are still pending at the deadline.
        """
        handle = self._live("Batch.wait")
        if timeout is None:
            ms = 0
        else:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
            if not timeout > 0 or timeout == float("inf"):
                raise ValueError(f"timeout must be a positive, finite number of seconds (got {timeout})")
            if timeout * 1000 >= 2**63:
                raise ValueError(f"timeout too large (got {timeout} s)")
            ms = max(1, int(round(timeout * 1000)))
        rc = _capi.lib.ferry_batch_wait(handle, ms)
        if rc != OK:
            err = error_for(rc, f"Batch.wait: {_capi.last_error()}")
            if self._blocks:
                try:
                    err.failed_blocks = self.failed_blocks()  # type: ignore[attr-defined]
                except FerryError:
                    err.failed_blocks = []  # type: ignore[attr-defined]
            raise err

    def cancel(self) -> None:
        """Cancels the requests still pending (they end ``CANCELLED``)."""
        handle = self._live("Batch.cancel")
        rc = _capi.lib.ferry_batch_cancel(handle)
        if rc != OK:
            raise error_for(rc, f"Batch.cancel: {_capi.last_error()}")

    def failed_blocks(self) -> List[int]:
        """Local block ids whose transfer failed or was cancelled, sorted (block transfers
        only; call it once the batch finished)."""
        if not self._blocks:
            raise TypeError("failed_blocks() is defined for batches of transfer_blocks() only")
        handle = self._live("Batch.failed_blocks")
        count = c_size_t()
        rc = _capi.lib.ferry_batch_failed_blocks(handle, None, 0, byref(count))
        if rc == OK and count.value == 0:
            return []
        if rc not in (OK, E_INVALID_ARGUMENT):
            raise error_for(rc, f"Batch.failed_blocks: {_capi.last_error()}")
        cap = count.value
        ids = (c_uint32 * cap)()
        rc = _capi.lib.ferry_batch_failed_blocks(handle, ids, cap, byref(count))
        if rc != OK:
            raise error_for(rc, f"Batch.failed_blocks: {_capi.last_error()}")
        return list(ids[: count.value])

    def free(self) -> None:
        """Releases the batch (cancelling requests still pending). Idempotent."""
        handle, self._handle = self._handle, 0
        if not handle:
            return
        if _capi.lib.ferry_batch_free(handle) != OK:
            # Still pending (or the engine is gone): cancel, then free again.
            _capi.lib.ferry_batch_cancel(handle)
            _capi.lib.ferry_batch_free(handle)
