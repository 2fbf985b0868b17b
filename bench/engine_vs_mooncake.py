#!/usr/bin/env python3
"""Run Ferry's engine bench and the Mooncake wheel's same-process measurement in one run, and
print both side by side with ratios (Ferry / Mooncake).

Usage (from the repository root):
  python3 -m venv /tmp/mc && /tmp/mc/bin/pip install mooncake-transfer-engine-non-cuda
  apt-get install -y libibverbs1 libnuma1 librdmacm1
  python3 bench/engine_vs_mooncake.py --mooncake-python /tmp/mc/bin/python
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def criterion_mean_ns(group, name):
    path = os.path.join(ROOT, "target", "criterion", group, name.replace("/", "_"), "new", "estimates.json")
    with open(path) as f:
        return json.load(f)["mean"]["point_estimate"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mooncake-python", default=sys.executable, help="python with the mooncake wheel installed")
    ap.add_argument("--skip-ferry", action="store_true", help="reuse the last criterion results")
    args = ap.parse_args()

    if not args.skip_ferry:
        subprocess.run(["cargo", "bench", "--bench", "engine", "--", "--noplot"], cwd=ROOT, check=True)
    ferry = {
        "null 4KiB x128 (req/s)": 128 / (criterion_mean_ns("overhead", "null/4KiB_x128") * 1e-9),
        "local 4KiB x128 (req/s)": 128 / (criterion_mean_ns("overhead", "local/4KiB_x128") * 1e-9),
        "local 1MiB (GB/s)": (1 << 20) / criterion_mean_ns("bandwidth", "local/1MiB"),
        "local 64MiB (GB/s)": (64 << 20) / criterion_mean_ns("bandwidth", "local/64MiB"),
        "memcpy 1MiB (GB/s)": (1 << 20) / criterion_mean_ns("bandwidth", "memcpy/1MiB"),
        "memcpy 64MiB (GB/s)": (64 << 20) / criterion_mean_ns("bandwidth", "memcpy/64MiB"),
    }
    mc = subprocess.run(
        [args.mooncake_python, os.path.join(ROOT, "bench", "mooncake_same_process.py")],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )
    mooncake = json.loads(mc.stdout.strip().splitlines()[-1])
    pairs = [
        ("4KiB x128 batch, req/s", ferry["local 4KiB x128 (req/s)"], mooncake["overhead_4KiB_x128_req_per_s"]),
        ("1 MiB transfer, GB/s", ferry["local 1MiB (GB/s)"], mooncake["bandwidth_1MiB_gb_per_s"]),
        ("64 MiB transfer, GB/s", ferry["local 64MiB (GB/s)"], mooncake["bandwidth_64MiB_gb_per_s"]),
    ]
    print()
    print("Ferry alone:")
    for k, v in ferry.items():
        print(f"  {k:<26} {v:>14,.2f}")
    print(f"  local/memcpy 1MiB          {ferry['local 1MiB (GB/s)'] / ferry['memcpy 1MiB (GB/s)']:>14.0%}")
    print(f"  local/memcpy 64MiB         {ferry['local 64MiB (GB/s)'] / ferry['memcpy 64MiB (GB/s)']:>14.0%}")
    print()
    print("Two engines in one process: Ferry (local transport) vs Mooncake wheel (TCP over loopback)")
    print(f"  {'case':<26} {'Ferry':>14} {'Mooncake':>14} {'ratio':>8}")
    for name, f, m in pairs:
        print(f"  {name:<26} {f:>14,.2f} {m:>14,.2f} {f / m:>7.1f}x")


if __name__ == "__main__":
    main()
