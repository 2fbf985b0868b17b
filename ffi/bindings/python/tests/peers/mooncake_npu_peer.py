#!/usr/bin/env python3
"""A KV-cache peer on Mooncake's NPU wheel (``mooncake-transfer-engine-npu``, its
``ascend_direct`` transport over HIXL), on Ferry's emulated CANN and HIXL.

Run it under the Python of ``.venv-mooncake-npu`` (``$FERRY_MOONCAKE_NPU_PYTHON``) with
``LD_LIBRARY_PATH`` naming a directory where the emulator is linked as ``libascendcl.so``,
``libhccl.so``, ``libllm_datadist.so``, ``libcann_hixl.so`` and ``libmetadef.so``: that is how
the wheel finds CANN on a real machine (CANN's ``set_env.sh``), since its RPATH is only
``$ORIGIN``. With ``--engine ferry`` the same program runs on Ferry's drop-in package instead
(``from ferry import TransferEngine``, under the Python that has ``ferry`` installed, CANN from
``FERRY_ASCEND_LIB_DIR``), so a Ferry ↔ Mooncake test changes the engine and nothing else.

What it does, in the order a vllm-ascend worker does it:

1. load ``libascendcl.so`` (``RTLD_GLOBAL``; the very object the engine binds),
   ``aclInit(NULL)``, ``aclrtSetDevice(--device)`` on the main thread (the thread that then
   creates the engine and registers memory);
2. allocate each layer's K and V cache with ``aclrtMalloc(..., ACL_MEM_MALLOC_HUGE_ONLY)`` and
   fill every block with its pattern;
3. ``TransferEngine()``, ``initialize(ip, "P2PHANDSHAKE", "ascend", "")``,
   ``register_memory(ptr, size)`` per tensor (no location: the engine asks
   ``aclrtPointerGetAttributes``);
4. print a ``ready`` line and serve commands from stdin.

Usage::

    mooncake_npu_peer.py prefill|decode [--engine mooncake|ferry] [--device N] [--ip IP]
                         [--layers N] [--blocks N] [--block-len BYTES]

Every output line is a JSON object with an ``"event"``:

- ``{"event": "ready", "engine", "session", "seed", "kv_caches": [[k, v], ...], "num_blocks",
  "block_len", "acl_device", "physical_device", "acl_objects", "setup_s"}``: ``session`` is
  ``ip:rpc_port`` (the P2P handshake name peers transfer to), ``kv_caches`` the device address
  of every layer's K and V tensor;
- ``{"event": "error", "step", "error"}`` when a step fails (then the process exits 1).

stdin commands, one per line (``<json>`` is ``{"session", "kv_caches", "remote_blocks",
"local_blocks", "remote_seed"}``: the other side's ``ready`` line plus the blocks to move):

- ``pull <json>``: one ``batch_transfer_sync_read`` moving every (layer, K/V) tensor's remote
  blocks into the local blocks (adjacent blocks merged into one request, as vllm-ascend's
  connector does); with ``"single": true`` one ``transfer_sync_read`` per request instead. Then
  reads the whole cache back with ``aclrtMemcpy`` device-to-host and checks every byte: a block
  pulled now or earlier must hold its remote block's pattern (``remote_seed``), every other
  block this side's own (a failed pull must not have touched its blocks). Answers
  ``{"event": "pulled", "rc", "error", "requests", "seconds", "checked_bytes", "mismatches"}``;
- ``push <json>``: the same requests with ``batch_transfer_sync_write`` (``"single": true``:
  ``transfer_sync_write``), local blocks into the remote blocks; answers ``{"event": "pushed",
  "rc", "error", "requests", "seconds"}`` (the receiving side checks with ``check``);
- ``check <json>``: ``{"written": [[local block, source block], ...], "remote_seed"}``: checks
  every byte of this side's cache, as after a pull, with the blocks another side pushed added to
  those that landed before; answers
  ``{"event": "checked", "checked_bytes", "mismatches"}``;
- ``quit``: unregisters every tensor, closes the engine, frees the cache, exits 0.

Data: block ``b`` of layer ``l``'s K (``kv`` 0) or V (``kv`` 1) tensor on the side with seed
``s`` holds ``random.Random(f"{s}/{l}/{kv}/{b}").randbytes(block_len)`` (the same pattern as
``vllm_ascend_worker.py``, whose ACL plumbing this program shares); prefill's seed is 1,
decode's 2.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import time
from typing import Any, Dict, List, Tuple

from vllm_ascend_worker import SEEDS, Acl, KvCache, acl_objects_mapped, fail, merge_runs, say, verify


def acl_library() -> str:
    """The ``libascendcl.so`` the engine binds: Ferry's from ``FERRY_ASCEND_LIB_DIR``, Mooncake's
    through the loader's search (``LD_LIBRARY_PATH``), by name, as its ``NEEDED`` entry is."""
    lib_dir = os.environ.get("FERRY_ASCEND_LIB_DIR", "")
    return os.path.join(lib_dir.split(":")[0], "libascendcl.so") if lib_dir else "libascendcl.so"


