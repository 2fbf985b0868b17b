#!/usr/bin/env python3
"""Drive `ferry metadata-server` and Mooncake's Python `mooncake_http_metadata_server` with the
same load, in one run: wrk GETs of one 1 KiB descriptor over 64 connections. Prints requests/s,
p50 and p99 latency of each and the ratio.

Usage (repository root, after `cargo build --release -p ferry-cli`; Debian package `wrk`):
  python3 bench/metadata_vs_mooncake.py --mooncake-server .venv-mooncake/bin/mooncake_http_metadata_server
"""
import argparse
import json
import os
import re
import socket
import subprocess
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FERRY = os.path.join(ROOT, "target", "release", "ferry")
KEY = "mooncake/ram/127.0.0.1:17123"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_and_put(port):
    url = f"http://127.0.0.1:{port}/metadata?key={KEY}"
    desc = {"name": "127.0.0.1:17123", "protocol": "tcp", "tcp_data_port": 16359, "tcp_proto_version": 2,
            "buffers": [{"addr": 140634074640400 + i * 4096, "length": 1048576, "name": "cpu:0"} for i in range(11)]}
    body = json.dumps(desc).encode()[:1024].ljust(1024, b" ")
    for _ in range(100):
        try:
            req = urllib.request.Request(url, data=body, method="PUT")
            urllib.request.urlopen(req, timeout=1).read()
            return url, len(body)
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"server on {port} did not come up")


def wrk(url, seconds, connections):
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency", url],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1))

    def pct(p):
        m = re.search(rf"\s{p}%\s+([0-9.]+)(us|ms|s)", out)
        v, u = float(m.group(1)), m.group(2)
        return v * {"us": 1e-3, "ms": 1, "s": 1e3}[u]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rps, "p50_ms": pct(50), "p99_ms": pct(99), "non_2xx": int(errors.group(1)) if errors else 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mooncake-server", default=os.path.join(ROOT, ".venv-mooncake", "bin", "mooncake_http_metadata_server"))
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--connections", type=int, default=64)
    a = ap.parse_args()
    results = {}
    for name, cmd in [("ferry", lambda p: [FERRY, "metadata-server", "--addr", f"127.0.0.1:{p}"]),
                      ("mooncake", lambda p: [a.mooncake_server, "--host", "127.0.0.1", "--port", str(p), "--log-level", "WARNING"])]:
        port = free_port()
        proc = subprocess.Popen(cmd(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url, size = wait_and_put(port)
            results[name] = wrk(url, a.seconds, a.connections)
            results[name]["body_bytes"] = size
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    f, m = results["ferry"], results["mooncake"]
    for name, r in results.items():
        print(f"{name:<9} {r['rps']:>12,.0f} req/s   p50 {r['p50_ms']:.2f} ms   p99 {r['p99_ms']:.2f} ms   non-2xx {r['non_2xx']}")
    print(f"ratio     {f['rps'] / m['rps']:.1f}x requests/s")


if __name__ == "__main__":
    main()
