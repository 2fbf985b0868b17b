"""Two engines of one process (P2PHANDSHAKE metadata, tcp protocol) through the Mooncake-style
API: sync, batch sync and async reads and writes, status values, notifications, managed
buffers. Every moved byte is checked."""

from __future__ import annotations

import re

import pytest

import ferry
from ferry import TransferNotify, TransferOpcode

from _support import pattern, wait_until


def test_initialize_names_the_engine_ip_and_rpc_port(pair):
    a, b = pair
    for e in (a, b):
        name = e.get_local_segment_name()
        assert re.fullmatch(r"127\.0\.0\.1:\d+", name), name
        assert int(name.rsplit(":", 1)[1]) == e.get_rpc_port()
        assert e.segment_name == name
    assert a.get_local_segment_name() != b.get_local_segment_name()
    assert ferry.capi_version() == "0.1.0"


def test_sync_read_and_write_move_the_bytes(pair, host_buffer):
    initiator, target = pair
    size = 1 << 20
    remote = host_buffer(size, pattern(0, size, 3))
    local = host_buffer(size)
    assert target.register_memory(remote.addr, size) == 0
    assert initiator.register_memory(local.addr, size, "cpu:0") == 0
    peer = target.get_local_segment_name()

    assert initiator.transfer_sync_read(peer, local.addr, remote.addr, size) == 0
    assert local.bytes() == remote.bytes()

    # A read at an odd offset and length lands exactly where asked.
    assert initiator.transfer_sync_read(peer, local.addr + 5, remote.addr + 4097, 65_537) == 0
    assert local.bytes(5, 65_537) == pattern(4097, 65_537, 3)

    local.write(0, pattern(0, 4096, 77))
    assert initiator.transfer_sync_write(peer, local.addr, remote.addr + 8192, 4096) == 0
    assert remote.bytes(8192, 4096) == pattern(0, 4096, 77)
    assert remote.bytes(0, 8192) == pattern(0, 8192, 3), "bytes around the write are untouched"

    assert initiator.transfer_sync(peer, local.addr, remote.addr, 100, TransferOpcode.Read) == 0
    assert local.bytes(0, 100) == remote.bytes(0, 100)
    assert initiator.transfer_sync(peer, local.addr, remote.addr + 200, 10, TransferOpcode.WRITE) == 0
    assert remote.bytes(200, 10) == local.bytes(0, 10)


def test_batch_sync_read_and_write(pair, host_buffer):
    initiator, target = pair
    remote = host_buffer(64 * 4096, pattern(0, 64 * 4096, 11))
    local = host_buffer(64 * 4096)
    assert target.register_memory(remote.addr, remote.size) == 0
    assert initiator.register_memory(local.addr, local.size) == 0
    peer = target.get_local_segment_name()

    # Gather every other remote block into consecutive local blocks.
    n = 16
    locals_ = [local.addr + i * 4096 for i in range(n)]
    remotes = [remote.addr + 2 * i * 4096 for i in range(n)]
    assert initiator.batch_transfer_sync_read(peer, locals_, remotes, [4096] * n) == 0
    for i in range(n):
        assert local.bytes(i * 4096, 4096) == pattern(2 * i * 4096, 4096, 11), f"block {i}"

    for i in range(n):
        local.write(i * 4096, pattern(0, 4096, 100 + i))
    targets = [remote.addr + (40 + i) * 4096 for i in range(n)]
    assert initiator.batch_transfer_sync_write(peer, locals_, targets, [4096] * n) == 0
    for i in range(n):
        assert remote.bytes((40 + i) * 4096, 4096) == pattern(0, 4096, 100 + i)

    assert initiator.batch_transfer_sync(peer, [local.addr], [remote.addr], [64], TransferOpcode.Read) == 0
    assert local.bytes(0, 64) == remote.bytes(0, 64)
    # Numpy-style integer types and tuples are accepted like Python ints and lists.
    assert initiator.batch_transfer_sync_read(peer, (local.addr,), (remote.addr,), (True,)) == 0


