"""TransferEngine.get_stats(): the engine's counters as a dict, through ferry_engine_stats."""

from __future__ import annotations

import pytest

import ferry
from ferry import TransferOpcode

from _support import pattern


def test_get_stats_counts_requests_bytes_failures_and_memory(pair, host_buffer):
    initiator, target = pair
    fresh = initiator.get_stats()
    assert fresh["segment"] == initiator.get_local_segment_name()
    assert fresh["transfers"] == [] and fresh["open_segments"] == 0
    assert fresh["batch_latency"]["count"] == 0
    assert set(fresh["failures"]) >= {"timeout", "peer_unreachable", "out_of_bounds"}
    assert all(n == 0 for n in fresh["failures"].values())

    size = 64 * 1024
    remote = host_buffer(size, pattern(0, size, 5))
    local = host_buffer(size)
    assert target.register_memory(remote.addr, size) == 0
    assert initiator.register_memory(local.addr, size) == 0
    peer = target.get_local_segment_name()
    for _ in range(3):
        assert initiator.transfer_sync_read(peer, local.addr, remote.addr, 4096) == 0
    assert initiator.transfer_sync_write(peer, local.addr, remote.addr, 100) == 0
    # Past the end of the peer's buffer: refused before anything starts.
    assert initiator.transfer_sync(peer, local.addr, remote.addr + size, 8, TransferOpcode.Read) != 0

    s = initiator.get_stats()
    routes = {(t["peer"], t["opcode"]): t for t in s["transfers"]}
    read, write = routes[(peer, "read")], routes[(peer, "write")]
    assert read["transport"] in ("local", "tcp")
    assert (read["requests"], read["bytes"], read["failed_requests"]) == (3, 3 * 4096, 0)
    assert (write["requests"], write["bytes"]) == (1, 100)
    assert s["rejected_submissions"]["out_of_bounds"] == 1
    assert s["open_segments"] == 1
    assert (s["registered_bytes"], s["registered_regions"]) == (size, 1)
    lat = s["batch_latency"]
    assert lat["count"] == 4
    assert 0 < lat["p50_us"] <= lat["p90_us"] <= lat["p99_us"] <= lat["p999_us"]
    assert lat["max_us"] > 0 and lat["sum_seconds"] > 0
    assert lat["buckets"][-1]["count"] <= 4
    # The target initiated nothing: it only counts its memory.
    t = target.get_stats()
    assert t["transfers"] == [] and t["registered_bytes"] == size


def test_get_stats_of_a_closed_engine_raises(make_engine):
    e = make_engine()
    e.close()
    with pytest.raises(ferry.FerryError):
        e.get_stats()
