#!/usr/bin/env python3
"""The HCCL transport's own overhead, measured on the emulated CANN (no NPU here).

Runs `examples/ascend_peer` as a prefill process and a decode process on two emulated cards
(physical 4 and 5, device IPs from a generated hccn.conf) and has decode read blocks from prefill
in a loop. The decode peer reports the wall time per batch and the time spent inside the device
jobs (HCCL calls plus the stream wait: what the emulator costs, standing in for the NPU and the
network); the difference is the transport's own overhead per batch (queueing to the device
thread, descriptors, completion). Prints one JSON object.

Build first (release):
    cargo build --release -p ferry-cann-emu && cargo build --release --example ascend_peer
    cargo build --release -p ferry-cann-emu --no-default-features --target-dir target/cann-emu-legacy
Then:
    python3 bench/hccl_emulator.py [--repeat 2000]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lib_dir(tmp, emu):
    d = tempfile.mkdtemp(dir=tmp)
    for name in ("libascendcl.so", "libhccl.so"):
        os.symlink(emu, os.path.join(d, name))
    return d


def run_case(peer_bin, libdir, hccn, blocks, block_len, reads, repeat, extra_env):
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("FERRY_", "ASCEND_", "HCCL_")) or k == "LOCAL_RANK":
            del env[k]
    env.update({
        "FERRY_ASCEND_LIB_DIR": libdir,
        "FERRY_HCCN_CONF": hccn,
        "ASCEND_RT_VISIBLE_DEVICES": "4,5",
        "FERRY_TRANSFER_TIMEOUT_MS": "20000",
        "HCCL_CONNECT_TIMEOUT": "20",
    })
    env.update(extra_env)
    common = ["--regions", "1", "--blocks", str(blocks), "--block-len", str(block_len)]
    prefill = subprocess.Popen([peer_bin, "prefill", *common], env={**env, "LOCAL_RANK": "0"},
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = prefill.stdout.readline()
        if not line.startswith("READY "):
            raise SystemExit(f"prefill did not start: {line!r}")
        ready = json.loads(line[len("READY "):])
        # Every other block, so that the KV planner cannot merge neighbours into one request.
        read = ",".join(f"{2 * r}:{2 * r}" for r in range(reads))
        out = subprocess.run(
            [peer_bin, "decode", "--peer", ready["segment"], "--peer-layout", json.dumps(ready["layout"]),
             *common, "--read", read, "--write", "0:0", "--repeat", str(repeat)],
            env={**env, "LOCAL_RANK": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
        done = [l for l in out.stdout.splitlines() if l.startswith("DONE ")]
        if not done:
            raise SystemExit(f"decode failed: {out.stderr[-2000:]}")
        d = json.loads(done[0][len("DONE "):])
    finally:
        try:
            prefill.stdin.write("quit\n")
            prefill.stdin.flush()
        except BrokenPipeError:
            pass
        prefill.wait(timeout=60)
    per_batch, device = d["read_us_per_batch"], d["device_us_per_read_batch"]
    return {
        "requests_per_batch": reads,
        "bytes_per_request": block_len,
        "us_per_batch": round(per_batch, 1),
        "emulator_device_jobs_us_per_batch": round(device, 1),
        "transport_overhead_us_per_batch": round(per_batch - device, 1),
        "path": "one-sided" if d["stats"]["one_sided_batches"] else "two-sided",
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--profile", default="release")
    ap.add_argument("--root", default=ROOT, help="the Ferry checkout whose build to measure (default: this one)")
    args = ap.parse_args()
    target = os.path.join(args.root, "target", args.profile)
    peer_bin = os.path.join(target, "examples", "ascend_peer")
    emu = os.path.join(target, "libferry_cann_emu.so")
    for f in (peer_bin, emu):
        if not os.path.exists(f):
            raise SystemExit(f"{f} missing: see the build commands in this script's docstring")
    with tempfile.TemporaryDirectory() as tmp:
        hccn = os.path.join(tmp, "hccn.conf")
        with open(hccn, "w") as f:
            f.write("address_4=127.0.0.5\naddress_5=127.0.0.6\n")
        full = lib_dir(tmp, emu)
        cases = {}
        for name, reads, block_len, env in [
            ("one_sided_1x4KiB", 1, 4096, {}),
            ("one_sided_64x4KiB", 64, 4096, {}),
            ("one_sided_1x1MiB", 1, 1 << 20, {}),
            ("two_sided_1x4KiB", 1, 4096, {"FERRY_CANN_EMU_NO_ONESIDED": "1"}),
            ("two_sided_64x4KiB", 64, 4096, {"FERRY_CANN_EMU_NO_ONESIDED": "1"}),
        ]:
            blocks = max(2 * reads, 8)
            repeat = args.repeat if block_len <= 4096 else max(args.repeat // 4, 50)
            cases[name] = run_case(peer_bin, full, hccn, blocks, block_len, reads, repeat, env)
            cases[name]["repeat"] = repeat
        for kind in ("one_sided", "two_sided"):
            one, many = cases[f"{kind}_1x4KiB"], cases[f"{kind}_64x4KiB"]
            cases[f"{kind}_overhead_us_per_extra_request"] = round(
                (many["transport_overhead_us_per_batch"] - one["transport_overhead_us_per_batch"]) / 63, 2)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "cases": cases}))


if __name__ == "__main__":
    main()
