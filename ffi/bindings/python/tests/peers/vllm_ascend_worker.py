#!/usr/bin/env python3
"""One vllm-ascend worker process, as far as KV transfer goes, on Ferry's emulated CANN.

A vllm-ascend worker reaches ACL through torch_npu; this script reaches the same library with
``ctypes``, making the calls a worker makes, in the same order:

1. load ``libascendcl.so`` from ``FERRY_ASCEND_LIB_DIR`` (``RTLD_GLOBAL``: the very object Ferry
   loads later), ``aclInit(NULL)``, ``aclrtSetDevice(0)`` on the main thread (the thread that
   then creates the engine; the card is chosen by ``ASCEND_RT_VISIBLE_DEVICES`` alone);
2. allocate each layer's K and V cache with ``aclrtMalloc(..., ACL_MEM_MALLOC_HUGE_ONLY)``;
3. ``from ferry import TransferEngine``, ``initialize(ip, "P2PHANDSHAKE", "ascend", "")``,
   ``register_memory(ptr, size)`` per tensor, without a location (vllm-ascend's
   ``GlobalTE.register_buffer``);
4. the decode side pulls selected blocks with ``batch_transfer_sync_read(session, local, remote,
   lengths)``, adjacent blocks merged into one request as the connector does, and checks every
   byte of its cache with ``aclrtMemcpy`` device-to-host.

Usage::

    vllm_ascend_worker.py prefill|decode [--ip IP] [--layers N] [--blocks N] [--block-len BYTES]
    vllm_ascend_worker.py selftest [--layers N] [--blocks N] [--block-len BYTES]

Every role prints JSON lines on stdout, each with an ``"event"``:

- ``{"event": "ready", "session", "kv_caches": [[k, v], ...], "num_blocks", "block_len",
  "acl_device", "physical_device"}`` once the engine is up and the cache registered (the
  prefill side's line is what the decode side needs: the real connector sends it over ZMQ);
- ``{"event": "error", "step", "error"}`` when a step fails (then the process exits 1);
- ``selftest`` checks the ACL plumbing only (no engine): ``{"event": "selftest", ...}``.

stdin commands (one per line):

- ``pull <json>`` (decode): ``{"session", "kv_caches", "remote_blocks", "local_blocks"}`` from
  the prefill side's ``ready`` line plus the blocks to move; answers ``{"event": "pulled", "rc",
  "error", "requests", "checked_bytes", "mismatches"}``;
- ``quit``: closes the engine, frees the cache, exits 0.

Data: block ``b`` of layer ``l``'s K (``kv`` 0) or V (``kv`` 1) tensor on the side with seed
``s`` holds ``random.Random(f"{s}/{l}/{kv}/{b}").randbytes(block_len)``: every block of every
tensor differs, so a block that lands in the wrong place is caught. Prefill's seed is 1,
decode's 2 (its own blocks must stay untouched, except the ones it pulled).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
from typing import Dict, List, Optional, Sequence, Tuple

ACL_MEM_MALLOC_HUGE_ONLY = 1
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_MEM_LOCATION_TYPE_DEVICE = 1
HUGE_PAGE = 2 << 20
SEEDS = {"prefill": 1, "decode": 2}


def say(**fields: object) -> None:
    """Prints one JSON event line on stdout."""
    print(json.dumps(fields), flush=True)


def fail(step: str, error: str) -> None:
    """Reports a failed step and exits 1."""
    say(event="error", step=step, error=error)
    sys.exit(1)


def block_bytes(seed: int, layer: int, kv: int, block: int, block_len: int) -> bytes:
    """The content of one block (see the module docstring)."""
    return random.Random(f"{seed}/{layer}/{kv}/{block}").randbytes(block_len)


class AclrtPtrAttributes(ctypes.Structure):
    """``aclrtPtrAttributes``: ``{u32 id; int type; u32 pageSize; u32 rsv[4]}``."""

    _fields_ = [
        ("id", ctypes.c_uint32),
        ("location_type", ctypes.c_int),
        ("page_size", ctypes.c_uint32),
        ("rsv", ctypes.c_uint32 * 4),
    ]


class Acl:
    """The few ACL runtime calls a vllm-ascend worker makes through torch_npu, via ctypes on
    ``path`` (default: the library in ``FERRY_ASCEND_LIB_DIR``). Each call raises
    ``RuntimeError`` with the ACL code and ``aclGetRecentErrMsg`` text when it fails."""

    def __init__(self, path: Optional[str] = None) -> None:
        if path is None:
            lib_dir = os.environ.get("FERRY_ASCEND_LIB_DIR", "")
            if not lib_dir:
                fail("load", "FERRY_ASCEND_LIB_DIR is not set")
            path = os.path.join(lib_dir.split(":")[0], "libascendcl.so")
        self.path = path
        try:
            self.lib = ctypes.CDLL(self.path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            fail("load", f"cannot load {self.path}: {e}")
        lib = self.lib
        lib.aclInit.argtypes = [ctypes.c_char_p]
        lib.aclrtSetDevice.argtypes = [ctypes.c_int32]
        lib.aclrtGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int32)]
        lib.aclrtGetPhyDevIdByUserDevId.argtypes = [ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]
        lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
        lib.aclrtFree.argtypes = [ctypes.c_void_p]
        lib.aclrtMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.aclrtPointerGetAttributes.argtypes = [ctypes.c_void_p, ctypes.POINTER(AclrtPtrAttributes)]
        lib.aclGetRecentErrMsg.restype = ctypes.c_char_p
        for name in (
            "aclInit",
            "aclrtSetDevice",
            "aclrtGetDevice",
            "aclrtGetPhyDevIdByUserDevId",
            "aclrtMalloc",
            "aclrtFree",
            "aclrtMemcpy",
            "aclrtPointerGetAttributes",
        ):
            getattr(lib, name).restype = ctypes.c_int

    def check(self, code: int, call: str) -> None:
        """Raises when an ACL call returned an error."""
        if code != 0:
            text = self.lib.aclGetRecentErrMsg()
            raise RuntimeError(f"{call} returned {code}: {text.decode(errors='replace') if text else '(no message)'}")

    def init(self) -> None:
        """``aclInit(NULL)``; a repeated initialisation is success, as torch_npu treats it."""
        code = self.lib.aclInit(None)
        if code != ACL_ERROR_REPEAT_INITIALIZE:
            self.check(code, "aclInit(NULL)")

    def set_device(self, user_id: int) -> None:
        """``aclrtSetDevice`` on the calling thread."""
        self.check(self.lib.aclrtSetDevice(user_id), f"aclrtSetDevice({user_id})")

    def get_device(self) -> int:
        """The calling thread's current (user) device."""
        out = ctypes.c_int32(-1)
        self.check(self.lib.aclrtGetDevice(ctypes.byref(out)), "aclrtGetDevice")
        return out.value

    def physical_id(self, user_id: int) -> int:
        """``aclrtGetPhyDevIdByUserDevId``."""
        out = ctypes.c_int32(-1)
        self.check(self.lib.aclrtGetPhyDevIdByUserDevId(user_id, ctypes.byref(out)), "aclrtGetPhyDevIdByUserDevId")
        return out.value

    def malloc(self, size: int) -> int:
        """``aclrtMalloc(&p, size, ACL_MEM_MALLOC_HUGE_ONLY)`` on the current device."""
        p = ctypes.c_void_p()
        self.check(self.lib.aclrtMalloc(ctypes.byref(p), size, ACL_MEM_MALLOC_HUGE_ONLY), f"aclrtMalloc({size})")
        return int(p.value or 0)

    def free(self, ptr: int) -> None:
        """``aclrtFree``."""
        self.check(self.lib.aclrtFree(ptr), f"aclrtFree({ptr:#x})")

    def write(self, dev: int, data: bytes) -> None:
        """Host to device (``aclrtMemcpy`` kind 1)."""
        self.check(
            self.lib.aclrtMemcpy(dev, len(data), data, len(data), ACL_MEMCPY_HOST_TO_DEVICE),
            f"aclrtMemcpy({dev:#x}, H2D, {len(data)})",
        )

    def read(self, dev: int, length: int) -> bytes:
        """Device to host (``aclrtMemcpy`` kind 2)."""
        buf = ctypes.create_string_buffer(length)
        self.check(
            self.lib.aclrtMemcpy(buf, length, dev, length, ACL_MEMCPY_DEVICE_TO_HOST),
            f"aclrtMemcpy({dev:#x}, D2H, {length})",
        )
        return buf.raw

    def attributes(self, ptr: int) -> AclrtPtrAttributes:
        """``aclrtPointerGetAttributes``."""
        attr = AclrtPtrAttributes()
        self.check(self.lib.aclrtPointerGetAttributes(ptr, ctypes.byref(attr)), "aclrtPointerGetAttributes")
        return attr


