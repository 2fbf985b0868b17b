"""Transfers across processes over P2PHANDSHAKE + tcp: Python to Python, Python to the Rust
engine (the `ferry` CLI), Python to Mooncake's PyPI wheel in both directions, and a script
written for Mooncake run unchanged except for its import."""

from __future__ import annotations

import json
import sys

import pytest

from ferry import KvLayout, TransferNotify, TransferOpcode

from _support import PEERS, REPO, Child, ferry_bin, fetch_descriptor, mooncake_python, pattern, python_child, wait_until

MOONCAKE_PEER = REPO / "transports" / "tcp" / "tests" / "interop" / "mooncake_peer.py"


def test_two_python_processes(make_engine, host_buffer, child_factory):
    size = 4 << 20
    child = child_factory(python_child(PEERS / "ferry_peer.py", str(size), "7"))
    info = child.read_json()
    peer, peer_addr = info["segment"], info["addr"]
    me = make_engine()
    my_name = me.get_local_segment_name()
    local = host_buffer(size)
    assert me.register_memory(local.addr, size) == 0

    # We read the child's whole buffer over TCP, then scattered pieces in one batch.
    assert me.transfer_sync_read(peer, local.addr, peer_addr, size) == 0, me.last_error()
    assert local.bytes() == pattern(0, size, 7)
    offsets = [0, 4097, 1 << 20, size - 100]
    assert (
        me.batch_transfer_sync_read(
            peer, [local.addr + i * 8192 for i in range(4)], [peer_addr + o for o in offsets], [100] * 4
        )
        == 0
    )
    for i, o in enumerate(offsets):
        assert local.bytes(i * 8192, 100) == pattern(o, 100, 7)

    # We write (sync and async); the child checks its own memory.
    local.write(0, pattern(0, 65536, 33))
    assert me.transfer_sync_write(peer, local.addr, peer_addr + 4096, 65536) == 0
    assert child.ask("check 4096 65536 33") == "ok"
    local.write(0, pattern(0, 3000, 34))
    bid = me.batch_transfer_async_write(
        peer, [local.addr, local.addr + 1000], [peer_addr + 10, peer_addr + 1010], [1000, 2000]
    )
    assert bid > 0 and me.get_batch_transfer_status([bid]) == 0
    assert child.ask("check 10 3000 34") == "ok"
    assert child.ask("check 10 3000 35").startswith("mismatch"), "the check can fail"

    # The child reads from and writes into our memory; its write carries a notification.
    ours = host_buffer(1 << 20, pattern(0, 1 << 20, 55))
    assert me.register_memory(ours.addr, ours.size) == 0
    reply = json.loads(child.ask(f"read {my_name} {ours.addr + 12345} 500000 {(12345 + 55) % 251}"))
    assert reply == {"rc": 0, "ok": True, "error": ""}
    reply = json.loads(child.ask(f"write {my_name} {ours.addr + 7} 1000 66"))
    assert reply["rc"] == 0, reply
    assert ours.bytes(7, 1000) == pattern(0, 1000, 66)
    got = []
    assert wait_until(lambda: got.extend(me.get_notifies()) or got)
    assert [(n.name, n.msg) for n in got] == [("", "wrote 1000")], "the name the child chose: empty"

    # Notifications the other way.
    me.notify(peer, "hello child")
    assert json.loads(child.ask("notifies")) == [{"name": my_name, "msg": "hello child"}]
    reply = json.loads(child.ask("notify 127.0.0.1:1 nobody"))
    assert reply["rc"] == -1 and "127.0.0.1:1" in reply["error"]


