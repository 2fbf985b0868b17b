#!/usr/bin/env python3
"""A Mooncake Transfer Engine peer (PyPI wheel) for Ferry's interop tests.

  mooncake_peer.py target SIZE SEED [METADATA_URL]
      Serves a SIZE-byte buffer filled with pattern SEED over tcp, on P2PHANDSHAKE or, with
      METADATA_URL, on that HTTP metadata server (named 127.0.0.1:<free port>). Prints one JSON
      line {"segment", "addr", "size", "first"} ("first": get_first_buffer_address of its own
      segment), then answers stdin commands:
        check OFFSET LENGTH SEED   -> "ok" or "mismatch at N"
        notifies                   -> JSON list of the notifications received (waits up to 5 s)
        write-notify SEGMENT ADDR MSG
                                   -> writes 16 bytes of its buffer to ADDR of SEGMENT with the
                                      notification TransferNotify("mooncake", MSG); prints the rc
        quit
  mooncake_peer.py http-pair URL SIZE
      Two Mooncake engines on the HTTP metadata server URL; one reads SIZE bytes from the other.
      Prints {"rc", "ok", "names"}.
  mooncake_peer.py initiator SEGMENT REMOTE_ADDR REMOTE_SEED WRITE_OFFSET WRITE_SEED SIZE...
      Reads each SIZE from SEGMENT at a few offsets and checks pattern REMOTE_SEED, then writes
      pattern WRITE_SEED of each SIZE at REMOTE_ADDR + WRITE_OFFSET. Prints one JSON line.
  mooncake_peer.py initiator-on URL SEGMENT REMOTE_ADDR REMOTE_SEED WRITE_OFFSET WRITE_SEED SIZE...
      The same, on the HTTP metadata server URL instead of P2PHANDSHAKE.

Pattern: byte k of a buffer (k counted from the buffer start) is (k + seed) % 251.
"""
import json
import sys
import time

BASE = bytes(range(251))


def pattern(offset, length, seed):
    start = (offset + seed) % 251
    reps = (start + length) // 251 + 1
    return (BASE * reps)[start:start + length]


def free_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def engine(metadata_url=None):
    """A tcp engine on P2PHANDSHAKE, or on the HTTP metadata server at metadata_url. Returns the
    engine and its segment name."""
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    if metadata_url:
        name = f"127.0.0.1:{free_port()}"
        rc = e.initialize(name, metadata_url, "tcp", "")
    else:
        rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        name = f"127.0.0.1:{e.get_rpc_port()}"
    if rc != 0:
        raise SystemExit(f"mooncake initialize failed: {rc}")
    return e, name


def fill(e, addr, size, seed):
    chunk = 8 << 20
    off = 0
    while off < size:
        n = min(chunk, size - off)
        if e.write_bytes_to_buffer(addr + off, pattern(off, n, seed), n) != 0:
            raise SystemExit("write_bytes_to_buffer failed")
        off += n


def target(size, seed, metadata_url=None):
    e, segment = engine(metadata_url)
    addr = e.allocate_managed_buffer(size)
    if not addr:
        raise SystemExit("allocate_managed_buffer failed")
    fill(e, addr, size, seed)
    first = e.get_first_buffer_address(segment)
    print(json.dumps({"segment": segment, "addr": addr, "size": size, "first": first}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        if words[0] == "notifies":
            got = []
            for _ in range(50):  # notifications arrive asynchronously; poll up to 5 s
                got.extend({k: str(getattr(n, k)) for k in dir(n) if not k.startswith("_")} for n in e.get_notifies())
                if got:
                    break
                time.sleep(0.1)
            print(json.dumps(got), flush=True)
            continue
        if words[0] == "write-notify":
            from mooncake.engine import TransferNotify, TransferOpcode

            peer, remote, msg = words[1], int(words[2]), words[3]
            rc = e.transfer_sync(peer, addr, remote, 16, TransferOpcode.Write, TransferNotify("mooncake", msg))
            print(rc, flush=True)
            continue
        if words[0] == "check":
            off, n, s = int(words[1]), int(words[2]), int(words[3])
            got = e.read_bytes_from_buffer(addr + off, n)
            want = pattern(0, n, s)
            if got == want:
                print("ok", flush=True)
            else:
                bad = next(i for i in range(n) if got[i] != want[i])
                print(f"mismatch at {bad}: got {got[bad]} want {want[bad]}", flush=True)


def initiator(segment, remote_addr, remote_seed, write_offset, write_seed, sizes, metadata_url=None):
    e, _ = engine(metadata_url)
    size = max(sizes)
    local = e.allocate_managed_buffer(size)
    if not local:
        raise SystemExit("allocate_managed_buffer failed")
    result = {"reads": [], "writes": []}
    for n in sizes:
        for off in (0, 4097):
            rc = e.transfer_sync_read(segment, local, remote_addr + off, n)
            ok = rc == 0 and e.read_bytes_from_buffer(local, n) == pattern(off, n, remote_seed)
            result["reads"].append({"size": n, "offset": off, "rc": rc, "ok": ok})
    for n in sizes:
        if e.write_bytes_to_buffer(local, pattern(0, n, write_seed), n) != 0:
            raise SystemExit("write_bytes_to_buffer failed")
        rc = e.transfer_sync_write(segment, local, remote_addr + write_offset, n)
        result["writes"].append({"size": n, "rc": rc})
    print(json.dumps(result), flush=True)


def http_pair(url, size):
    """Two Mooncake engines registered with the HTTP metadata server at URL; B reads A."""
    from mooncake.engine import TransferEngine

    names = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    engines = []
    for n in names:
        e = TransferEngine()
        rc = e.initialize(n, url, "tcp", "")
        if rc != 0:
            raise SystemExit(f"mooncake initialize({n}, {url}) failed: {rc}")
        engines.append(e)
    a, b = engines
    src, dst = a.allocate_managed_buffer(size), b.allocate_managed_buffer(size)
    fill(a, src, size, 9)
    rc = b.transfer_sync_read(names[0], dst, src, size)
    ok = rc == 0 and b.read_bytes_from_buffer(dst, size) == pattern(0, size, 9)
    print(json.dumps({"rc": rc, "ok": ok, "names": names}), flush=True)


def main():
    mode = sys.argv[1]
    if mode == "target":
        target(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
    elif mode == "http-pair":
        http_pair(sys.argv[2], int(sys.argv[3]))
    elif mode == "initiator":
        a = sys.argv[2:]
        initiator(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), [int(x) for x in a[5:]])
    elif mode == "initiator-on":
        url, a = sys.argv[2], sys.argv[3:]
        initiator(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), [int(x) for x in a[5:]], url)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