class KvCache:
    """``layers`` × (K, V) device tensors of ``num_blocks`` blocks of ``block_len`` bytes."""

    def __init__(self, acl: Acl, layers: int, num_blocks: int, block_len: int) -> None:
        self.acl, self.layers, self.num_blocks, self.block_len = acl, layers, num_blocks, block_len
        self.size = num_blocks * block_len
        self.tensors: List[List[int]] = []
        for _ in range(layers):
            self.tensors.append([acl.malloc(self.size), acl.malloc(self.size)])

    def fill(self, seed: int) -> None:
        """Writes the pattern of ``seed`` into every block of every tensor."""
        for layer, pair in enumerate(self.tensors):
            for kv, base in enumerate(pair):
                data = b"".join(block_bytes(seed, layer, kv, b, self.block_len) for b in range(self.num_blocks))
                self.acl.write(base, data)

    def bases(self) -> List[Tuple[int, int, int]]:
        """(layer, kv, base address) of every tensor."""
        return [(layer, kv, base) for layer, pair in enumerate(self.tensors) for kv, base in enumerate(pair)]

    def free(self) -> None:
        """Frees every tensor."""
        for _, _, base in self.bases():
            self.acl.free(base)
        self.tensors = []


def acl_objects_mapped(acl: Acl) -> List[str]:
    """The distinct files mapped into this process that provide ACL: the object this script
    loaded (mapped under its real path) and anything named like CANN's ACL or HCCL libraries.
    Ferry must bind that same object (one entry): device memory allocated through one copy of
    the runtime is unknown to another."""
    names = {os.path.basename(os.path.realpath(acl.path))}
    prefixes = ("libascendcl.so", "libhccl.so", "libhcomm.so", "libacl_rt.so")
    seen: Dict[Tuple[int, int], str] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            path = parts[5].strip()
            base = os.path.basename(path)
            if base in names or base.startswith(prefixes):
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                seen[(info.st_dev, info.st_ino)] = path
    return sorted(seen.values())


