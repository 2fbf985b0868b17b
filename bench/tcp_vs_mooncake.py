#!/usr/bin/env python3
"""Run Mooncake's transfer_engine_bench and `ferry bench` with identical parameters, in one run,
over loopback TCP with P2PHANDSHAKE, and print throughputs and ratios (Ferry / Mooncake).

Usage (repository root, after `cargo build --release -p ferry-cli`):
  python3 bench/tcp_vs_mooncake.py --mooncake-bench .venv-mooncake/bin/transfer_engine_bench
Options: --duration S (default 3), --blocks 4096,65536,1048576,4194304, --threads 1,2,
--ops read,write, --batch 64, --json FILE (write the table as JSON too), --ferry PATH (the
`ferry` binary; default target/release/ferry: another build's binary compares two Ferry builds
against the same Mooncake in one run).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FERRY = os.path.join(ROOT, "target", "release", "ferry")


def start_target(cmd):
    """Starts a target and returns (process, segment) once it printed its address."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 30
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        m = re.search(r"listening on (\S+)", line)
        if m:
            return p, m.group(1)
    p.kill()
    raise SystemExit(f"target did not report its address: {' '.join(cmd)}")


def run_initiator(cmd):
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300).stdout
    m = re.search(r"throughput ([0-9.]+) GB/s", out)
    if not m:
        raise SystemExit(f"no throughput line from {' '.join(cmd)}:\n{out[-2000:]}")
    batches = re.search(r"duration ([0-9.]+), batch count ([0-9]+)", out)
    p50 = re.search(r"p50 ([0-9.]+) (µs|ms)", out)
    extra = {}
    if batches:
        extra["mean_batch_us"] = float(batches.group(1)) / int(batches.group(2)) * 1e6
    if p50:
        extra["p50_us"] = float(p50.group(1)) * (1000 if p50.group(2) == "ms" else 1)
    return float(m.group(1)), extra


def is_ferry(binary):
    """Whether `binary` is a `ferry` build (which takes `bench` first) rather than Mooncake's."""
    return os.path.basename(binary).startswith("ferry")


def measure(binary, args, buffer_size, detail=False):
    common = ["--protocol=tcp", "--metadata_server=P2PHANDSHAKE", "--local_server_name=127.0.0.1",
              f"--buffer_size={buffer_size}"]
    target, segment = start_target([binary, "bench", "--mode=target"] + common if is_ferry(binary)
                                   else [binary, "--mode=target"] + common)
    try:
        init = [binary, "bench"] if is_ferry(binary) else [binary]
        tput, extra = run_initiator(init + ["--mode=initiator", f"--segment_id={segment}"] + common + args)
        return (tput, extra) if detail else tput
    finally:
        target.terminate()
        try:
            target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            target.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mooncake-bench", default=os.path.join(ROOT, ".venv-mooncake", "bin", "transfer_engine_bench"))
    ap.add_argument("--duration", type=int, default=3)
    ap.add_argument("--blocks", default="4096,65536,1048576,4194304")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--ops", default="read,write")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--ferry", default=FERRY, help="the ferry binary to measure")
    a = ap.parse_args()
    ferry = a.ferry
    if not os.path.exists(ferry):
        raise SystemExit("build Ferry first: cargo build --release -p ferry-cli")
    rows = []
    print(f"{'op':<6}{'block':>9}{'thr':>4}{'Mooncake GB/s':>15}{'Ferry GB/s':>12}{'ratio':>8}")
    for op in a.ops.split(","):
        for block in [int(b) for b in a.blocks.split(",")]:
            for threads in [int(t) for t in a.threads.split(",")]:
                # Room for every thread's batch, at least 256 MiB.
                buffer_size = max(256 << 20, block * a.batch * threads * 2)
                args = [f"--operation={op}", f"--block_size={block}", f"--batch_size={a.batch}",
                        f"--threads={threads}", f"--duration={a.duration}"]
                mc = measure(a.mooncake_bench, args, buffer_size)
                fe = measure(ferry, args, buffer_size)
                ratio = fe / mc if mc else float("inf")
                rows.append({"op": op, "block": block, "threads": threads, "mooncake": mc, "ferry": fe, "ratio": ratio})
                print(f"{op:<6}{block:>9}{threads:>4}{mc:>15.2f}{fe:>12.2f}{ratio:>7.2f}x", flush=True)
    worst = min(r["ratio"] for r in rows)
    print(f"lowest ratio: {worst:.2f}x")
    # Single-request latency: 4 KiB reads, batch 1, one thread.
    args = ["--operation=read", "--block_size=4096", "--batch_size=1", "--threads=1", f"--duration={a.duration}"]
    mc, mce = measure(a.mooncake_bench, args, 256 << 20, detail=True)
    fe, fee = measure(ferry, args, 256 << 20, detail=True)
    latency = {"mooncake_mean_us": mce.get("mean_batch_us"), "ferry_mean_us": fee.get("mean_batch_us"),
               "ferry_p50_us": fee.get("p50_us")}
    print(f"4 KiB read, batch 1: Mooncake mean {latency['mooncake_mean_us']:.1f} us; "
          f"Ferry mean {latency['ferry_mean_us']:.1f} us, p50 {latency['ferry_p50_us']:.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"sweep": rows, "latency_4k": latency}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
