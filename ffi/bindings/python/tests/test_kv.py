"""The Pythonic KV-block layer: KvLayout, register_kv_layout, transfer_blocks, Batch."""

from __future__ import annotations

import pytest

import ferry
from ferry import KvLayout, TransferState

from _support import pattern

BLOCKS = 16
BLOCK_LEN = 512
REGIONS = 3  # e.g. layer 0 K, layer 0 V, layer 1 K


@pytest.fixture
def caches(pair, host_buffer):
    """(decode engine, its layout, prefill engine's segment, prefill's layout, local regions,
    remote regions). Remote region r, block b holds pattern seed 10*r + b."""
    decode, prefill = pair
    remote = []
    for r in range(REGIONS):
        buf = host_buffer(BLOCKS * BLOCK_LEN)
        for b in range(BLOCKS):
            buf.write(b * BLOCK_LEN, pattern(0, BLOCK_LEN, 10 * r + b))
        assert prefill.register_memory(buf.addr, buf.size) == 0
        remote.append(buf)
    local = [host_buffer(BLOCKS * BLOCK_LEN) for _ in range(REGIONS)]
    for buf in local:
        assert decode.register_memory(buf.addr, buf.size) == 0
    layout = decode.register_kv_layout(KvLayout([b.addr for b in local], BLOCKS, BLOCK_LEN))
    remote_layout = KvLayout([b.addr for b in remote], BLOCKS, BLOCK_LEN)
    return decode, layout, prefill.get_local_segment_name(), remote_layout, local, remote


def block(buf, b):
    return buf.bytes(b * BLOCK_LEN, BLOCK_LEN)


def test_read_selected_blocks_and_only_those(caches):
    decode, layout, peer, remote_layout, local, remote = caches
    batch = decode.transfer_blocks(peer, remote_layout, [0, 1, 2, 9], [5, 6, 7, 3], op="read")
    # Contiguous pairs merge: (0..2 <- 5..7) is one run, (9 <- 3) another; per region.
    assert len(batch) == 2 * REGIONS
    assert [s.state for s in batch.status()] == [TransferState.COMPLETED] * len(batch)
    assert sum(s.transferred for s in batch.status()) == 4 * BLOCK_LEN * REGIONS
    assert batch.done() and batch.pending() == 0 and batch.failed_blocks() == []
    for r in range(REGIONS):
        for lb, rb in [(0, 5), (1, 6), (2, 7), (9, 3)]:
            assert block(local[r], lb) == pattern(0, BLOCK_LEN, 10 * r + rb), f"region {r} block {lb}"
        for lb in set(range(BLOCKS)) - {0, 1, 2, 9}:
            assert block(local[r], lb) == bytes(BLOCK_LEN), f"region {r} block {lb} must stay untouched"
    batch.free()
    batch.free()
    with pytest.raises(ferry.NotFoundError):
        batch.status()


def test_write_blocks_without_waiting(caches):
    decode, layout, peer, remote_layout, local, remote = caches
    for r in range(REGIONS):
        local[r].write(4 * BLOCK_LEN, pattern(0, BLOCK_LEN, 200 + r))
    with decode.transfer_blocks(
        peer, remote_layout, [4], [15], op=ferry.TransferOpcode.Write, wait=False, local_layout=layout
    ) as batch:
        for bad in (float("inf"), float("nan"), -1, 0, 1e30):
            with pytest.raises(ValueError):
                batch.wait(timeout=bad)
        batch.wait(timeout=10)
        assert len(batch) == REGIONS and batch.done()
    for r in range(REGIONS):
        assert block(remote[r], 15) == pattern(0, BLOCK_LEN, 200 + r)
        assert block(remote[r], 14) == pattern(0, BLOCK_LEN, 10 * r + 14)


def test_block_errors_raise_ferry_errors_with_messages(caches):
    decode, layout, peer, remote_layout, local, remote = caches
    with pytest.raises(ferry.OutOfBoundsError) as info:
        decode.transfer_blocks(peer, remote_layout, [0], [BLOCKS])
    assert f"block id {BLOCKS}" in str(info.value)
    with pytest.raises(ferry.InvalidArgumentError) as info:
        decode.transfer_blocks(peer, remote_layout, [1, 1], [2, 3], op="read")
    assert "more than once" in str(info.value)
    with pytest.raises(ferry.InvalidArgumentError) as info:
        decode.transfer_blocks(peer, KvLayout(remote_layout.bases[:1], BLOCKS, BLOCK_LEN), [0], [0])
    assert "regions" in str(info.value)
    with pytest.raises(ferry.OutOfBoundsError):
        decode.transfer_blocks(peer, KvLayout([b + 1 for b in remote_layout.bases], BLOCKS, BLOCK_LEN), [0], [15])
    with pytest.raises(ferry.PeerUnreachableError):
        decode.transfer_blocks("127.0.0.1:1", remote_layout, [0], [0])
    with pytest.raises(ValueError):
        decode.transfer_blocks(peer, remote_layout, [0, 1], [0])
    with pytest.raises(ValueError):
        decode.transfer_blocks(peer, remote_layout, [], [])
    with pytest.raises(ValueError):
        decode.transfer_blocks(peer, remote_layout, [0], [0], op="sideways")
    with pytest.raises(ValueError):
        decode.transfer_blocks(peer, remote_layout, [-1], [0])
    with pytest.raises(TypeError):
        decode.transfer_blocks(peer, list(remote_layout.bases), [0], [0])
    assert "transfer_blocks" in decode.last_error()


