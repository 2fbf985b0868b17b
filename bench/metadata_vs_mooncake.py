#!/usr/bin/env python3
"""Drive `ferry metadata-server` and Mooncake's Python `mooncake_http_metadata_server` with the
same load, in one run: wrk GETs of one 1 KiB descriptor over 64 connections, in two shapes:

  round-trip  one request per connection at a time (what Mooncake's and Ferry's clients do);
  pipelined   16 requests per write on each connection (HTTP/1.1 pipelining, wrk Lua script).

For each server it prints requests/s, p50 and p99 latency, and the CPU time per request of the
server process and of wrk (from /proc and getrusage), then the ratio of requests/s. When nginx
is installed (`--nginx`, default: found on PATH) it also serves the same 1 KiB as a static file
with its default settings: a familiar reference point (not tuned, so not a ceiling).

Usage (repository root, after `cargo build --release -p ferry-cli`; Debian packages `wrk`, and
optionally `nginx-light`):
  python3 bench/metadata_vs_mooncake.py --mooncake-server .venv-mooncake/bin/mooncake_http_metadata_server
"""
import argparse
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FERRY = os.path.join(ROOT, "target", "release", "ferry")
KEY = "mooncake/ram/127.0.0.1:17123"
PIPELINE_DEPTH = 16
PIPELINE_LUA = f"""
-- {PIPELINE_DEPTH} GETs of the URL per write (HTTP/1.1 pipelining).
init = function(args)
  local r = {{}}
  for i = 1, {PIPELINE_DEPTH} do r[i] = wrk.format(nil) end
  req = table.concat(r)
end
request = function() return req end
"""


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def descriptor():
    desc = {"name": "127.0.0.1:17123", "protocol": "tcp", "tcp_data_port": 16359, "tcp_proto_version": 2,
            "buffers": [{"addr": 140634074640400 + i * 4096, "length": 1048576, "name": "cpu:0"} for i in range(11)]}
    return json.dumps(desc).encode()[:1024].ljust(1024, b" ")


def wait_up(url, body=None):
    for _ in range(100):
        try:
            req = urllib.request.Request(url, data=body, method="PUT" if body is not None else "GET")
            urllib.request.urlopen(req, timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


def cpu_seconds(pid):
    """User + system CPU of `pid` and its children (nginx serves from worker processes)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wrk(url, seconds, connections, script, server_pid):
    cmd = ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency"] + (["-s", script] if script else []) + [url]
    server0, wrk0 = cpu_seconds(server_pid), children_cpu()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    server1, wrk1 = cpu_seconds(server_pid), children_cpu()
    rps = float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1))
    n = int(re.search(r"(\d+) requests in", out).group(1))

    def pct(p):
        m = re.search(rf"\s{p}%\s+([0-9.]+)(us|ms|s)", out)
        v, u = float(m.group(1)), m.group(2)
        return v * {"us": 1e-3, "ms": 1, "s": 1e3}[u]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rps, "p50_ms": pct(50), "p99_ms": pct(99), "non_2xx": int(errors.group(1)) if errors else 0,
            "server_us": 1e6 * (server1 - server0) / n, "wrk_us": 1e6 * (wrk1 - wrk0) / n}


NGINX_CONF = """worker_processes 2;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};
  server {{ listen 127.0.0.1:{port}; root {d}/www; location / {{ default_type application/json; }} }}
}}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mooncake-server", default=os.path.join(ROOT, ".venv-mooncake", "bin", "mooncake_http_metadata_server"))
    ap.add_argument("--nginx", default=shutil.which("nginx") or "", help="nginx binary for the reference row ('' to skip)")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--connections", type=int, default=64)
    a = ap.parse_args()
    body = descriptor()
    tmp = tempfile.mkdtemp(prefix="ferry-metadata-bench-")
    script = os.path.join(tmp, "pipeline.lua")
    with open(script, "w") as f:
        f.write(PIPELINE_LUA)

    def ferry(port):
        return [FERRY, "metadata-server", "--addr", f"127.0.0.1:{port}"], f"http://127.0.0.1:{port}/metadata?key={KEY}", True

    def mooncake(port):
        return ([a.mooncake_server, "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
                f"http://127.0.0.1:{port}/metadata?key={KEY}", True)

    def nginx(port):
        os.makedirs(os.path.join(tmp, "www"), exist_ok=True)
        with open(os.path.join(tmp, "www", "metadata"), "wb") as f:
            f.write(body)
        conf = os.path.join(tmp, "nginx.conf")
        with open(conf, "w") as f:
            f.write(NGINX_CONF.format(d=tmp, port=port))
        return [a.nginx, "-c", conf], f"http://127.0.0.1:{port}/metadata", False

    servers = [("ferry", ferry), ("mooncake", mooncake)] + ([("nginx", nginx)] if a.nginx else [])
    results = {}
    for shape, lua in [("round-trip", None), ("pipelined", script)]:
        for name, start in servers:
            port = free_port()
            cmd, url, needs_put = start(port)
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_up(url, body if needs_put else None)
                results[(shape, name)] = wrk(url, a.seconds, a.connections, lua, proc.pid)
            finally:
                proc.terminate()
                proc.wait(timeout=10)
    print(f"wrk -t2 -c{a.connections} -d{a.seconds}s, GET of a {len(body)}-byte value; CPU per request from /proc")
    for shape in ["round-trip", "pipelined"]:
        print(f"\n{shape}" + (f" ({PIPELINE_DEPTH} requests per write; latency is per batch)" if shape == "pipelined"
                               else " (one request per connection at a time)"))
        for name, _ in servers:
            r = results[(shape, name)]
            # With pipelining wrk times whole batches, and reports zeros when it has too few.
            lat = (f"p50 {r['p50_ms']:6.2f} ms   p99 {r['p99_ms']:6.2f} ms" if r["p99_ms"] > 0 else f"{'latency not reported by wrk':<29}")
            print(f"  {name:<9} {r['rps']:>10,.0f} req/s   {lat}   "
                  f"server {r['server_us']:5.2f} us/req   wrk {r['wrk_us']:5.2f} us/req   non-2xx {r['non_2xx']}")
        f, m = results[(shape, "ferry")], results[(shape, "mooncake")]
        print(f"  ratio     {f['rps'] / m['rps']:.1f}x requests/s, {m['server_us'] / f['server_us']:.1f}x less server CPU per request")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
