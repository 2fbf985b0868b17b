#!/usr/bin/env python3
"""Run Mooncake's transfer_engine_bench and `ferry bench` with identical parameters, in one run,
over loopback TCP with P2PHANDSHAKE, in alternating rounds, and print operations per second,
the median ratio (Ferry / Mooncake) over the rounds and its spread.

Usage (repository root, after `cargo build --release -p ferry-cli`):
  python3 bench/tcp_vs_mooncake.py --mooncake-bench .venv-mooncake/bin/transfer_engine_bench

Options:
  --rounds N (default 3): every case is measured N times per engine; the engines' order
      alternates from one round to the next (Mooncake first, then Ferry first, ...), so a
      machine whose speed drifts during the run does not favour one of them.
  --duration S (default 2): seconds per measurement.
  --blocks 4096,65536,1048576 --threads 1,2 --ops read,write --batches 1,64: the sweep.
  --auth: also measure Ferry with peer authentication on (FERRY_AUTH_SECRET given to its target
      and initiator), as a third engine with its own ratio to Mooncake and to Ferry without it.
  --ferry PATH (default target/release/ferry), --baseline PATH (another ferry build, measured
      as a further engine: two Ferry builds against the same Mooncake in one run).
  --access same|rotate (default same): which blocks Ferry's batches move. `same` is what
      Mooncake's transfer_engine_bench does (every batch of thread t moves the blocks
      i * threads + t, warm in the CPU caches when they fit), so both engines run one workload.
      `rotate` moves the next blocks of the buffer in each batch (cold memory); Mooncake's bench
      cannot, so its ratio then compares two workloads. Ferry builds from before 2026-12-02
      have no `--access` and always rotate: the script says so and labels them.
  --also-rotate: also measure Ferry rotating, as a further engine (ferry-rotate), beside
      `--access`'s: what cold memory costs it, in the same run.
  --variant NAME:VAR=VALUE[,VAR=VALUE...]: also measure Ferry (--ferry) with these environment
      variables, as a further engine NAME (repeatable). For example
      `--variant ferry-system-cc:FERRY_TCP_LOCAL_CONGESTION=system` measures Ferry keeping the
      host's congestion control on loopback, as Mooncake does.
  --congestion NAME (default: FERRY_TCP_LOCAL_CONGESTION if set, else reno, what Ferry gives
      connections within a host): the congestion control of the floor's, the polling
      ping-pong's and the ceiling's sockets, so that they bound what Ferry's connections can
      do. The ceiling is measured with the host's default too (what Mooncake's connections
      use), and both are shown.
  --json FILE: write every measurement and the summary as JSON too.
  --chart FILE.png: draw the results (bench/chart.py; needs matplotlib, which the script says
      how to get when it is missing; the JSON goes beside the PNG when --json is not given).
  --floor PATH: the ping-pong floor (transports/tcp/examples/pingpong_floor.rs, built with
      `cargo build --release -p ferry-transport-tcp --example pingpong_floor`), run in every
      round of the cases with one thread and batch 1 (its response is the case's block size),
      between the engines; the case's line then shows the floor's p50 and each Ferry engine's
      p50 over it. The same binary's polling mode runs there too (both sides poll non-blocking
      sockets and never sleep, moving their blocks as `--access` says Ferry's do):
      the most one request at a time reaches here; the line gives the share of it that 1.5x
      Mooncake would take.
  --ceiling PATH: the loopback ceiling (transports/tcp/examples/loopback_ceiling.rs, built with
      `cargo build --release -p ferry-transport-tcp --example loopback_ceiling`): plain sockets
      streaming 1 MiB buffers (one on each side, reused) from one process to another, no
      requests, the best of 1 and 4 streams, run in every round of every case between the
      engines. The case's line then shows
      it as blocks of the case's size per second, with Mooncake's share of it, and the summary
      gives, case by case, the share of it that 1.5x Mooncake would take (above 100%, no engine
      over TCP reaches it on this machine).

Operations per second are transfers (blocks) per second: batch count x batch size / duration,
from the `Test completed: duration D, batch count N` line both tools print. A ratio is the
median of the per-round ratios (each round's Ferry over the same round's Mooncake), the spread
is their minimum and maximum.
"""
import argparse
import json
import os
import signal
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FERRY = os.path.join(ROOT, "target", "release", "ferry")
# The secret of the --auth engine (any 16+ bytes; both sides get it through the environment).
AUTH_SECRET = "tcp-vs-mooncake-bench-secret-0123456789"


