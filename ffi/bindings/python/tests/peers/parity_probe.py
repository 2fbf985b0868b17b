"""Probes the behaviours where a drop-in for mooncake.engine could diverge; written against
`mooncake.engine` only, run under Mooncake's wheel and under Ferry (the alias), and prints one
JSON object of results for test_mooncake_parity.py to compare.

  parity_probe.py p2p
  parity_probe.py http URL      (a metadata server nobody else uses)
"""

import ctypes
import json
import os
import socket
import sys
import time

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

out = {}
mode = sys.argv[1]


def engine(name="127.0.0.1", metadata="P2PHANDSHAKE", protocol="tcp"):
    e = TransferEngine()
    rc = e.initialize(name, metadata, protocol, "")
    return e, rc


def seg(e, host="127.0.0.1"):
    return f"{host}:{e.get_rpc_port()}"


if mode == "p2p":
    os.environ.pop("MC_FORCE_TCP", None)
    _, out["rdma_without_force_tcp"] = engine(protocol="rdma")
    os.environ["MC_FORCE_TCP"] = "1"
    _, out["rdma_with_force_tcp"] = engine(protocol="rdma")
    os.environ["MC_FORCE_TCP"] = "0"
    _, out["rdma_with_force_tcp_0"] = engine(protocol="rdma")
    del os.environ["MC_FORCE_TCP"]

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    port = held.getsockname()[1]
    a, rc_a = engine(f"127.0.0.1:{port}")
    b, rc_b = engine(f"127.0.0.1:{port}")
    out["same_name_twice"] = [rc_a, rc_b]
    out["same_name_ports_differ"] = a.get_rpc_port() != b.get_rpc_port()
    out["name_port_ignored"] = port not in (a.get_rpc_port(), b.get_rpc_port())

    buf_a = a.allocate_managed_buffer(1 << 16)
    buf_b = b.allocate_managed_buffer(1 << 16)
    a.write_bytes_to_buffer(buf_a, b"x" * 64, 64)
    rc = a.transfer_sync(seg(b), buf_a, buf_b, 64, TransferOpcode.Write, TransferNotify("my-chosen-name", "hello"))
    time.sleep(0.5)
    out["notify_rc"] = rc
    out["notifies"] = [[n.name, n.msg] for n in b.get_notifies()]

    out["probe_live"] = a.send_probe(seg(b))
    out["probe_closed_port"] = a.send_probe("127.0.0.1:1") != 0
    out["probe_unknown"] = a.send_probe("unreachable_peer:9") != 0
    out["submit_unknown"] = [
        a.transfer_submit_write("unreachable_peer:9", 0, 0, 16),
        a.batch_transfer_async_write("unreachable_peer:9", [0], [0], [16]),
    ]

    raw = (ctypes.c_ubyte * 4096)()
    out["write_from_unregistered"] = a.transfer_sync_write(seg(b), ctypes.addressof(raw), buf_b, 128)

    topo = json.loads(a.get_local_topology())
    out["topology"] = topo
    out["engine_ptr_nonzero"] = a.get_engine_ptr() != 0

    old = seg(a)
    out["reinitialize"] = a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    out["reinitialize_new_name"] = seg(a) != old
    out["old_name_answers_probe"] = b.send_probe(old) == 0
    out["new_name_answers_probe"] = b.send_probe(seg(a)) == 0
else:
    url = sys.argv[2]
    a, rc_a = engine("127.0.0.1:23456", url)
    b, rc_b = engine("127.0.0.1:23456", url)
    c, rc_c = engine("127.0.0.1:23457", url)
    out["same_name_twice"] = [rc_a, rc_b]
    out["probe_live"] = c.send_probe("127.0.0.1:23456")
    out["probe_unknown"] = c.send_probe("unreachable_peer:9")
print(json.dumps(out), flush=True)