def merge_runs(local: Sequence[int], remote: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(local block, remote block, count) runs: consecutive pairs whose local and remote blocks
    both advance by one are merged, as vllm-ascend's ``group_concurrent_contiguous`` does."""
    runs: List[Tuple[int, int, int]] = []
    for lb, rb in zip(local, remote):
        if runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == rb:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lb, rb, 1))
    return runs


def verify(cache: KvCache, pulled: Dict[int, int], remote_seed: int, own_seed: int) -> Tuple[int, List[str]]:
    """Checks every byte of every tensor: a pulled local block must equal the remote block it
    came from, every other block must still hold this side's own pattern. Returns (bytes
    checked, descriptions of the first mismatches)."""
    checked, bad = 0, []
    for layer, kv, base in cache.bases():
        got_all = cache.acl.read(base, cache.size)
        for b in range(cache.num_blocks):
            got = got_all[b * cache.block_len : (b + 1) * cache.block_len]
            if b in pulled:
                want, what = (
                    block_bytes(remote_seed, layer, kv, pulled[b], cache.block_len),
                    f"remote block {pulled[b]}",
                )
            else:
                want, what = block_bytes(own_seed, layer, kv, b, cache.block_len), "its own (untouched) content"
            checked += len(got)
            if got != want:
                first = next(i for i in range(len(got)) if got[i] != want[i])
                zero = " (all zero)" if got.count(0) == len(got) else ""
                bad.append(
                    f"layer {layer} {'KV'[kv]} local block {b}: byte {first} is {got[first]}, expected {want[first]} "
                    f"from {what}{zero}"
                )
    return checked, bad[:20]