def start_target(cmd, env):
    """Starts a target and returns (process, segment) once it printed its address."""
    # A session of its own: the wheel's `transfer_engine_bench` is a Python wrapper that runs the
    # real binary as its child, and stopping only the wrapper left that child listening (hundreds
    # of them after a sweep, holding ports other benchmarks need). `stop_target` ends the group.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    deadline = time.time() + 30
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        m = re.search(r"listening on (\S+)", line)
        if m:
            return p, m.group(1)
    stop_target(p)
    raise SystemExit(f"target did not report its address: {' '.join(cmd)}")


def stop_target(p):
    """Stops a target started by `start_target` and every process of its session."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=wait)
            # The group's other members (the wrapper's child) may outlive the leader.
            os.killpg(p.pid, signal.SIGKILL)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
        return


def run_initiator(cmd, env, batch):
    """Runs an initiator; returns (operations per second, p50 batch latency in µs or None)."""
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                         env=env).stdout
    m = re.search(r"duration ([0-9.]+), batch count ([0-9]+)", out)
    if not m:
        raise SystemExit(f"no 'duration D, batch count N' line from {' '.join(cmd)}:\n{out[-2000:]}")
    ops = int(m.group(2)) * batch / float(m.group(1))
    p50 = re.search(r"p50 ([0-9.]+) ?(µs|us|ms)", out)
    p50_us = float(p50.group(1)) * (1000 if p50.group(2) == "ms" else 1) if p50 else None
    return ops, p50_us


def is_ferry(binary):
    """Whether `binary` is a `ferry` build (which takes `bench` first) rather than Mooncake's."""
    return os.path.basename(binary).startswith("ferry")


def measure(engine, case, duration):
    """One measurement of `case` by `engine` ({binary, env, args}); (ops/s, p50 µs or None)."""
    binary, env = engine["binary"], engine["env"]
    block, batch, threads = case["block"], case["batch"], case["threads"]
    # Room for every thread's batch, at least 256 MiB.
    buffer_size = max(256 << 20, block * batch * threads * 2)
    common = ["--protocol=tcp", "--metadata_server=P2PHANDSHAKE", "--local_server_name=127.0.0.1",
              f"--buffer_size={buffer_size}"]
    args = [f"--operation={case['op']}", f"--block_size={block}", f"--batch_size={batch}",
            f"--threads={threads}", f"--duration={duration}"] + engine.get("args", [])
    prefix = [binary, "bench"] if is_ferry(binary) else [binary]
    target, segment = start_target(prefix + ["--mode=target"] + common, env)
    try:
        return run_initiator(prefix + ["--mode=initiator", f"--segment_id={segment}"] + common + args, env, batch)
    finally:
        stop_target(target)


def measure_floor(binary, block, congestion):
    """The ping-pong floor's p50 in µs: 24 bytes out, `block` bytes back, blocking sockets."""
    out = subprocess.run([binary, "20000", str(block), "blocking", "same", congestion], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT,
                         text=True, timeout=300).stdout
    m = re.search(r"p50 ([0-9.]+) us", out)
    if not m:
        raise SystemExit(f"no 'p50 X us' from {binary}:\n{out[-2000:]}")
    return float(m.group(1))


