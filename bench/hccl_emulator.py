#!/usr/bin/env python3
"""The HCCL transport's own overhead, measured on the emulated CANN (no NPU here).

Runs `examples/ascend_peer` as a prefill process and a decode process on two emulated cards
(physical 4 and 5, device IPs from a generated hccn.conf) and has decode read blocks from prefill
in a loop. The decode peer reports the wall time per batch and the time spent inside the device
jobs (HCCL calls plus the stream wait: what the emulator costs, standing in for the NPU and the
network); the difference is the transport's own overhead per batch (queueing to the device
thread, descriptors, completion). Builds that report it also give the thread hand-offs per batch
(`Stats::handoffs`) and the batches run on the caller's own thread (`Stats::on_caller_thread`),
and the median and 90th percentile of the overhead per batch (`overhead_p50_us`,
`overhead_p90_us`): on this VM a batch whose completion wakes a caller on the other, halted vCPU
costs about 30 us more, so the mean depends on how often that happens in a run. Builds with
hybrid waiting (docs/transports.md, "Waiting for a device") also give the blocking waits per
batch that polled the batch's expected end (`tail_polls_per_batch`) and those that saw it end
while polling (`tail_polls_caught_per_batch`).
Prints one JSON object.

The decode peer's thread holds its device's context (it allocated the device memory, as an
inference engine's worker does) and waits for each batch at once
(`submit_blocks_for_blocking_wait`): a one-sided batch then runs on that thread, with no hand-off.
The `_handoff` cases read through the async API instead (`--async-submit`), where the batch goes
to the device thread: one hand-off. Builds before the caller-thread path always hand off, and
are not given the `_handoff` cases.

Build first (release):
    cargo build --release -p ferry-cann-emu && cargo build --release --example ascend_peer
Then:
    python3 bench/hccl_emulator.py [--repeat 2000]

Before/after: build the old tree elsewhere (for example `git archive <commit> | tar -x -C
/tmp/old`, then the same two commands there) and alternate rounds of both builds in one run, so
that both see the same load (this VM's 2 cores are shared; a single round says little):
    python3 bench/hccl_emulator.py --baseline /tmp/old --rounds 5
Each case then gives, per build, every round's figures and their median, min and max, and the
median of the per-round differences (new - old).
"""
import argparse
import json
import os
import statistics
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


def run_case(peer_bin, libdir, hccn, blocks, block_len, reads, repeat, extra_env, extra_args=()):
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
             *common, "--read", read, "--write", "0:0", "--repeat", str(repeat), *extra_args],
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
    handoffs = d.get("handoffs_per_read_batch")
    on_caller = d.get("on_caller_per_read_batch")
    return {
        "requests_per_batch": reads,
        "bytes_per_request": block_len,
        "us_per_batch": round(per_batch, 1),
        "batches_per_s": round(1e6 / per_batch),
        "emulator_device_jobs_us_per_batch": round(device, 1),
        "transport_overhead_us_per_batch": round(per_batch - device, 1),
        # The same per batch (wall minus device time of each), where the build reports it: the
        # mean above includes the occasional slow batch, these show how often.
        "overhead_p50_us": None if d.get("overhead_us_p50") is None else round(d["overhead_us_p50"], 1),
        "overhead_p90_us": None if d.get("overhead_us_p90") is None else round(d["overhead_us_p90"], 1),
        "handoffs_per_batch": None if handoffs is None else round(handoffs, 3),
        "on_caller_thread_per_batch": None if on_caller is None else round(on_caller, 3),
        # Builds with hybrid waiting: waits that polled the batch's expected end, and those
        # that saw it end there (the rest slept again and were woken).
        "tail_polls_per_batch": None if d.get("tail_polls_per_read_batch") is None
        else round(d["tail_polls_per_read_batch"], 3),
        "tail_polls_caught_per_batch": None if d.get("tail_polls_caught_per_read_batch") is None
        else round(d["tail_polls_caught_per_read_batch"], 3),
        "path": "one-sided" if d["stats"]["one_sided_batches"] else "two-sided",
    }


HANDOFF = ("--async-submit",)
CASES = [
    ("one_sided_1x4KiB", 1, 4096, {}, ()),
    ("one_sided_1x4KiB_handoff", 1, 4096, {}, HANDOFF),
    ("one_sided_64x4KiB", 64, 4096, {}, ()),
    ("one_sided_64x4KiB_handoff", 64, 4096, {}, HANDOFF),
    ("one_sided_1x1MiB", 1, 1 << 20, {}, ()),
    ("one_sided_1x1MiB_handoff", 1, 1 << 20, {}, HANDOFF),
    ("two_sided_1x4KiB", 1, 4096, {"FERRY_CANN_EMU_NO_ONESIDED": "1"}, ()),
    ("two_sided_64x4KiB", 64, 4096, {"FERRY_CANN_EMU_NO_ONESIDED": "1"}, ()),
]

