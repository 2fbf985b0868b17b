#!/usr/bin/env python3
"""Per-call cost of Ferry's Python binding: `transfer_sync_read` of 4 KiB, timed call by call.

Cases (each: p50, p90, p99 and mean microseconds per call, calls per second):
  in_process.mooncake_api   engine.transfer_sync_read(...) between two engines of this process
                            (initialized P2PHANDSHAKE + tcp; inside one process Ferry moves the
                            bytes with its `local` companion transport, so this is the cost of
                            the Python layer + C API + engine, without a network hop)
  in_process.ctypes_direct  the same transfer as one raw ctypes call of ferry_transfer_sync with
                            a prebuilt request (the floor the Python layer adds to)
  cross_process_tcp.*       the same two calls against an engine in a second Python process:
                            real TCP over loopback (skipped with --no-cross-process)
  cross_process_tcp.rust_engine
                            with --ferry-bin PATH: the Rust engine called directly (`ferry bench`,
                            blocking API, batches of one 4 KiB read, one thread) against the same
                            second-process engine: what the binding adds to, measured in the same run
  mooncake_wheel            with --mooncake-python PY: the same loop on Mooncake's wheel in that
                            interpreter, two engines of one process (TCP loopback: Mooncake has
                            no same-process path)

Prints one JSON object. Install the package first (`pip install ./ffi/bindings/python`, release build).

Usage: python bench/python_overhead.py [--iterations N] [--warmup N] [--size BYTES]
                                       [--no-cross-process] [--mooncake-python PATH]
                                       [--ferry-bin target/release/ferry]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time


def summarize(samples_ns):
    s = sorted(samples_ns)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] / 1000.0  # noqa: E731
    mean = statistics.fmean(s) / 1000.0
    return {
        "p50_us": round(pick(0.50), 3),
        "p90_us": round(pick(0.90), 3),
        "p99_us": round(pick(0.99), 3),
        "mean_us": round(mean, 3),
        "calls_per_s": round(1e6 / mean),
    }


def timed(fn, iterations, warmup):
    for _ in range(warmup):
        if fn() != 0:
            raise SystemExit("transfer failed during warm-up")
    clock = time.perf_counter_ns
    samples = [0] * iterations
    for i in range(iterations):
        t0 = clock()
        rc = fn()
        samples[i] = clock() - t0
        if rc != 0:
            raise SystemExit(f"transfer failed (rc {rc})")
    return summarize(samples)


def cases(engine, peer, local, remote, size, iterations, warmup):
    from ferry import _capi

    seg = engine._segment(peer, "bench")  # the handle the binding caches for `peer`
    if not seg:
        raise SystemExit(f"cannot open {peer}: {engine.last_error()}")
    req = _capi.TransferRequest(_capi.OPCODE_READ, 0, seg, local, remote, size)
    handle, sync = engine._handle, _capi.lib.ferry_transfer_sync
    return {
        "mooncake_api": timed(lambda: engine.transfer_sync_read(peer, local, remote, size), iterations, warmup),
        "ctypes_direct": timed(lambda: sync(handle, req, 1, 0), iterations, warmup),
    }


def serve(size):
    """--serve: a target engine in this (second) process; prints {segment, addr}, exits on EOF."""
    from ferry import TransferEngine

    e = TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit(e.last_error())
    addr = e.allocate_managed_buffer(size)
    print(json.dumps({"segment": e.get_local_segment_name(), "addr": addr}), flush=True)
    sys.stdin.read()
    e.close()


def mooncake_case(size, iterations, warmup):
    """--mooncake-case: the in-process loop on Mooncake's wheel (run in the wheel's Python)."""
    from mooncake.engine import TransferEngine

    target, initiator = TransferEngine(), TransferEngine()
    for e in (target, initiator):
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit("mooncake initialize failed")
    peer = f"127.0.0.1:{target.get_rpc_port()}"
    remote, local = target.allocate_managed_buffer(size), initiator.allocate_managed_buffer(size)
    print(json.dumps(timed(lambda: initiator.transfer_sync_read(peer, local, remote, size), iterations, warmup)))


def rust_case(ferry_bin, segment, args):
    """The Rust engine reading `size` bytes from `segment`, one request per batch, one thread."""
    run = subprocess.run(
        [
            ferry_bin, "bench", "--segment_id", segment, "--operation", "read",
            "--block_size", str(args.size), "--buffer_size", str(max(args.size, 65536)),
            "--batch_size", "1", "--threads", "1", "--duration", str(args.rust_seconds), "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        check=True,
    )
    report = json.loads(run.stdout.strip().splitlines()[-1])
    lat = report["batch_latency_us"]
    mean = report["duration_s"] * 1e6 / max(report["batches"], 1)
    return {"p50_us": round(lat["p50"], 3), "p99_us": round(lat["p99"], 3), "mean_us": round(mean, 3),
            "calls_per_s": round(1e6 / mean)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--no-cross-process", action="store_true")
    ap.add_argument("--mooncake-python", help="a Python with the Mooncake wheel, for the comparison row")
    ap.add_argument("--ferry-bin", help="the ferry CLI, for the Rust-engine row (cross-process)")
    ap.add_argument("--rust-seconds", type=int, default=5, help="duration of the Rust-engine row")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mooncake-case", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.size)
    if args.mooncake_case:
        return mooncake_case(args.size, args.iterations, args.warmup)

    import ferry
    from ferry import TransferEngine

    target, initiator = TransferEngine(), TransferEngine()
    for e in (target, initiator):
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit(f"initialize failed: {e.last_error()}")
    remote = target.allocate_managed_buffer(args.size)
    local = initiator.allocate_managed_buffer(args.size)
    out = {
        "operation": "transfer_sync_read",
        "size_bytes": args.size,
        "iterations": args.iterations,
        "python": platform.python_version(),
        "library": ferry.library_path(),
        "in_process": cases(
            initiator, target.get_local_segment_name(), local, remote, args.size, args.iterations, args.warmup
        ),
    }
    if not args.no_cross_process:
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--size", str(args.size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            info = json.loads(child.stdout.readline())
            out["cross_process_tcp"] = cases(
                initiator, info["segment"], local, info["addr"], args.size, args.iterations, args.warmup
            )
            if args.ferry_bin:
                out["cross_process_tcp"]["rust_engine"] = rust_case(args.ferry_bin, info["segment"], args)
        finally:
            child.stdin.close()
            child.wait(timeout=30)
    initiator.close()
    target.close()
    if args.mooncake_python:
        run = subprocess.run(
            [
                args.mooncake_python,
                __file__,
                "--mooncake-case",
                "--size",
                str(args.size),
                "--iterations",
                str(args.iterations),
                "--warmup",
                str(args.warmup),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            check=True,
        )
        out["mooncake_wheel"] = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
