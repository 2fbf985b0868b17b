#!/usr/bin/env python3
"""Measure Mooncake Transfer Engine (PyPI wheel) moving data between two engines of one process.

This is the job Ferry's `local` transport does by memcpy; Mooncake has no same-process path, so
its engines talk TCP over loopback. Prints one JSON object:
  {"overhead_4KiB_x128_req_per_s": ..., "bandwidth_1MiB_gb_per_s": ..., "bandwidth_64MiB_gb_per_s": ...}

Usage: python bench/mooncake_same_process.py [--seconds N]
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0, help="measuring time per case")
    args = ap.parse_args()
    try:
        from mooncake.engine import TransferEngine
    except Exception as e:  # noqa: BLE001 - report any import failure plainly
        print(f"mooncake wheel not importable: {e}", file=sys.stderr)
        sys.exit(2)

    def engine():
        e = TransferEngine()
        rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise SystemExit(f"mooncake initialize failed: {rc}")
        return e

    target, initiator = engine(), engine()
    peer = f"127.0.0.1:{target.get_rpc_port()}"
    size = 64 << 20
    src = target.allocate_managed_buffer(size)
    dst = initiator.allocate_managed_buffer(size)
    if not src or not dst:
        raise SystemExit("mooncake allocate_managed_buffer failed")

    def rate(fn, per_call):
        fn()  # warm up (connection set-up)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            if fn() != 0:
                raise SystemExit("mooncake transfer failed")
            n += 1
        return n * per_call / (time.perf_counter() - start)

    req = 4096
    batch = 128
    bufs = [dst + i * req for i in range(batch)]
    peers = [src + i * req for i in range(batch)]
    lens = [req] * batch
    out = {
        "overhead_4KiB_x128_req_per_s": rate(lambda: initiator.batch_transfer_sync_read(peer, bufs, peers, lens), batch),
        "bandwidth_1MiB_gb_per_s": rate(lambda: initiator.transfer_sync_read(peer, dst, src, 1 << 20), 1 << 20) / 1e9,
        "bandwidth_64MiB_gb_per_s": rate(lambda: initiator.transfer_sync_read(peer, dst, src, 64 << 20), 64 << 20) / 1e9,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