def test_async_batches_and_status_values(pair, host_buffer):
    initiator, target = pair
    size = 256 * 1024
    remote = host_buffer(size, pattern(0, size, 5))
    local = host_buffer(size)
    assert target.register_memory(remote.addr, size) == 0
    assert initiator.register_memory(local.addr, size) == 0
    peer = target.get_local_segment_name()

    ids = [
        initiator.batch_transfer_async_read(peer, [local.addr], [remote.addr], [size // 2]),
        initiator.batch_transfer_async_read(peer, [local.addr + size // 2], [remote.addr + size // 2], [size // 2]),
    ]
    assert all(i > 0 for i in ids) and ids[0] != ids[1]
    assert initiator.get_batch_transfer_status(ids) == 0
    assert local.bytes() == remote.bytes()
    # The ids were released by get_batch_transfer_status.
    assert initiator.get_batch_transfer_status([ids[0]]) == -1
    assert "unknown batch id" in initiator.last_error()

    local.write(0, pattern(0, 4096, 9))
    bid = initiator.batch_transfer_async_write(peer, [local.addr], [remote.addr + 4096], [4096])
    assert bid > 0 and initiator.get_batch_transfer_status([bid]) == 0
    assert remote.bytes(4096, 4096) == pattern(0, 4096, 9)

    bid = initiator.batch_transfer_async(peer, [local.addr], [remote.addr], [4096], TransferOpcode.Read)
    assert initiator.get_batch_transfer_status([bid]) == 0
    assert initiator.get_batch_transfer_status([]) == 0

    # transfer_submit_write + transfer_check_status: 0 while running, 1 once, then unknown (-1).
    local.write(0, pattern(0, 1000, 42))
    bid = initiator.transfer_submit_write(peer, local.addr, remote.addr + 3, 1000)
    assert bid > 0
    seen = []
    assert wait_until(lambda: seen.append(initiator.transfer_check_status(bid)) or seen[-1] != 0)
    assert seen[-1] == 1 and set(seen) <= {0, 1}
    assert remote.bytes(3, 1000) == pattern(0, 1000, 42)
    assert initiator.transfer_check_status(bid) == -1
    assert "unknown batch id" in initiator.last_error()


def test_failed_async_transfers_report_minus_one(pair, host_buffer):
    initiator, target = pair
    remote = host_buffer(4096)
    local = host_buffer(4096)
    assert target.register_memory(remote.addr, 4096) == 0
    assert initiator.register_memory(local.addr, 4096) == 0
    peer = target.get_local_segment_name()
    # Outside the peer's buffer: refused at submit (Mooncake: batch id 0 / -1).
    assert initiator.batch_transfer_async_read(peer, [local.addr], [remote.addr + 4096], [16]) == 0
    assert "not inside any buffer" in initiator.last_error()
    assert initiator.transfer_submit_write(peer, local.addr, remote.addr + 4096, 16) == 0  # Mooncake's sentinel
    # One good and one unknown id: the good one is waited for and released, the result is -1.
    good = initiator.batch_transfer_async_read(peer, [local.addr], [remote.addr], [16])
    assert initiator.get_batch_transfer_status([good, 987654321]) == -1
    assert initiator.transfer_check_status(good) == -1


def test_zero_length_and_empty_batches_succeed_like_mooncake(pair, host_buffer):
    initiator, target = pair
    remote, local = host_buffer(64), host_buffer(64)
    assert target.register_memory(remote.addr, 64) == 0
    assert initiator.register_memory(local.addr, 64) == 0
    peer = target.get_local_segment_name()
    assert initiator.transfer_sync_read(peer, local.addr, remote.addr, 0) == 0
    assert initiator.batch_transfer_sync_write(peer, [], [], []) == 0
    bid = initiator.batch_transfer_async_read(peer, [], [], [])
    assert bid > 0 and initiator.transfer_check_status(bid) == 1


def test_managed_buffers_and_byte_helpers(pair):
    initiator, target = pair
    size = 3 << 20
    src = target.allocate_managed_buffer(size)
    dst = initiator.allocate_managed_buffer(size)
    assert src and dst and src % 4096 == 0
    assert target.read_bytes_from_buffer(src, 4096) == bytes(4096), "managed buffers start zeroed"
    data = pattern(0, size, 21)
    assert target.write_bytes_to_buffer(src, data, size) == 0
    assert target.write_bytes_to_buffer(src + 10, bytearray(b"xyz"), 3) == 0
    assert target.write_bytes_to_buffer(src + 20, "héllo", 2) == 0  # str is written as UTF-8
    assert initiator.transfer_sync_read(target.get_local_segment_name(), dst, src, size) == 0
    got = initiator.read_bytes_from_buffer(dst, size)
    assert got[:10] == data[:10] and got[10:13] == b"xyz" and got[20:22] == "héllo".encode()[:2]
    assert got[22:] == data[22:]
    assert initiator.read_bytes_from_buffer(dst, 0) == b""
    # The buffer is registered: registering it again overlaps (Mooncake's -7).
    assert initiator.register_memory(dst, 4096) == -7
    assert initiator.free_managed_buffer(dst, size) == 0
    assert initiator.free_managed_buffer(dst, size) == -1
    assert "not a managed buffer" in initiator.last_error()
    # Freed means unregistered: the range can be registered again... but it is unmapped now,
    # so only check that the engine forgot it.
    assert initiator.unregister_memory(dst) == -3
    tiny = initiator.allocate_managed_buffer(0)
    assert tiny and initiator.free_managed_buffer(tiny, 0) == 0


def test_register_and_unregister_in_batches(make_engine, host_buffer):
    e = make_engine()
    bufs = [host_buffer(4096) for _ in range(3)]
    assert e.batch_register_memory([b.addr for b in bufs], [4096] * 3) == 0
    assert e.batch_unregister_memory([b.addr for b in bufs]) == 0
    # A failure rolls back what the call registered: afterwards all three are free again.
    assert e.register_memory(bufs[2].addr, 4096) == 0
    assert e.batch_register_memory([b.addr for b in bufs], [4096] * 3, "*") == -7
    assert "overlaps" in e.last_error()
    assert e.unregister_memory(bufs[0].addr) == -3
    assert e.batch_unregister_memory([bufs[2].addr, bufs[1].addr]) == -3
    assert e.unregister_memory(bufs[2].addr) == -3, "the batch call unregistered what it could"


def test_notifications_carry_the_sender_and_arrive_after_the_data(pair, host_buffer):
    initiator, target = pair
    remote, local = host_buffer(4096), host_buffer(4096, pattern(0, 4096, 8))
    assert target.register_memory(remote.addr, 4096) == 0
    assert initiator.register_memory(local.addr, 4096) == 0
    peer = target.get_local_segment_name()
    assert target.get_notifies() == []

    rc = initiator.transfer_sync(
        peer, local.addr, remote.addr, 4096, TransferOpcode.Write, TransferNotify("req-1", "done:1")
    )
    assert rc == 0
    assert remote.bytes() == local.bytes(), "the data landed before the notification"
    rc = initiator.batch_transfer_sync(
        peer, [local.addr], [remote.addr], [16], TransferOpcode.Read, notify=TransferNotify("req-2", "done:2")
    )
    assert rc == 0
    initiator.notify(peer, "plain")
    got = target.get_notifies()
    assert [n.msg for n in got] == ["done:1", "done:2", "plain"]
    # The name the sender chose travels as given (as in Mooncake); notify() sends the sender's
    # segment name.
    assert [n.name for n in got] == ["req-1", "req-2", initiator.get_local_segment_name()]
    assert got[0].notify_msg == "done:1" and isinstance(got[0], TransferNotify)
    assert target.get_notifies() == [], "draining empties the queue"

    # A notification to nobody fails: -1 from the Mooncake-style call, an exception from notify().
    assert initiator.transfer_sync(peer, local.addr, remote.addr, 16, TransferOpcode.Read, TransferNotify("", "x")) == 0
    target.get_notifies()
    with pytest.raises(ferry.PeerUnreachableError) as info:
        initiator.notify("127.0.0.1:1", "nobody")
    assert "127.0.0.1:1" in str(info.value) and info.value.code == -1


def test_close_is_idempotent_and_later_calls_fail_cleanly(make_engine, host_buffer):
    e = make_engine()
    buf = host_buffer(4096)
    assert e.register_memory(buf.addr, 4096) == 0
    e.close()
    e.close()
    assert e.register_memory(buf.addr, 4096) == -202
    assert e.transfer_sync_read("127.0.0.1:1", buf.addr, 0, 1) == -1
    assert "not initialized" in e.last_error()
    assert e.get_rpc_port() == -1
    assert e.batch_transfer_async_read("x", [buf.addr], [1], [1]) == 0
    assert e.get_notifies() == []
    with pytest.raises(ferry.ShutdownError):
        e.get_local_segment_name()
    with ferry.TransferEngine() as scoped:
        assert scoped.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert scoped.get_rpc_port() > 0
    assert scoped.get_rpc_port() == -1


def test_engines_on_the_embedded_store_and_from_config(host_buffer):
    # metadata_server "" selects Ferry's in-process store (a Ferry extension); protocol local.
    a = ferry.TransferEngine.from_config(None)
    b = ferry.TransferEngine()
    try:
        assert b.initialize("", "", "local", "") == 0
        src, dst = host_buffer(1000, pattern(0, 1000, 1)), host_buffer(1000)
        assert a.register_memory(src.addr, 1000) == 0
        assert b.register_memory(dst.addr, 1000) == 0
        assert b.transfer_sync_read(a.get_local_segment_name(), dst.addr, src.addr, 1000) == 0
        assert dst.bytes() == src.bytes()
        assert a.get_rpc_port() == -1, "an engine without host:port name has no RPC port"
        assert "not host:port" in a.last_error()
    finally:
        a.close()
        b.close()


def test_get_first_buffer_address_finds_the_peers_buffer(pair, host_buffer):
    initiator, target = pair
    remote = host_buffer(64 * 1024, pattern(0, 64 * 1024, 5))
    local = host_buffer(4096)
    assert target.register_memory(remote.addr, remote.size) == 0
    assert initiator.register_memory(local.addr, local.size) == 0
    peer = target.get_local_segment_name()
    # The Mooncake pattern: learn the remote address from the segment, then read from it.
    first = initiator.get_first_buffer_address(peer)
    assert first == remote.addr
    assert initiator.transfer_sync_read(peer, local.addr, first + 4096, 4096) == 0
    assert local.bytes() == pattern(4096, 4096, 5)

    assert initiator.get_first_buffer_address("127.0.0.1:1") == 0, "no such segment"
    assert "get_first_buffer_address" in initiator.last_error() and "127.0.0.1:1" in initiator.last_error()
    assert target.get_first_buffer_address(initiator.get_local_segment_name()) == local.addr
    with pytest.raises(TypeError):
        initiator.get_first_buffer_address(1234)


def test_get_first_buffer_address_follows_registration_order_and_is_live_for_itself(pair, host_buffer):
    initiator, target = pair
    me = target.get_local_segment_name()
    assert target.get_first_buffer_address(me) == 0, "nothing registered yet"
    low, high = sorted([host_buffer(4096), host_buffer(4096)], key=lambda b: b.addr)
    assert target.register_memory(high.addr, high.size) == 0
    assert target.register_memory(low.addr, low.size) == 0
    assert target.get_first_buffer_address(me) == high.addr, "the first registered, not the lowest"
    assert initiator.get_first_buffer_address(me) == high.addr
    assert target.unregister_memory(high.addr) == 0
    assert target.get_first_buffer_address(me) == low.addr