class DlInfo(ctypes.Structure):
    """glibc's ``Dl_info``."""

    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def loaded_from(acl: Acl) -> str:
    """The file the loader found ``libascendcl.so`` in (``dladdr`` of ``aclInit``)."""
    info = DlInfo()
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    if not libc.dladdr(ctypes.cast(acl.lib.aclInit, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        fail("load", f"dladdr cannot place aclInit of {acl.path}")
    return info.dli_fname.decode()


def make_engine(kind: str) -> Any:
    """A new, uninitialised TransferEngine of Mooncake's wheel or of Ferry's package."""
    try:
        if kind == "mooncake":
            from mooncake.engine import TransferEngine
        else:
            from ferry import TransferEngine
    except ImportError as e:
        fail("import", f"{kind}: {e}")
    return TransferEngine()


def last_error(engine: Any) -> str:
    """Ferry's text for the last failure; Mooncake's wheel has none (its log is on stderr)."""
    getter = getattr(engine, "last_error", None)
    return getter() if getter else "(Mooncake reports details in its log on stderr)"


def requests_for(cache: KvCache, peer: Dict[str, Any]) -> Tuple[List[int], List[int], List[int]]:
    """(local addresses, remote addresses, lengths): for every (layer, K/V) tensor, one request
    per run of adjacent block pairs."""
    runs = merge_runs(peer["local_blocks"], peer["remote_blocks"])
    local, remote, lengths = [], [], []
    for layer, pair in enumerate(cache.tensors):
        for kv, base in enumerate(pair):
            remote_base = peer["kv_caches"][layer][kv]
            for lb, rb, n in runs:
                local.append(base + lb * cache.block_len)
                remote.append(remote_base + rb * cache.block_len)
                lengths.append(n * cache.block_len)
    return local, remote, lengths


def transfer(engine: Any, op: str, peer: Dict[str, Any], cache: KvCache) -> Tuple[int, str, int]:
    """Runs one pull (``read``) or push (``write``); returns (rc, error text, requests)."""
    local, remote, lengths = requests_for(cache, peer)
    if peer.get("single"):
        one = engine.transfer_sync_read if op == "read" else engine.transfer_sync_write
        rc = 0
        for lo, re_, n in zip(local, remote, lengths):
            rc = one(peer["session"], lo, re_, n)
            if rc != 0:
                break
    else:
        batch = engine.batch_transfer_sync_read if op == "read" else engine.batch_transfer_sync_write
        rc = batch(peer["session"], local, remote, lengths)
    return rc, (last_error(engine) if rc != 0 else ""), len(lengths)


def check(cache: KvCache, moved: Dict[int, int], remote_seed: int, seed: int) -> Tuple[int, List[str]]:
    """Every byte of the cache (see ``verify``); a failed read-back is a mismatch."""
    try:
        return verify(cache, moved, remote_seed, seed)
    except RuntimeError as e:
        return 0, [f"cannot read the cache back: {e}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--engine", choices=["mooncake", "ferry"], default="mooncake")
    ap.add_argument("--device", type=int, default=0, help="the aclrtSetDevice id")
    ap.add_argument("--ip", default="127.0.0.1")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--block-len", type=int, default=64 << 10)
    args = ap.parse_args()
    seed = SEEDS[args.role]

    acl = Acl(acl_library())
    acl.path = loaded_from(acl)
    try:
        acl.init()
        acl.set_device(args.device)
        cache = KvCache(acl, args.layers, args.blocks, args.block_len)
        cache.fill(seed)
    except RuntimeError as e:
        fail("acl", str(e))

    engine = make_engine(args.engine)
    started = time.monotonic()
    if engine.initialize(args.ip, "P2PHANDSHAKE", "ascend", "") != 0:
        fail("initialize", last_error(engine))
    for layer, kv, base in cache.bases():
        if engine.register_memory(base, cache.size) != 0:
            fail("register_memory", f"layer {layer} {'KV'[kv]} at {base:#x}: {last_error(engine)}")
    user = acl.get_device()
    say(
        event="ready",
        engine=args.engine,
        session=f"{args.ip}:{engine.get_rpc_port()}",
        seed=seed,
        kv_caches=cache.tensors,
        num_blocks=cache.num_blocks,
        block_len=cache.block_len,
        acl_device=user,
        physical_device=acl.physical_id(user),
        acl_objects=acl_objects_mapped(acl),
        setup_s=round(time.monotonic() - started, 3),
    )

    # Every block another side has put into this cache so far (local block -> its source
    # block) and that side's seed: each check covers the whole cache, earlier moves included.
    landed: Dict[int, int] = {}
    landed_seed = SEEDS["prefill"]
    for line in sys.stdin:
        cmd, _, rest = line.strip().partition(" ")
        if cmd == "quit":
            break
        try:
            peer = json.loads(rest) if rest else {}
        except json.JSONDecodeError as e:
            say(event="error", step="command", error=f"{cmd}: {e}")
            continue
        if cmd == "pull":
            t0 = time.monotonic()
            rc, error, n = transfer(engine, "read", peer, cache)
            took = time.monotonic() - t0
            if rc == 0:
                landed.update(zip(peer["local_blocks"], peer["remote_blocks"]))
                landed_seed = peer.get("remote_seed", landed_seed)
            checked, bad = check(cache, landed, landed_seed, seed)
            say(
                event="pulled",
                rc=rc,
                error=error,
                requests=n,
                seconds=round(took, 3),
                checked_bytes=checked,
                mismatches=bad,
            )
        elif cmd == "push":
            t0 = time.monotonic()
            rc, error, n = transfer(engine, "write", peer, cache)
            say(event="pushed", rc=rc, error=error, requests=n, seconds=round(time.monotonic() - t0, 3))
        elif cmd == "check":
            landed.update((local, source) for local, source in peer["written"])
            landed_seed = peer["remote_seed"]
            checked, bad = check(cache, landed, landed_seed, seed)
            say(event="checked", checked_bytes=checked, mismatches=bad)
        else:
            say(event="error", step="command", error=f"unknown command {line.strip()!r}")

    # Mooncake's order of teardown: unregister (it disconnects every peer first), then the
    # engine goes (the wheel has no close(): its destructor finalizes HIXL), then the memory.
    for layer, kv, base in cache.bases():
        if engine.unregister_memory(base) != 0:
            fail("unregister_memory", f"layer {layer} {'KV'[kv]} at {base:#x}: {last_error(engine)}")
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    del engine
    gc.collect()
    try:
        cache.free()
    except RuntimeError as e:
        fail("free", str(e))
    say(event="bye")


if __name__ == "__main__":
    main()
