"""Bad arguments raise TypeError / ValueError; failures return Mooncake's codes and keep the
library's readable message reachable (last_error(), the `ferry` logger, FerryError)."""

from __future__ import annotations

import logging

import pytest

import ferry
from ferry import TransferNotify, TransferOpcode

PEER = "127.0.0.1:1"  # nothing listens on port 1


@pytest.fixture
def engine(make_engine, host_buffer):
    e = make_engine()
    buf = host_buffer(4096)
    assert e.register_memory(buf.addr, 4096) == 0
    e.buf = buf
    return e


@pytest.mark.parametrize(
    "call",
    [
        lambda e: e.transfer_sync_read(12, e.buf.addr, 0, 1),
        lambda e: e.transfer_sync_read(None, e.buf.addr, 0, 1),
        lambda e: e.transfer_sync_read(PEER, "0x1000", 0, 1),
        lambda e: e.transfer_sync_write(PEER, e.buf.addr, 1.5, 1),
        lambda e: e.transfer_sync_write(PEER, e.buf.addr, 0, b"1"),
        lambda e: e.transfer_sync(PEER, e.buf.addr, 0, 1, TransferOpcode.Read, notify="msg"),
        lambda e: e.transfer_sync(PEER, e.buf.addr, 0, 1, 0.0),
        lambda e: e.transfer_sync_read(PEER, e.buf.addr, 0, 1, transport_hint=None),
        lambda e: e.batch_transfer_sync_read(PEER, e.buf.addr, [0], [1]),
        lambda e: e.batch_transfer_sync_write(PEER, [e.buf.addr], "0", [1]),
        lambda e: e.batch_transfer_async_read(PEER, [e.buf.addr], [0], ["1"]),
        lambda e: e.batch_transfer_async_write(PEER, [e.buf.addr], [None], [1]),
        lambda e: e.register_memory("addr", 16),
        lambda e: e.register_memory(e.buf.addr, 16, location=0),
        lambda e: e.unregister_memory([e.buf.addr]),
        lambda e: e.batch_register_memory({1: 2}, [16]),
        lambda e: e.get_batch_transfer_status(7),
        lambda e: e.transfer_check_status("7"),
        lambda e: e.write_bytes_to_buffer(e.buf.addr, 1234, 4),
        lambda e: e.read_bytes_from_buffer(e.buf.addr, 1.0),
        lambda e: e.allocate_managed_buffer("1MiB"),
        lambda e: e.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", None),
        lambda e: ferry.TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", None, ""),
        lambda e: ferry.TransferEngine.from_config(42),
        lambda e: e.register_kv_layout((e.buf.addr,)),
        lambda e: ferry.KvLayout("ab", 1, 1),
        lambda e: ferry.KvLayout([e.buf.addr], 1.0, 1),
        lambda e: TransferNotify(1, "x"),
    ],
)
def test_wrong_types_raise_type_error(engine, call):
    with pytest.raises(TypeError):
        call(engine)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda e: e.transfer_sync_read(PEER, e.buf.addr, 0, -1), "negative"),
        (lambda e: e.transfer_sync_write(PEER, -e.buf.addr, 0, 1), "negative"),
        (lambda e: e.transfer_sync_read(PEER, e.buf.addr, 1 << 64, 1), "at most"),
        (lambda e: e.transfer_sync_read("127.0.0.1:1\0", e.buf.addr, 0, 1), "NUL"),
        (lambda e: e.transfer_sync(PEER, e.buf.addr, 0, 1, 2), "TransferOpcode"),
        (lambda e: e.batch_transfer_sync_read(PEER, [e.buf.addr], [0, 1], [1]), "differ in length"),
        (lambda e: e.batch_transfer_sync_write(PEER, [e.buf.addr], [0], [1, 2]), "differ in length"),
        (lambda e: e.batch_transfer_async_read(PEER, [], [0], []), "differ in length"),
        (lambda e: e.batch_transfer_async(PEER, [e.buf.addr], [0], [-5], TransferOpcode.Write), "negative"),
        (lambda e: e.batch_register_memory([e.buf.addr], [16, 16]), "differ in length"),
        (lambda e: e.register_memory(e.buf.addr, -16), "negative"),
        (lambda e: e.write_bytes_to_buffer(e.buf.addr, b"ab", 3), "exceeds"),
        (lambda e: e.read_bytes_from_buffer(e.buf.addr, -1), "negative"),
        (lambda e: e.get_batch_transfer_status([-1]), "negative"),
        (lambda e: ferry.KvLayout([], 4, 64), "at least one"),
        (lambda e: ferry.KvLayout([1], 0, 64), "positive"),
        (lambda e: ferry.KvLayout([1], 1 << 32, 64), "at most"),
        (lambda e: ferry.KvLayout([(1 << 64) - 4096], 2, 4096), "wraps"),
    ],
)
def test_invalid_values_raise_value_error(engine, call, words):
    with pytest.raises(ValueError) as info:
        call(engine)
    assert words in str(info.value)