def test_python_engine_with_the_rust_engine(make_engine, host_buffer, child_factory):
    size = 1 << 20
    child = child_factory(
        Child(
            [
                str(ferry_bin()),
                "bench",
                "--mode",
                "target",
                "--metadata_server",
                "P2PHANDSHAKE",
                "--local_server_name",
                "127.0.0.1",
                "--protocol",
                "tcp",
                "--buffer_size",
                str(size),
            ],
            quit=None,
        )
    )
    line = child.readline()
    assert line.startswith("listening on "), line
    peer = line.split()[-1]
    buffers = fetch_descriptor(peer)["buffers"]
    assert len(buffers) == 1 and buffers[0]["length"] == size
    remote = buffers[0]["addr"]
    # The target's buffer: byte 4096*i is i & 0xff, every other byte 0 (cli/src/bench.rs).
    expected = bytearray(size)
    for i in range(size // 4096):
        expected[4096 * i] = i & 0xFF

    e = make_engine()
    local = host_buffer(size)
    assert e.register_memory(local.addr, size) == 0
    assert e.transfer_sync_read(peer, local.addr, remote, size) == 0, e.last_error()
    assert local.bytes() == bytes(expected)

    # Pages 1, 3, 5, ... in one async batch.
    pages = list(range(1, size // 4096, 2))
    bid = e.batch_transfer_async_read(
        peer, [local.addr + p * 4096 for p in pages], [remote + p * 4096 + 0 for p in pages], [4096] * len(pages)
    )
    assert e.get_batch_transfer_status([bid]) == 0

    # Write into the Rust engine's memory, read it back.
    local.write(0, pattern(0, 10_000, 99))
    assert e.transfer_sync(peer, local.addr, remote + 20_000, 10_000, TransferOpcode.Write) == 0
    check = host_buffer(10_000)
    assert e.register_memory(check.addr, check.size) == 0
    assert e.transfer_sync_read(peer, check.addr, remote + 20_000, 10_000) == 0
    assert check.bytes() == pattern(0, 10_000, 99)

    # The KV layer against a layout over the same buffer (4 KiB blocks).
    kv = host_buffer(8 * 4096)
    assert e.register_memory(kv.addr, kv.size) == 0
    e.register_kv_layout(KvLayout([kv.addr], 8, 4096))
    batch = e.transfer_blocks(peer, KvLayout([remote], size // 4096, 4096), [0, 1, 2, 6], [100, 101, 102, 200])
    assert len(batch) == 2
    for lb, rb in [(0, 100), (1, 101), (2, 102), (6, 200)]:
        assert kv.bytes(lb * 4096, 4096) == bytes([rb & 0xFF]) + bytes(4095)
    assert kv.bytes(3 * 4096, 3 * 4096) == bytes(3 * 4096)


def test_ferry_python_and_the_mooncake_wheel(make_engine, host_buffer, child_factory):
    """Ferry (this process) reads and writes a Mooncake engine (its PyPI wheel), and notifies it."""
    size = 8 << 20
    mc = child_factory(Child([str(mooncake_python()), str(MOONCAKE_PEER), "target", str(size), "13"]))
    info = mc.read_json(timeout=120)
    peer, remote = info["segment"], info["addr"]
    e = make_engine()
    local = e.allocate_managed_buffer(size)
    assert local
    # The Mooncake engine's own answer (its first registered buffer: the wheel registers a
    # buffer pool at start, so not `remote`).
    assert e.get_first_buffer_address(peer) == info["first"] != 0
    for n in (1, 7, 4096, 65_537, 1 << 20, size):
        assert e.transfer_sync_read(peer, local, remote, n) == 0, e.last_error()
        assert e.read_bytes_from_buffer(local, n) == pattern(0, n, 13), f"read of {n} bytes"
    for n, seed in ((4096, 50), (1 << 20, 51)):
        assert e.write_bytes_to_buffer(local, pattern(0, n, seed), n) == 0
        assert e.transfer_sync_write(peer, local, remote + 100, n) == 0, e.last_error()
        assert mc.ask(f"check 100 {n} {seed}") == "ok"
    assert e.write_bytes_to_buffer(local, pattern(0, 4096, 60), 4096) == 0
    ids = [
        e.batch_transfer_async_write(peer, [local], [remote + 5 * 4096], [4096]),
        e.batch_transfer_async_read(peer, [local + 4096], [remote], [4096]),
    ]
    assert e.get_batch_transfer_status(ids) == 0
    assert mc.ask(f"check {5 * 4096} 4096 60") == "ok"
    rc = e.transfer_sync(peer, local, remote, 16, TransferOpcode.Read, TransferNotify("prefill-7", "kv ready"))
    assert rc == 0
    notes = json.loads(mc.ask("notifies"))
    assert [(n["name"], n["msg"]) for n in notes] == [("prefill-7", "kv ready")], "the name as the sender chose it"


def test_mooncake_wheel_reads_and_writes_a_ferry_python_engine(make_engine, child_factory):
    size = 2 << 20
    e = make_engine()
    buf = e.allocate_managed_buffer(size)
    assert e.write_bytes_to_buffer(buf, pattern(0, size, 17), size) == 0
    sizes = [1, 4096, 65_537, 1 << 20]
    mc = child_factory(
        Child(
            [
                str(mooncake_python()),
                str(MOONCAKE_PEER),
                "initiator",
                e.get_local_segment_name(),
                str(buf),
                "17",
                str(1 << 20),
                "23",
                *map(str, sizes),
            ]
        )
    )
    result = mc.read_json(timeout=120)
    assert all(r["rc"] == 0 and r["ok"] for r in result["reads"]), result
    assert all(w["rc"] == 0 for w in result["writes"]), result
    # The last (largest) write is what the buffer holds at the write offset.
    assert e.read_bytes_from_buffer(buf + (1 << 20), 1 << 20) == pattern(0, 1 << 20, 23)
    assert e.read_bytes_from_buffer(buf, 1 << 20) == pattern(0, 1 << 20, 17), "bytes before it are untouched"


def test_a_script_written_for_mooncake_runs_on_ferry(tmp_path, child_factory):
    """transports/tcp/tests/interop/mooncake_peer.py with only its import changed serves as a Ferry target that
    Mooncake's own copy of the script (in the wheel's Python) reads, checks and writes."""
    source = MOONCAKE_PEER.read_text()
    old = "from mooncake.engine import TransferEngine"
    assert source.count(old) >= 1
    script = tmp_path / "ferry_as_mooncake_peer.py"
    script.write_text(source.replace(old, "from ferry.engine import TransferEngine"))
    size = 4 << 20
    target = child_factory(Child([sys.executable, str(script), "target", str(size), "31"]))
    info = target.read_json()
    assert info["first"] == info["addr"], "its one buffer, from its own published descriptor"
    sizes = [1, 4096, 1 << 20]
    mc = child_factory(
        Child(
            [
                str(mooncake_python()),
                str(MOONCAKE_PEER),
                "initiator",
                info["segment"],
                str(info["addr"]),
                "31",
                str(2 << 20),
                "37",
                *map(str, sizes),
            ]
        )
    )
    result = mc.read_json(timeout=120)
    assert all(r["rc"] == 0 and r["ok"] for r in result["reads"]), result
    assert all(w["rc"] == 0 for w in result["writes"]), result
    assert target.ask(f"check {2 << 20} {1 << 20} 37") == "ok"
    assert target.ask(f"check {2 << 20} {1 << 20} 38") != "ok"


def test_notifications_and_rpc_port_on_an_http_metadata_server(make_engine, host_buffer, child_factory):
    """Mooncake-style engines on `ferry metadata-server` (HTTP metadata, not P2PHANDSHAKE): each
    runs a handshake listener on the RPC port its rpc entry names, so notifications arrive."""
    import socket
    import urllib.request

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    child_factory(Child([str(ferry_bin()), "metadata-server", "--addr", f"127.0.0.1:{port}"], quit=None))
    url = f"http://127.0.0.1:{port}/metadata"
    assert wait_until(lambda: _answers(f"http://127.0.0.1:{port}/health"), timeout=30)
    a, b = make_engine("127.0.0.1:40201", url), make_engine("127.0.0.1:40202", url)
    for e in (a, b):
        rpc_port = e.get_rpc_port()
        assert rpc_port > 0, e.last_error()
        key = f"mooncake/rpc_meta/{e.get_local_segment_name()}"
        entry = json.loads(urllib.request.urlopen(f"{url}?key={key}", timeout=5).read())
        assert entry == {"ip_or_host_name": "127.0.0.1", "rpc_port": rpc_port}
    src, dst = host_buffer(4096, pattern(0, 4096, 9)), host_buffer(4096)
    assert a.register_memory(src.addr, 4096) == 0
    assert b.register_memory(dst.addr, 4096) == 0
    rc = a.transfer_sync(b.get_local_segment_name(), src.addr, dst.addr, 4096, TransferOpcode.Write, TransferNotify("", "kv-ready"))
    assert rc == 0, a.last_error()
    assert dst.bytes() == src.bytes()
    got = []
    assert wait_until(lambda: got.extend(b.get_notifies()) or got, timeout=10)
    assert [(n.name, n.msg) for n in got] == [("", "kv-ready")]


def _answers(url: str) -> bool:
    import urllib.request

    try:
        return urllib.request.urlopen(url, timeout=1).status == 200
    except OSError:
        return False
