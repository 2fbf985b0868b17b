"""The vllm-ascend case, end to end, on Ferry's emulated CANN.

Two processes behave like vllm-ascend workers (``peers/vllm_ascend_worker.py``): each is given
one card by ``ASCEND_RT_VISIBLE_DEVICES`` alone (no ``LOCAL_RANK``, no Ferry identity variable,
no config file), sets it with ``aclrtSetDevice(0)``, allocates its KV cache (2 layers × K/V,
32 blocks of 64 KiB each) with ``aclrtMalloc(..., ACL_MEM_MALLOC_HUGE_ONLY)``, then
``from ferry import TransferEngine``, ``initialize(ip, "P2PHANDSHAKE", "ascend", "")`` and
``register_memory(ptr, size)`` without a location. The decode side learns the prefill side's
session and tensor addresses from the prefill process's stdout (the connector's ZMQ message),
pulls non-contiguous blocks with ``batch_transfer_sync_read``, and checks every byte of its
cache through ``aclrtMemcpy``: the pulled blocks hold the prefill blocks they came from, every
other block is untouched.

Two deployments: bare metal (cards 4 and 5) and a container mounting physical cards 6 and 7
as its logical 0 and 1 (``FERRY_CANN_EMU_MOUNTED=6,7``; the workers see
``ASCEND_RT_VISIBLE_DEVICES=0`` and ``=1``). Both workers run on one host, so HCCL uses the
HCCS IPC rules (device memory only, 2 MiB aligned).

The emulated CANN library must be built (``cargo build -p ferry-cann-emu``); it is looked up
as ``$FERRY_CANN_EMU_LIB``, else ``$CARGO_TARGET_DIR/debug/libferry_cann_emu.so``, else the
repository's ``target/debug/libferry_cann_emu.so``. A missing library fails the tests.

The ``selftest`` tests check the ACL plumbing of the worker alone (no engine), so a failure of
the transfer tests is about the engine and its transport, not about the test.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest

from _support import PEERS, Child, emulated_cann, is_identity_variable, python_child

WORKER = PEERS / "vllm_ascend_worker.py"
LAYERS, BLOCKS, BLOCK_LEN = 2, 32, 64 << 10
# Non-contiguous on both sides; remote 15,16 -> local 9,10 is one run (one merged request).
REMOTE_BLOCKS = [3, 7, 8, 15, 16]
LOCAL_BLOCKS = [0, 1, 5, 9, 10]
# How long a pull may take (the transfer timeout is 20 s; the transport may retry).
PULL_WAIT_S = 120.0


@dataclass
class Deployment:
    """One way of running the two workers: each side's extra environment and the physical
    card each must end up on."""

    name: str
    net: int
    prefill_env: Dict[str, str]
    decode_env: Dict[str, str]
    prefill_card: int
    decode_card: int


DEPLOYMENTS = [
    Deployment("bare-metal", 41, {"ASCEND_RT_VISIBLE_DEVICES": "4"}, {"ASCEND_RT_VISIBLE_DEVICES": "5"}, 4, 5),
    Deployment(
        "container",
        42,
        {"FERRY_CANN_EMU_MOUNTED": "6,7", "ASCEND_RT_VISIBLE_DEVICES": "0"},
        {"FERRY_CANN_EMU_MOUNTED": "6,7", "ASCEND_RT_VISIBLE_DEVICES": "1"},
        6,
        7,
    ),
]


class Node:
    """An emulated Atlas node: a directory with ``libascendcl.so`` and ``libhccl.so`` linked to
    the emulator, and an ``hccn.conf`` giving physical card N the address ``127.<net>.0.<N+1>``
    (a /24 of its own per test, so tests never share a device endpoint)."""

    def __init__(self, root: Path, net: int) -> None:
        self.lib_dir = emulated_cann(root / "cann")  # no HIXL: the direct HCCL backend
        self.hccn_conf = root / "hccn.conf"
        self.hccn_conf.write_text("".join(f"address_{d}=127.{net}.0.{d + 1}\n" for d in range(8)))
        self.net = net
        self.children: List[Child] = []

    def env(self, extra: Dict[str, str]) -> Dict[str, str]:
        """A worker's environment: the node's library and hccn.conf, the timeouts, ``extra``."""
        return {
            "FERRY_ASCEND_LIB_DIR": str(self.lib_dir),
            "FERRY_HCCN_CONF": str(self.hccn_conf),
            "FERRY_TRANSFER_TIMEOUT_MS": "20000",
            "HCCL_CONNECT_TIMEOUT": "20",
            # The emulator's call log (stderr), shown when a test fails.
            "FERRY_CANN_EMU_LOG": "1",
            **extra,
        }

    def worker(self, role: str, extra: Dict[str, str]) -> Child:
        """Starts a worker process (closed by :meth:`close`)."""
        unset = [k for k in os.environ if is_identity_variable(k)]
        child = python_child(
            WORKER,
            role,
            "--layers",
            str(LAYERS),
            "--blocks",
            str(BLOCKS),
            "--block-len",
            str(BLOCK_LEN),
            env=self.env(extra),
            unset=unset,
        )
        self.children.append(child)
        return child

    def close(self) -> None:
        for child in self.children:
            child.close()


@pytest.fixture(params=DEPLOYMENTS, ids=[d.name for d in DEPLOYMENTS])
def deployment(request) -> Deployment:
    return request.param


@pytest.fixture
def node(tmp_path, deployment):
    n = Node(tmp_path, deployment.net)
    yield n
    n.close()


_FAILED_CALL = re.compile(r"^\[ferry-cann-emu [^\]]*\] .*\) -> -?[1-9]")


def stderr_report(name: str, child: Child) -> str:
    """A child's stderr for a failure message: every distinct emulator call that failed (with
    its reason and how often; handles and addresses folded), then the end of everything else."""
    child._stderr.flush()
    text = child.stderr_path.read_text(errors="replace")
    lines = text.splitlines()
    failed: Dict[str, int] = {}
    for line in lines:
        if _FAILED_CALL.match(line) and "aclInit" not in line:
            call = re.sub(r"0x[0-9a-f]+", "0x…", line.split("] ", 1)[1])
            failed[call] = failed.get(call, 0) + 1
    other = [line for line in lines if not line.startswith("[ferry-cann-emu ")]
    out = [f"--- {name} stderr ({child.stderr_path}): emulator calls that failed ---"]
    out.extend(f"{n} × {call}" for call, n in failed.items())
    if other:
        out.append(f"--- {name} stderr: other output (last 60 lines) ---")
        out.extend(other[-60:])
    return "\n".join(out)


def both_stderrs(prefill: Child, decode: Child = None) -> str:
    parts = [stderr_report("prefill", prefill)]
    if decode is not None:
        parts.append(stderr_report("decode", decode))
    return "\n" + "\n".join(parts)


def read_event(child: Child, name: str, others: List[Child], timeout: float = 60.0) -> dict:
    """The next JSON event from ``child``; fails with the children's stderr if it is an error
    event, not JSON, or does not come."""
    try:
        line = child.readline(timeout)
    except AssertionError as e:
        raise AssertionError(f"{name}: {e}\n{both_stderrs(*others)}") from None
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        raise AssertionError(f"{name} printed {line!r}, not a JSON event\n{both_stderrs(*others)}") from None
    assert event.get("event") != "error", (
        f"{name} failed at {event.get('step')}: {event.get('error')}\n{both_stderrs(*others)}"
    )
    return event


def test_the_worker_reaches_the_emulated_acl_as_a_vllm_ascend_worker_does(node, deployment):
    """The plumbing alone, no engine: the card chosen by the environment, huge-page device
    memory, and a pattern that survives host -> device -> host."""
    for extra, card in (
        (deployment.prefill_env, deployment.prefill_card),
        (deployment.decode_env, deployment.decode_card),
    ):
        child = node.worker("selftest", extra)
        got = read_event(child, "selftest", [child])
        assert got["acl_device"] == 0, got
        assert got["physical_device"] == card, got
        assert got["aligned_2mib"], got
        assert got["locations"] == [1] * (2 * LAYERS), f"device memory (ACL_MEM_LOCATION_TYPE_DEVICE): {got}"
        assert got["page_sizes"] == [2 << 20] * (2 * LAYERS), got
        assert got["checked_bytes"] == 2 * LAYERS * BLOCKS * BLOCK_LEN, got
        assert got["mismatches"] == [], got
        assert len(got["corruption_found"]) == 1, f"the byte check must catch a flipped byte: {got}"


def test_decode_pulls_selected_blocks_from_prefill_like_vllm_ascend(node, deployment):
    """Prefill and decode workers on two cards of one node; decode pulls blocks 3, 7, 8, 15, 16
    of every layer's K and V into its blocks 0, 1, 5, 9, 10; every byte of decode's cache is
    checked."""
    prefill = node.worker("prefill", deployment.prefill_env)
    p = read_event(prefill, "prefill", [prefill])
    assert p["event"] == "ready", p
    assert (p["acl_device"], p["physical_device"]) == (0, deployment.prefill_card), p
    assert len(p["acl_objects"]) == 1, f"ACL must be one object, loaded once, shared with Ferry: {p}"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", p["session"]), p

    decode = node.worker("decode", deployment.decode_env)
    d = read_event(decode, "decode", [prefill, decode])
    assert d["event"] == "ready", d
    assert (d["acl_device"], d["physical_device"]) == (0, deployment.decode_card), d
    assert len(d["acl_objects"]) == 1, d

    # What the prefill side's connector would send over ZMQ, plus the blocks to pull.
    request = {
        "session": p["session"],
        "kv_caches": p["kv_caches"],
        "remote_blocks": REMOTE_BLOCKS,
        "local_blocks": LOCAL_BLOCKS,
    }
    decode.send("pull " + json.dumps(request))
    pulled = read_event(decode, "decode", [prefill, decode], timeout=PULL_WAIT_S)
    assert pulled["event"] == "pulled", pulled
    # 4 tensors × 4 runs (15,16 -> 9,10 is one request).
    assert pulled["requests"] == 2 * LAYERS * 4, pulled
    assert pulled["checked_bytes"] == 2 * LAYERS * BLOCKS * BLOCK_LEN, pulled
    assert pulled["rc"] == 0 and pulled["mismatches"] == [], (
        f"batch_transfer_sync_read returned {pulled['rc']} ({pulled['error'] or 'no error text'}); "
        f"{len(pulled['mismatches'])} block(s) wrong:\n  "
        + "\n  ".join(pulled["mismatches"])
        + both_stderrs(prefill, decode)
    )

    # Both workers shut down cleanly (engine closed, cache freed).
    for child, name in ((decode, "decode"), (prefill, "prefill")):
        child.send("quit")
        code = child.proc.wait(timeout=30)
        assert code == 0, f"{name} exited {code}{both_stderrs(prefill, decode)}"
