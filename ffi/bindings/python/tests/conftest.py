"""Fixtures of the ferry Python suite. The suite runs against the *installed* package
(`pip install ./ffi/bindings/python`), so it tests the wheel users get, C library included."""

from __future__ import annotations

import ctypes
from typing import Callable, Iterator, List

import pytest

import ferry

from _support import Child, SilentPeer


@pytest.fixture
def make_engine(host_buffer) -> Iterator[Callable[..., ferry.TransferEngine]]:
    """Factory of engines initialized Mooncake-style (P2PHANDSHAKE + tcp on 127.0.0.1);
    closed at the end of the test, before the test's host buffers are freed."""
    engines: List[ferry.TransferEngine] = []

    def make(
        hostname: str = "127.0.0.1", metadata: str = "P2PHANDSHAKE", protocol: str = "tcp"
    ) -> ferry.TransferEngine:
        e = ferry.TransferEngine()
        rc = e.initialize(hostname, metadata, protocol, "")
        assert rc == 0, f"initialize failed: {e.last_error()}"
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


@pytest.fixture
def pair(make_engine):
    """Two engines: (initiator, target)."""
    return make_engine(), make_engine()


@pytest.fixture
def silent_peer() -> Iterator[SilentPeer]:
    peer = SilentPeer()
    yield peer
    peer.close()


class HostBuffer:
    """Memory owned by the test (a ctypes array), for register_memory."""

    def __init__(self, size: int, fill: bytes = b"") -> None:
        self.raw = (ctypes.c_ubyte * size)()
        self.addr = ctypes.addressof(self.raw)
        self.size = size
        if fill:
            ctypes.memmove(self.addr, fill, len(fill))

    def bytes(self, offset: int = 0, length: int = -1) -> bytes:
        n = self.size - offset if length < 0 else length
        return ctypes.string_at(self.addr + offset, n)

    def write(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self.addr + offset, data, len(data))


@pytest.fixture
def host_buffer() -> Iterator[Callable[..., HostBuffer]]:
    """Factory of test-owned buffers, kept alive until every engine of the test is closed."""
    keep: List[HostBuffer] = []

    def make(size: int, fill: bytes = b"") -> HostBuffer:
        buf = HostBuffer(size, fill)
        keep.append(buf)
        return buf

    yield make
    keep.clear()


@pytest.fixture
def child_factory():
    """Registers child processes to close at the end of the test."""
    children: List[Child] = []

    def make(child: Child) -> Child:
        children.append(child)
        return child

    yield make
    for c in children:
        c.close()
