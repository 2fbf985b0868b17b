"""The calls inference engines make on `mooncake.engine.TransferEngine`, in their order and with
their arguments (from their sources: vLLM's MooncakeConnector, SGLang's
disaggregation/mooncake/transfer_engine.py, vllm-ascend's Mooncake connector), written against
`mooncake.engine` only so it runs on Mooncake's wheel and on Ferry (the alias).

  connector_calls.py kv PROTOCOL LAYERS BLOCKS BLOCK_LEN SEED
      A KV cache of LAYERS tensors (BLOCKS blocks of BLOCK_LEN bytes each, filled with pattern
      SEED + layer), registered as vLLM and SGLang do (batch_register_memory, location "*").
      Prints {"session", "bases"} (session = f"{ip}:{get_rpc_port()}"), then answers
        check LAYER BLOCK SEED   -> "ok" / "mismatch"
  connector_calls.py push PROTOCOL SESSION BASES LAYERS BLOCKS BLOCK_LEN SEED PAIRS
      vLLM's and SGLang's prefill side: its own KV cache (pattern SEED + layer), SGLang's
      send_probe of the decode session, then for each (local block, remote block) pair list
      PAIRS ("0:5,1:6,2:7") one batch_transfer_sync_write per layer with adjacent runs merged,
      from a thread pool. Prints {"probe", "rcs"}.
  connector_calls.py pull PROTOCOL SESSION BASES LAYERS BLOCKS BLOCK_LEN PAIRS
      vllm-ascend's decode side: register_memory(ptr, size) without a location per layer, then
      batch_transfer_sync_read of the pairs. Prints {"rcs", "blocks"} where blocks maps
      "layer:block" to the first 8 bytes read (hex) for the test to check.
"""

import ctypes
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from mooncake.engine import TransferEngine

BASE = bytes(range(251))


def pattern(length, seed):
    start = seed % 251
    return (BASE * ((start + length) // 251 + 1))[start : start + length]


def start(protocol):
    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        sys.exit(f"initialize(127.0.0.1, P2PHANDSHAKE, {protocol}, '') returned {rc}")
    return e, f"127.0.0.1:{e.get_rpc_port()}"


def cache(layers, blocks, block_len, seed):
    tensors = []
    for layer in range(layers):
        t = (ctypes.c_ubyte * (blocks * block_len))()
        if seed is not None:
            ctypes.memmove(t, pattern(blocks * block_len, seed + layer), blocks * block_len)
        tensors.append(t)
    return tensors


def runs(pairs):
    """Adjacent (local, remote) pairs merged into (local, remote, count) runs, as vLLM does."""
    out = []
    for lo, re in sorted(pairs):
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == re:
            out[-1][2] += 1
        else:
            out.append([lo, re, 1])
    return out


mode, protocol = sys.argv[1], sys.argv[2]
if mode == "kv":
    layers, blocks, block_len, seed = map(int, sys.argv[3:7])
    engine, session = start(protocol)
    tensors = cache(layers, blocks, block_len, seed)
    bases = [ctypes.addressof(t) for t in tensors]
    rc = engine.batch_register_memory(bases, [blocks * block_len] * layers)
    if rc != 0:
        sys.exit(f"batch_register_memory returned {rc}")
    print(json.dumps({"session": session, "bases": bases}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "check":
            layer, block, want = map(int, words[1:4])
            got = ctypes.string_at(bases[layer] + block * block_len, block_len)
            expect = pattern(blocks * block_len, want + layer)[block * block_len : (block + 1) * block_len]
            print("ok" if got == expect else "mismatch", flush=True)
        elif words and words[0] == "quit":
            break
elif mode == "push":
    session, bases = sys.argv[3], json.loads(sys.argv[4])
    layers, blocks, block_len, seed = map(int, sys.argv[5:9])
    pairs = [tuple(map(int, p.split(":"))) for p in sys.argv[9].split(",")]
    engine, _ = start(protocol)
    tensors = cache(layers, blocks, block_len, seed)
    mine = [ctypes.addressof(t) for t in tensors]
    assert engine.batch_register_memory(mine, [blocks * block_len] * layers) == 0
    probe = engine.send_probe(session)  # SGLANG_ENABLE_FAILED_SESSION_PROBE=1: no try around it
    jobs = []
    for layer in range(layers):
        src, dst, lens = [], [], []
        for lo, re, n in runs(pairs):
            src.append(mine[layer] + lo * block_len)
            dst.append(bases[layer] + re * block_len)
            lens.append(n * block_len)
        jobs.append((src, dst, lens))
    with ThreadPoolExecutor(max_workers=4) as pool:
        rcs = list(pool.map(lambda j: engine.batch_transfer_sync_write(session, *j), jobs))
    print(json.dumps({"probe": probe, "rcs": rcs}), flush=True)
elif mode == "pull":
    session, bases = sys.argv[3], json.loads(sys.argv[4])
    layers, blocks, block_len = map(int, sys.argv[5:8])
    pairs = [tuple(map(int, p.split(":"))) for p in sys.argv[8].split(",")]
    engine, _ = start(protocol)
    tensors = cache(layers, blocks, block_len, None)
    mine = [ctypes.addressof(t) for t in tensors]
    for addr in mine:
        assert engine.register_memory(addr, blocks * block_len) == 0
    rcs, seen = [], {}
    for layer in range(layers):
        src, dst, lens = [], [], []
        for lo, re, n in runs(pairs):
            src.append(mine[layer] + lo * block_len)
            dst.append(bases[layer] + re * block_len)
            lens.append(n * block_len)
        rcs.append(engine.batch_transfer_sync_read(session, src, dst, lens))
        for lo, re in pairs:
            seen[f"{layer}:{lo}"] = ctypes.string_at(mine[layer] + lo * block_len, block_len).hex()
    print(json.dumps({"rcs": rcs, "blocks": seen}), flush=True)