def test_transfer_failures_return_minus_one_with_a_readable_message(engine, caplog):
    e = engine
    with caplog.at_level(logging.DEBUG, logger="ferry"):
        assert e.transfer_sync_read(PEER, e.buf.addr, 0x1000, 16) == -1
    assert e.last_error().startswith("transfer_sync_read: peer_unreachable:"), e.last_error()
    assert "127.0.0.1:1" in e.last_error()
    assert e.last_error_code() == -1  # FERRY_E_PEER_UNREACHABLE
    assert any("127.0.0.1:1" in r.getMessage() for r in caplog.records), "failures are logged at debug level"
    assert e.batch_transfer_sync_write(PEER, [e.buf.addr], [0x1000], [16]) == -1
    assert e.batch_transfer_async_read(PEER, [e.buf.addr], [0x1000], [16]) == 0
    assert e.transfer_submit_write(PEER, e.buf.addr, 0x1000, 16) == 0, "Mooncake's failure sentinel"
    assert e.transfer_check_status(12345) == -1
    assert "unknown batch id 12345" in e.last_error()

    # The engine's own segment, but a local range it never registered: refused, and said at
    # WARNING level (callers such as SGLang only debug-log a failed registration), naming the
    # address and how to register it.
    me = e.get_local_segment_name()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ferry"):
        assert e.transfer_sync_read(me, 0x1000, e.buf.addr, 16) == -1
    assert "out_of_bounds" in e.last_error() and e.last_error_code() == -4
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "0x1000" in warned[0] and "never registered" in warned[0] and "register_memory(" in warned[0], warned


def test_registration_failures_return_mooncake_error_codes(engine):
    e = engine
    assert e.register_memory(e.buf.addr, 4096) == -7  # ERR_ADDRESS_OVERLAPPED
    assert "overlaps" in e.last_error()
    assert e.register_memory(1 << 40, 0) == -1  # ERR_INVALID_ARGUMENT
    assert "length" in e.last_error()
    assert e.register_memory(1 << 40, 16, "gpu-of-the-future:0") == -1
    assert e.unregister_memory(0x1234) == -3  # ERR_ADDRESS_NOT_REGISTERED
    assert "0x1234" in e.last_error()
    assert e.write_bytes_to_buffer(0x1234, b"x", 1) == -3
    with pytest.raises(ferry.OutOfBoundsError) as info:
        e.read_bytes_from_buffer(e.buf.addr + 4000, 200)
    assert isinstance(info.value, ValueError) and "not inside memory registered" in str(info.value)
    assert e.free_managed_buffer(e.buf.addr, 4096) == -1


def test_initialize_failures_return_minus_one(make_engine):
    e = ferry.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "carrier-pigeon", "") == -1
    assert "carrier-pigeon" in e.last_error() and e.last_error_code() == -7  # FERRY_E_CONFIG
    assert e.initialize("127.0.0.1", "gopher://x", "tcp", "") == -1
    assert "gopher" in e.last_error()
    assert e.initialize_ext("127.0.0.1", "127.0.0.1:1", "tcp", "", "zookeeper") == -1
    assert e.get_rpc_port() == -1
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    e.close()
    # initialize_ext with metadata type p2p means P2PHANDSHAKE.
    assert e.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p") == 0
    e.close()


def test_pythonic_errors_carry_code_and_message():
    with pytest.raises(ferry.ConfigError) as info:
        ferry.TransferEngine.from_config('{"protocol": "tcp",, }')
    assert info.value.code == -7 and "line 1" in info.value.message
    with pytest.raises(ferry.ConfigError) as info:
        ferry.TransferEngine.from_config({"metadata_server": "P2PHANDSHAKE", "transfer_timeout_ms": "soon"})
    assert "transfer_timeout_ms" in str(info.value)
    with pytest.raises(ferry.ConfigError) as info:
        ferry.TransferEngine.from_file("/nonexistent/mooncake.json")
    assert "/nonexistent/mooncake.json" in str(info.value)
    assert issubclass(ferry.TransferTimeoutError, TimeoutError)
    assert issubclass(ferry.PeerUnreachableError, ConnectionError)
    assert issubclass(ferry.InvalidArgumentError, ValueError)
    assert all(issubclass(c, ferry.FerryError) for c in (ferry.BusyError, ferry.NotFoundError, ferry.InternalError))


def test_last_error_is_per_thread(engine):
    import threading

    seen = {}

    def worker():
        seen["before"] = engine.last_error()
        engine.unregister_memory(0x42)
        seen["after"] = engine.last_error()

    assert engine.transfer_sync_read(PEER, engine.buf.addr, 0, 1) == -1
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["before"] == "" and "0x42" in seen["after"]
    assert "peer_unreachable" in engine.last_error(), "the other thread's failure did not overwrite ours"
