"""Managed buffers of ``ascend`` engines on Ferry's emulated CANN.

HCCL can only register host memory that came from ``aclrtMallocHost`` (docs/ascend.md, "What
the emulated CANN enforces", rule 5), so ``allocate_managed_buffer`` of an ``ascend`` engine
must hand out such memory: ``aclrtPointerGetAttributes`` calls it HOST (location type 0), not
UNREGISTERED (2, what ``malloc``/``mmap`` memory is). Two processes (``peers/
managed_buffer_worker.py``) on cards 4 and 5 of one emulated node, each with a managed buffer
and nothing else registered, move the prefill side's whole buffer into the decode side's.
``HCCL_INTRA_ROCE_ENABLE=1``: two processes of one host otherwise talk over HCCS IPC, which
carries device memory only.

The emulated CANN library must be built (``cargo build -p ferry-cann-emu``); see
``test_vllm_ascend.py`` for where it is looked up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List

from _support import PEERS, Child, emulated_cann, is_identity_variable, python_child

WORKER = PEERS / "managed_buffer_worker.py"
LENGTH = (4 << 20) + 12345  # not a multiple of a page: the whole length must move
NET = 43
ACL_MEM_LOCATION_TYPE_HOST = 0


def start(tmp: Path, role: str, card: int, children: List[Child]) -> Child:
    lib_dir = tmp / "cann"
    if not lib_dir.exists():
        emulated_cann(lib_dir)  # no HIXL: the direct HCCL backend
        (tmp / "hccn.conf").write_text("".join(f"address_{d}=127.{NET}.0.{d + 1}\n" for d in range(8)))
    env: Dict[str, str] = {
        "FERRY_ASCEND_LIB_DIR": str(lib_dir),
        "FERRY_HCCN_CONF": str(tmp / "hccn.conf"),
        "FERRY_TRANSFER_TIMEOUT_MS": "20000",
        "HCCL_CONNECT_TIMEOUT": "20",
        "HCCL_INTRA_ROCE_ENABLE": "1",
        "ASCEND_RT_VISIBLE_DEVICES": str(card),
        "FERRY_CANN_EMU_LOG": "1",
    }
    unset = [k for k in os.environ if is_identity_variable(k)]
    child = python_child(WORKER, role, "--length", str(LENGTH), env=env, unset=unset)
    children.append(child)
    return child


def event(child: Child, name: str, timeout: float = 60.0) -> dict:
    line = child.readline(timeout)
    try:
        got = json.loads(line)
    except json.JSONDecodeError:
        raise AssertionError(f"{name} printed {line!r}\nstderr:\n{child.stderr_text()}") from None
    assert got.get("event") != "error", f"{name} failed at {got.get('step')}: {got.get('error')}\n{child.stderr_text()}"
    return got


def test_ascend_managed_buffers_are_pinned_host_memory_that_moves(tmp_path):
    children: List[Child] = []
    try:
        prefill = start(tmp_path, "prefill", 4, children)
        p = event(prefill, "prefill")
        decode = start(tmp_path, "decode", 5, children)
        d = event(decode, "decode")
        assert (p["physical_device"], d["physical_device"]) == (4, 5), (p, d)
        decode.send(f"pull {p['session']} {p['addr']}")
        pulled = event(decode, "decode", timeout=120.0)
        assert pulled["rc"] == 0, (
            f"transfer_sync_read returned {pulled['rc']}: {pulled['error']}\n"
            f"decode stderr:\n{decode.stderr_text()}\nprefill stderr:\n{prefill.stderr_text()}"
        )
        assert pulled["equal"], f"first wrong byte at {pulled['first_difference']}"
        for name, got in (("prefill", p), ("decode", d)):
            assert got["location_type"] == ACL_MEM_LOCATION_TYPE_HOST, (
                f"{name}'s managed buffer is not aclrtMallocHost memory (aclrtPointerGetAttributes location "
                f"type {got['location_type']}; 0 is HOST, 2 UNREGISTERED)"
            )
            assert got["zeroed"], got
        for child, name in ((decode, "decode"), (prefill, "prefill")):
            child.send("quit")
            bye = event(child, name)
            assert bye["free_rc"] == 0, bye
            assert child.proc.wait(timeout=30) == 0, child.stderr_text()
    finally:
        for child in children:
            child.close()