def measure_polling_bound(binary, block, access, congestion):
    """Round trips per second of the polling ping-pong (no sleep, blocks moved as `access` says):
    the most one request at a time reaches here."""
    rounds = max(2000, min(20000, (4 << 30) // block))
    out = subprocess.run([binary, str(rounds), str(block), "polling", access, congestion], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300).stdout
    m = re.search(r"([0-9.]+) ops/s", out)
    if not m:
        raise SystemExit(f"no 'N ops/s' from {binary} polling:\n{out[-2000:]}")
    return float(m.group(1))


def measure_ceiling(binary, congestion):
    """Bytes per second plain loopback sockets stream here with this congestion control (`system`:
    the host's): the best of 1 and 4 streams."""
    best = 0.0
    for streams in (1, 4):
        out = subprocess.run([binary, "1", str(streams), str(1 << 20), congestion], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=60).stdout
        m = re.search(r"([0-9.]+) GB/s", out)
        if not m:
            raise SystemExit(f"no 'X GB/s' from {binary}:\n{out[-2000:]}")
        best = max(best, float(m.group(1)) * 1e9)
    return best


def has_access_option(binary):
    """Whether this `ferry` build takes `bench --access` (builds before 2026-12-02 always rotate)."""
    out = subprocess.run([binary, "bench", "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=60).stdout
    return "--access" in out


def ferry_engine(binary, env, access):
    """A Ferry engine moving its blocks as `access` says, or as it can (older builds rotate)."""
    if has_access_option(binary):
        return {"binary": binary, "env": env, "args": [f"--access={access}"], "access": access}
    print(f"note: {binary} has no --access (a build before 2026-12-02): its batches rotate through its buffer",
          file=sys.stderr)
    return {"binary": binary, "env": env, "args": [], "access": "rotate"}


def fmt_ops(x):
    return f"{x / 1e3:.1f}k" if x < 1e6 else f"{x / 1e6:.2f}M"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mooncake-bench", default=os.path.join(ROOT, ".venv-mooncake", "bin", "transfer_engine_bench"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=2)
    ap.add_argument("--blocks", default="4096,65536,1048576")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--ops", default="read,write")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--auth", action="store_true", help="also measure Ferry with peer authentication on")
    ap.add_argument("--ferry", default=FERRY, help="the ferry binary to measure")
    ap.add_argument("--baseline", help="another ferry binary, measured as a further engine")
    ap.add_argument("--access", choices=("same", "rotate"), default="same",
                    help="which blocks Ferry's batches move (same: as Mooncake's bench does)")
    ap.add_argument("--also-rotate", action="store_true", help="also measure Ferry rotating (engine ferry-rotate)")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:VAR=VALUE[,VAR=VALUE...]: also measure Ferry with these variables, as engine NAME")
    ap.add_argument("--congestion", default=os.environ.get("FERRY_TCP_LOCAL_CONGESTION") or "reno",
                    help="congestion control of the floor's, ping-pong's and ceiling's sockets (default reno)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--chart", help="also draw a PNG chart of the results (bench/chart.py; needs matplotlib)")
    ap.add_argument("--floor", help="the pingpong_floor example binary, run beside batch-1 one-thread cases")
    ap.add_argument("--ceiling", help="the loopback_ceiling example binary, run in every round of every case")
    a = ap.parse_args()
    for b in [a.ferry] + ([a.baseline] if a.baseline else []) + ([a.ceiling] if a.ceiling else []):
        if not os.path.exists(b):
            raise SystemExit(f"{b} does not exist: build Ferry first (cargo build --release -p ferry-cli)")
    if not os.path.exists(a.mooncake_bench):
        raise SystemExit(f"{a.mooncake_bench} does not exist: pip install mooncake-transfer-engine-non-cuda "
                         "(and Debian libibverbs1 libnuma1 librdmacm1)")
    plain = dict(os.environ)
    plain.pop("FERRY_AUTH_SECRET", None)
    plain.pop("FERRY_AUTH_SECRET_FILE", None)
    engines = {"mooncake": {"binary": a.mooncake_bench, "env": plain, "access": "same"},
               "ferry": ferry_engine(a.ferry, plain, a.access)}
    if a.auth:
        engines["ferry+auth"] = ferry_engine(a.ferry, dict(plain, FERRY_AUTH_SECRET=AUTH_SECRET), a.access)
    if a.baseline:
        engines["baseline"] = ferry_engine(a.baseline, plain, a.access)
    if a.also_rotate and engines["ferry"]["access"] != "rotate":
        engines["ferry-rotate"] = ferry_engine(a.ferry, plain, "rotate")
    for v in a.variant:
        name, _, assignments = v.partition(":")
        extra = dict(kv.split("=", 1) for kv in assignments.split(",") if "=" in kv)
        if not name or name in engines or not extra:
            raise SystemExit(f"--variant {v!r}: NAME:VAR=VALUE[,VAR=VALUE...] with a new NAME")
        engines[name] = dict(ferry_engine(a.ferry, dict(plain, **extra), a.access), extra_env=extra)
    for n, e in engines.items():
        extra = "".join(f", {k}={v}" for k, v in e.get("extra_env", {}).items())
        print(f"{n}: {e['binary']}, blocks moved: {e['access']}{extra}", flush=True)
    cases = [{"op": op, "block": int(block), "batch": int(batch), "threads": int(threads)}
             for batch in a.batches.split(",") for op in a.ops.split(",")
             for block in a.blocks.split(",") for threads in a.threads.split(",")]
    names = list(engines)
    results = []
    for case in cases:
        runs = {n: [] for n in names}
        floor = a.floor and case["batch"] == 1 and case["threads"] == 1
        floors, ceilings, system_ceilings, bounds = [], [], [], []
        for r in range(a.rounds):
            # Alternate: round 0 in the listed order, round 1 reversed, ...
            order = names if r % 2 == 0 else list(reversed(names))
            for i, n in enumerate(order):
                if floor and i == len(order) // 2:
                    floors.append(measure_floor(a.floor, case["block"], a.congestion))
                    bounds.append(measure_polling_bound(a.floor, case["block"], a.access, a.congestion))
                if a.ceiling and i == len(order) // 2:
                    ceilings.append(measure_ceiling(a.ceiling, a.congestion) / case["block"])
                    system_ceilings.append(measure_ceiling(a.ceiling, "system") / case["block"])
                runs[n].append(measure(engines[n], case, a.duration))
        results.append({"case": case, "runs": runs, "floor_p50_us": floors or None,
                        "polling_bound_ops": bounds or None,
                        "ceiling_ops": ceilings or None, "ceiling_system_congestion_ops": system_ceilings or None})
        print_case(case, runs, names, a.rounds, floors, ceilings, bounds, system_ceilings, a.congestion)
    summary = summarize(results, names)
    print("\nmedian ratio to Mooncake over the rounds [min, max]:")
    for n in names[1:]:
        rs = [s["ratio"][n]["median"] for s in summary]
        print(f"  {n}: lowest {min(rs):.2f}x, highest {max(rs):.2f}x over {len(rs)} cases")
    bounded = [s for s in summary if s.get("ceiling_ops")]
    if bounded:
        print(f"1.5x Mooncake as a share of the loopback ceiling measured beside it with {a.congestion} (over 100%:"
              " out of reach of any engine over TCP here):")
        for s in sorted(bounded, key=lambda s: -s["ops_median"]["mooncake"] / s["ceiling_ops"]):
            c = s["case"]
            need = 1.5 * s["ops_median"]["mooncake"]
            print(f"  {c['op']} {c['block']} B batch {c['batch']} x{c['threads']}: {fmt_ops(need)}/s ="
                  f" {need / s['ceiling_ops']:.0%} of {fmt_ops(s['ceiling_ops'])}/s")
    if a.auth:
        costs = [s["auth_cost"] for s in summary]
        print(f"  ferry+auth / ferry: median {statistics.median(costs):.3f} (per case {min(costs):.3f} to {max(costs):.3f})")
    if a.json or a.chart:
        out = a.json or (os.path.splitext(a.chart)[0] + ".json")
        with open(out, "w") as f:
            json.dump({"engines": names, "access": {n: e["access"] for n, e in engines.items()},
                       "extra_env": {n: e.get("extra_env", {}) for n, e in engines.items()},
                       "congestion": a.congestion,
                       "rounds": a.rounds, "duration_s": a.duration,
                       "results": results, "summary": summary}, f, indent=1)
    if a.chart:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import chart
        chart.chart(out, a.chart)


def ratios(runs, n, base="mooncake"):
    return [x[0] / b[0] if b[0] else float("inf") for x, b in zip(runs[n], runs[base])]


def print_case(case, runs, names, rounds, floors=(), ceilings=(), bounds=(), system_ceilings=(), congestion=""):
    head = f"{case['op']:<5} {case['block']:>8} B batch {case['batch']:>3} x{case['threads']}"
    cols = []
    for n in names:
        ops = statistics.median(x[0] for x in runs[n])
        p50s = [x[1] for x in runs[n] if x[1] is not None]
        p50 = f" p50 {statistics.median(p50s):.0f}us" if p50s else ""
        cell = f"{n} {fmt_ops(ops)}/s{p50}"
        if n != "mooncake":
            rs = ratios(runs, n)
            cell += f" ({statistics.median(rs):.2f}x [{min(rs):.2f}-{max(rs):.2f}])"
        cols.append(cell)
    if floors:
        floor = statistics.median(floors)
        over = [f"{n} {statistics.median(x[1] for x in runs[n] if x[1] is not None) / floor:.2f}x"
                for n in names if n != "mooncake" and any(x[1] is not None for x in runs[n])]
        cols.append(f"floor p50 {floor:.0f}us [{min(floors):.0f}-{max(floors):.0f}]"
                    + (f" (p50 over floor: {', '.join(over)})" if over else ""))
    if ceilings:
        ceiling = statistics.median(ceilings)
        moon = statistics.median(x[0] for x in runs["mooncake"])
        cols.append(f"loopback ceiling {fmt_ops(ceiling)}/s [{fmt_ops(min(ceilings))}-{fmt_ops(max(ceilings))}]"
                    f" with {congestion} (mooncake at {moon / ceiling:.0%} of it)")
    if system_ceilings:
        cols.append(f"with the host's congestion control {fmt_ops(statistics.median(system_ceilings))}/s")
    if bounds:
        bound = statistics.median(bounds)
        moon = statistics.median(x[0] for x in runs["mooncake"])
        cols.append(f"polling ping-pong {fmt_ops(bound)}/s [{fmt_ops(min(bounds))}-{fmt_ops(max(bounds))}]"
                    f" (1.5x mooncake = {1.5 * moon / bound:.0%} of it)")
    print(f"{head}: " + "; ".join(cols) + f"  ({rounds} rounds)", flush=True)


def summarize(results, names):
    out = []
    for res in results:
        runs = res["runs"]
        s = {"case": res["case"],
             "ops_median": {n: statistics.median(x[0] for x in runs[n]) for n in names},
             "ratio": {}}
        for n in names[1:]:
            rs = ratios(runs, n)
            s["ratio"][n] = {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}
        if res.get("ceiling_ops"):
            s["ceiling_ops"] = statistics.median(res["ceiling_ops"])
        if res.get("ceiling_system_congestion_ops"):
            s["ceiling_system_congestion_ops"] = statistics.median(res["ceiling_system_congestion_ops"])
        if res.get("polling_bound_ops"):
            s["polling_bound_ops"] = statistics.median(res["polling_bound_ops"])
        if "ferry+auth" in runs:
            s["auth_cost"] = statistics.median(ratios(runs, "ferry+auth", base="ferry"))
        out.append(s)
    return out


if __name__ == "__main__":
    sys.exit(main())