def selftest(acl: Acl, cache: KvCache) -> None:
    """Checks the plumbing the transfer test relies on, without any engine: the device the
    thread is on, its physical id, the allocations' alignment and location, and that a pattern
    written host-to-device reads back device-to-host unchanged."""
    cache.fill(SEEDS["prefill"])
    checked, bad = verify(cache, {}, 0, SEEDS["prefill"])
    # The check must be able to fail: one flipped byte in the last tensor's block 1 is found.
    _, _, last = cache.bases()[-1]
    spot = last + cache.block_len + 7
    acl.write(spot, bytes([acl.read(spot, 1)[0] ^ 0xFF]))
    _, caught = verify(cache, {}, 0, SEEDS["prefill"])
    attrs = [acl.attributes(base + cache.block_len) for _, _, base in cache.bases()]
    user = acl.get_device()
    say(
        event="selftest",
        library=acl.path,
        acl_device=user,
        physical_device=acl.physical_id(user),
        aligned_2mib=all(base % HUGE_PAGE == 0 for _, _, base in cache.bases()),
        locations=[a.location_type for a in attrs],
        page_sizes=[a.page_size for a in attrs],
        checked_bytes=checked,
        mismatches=bad,
        corruption_found=caught,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=["prefill", "decode", "selftest"])
    ap.add_argument("--ip", default="127.0.0.1")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--block-len", type=int, default=64 << 10)
    args = ap.parse_args()

    # What torch_npu does when the worker starts: the card is the one ASCEND_RT_VISIBLE_DEVICES
    # leaves visible, user id 0, set on this (the main) thread.
    acl = Acl()
    try:
        acl.init()
        acl.set_device(0)
        cache = KvCache(acl, args.layers, args.blocks, args.block_len)
    except RuntimeError as e:
        fail("acl", str(e))
    if args.role == "selftest":
        selftest(acl, cache)
        cache.free()
        return
    seed = SEEDS[args.role]
    cache.fill(seed)

    # What vllm-ascend's GlobalTE does once the device is set and the KV caches exist.
    from ferry import TransferEngine

    engine = TransferEngine()
    if engine.initialize(args.ip, "P2PHANDSHAKE", "ascend", "") != 0:
        fail("initialize", engine.last_error())
    for layer, kv, base in cache.bases():
        if engine.register_memory(base, cache.size) != 0:
            fail("register_memory", f"layer {layer} {'KV'[kv]} at {base:#x}: {engine.last_error()}")
    user = acl.get_device()
    say(
        event="ready",
        session=f"{args.ip}:{engine.get_rpc_port()}",
        kv_caches=cache.tensors,
        num_blocks=cache.num_blocks,
        block_len=cache.block_len,
        acl_device=user,
        physical_device=acl.physical_id(user),
        acl_objects=acl_objects_mapped(acl),
    )

    for line in sys.stdin:
        cmd, _, rest = line.strip().partition(" ")
        if cmd == "quit":
            break
        if cmd == "pull":
            peer = json.loads(rest)
            runs = merge_runs(peer["local_blocks"], peer["remote_blocks"])
            local, remote, lengths = [], [], []
            for layer, pair in enumerate(cache.tensors):
                for kv, base in enumerate(pair):
                    remote_base = peer["kv_caches"][layer][kv]
                    for lb, rb, n in runs:
                        local.append(base + lb * cache.block_len)
                        remote.append(remote_base + rb * cache.block_len)
                        lengths.append(n * cache.block_len)
            rc = engine.batch_transfer_sync_read(peer["session"], local, remote, lengths)
            error = engine.last_error() if rc != 0 else ""
            pulled = dict(zip(peer["local_blocks"], peer["remote_blocks"]))
            try:
                checked, bad = verify(cache, pulled, SEEDS["prefill"], seed)
            except RuntimeError as e:
                checked, bad = 0, [f"cannot read the cache back: {e}"]
            say(event="pulled", rc=rc, error=error, requests=len(lengths), checked_bytes=checked, mismatches=bad)
        else:
            say(event="error", step="command", error=f"unknown command {line.strip()!r}")
    engine.close()
    cache.free()


if __name__ == "__main__":
    main()