FIGURES = ("us_per_batch", "batches_per_s", "emulator_device_jobs_us_per_batch", "transport_overhead_us_per_batch",
           "overhead_p50_us", "overhead_p90_us", "handoffs_per_batch", "on_caller_thread_per_batch",
           "tail_polls_per_batch", "tail_polls_caught_per_batch")


def build_paths(root, profile):
    target = os.path.join(root, "target", profile)
    peer_bin = os.path.join(target, "examples", "ascend_peer")
    emu = os.path.join(target, "libferry_cann_emu.so")
    for f in (peer_bin, emu):
        if not os.path.exists(f):
            raise SystemExit(f"{f} missing: see the build commands in this script's docstring")
    return peer_bin, emu


def has_async_submit(peer_bin):
    """Whether this `ascend_peer` build takes `--async-submit`: the builds that report
    `on_caller_thread` (the caller-thread path came with both; the option's own text does not
    survive optimisation as a string)."""
    with open(peer_bin, "rb") as f:
        return b"on_caller_thread" in f.read()


def one_round(tmp, hccn, peer_bin, emu, repeat, extra_env, only):
    """Every case once with one build (the `_handoff` cases only when it has `--async-submit`)."""
    libdir = lib_dir(tmp, emu)
    cases = {}
    handoff = has_async_submit(peer_bin)
    for name, reads, block_len, env, extra_args in CASES:
        if (only and name not in only) or (extra_args and not handoff):
            continue
        blocks = max(2 * reads, 8)
        n = repeat if block_len <= 4096 else max(repeat // 4, 50)
        cases[name] = run_case(peer_bin, libdir, hccn, blocks, block_len, reads, n, {**env, **extra_env}, extra_args)
        cases[name]["repeat"] = n
    for kind in ("one_sided", "two_sided"):
        one, many = cases.get(f"{kind}_1x4KiB"), cases.get(f"{kind}_64x4KiB")
        if one and many:
            cases[f"{kind}_overhead_us_per_extra_request"] = round(
                (many["transport_overhead_us_per_batch"] - one["transport_overhead_us_per_batch"]) / 63, 2)
    return cases


def summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--profile", default="release")
    ap.add_argument("--root", default=ROOT, help="the Ferry checkout whose build to measure (default: this one)")
    ap.add_argument("--baseline", help="another checkout's build to alternate with --root's, round by round")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every case (of each build)")
    ap.add_argument("--case", action="append", help="only this case (repeatable)")
    ap.add_argument("--wait-spin-us", help="FERRY_WAIT_SPIN_US for both peers (the engine's default when absent)")
    args = ap.parse_args()
    builds = {"new": build_paths(args.root, args.profile)}
    if args.baseline:
        builds = {"old": build_paths(args.baseline, args.profile), **builds}
    extra_env = {} if args.wait_spin_us is None else {"FERRY_WAIT_SPIN_US": args.wait_spin_us}
    rounds = {b: [] for b in builds}
    with tempfile.TemporaryDirectory() as tmp:
        hccn = os.path.join(tmp, "hccn.conf")
        with open(hccn, "w") as f:
            f.write("address_4=127.0.0.5\naddress_5=127.0.0.6\n")
        for _ in range(args.rounds):
            for b, (peer_bin, emu) in builds.items():
                rounds[b].append(one_round(tmp, hccn, peer_bin, emu, args.repeat, extra_env, args.case))
    meta = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "repeat": args.repeat, "rounds": args.rounds,
            "wait_spin_us": args.wait_spin_us, "builds": {b: os.path.abspath(args.baseline if b == "old" else args.root)
                                                          for b in builds}}
    if args.rounds == 1 and len(builds) == 1:
        print(json.dumps({**meta, "cases": rounds["new"][0]}))
        return
    out = {}
    for name in rounds["new"][0]:
        if not isinstance(rounds["new"][0][name], dict):
            continue
        case = {}
        for b in builds:
            if name in rounds[b][0]:
                case[b] = {f: summary([r[name][f] for r in rounds[b]]) for f in FIGURES}
        if "old" in builds and name in rounds["old"][0]:
            case["new_minus_old_median_per_round"] = {
                f: statistics.median([n[name][f] - o[name][f] for n, o in zip(rounds["new"], rounds["old"])])
                for f in FIGURES if rounds["old"][0][name][f] is not None and rounds["new"][0][name][f] is not None}
        out[name] = case
    print(json.dumps({**meta, "cases": out}))


if __name__ == "__main__":
    main()
