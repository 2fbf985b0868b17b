#!/usr/bin/env python3
"""A second Python process with a Ferry engine, for the two-process tests.

  ferry_peer.py SIZE SEED
      Starts an engine (P2PHANDSHAKE + tcp on 127.0.0.1), allocates a SIZE-byte managed buffer
      filled with pattern SEED, prints one JSON line {"segment", "addr", "size"}, then answers
      one line per stdin command:
        check OFFSET LENGTH SEED           -> "ok" or "mismatch at N"
        read SEGMENT ADDR LENGTH SEED      -> reads LENGTH bytes at ADDR of SEGMENT into its buffer
                                              and checks pattern SEED: {"rc", "ok"}
        write SEGMENT ADDR LENGTH SEED     -> writes pattern SEED of LENGTH bytes to ADDR of
                                              SEGMENT: {"rc"}
        notify SEGMENT MESSAGE             -> {"rc"} (a notification to SEGMENT)
        notifies                           -> JSON list of {"name", "msg"} received (waits up to 5 s)
        quit

Pattern: byte k of a buffer is (k + seed) % 251.
"""

import json
import sys
import time

from ferry import TransferEngine, TransferNotify, TransferOpcode

BASE = bytes(range(251))


def pattern(offset, length, seed):
    start = (offset + seed) % 251
    reps = (start + length) // 251 + 1
    return (BASE * reps)[start : start + length]


def main():
    size, seed = int(sys.argv[1]), int(sys.argv[2])
    e = TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit(f"initialize failed: {e.last_error()}")
    addr = e.allocate_managed_buffer(size)
    if not addr or e.write_bytes_to_buffer(addr, pattern(0, size, seed), size) != 0:
        raise SystemExit(f"buffer setup failed: {e.last_error()}")
    print(json.dumps({"segment": e.get_local_segment_name(), "addr": addr, "size": size}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        cmd = words[0]
        if cmd == "quit":
            break
        if cmd == "check":
            off, n, s = int(words[1]), int(words[2]), int(words[3])
            got, want = e.read_bytes_from_buffer(addr + off, n), pattern(0, n, s)
            bad = next((i for i in range(n) if got[i] != want[i]), None)
            print("ok" if bad is None else f"mismatch at {bad}", flush=True)
        elif cmd == "read":
            seg, raddr, n, s = words[1], int(words[2]), int(words[3]), int(words[4])
            rc = e.transfer_sync_read(seg, addr, raddr, n)
            ok = rc == 0 and e.read_bytes_from_buffer(addr, n) == pattern(0, n, s)
            print(json.dumps({"rc": rc, "ok": ok, "error": e.last_error() if rc else ""}), flush=True)
        elif cmd == "write":
            seg, raddr, n, s = words[1], int(words[2]), int(words[3]), int(words[4])
            e.write_bytes_to_buffer(addr, pattern(0, n, s), n)
            rc = e.transfer_sync(seg, addr, raddr, n, TransferOpcode.Write, TransferNotify("", f"wrote {n}"))
            print(json.dumps({"rc": rc, "error": e.last_error() if rc else ""}), flush=True)
        elif cmd == "notify":
            try:
                e.notify(words[1], " ".join(words[2:]))
                print(json.dumps({"rc": 0}), flush=True)
            except Exception as err:  # noqa: BLE001 - report it to the test
                print(json.dumps({"rc": -1, "error": str(err)}), flush=True)
        elif cmd == "notifies":
            got = []
            for _ in range(50):
                got.extend({"name": n.name, "msg": n.msg} for n in e.get_notifies())
                if got:
                    break
                time.sleep(0.1)
            print(json.dumps(got), flush=True)
        else:
            print(f"unknown command {cmd}", flush=True)
    e.close()


if __name__ == "__main__":
    main()
