"""Waiting never holds the GIL, and a peer that never answers fails transfers within the
configured timeout (FERRY_TRANSFER_TIMEOUT_MS) with Mooncake's status values."""

from __future__ import annotations

import threading
import time

import pytest

import ferry
from ferry import KvLayout, TransferState

TIMEOUT_MS = 1000


@pytest.fixture
def engine(monkeypatch, make_engine, host_buffer):
    # Read by ferry_engine_create (the C side applies the FERRY_* environment overrides).
    monkeypatch.setenv("FERRY_TRANSFER_TIMEOUT_MS", str(TIMEOUT_MS))
    e = make_engine()
    e.buf = host_buffer(1 << 16)
    assert e.register_memory(e.buf.addr, e.buf.size) == 0
    return e


class Counter:
    """A Python thread that counts as fast as it can while running."""

    def __init__(self) -> None:
        self.n = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.n += 1

    def __enter__(self) -> Counter:
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def counted(fn):
    """Runs fn() on this thread while a Counter runs; returns (result, seconds, increments)."""
    with Counter() as c:
        start, before = time.monotonic(), c.n
        result = fn()
        seconds, increments = time.monotonic() - start, c.n - before
    return result, seconds, increments


def baseline_rate() -> float:
    """Increments per second the counter manages while this thread merely sleeps (GIL free)."""
    _, seconds, increments = counted(lambda: time.sleep(0.3))
    return increments / seconds


def test_a_sync_transfer_to_a_silent_peer_waits_without_the_gil(engine, silent_peer):
    rate = baseline_rate()
    rc, seconds, increments = counted(
        lambda: engine.transfer_sync_read(silent_peer.segment, engine.buf.addr, silent_peer.addr, 4096)
    )
    assert rc == -1
    assert "timeout" in engine.last_error().lower(), engine.last_error()
    assert TIMEOUT_MS / 1000 * 0.8 <= seconds < 5, f"failed after {seconds:.2f} s, configured {TIMEOUT_MS} ms"
    # A call holding the GIL for ~1 s leaves the counter at 0 (measured with ctypes.PyDLL);
    # released, the counter keeps most of its free-running rate.
    assert increments > 0.1 * rate * seconds, f"{increments} increments in {seconds:.2f} s (free rate {rate:.0f}/s)"


def test_waiting_on_async_batches_releases_the_gil_and_reports_timeouts(engine, silent_peer):
    rate = baseline_rate()
    bid = engine.batch_transfer_async_read(silent_peer.segment, [engine.buf.addr], [silent_peer.addr], [4096])
    assert bid > 0
    rc, seconds, increments = counted(lambda: engine.get_batch_transfer_status([bid]))
    assert rc == -1 and "timeout" in engine.last_error().lower()
    assert increments > 0.1 * rate * seconds

    # transfer_check_status: 0 while pending, then -2 (timed out) — repeatedly, as Mooncake does.
    bid = engine.transfer_submit_write(silent_peer.segment, engine.buf.addr, silent_peer.addr, 16)
    assert engine.transfer_check_status(bid) == 0
    deadline = time.monotonic() + 10
    while (status := engine.transfer_check_status(bid)) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert status == -2 and engine.transfer_check_status(bid) == -2


def test_block_batches_time_out_per_block_and_can_be_cancelled(engine, silent_peer, monkeypatch, make_engine):
    base = engine.buf.addr
    engine.register_kv_layout(KvLayout([base, base + 8 * 1024], 8, 1024))
    remote = KvLayout([silent_peer.addr, silent_peer.addr + 8 * 1024], 8, 1024)

    with pytest.raises(ferry.TransferTimeoutError) as info:
        engine.transfer_blocks(silent_peer.segment, remote, [0, 1, 5], [2, 3, 7])
    assert info.value.failed_blocks == [0, 1, 5]
    assert "timeout" in engine.last_error().lower()

    # An engine with a long transfer timeout: its batch is still pending when cancelled.
    monkeypatch.setenv("FERRY_TRANSFER_TIMEOUT_MS", "20000")
    patient = make_engine()
    assert patient.register_memory(base, engine.buf.size) == 0
    local = patient.register_kv_layout(KvLayout([base, base + 8 * 1024], 8, 1024))
    rate = baseline_rate()
    batch = patient.transfer_blocks(silent_peer.segment, remote, [2, 3], [0, 1], wait=False, local_layout=local)
    assert batch.pending() == len(batch) == 2
    _, seconds, increments = counted(lambda: pytest.raises(ferry.TransferTimeoutError, batch.wait, 0.3))
    assert 0.25 <= seconds < 3 and increments > 0.1 * rate * seconds
    batch.cancel()
    assert [s.state for s in batch.status()] == [TransferState.CANCELLED] * 2
    assert all(s.code == -9 for s in batch.status())  # FERRY_E_CANCELLED
    assert batch.failed_blocks() == [2, 3]
    with pytest.raises(ferry.CancelledError):
        batch.wait()
    batch.free()


def test_another_thread_can_use_the_engine_while_one_waits(engine, silent_peer, pair, host_buffer):
    """A transfer stuck on a silent peer does not stop other threads' transfers."""
    _, target = pair
    src = host_buffer(4096, bytes(range(256)) * 16)
    assert target.register_memory(src.addr, 4096) == 0
    results = {}
    stuck = threading.Thread(
        target=lambda: results.setdefault(
            "stuck", engine.transfer_sync_read(silent_peer.segment, engine.buf.addr, silent_peer.addr, 16)
        )
    )
    stuck.start()
    time.sleep(0.1)
    start = time.monotonic()
    for _ in range(20):
        assert engine.transfer_sync_read(target.get_local_segment_name(), engine.buf.addr + 4096, src.addr, 4096) == 0
    assert time.monotonic() - start < TIMEOUT_MS / 1000, "the other thread's transfers were not held up"
    assert engine.read_bytes_from_buffer(engine.buf.addr + 4096, 4096) == src.bytes()
    stuck.join()
    assert results["stuck"] == -1


def test_mooncake_transfer_timeout_variable_is_honoured(monkeypatch, make_engine, host_buffer, silent_peer):
    """MC_TRANSFER_TIMEOUT (whole seconds, at least 5, as in Mooncake) sets the transfer
    timeout; FERRY_TRANSFER_TIMEOUT_MS, when set too, wins."""
    buf = host_buffer(4096)
    monkeypatch.delenv("FERRY_TRANSFER_TIMEOUT_MS", raising=False)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")  # raised to Mooncake's minimum of 5 s
    mc = make_engine()
    assert mc.register_memory(buf.addr, 4096) == 0
    start = time.monotonic()
    assert mc.transfer_sync_read(silent_peer.segment, buf.addr, silent_peer.addr, 16) == -1
    assert 4.5 <= time.monotonic() - start < 15, "5 s, not the 30 s default"

    monkeypatch.setenv("FERRY_TRANSFER_TIMEOUT_MS", "500")
    both = make_engine()
    assert both.register_memory(buf.addr, 4096) == 0
    start = time.monotonic()
    assert both.transfer_sync_read(silent_peer.segment, buf.addr, silent_peer.addr, 16) == -1
    assert time.monotonic() - start < 3
