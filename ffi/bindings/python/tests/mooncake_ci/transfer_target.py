"""Target side of the transfer-engine check Mooncake's CI runs (see README.md): written against
``mooncake.engine`` only, so it runs on Mooncake's wheel and, through ``python -m ferry.alias
install``, on Ferry.

Environment (as Mooncake's test): TARGET_SERVER_NAME (default 127.0.0.1:12345),
MC_METADATA_SERVER (default 127.0.0.1:2379), PROTOCOL (default tcp). Prints one line
``Target server ready at <name>`` (the name initiators pass as target_hostname; under
P2PHANDSHAKE it carries the RPC port) and serves until stdin closes or it is killed.
"""

import os
import sys

from mooncake.engine import TransferEngine

CAPACITY = 64 * 1024 * 1024

name = os.environ.get("TARGET_SERVER_NAME", "127.0.0.1:12345")
metadata = os.environ.get("MC_METADATA_SERVER", "127.0.0.1:2379")
protocol = os.environ.get("PROTOCOL", "tcp")

engine = TransferEngine()
rc = engine.initialize(name, metadata, protocol, "")
if rc != 0:
    sys.exit(f"target: initialize({name!r}, {metadata!r}, {protocol!r}) returned {rc}")
if metadata == "P2PHANDSHAKE":
    name = f"{name.rpartition(':')[0] or name}:{engine.get_rpc_port()}"

# The initiator writes into the first buffer this segment publishes.
if engine.get_first_buffer_address(name) == 0:
    if engine.allocate_managed_buffer(CAPACITY) == 0:
        sys.exit("target: allocate_managed_buffer failed")

print(f"Target server ready at {name}", flush=True)
sys.stdin.read()  # serve until the test closes our stdin (Mooncake's target spins instead)