def test_layout_registration(make_engine, host_buffer):
    e = make_engine()
    buf = host_buffer(8 * 64)
    with pytest.raises(ferry.NotFoundError) as info:
        e.transfer_blocks(e.get_local_segment_name(), KvLayout([buf.addr], 8, 64), [0], [1])
    assert "register_kv_layout" in str(info.value)
    with pytest.raises(ferry.FerryError) as info:
        e.register_kv_layout(KvLayout([buf.addr], 8, 64))  # its memory is not registered
    assert info.value.code != 0 and info.value.message
    assert e.register_memory(buf.addr, buf.size) == 0
    first = e.register_kv_layout(KvLayout([buf.addr], 4, 64))
    second = e.register_kv_layout(KvLayout([buf.addr + 256], 4, 64))
    assert first.id != second.id and second.layout.block_addr(0, 3) == buf.addr + 256 + 3 * 64
    with pytest.raises(ValueError) as info:
        e.transfer_blocks(e.get_local_segment_name(), first.layout, [0], [1])
    assert "local_layout=" in str(info.value)
    # Blocks 0..3 of the first layout copied onto blocks 0..3 of the second, same engine.
    buf.write(0, pattern(0, 256, 4))
    e.transfer_blocks(
        e.get_local_segment_name(), second.layout, [0, 1, 2, 3], [0, 1, 2, 3], op="write", local_layout=first
    )
    assert buf.bytes(256, 256) == pattern(0, 256, 4)
    e.unregister_kv_layout(first)
    with pytest.raises(ferry.NotFoundError):
        e.unregister_kv_layout(first)
    assert KvLayout([buf.addr], 4, 64) == KvLayout((buf.addr,), 4, 64)
    assert KvLayout([1, 2], 3, 4).region_len == 12


def test_a_published_layout_is_read_by_name_and_one_layer_moves_alone(pair, host_buffer):
    decode, prefill = pair
    remote = []
    for r in range(REGIONS):
        buf = host_buffer(BLOCKS * BLOCK_LEN)
        for b in range(BLOCKS):
            buf.write(b * BLOCK_LEN, pattern(0, BLOCK_LEN, 10 * r + b))
        assert prefill.register_memory(buf.addr, buf.size) == 0
        remote.append(buf)
    local = [host_buffer(BLOCKS * BLOCK_LEN) for _ in range(REGIONS)]
    for buf in local:
        assert decode.register_memory(buf.addr, buf.size) == 0
    decode.register_kv_layout(KvLayout([b.addr for b in local], BLOCKS, BLOCK_LEN))
    peer = prefill.get_local_segment_name()

    published = prefill.publish_kv_layout("kv", KvLayout([b.addr for b in remote], BLOCKS, BLOCK_LEN))
    with pytest.raises(ferry.AlreadyExistsError):
        prefill.publish_kv_layout("kv", published.layout)
    fetched = decode.remote_kv_layout(peer, "kv")
    assert fetched == published.layout
    with pytest.raises(ferry.NotFoundError) as info:
        decode.remote_kv_layout(peer, "draft")
    assert "(it publishes: kv)" in str(info.value)

    # Region 2 only (say, layer 1's K): blocks 3, 4 into 0, 1.
    batch = decode.transfer_blocks(peer, fetched, [0, 1], [3, 4], regions=[2])
    assert len(batch) == 1
    assert block(local[2], 0) == pattern(0, BLOCK_LEN, 23) and block(local[2], 1) == pattern(0, BLOCK_LEN, 24)
    for r in (0, 1):
        assert local[r].bytes(0, 2 * BLOCK_LEN) == bytes(2 * BLOCK_LEN), f"region {r} was not asked for"
    with pytest.raises(ferry.OutOfBoundsError) as info:
        decode.transfer_blocks(peer, fetched, [0], [3], regions=[REGIONS])
    assert "region subset" in str(info.value)
    with pytest.raises(ValueError):
        decode.transfer_blocks(peer, fetched, [0], [3], regions=[])
    prefill.unregister_kv_layout(published)
