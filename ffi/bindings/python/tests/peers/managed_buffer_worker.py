#!/usr/bin/env python3
"""One process with an ``ascend`` engine whose memory is a managed buffer, on Ferry's emulated
CANN (used by ``test_managed_buffers_ascend.py``).

Like a vllm-ascend worker (``vllm_ascend_worker.py``, whose ACL plumbing this reuses) it loads
``libascendcl.so`` from ``FERRY_ASCEND_LIB_DIR``, ``aclInit``\\s and sets device 0 (the card is
chosen by ``ASCEND_RT_VISIBLE_DEVICES``), then ``initialize(ip, "P2PHANDSHAKE", "ascend", "")``
and ``allocate_managed_buffer(length)``: no ``register_memory`` of its own.

Usage::

    managed_buffer_worker.py prefill|decode --length BYTES [--ip IP]

Prints JSON lines on stdout:

- ``{"event": "ready", "session", "addr", "location_type", "zeroed", "physical_device"}`` once
  the buffer is allocated (``location_type`` is what ``aclrtPointerGetAttributes`` says of it:
  0 HOST for ``aclrtMallocHost`` memory, 2 UNREGISTERED for plain memory); the prefill side
  has filled its buffer with ``pattern(length, 1)`` through ``write_bytes_to_buffer``;
- ``{"event": "error", "step", "error"}`` when a step fails (then the process exits 1).

stdin commands (one per line):

- ``pull <session> <remote addr>`` (decode): ``transfer_sync_read`` of the whole buffer;
  answers ``{"event": "pulled", "rc", "error", "equal", "first_difference"}``;
- ``quit``: frees the managed buffer (``free_managed_buffer``), closes the engine, exits 0
  after ``{"event": "bye", "free_rc"}``.
"""

from __future__ import annotations

import argparse
import sys

from vllm_ascend_worker import Acl, fail, say


def pattern(length: int, seed: int) -> bytes:
    """Byte k is (k * 7 + seed) % 251."""
    base = bytes((k * 7 + seed) % 251 for k in range(251 * 7))
    reps = length // len(base) + 1
    return (base * reps)[:length]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("prefill", "decode"))
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--ip", default="127.0.0.1")
    args = parser.parse_args()

    acl = Acl()
    try:
        acl.init()
        acl.set_device(0)
        physical = acl.physical_id(acl.get_device())
    except RuntimeError as e:
        fail("acl", str(e))

    from ferry import TransferEngine

    engine = TransferEngine()
    if engine.initialize(args.ip, "P2PHANDSHAKE", "ascend", "") != 0:
        fail("initialize", engine.last_error())
    addr = engine.allocate_managed_buffer(args.length)
    if not addr:
        fail("allocate_managed_buffer", engine.last_error())
    try:
        location = acl.attributes(addr).location_type
    except RuntimeError as e:
        fail("aclrtPointerGetAttributes", str(e))
    zeroed = engine.read_bytes_from_buffer(addr, args.length) == bytes(args.length)
    if args.role == "prefill" and engine.write_bytes_to_buffer(addr, pattern(args.length, 1), args.length) != 0:
        fail("write_bytes_to_buffer", engine.last_error())
    say(
        event="ready",
        session=engine.get_local_segment_name(),
        addr=addr,
        location_type=location,
        zeroed=zeroed,
        physical_device=physical,
    )

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "pull":
            session, remote = cmd[1], int(cmd[2])
            rc = engine.transfer_sync_read(session, addr, remote, args.length)
            got = engine.read_bytes_from_buffer(addr, args.length)
            want = pattern(args.length, 1)
            diff = next((k for k in range(args.length) if got[k] != want[k]), None) if got != want else None
            say(event="pulled", rc=rc, error=engine.last_error() if rc else "", equal=got == want, first_difference=diff)
        elif cmd[0] == "quit":
            free_rc = engine.free_managed_buffer(addr, args.length)
            engine.close()
            say(event="bye", free_rc=free_rc)
            return


if __name__ == "__main__":
    main()
