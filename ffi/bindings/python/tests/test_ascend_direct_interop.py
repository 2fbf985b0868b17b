"""Ferry's ``ascend`` transport and Mooncake's ``ascend_direct``, judged by the real Mooncake NPU
wheel, on Ferry's emulated CANN and emulated HIXL.

**What this proves and what it does not.** Both sides of every transfer here use the emulated
HIXL (``ffi/ascend/cann-emu``) between them, so these tests prove Ferry's use of HIXL's API and of
Mooncake's ``ascend_direct`` descriptor, and that the emulator carries the C++ the real wheel
inlines (``std::map`` options, ``std::make_shared<adxl::AdxlEngine>``, ``ge::AscendString``
copies). They do not prove anything about HIXL's own wire protocol, and nothing here ran on an
NPU.

The Mooncake side is ``mooncake-transfer-engine-npu`` 0.3.13.post1 (``.venv-mooncake-npu``,
installed by ``scripts/test.sh``; ``$FERRY_MOONCAKE_NPU_PYTHON``), unmodified, loading CANN the
way it does on a real machine: by name, through ``LD_LIBRARY_PATH``, from a directory where the
emulator is linked as ``libascendcl.so``, ``libhccl.so``, ``libllm_datadist.so``,
``libcann_hixl.so`` and ``libmetadef.so``. The Ferry side is Ferry's Python package
(``from ferry import TransferEngine``, protocol ``ascend``, the drop-in API) with CANN from the
same directory (``FERRY_ASCEND_LIB_DIR``). Both run ``peers/mooncake_npu_peer.py`` (``--engine
mooncake`` or ``--engine ferry``): ``aclrtSetDevice``, a KV cache of 2 layers × K/V × 32 blocks
of 64 KiB from the emulated ``aclrtMalloc``, every block filled with a pattern of (side, layer,
K/V, block), ``initialize(ip, "P2PHANDSHAKE", "ascend", "")``, ``register_memory(ptr, size)``.
The decode side pulls non-contiguous blocks (``batch_transfer_sync_read``; once also
``transfer_sync_read``), or the prefill side pushes them (``batch_transfer_sync_write``; once
also ``transfer_sync_write``); then the receiving side reads its whole cache back with
``aclrtMemcpy`` and every byte is checked: moved blocks hold their source's pattern, every
other block is untouched. Each transfer must also appear in the initiator's emulator call log
as a successful HIXL ``TransferSync`` (or ``TransferAsync``) to the target's engine. One test
kills the prefill process between two pulls: the second must fail and touch nothing.

The Ferry ↔ Mooncake tests hold Ferry to the issue's contract: Ferry publishes Mooncake's
``ascend_direct`` descriptor (``rank_info.hostIp``, ``rank_info.endpoints``, per-buffer
``device_id``) and uses HIXL for a peer whose descriptor has ``endpoints``.

**Ports and devices.** Mooncake's HIXL engine listens on a random free port in
``[ASCEND_BASE_PORT + 100 × physical id, ... + 100]`` (``ASCEND_BASE_PORT`` defaults to 20000;
Mooncake's ``utils.cpp``). Each test has a slot of its own: two emulated devices
(``2 × slot``, ``2 × slot + 1``), its own ``ASCEND_BASE_PORT`` and its own device network in
``hccn.conf``, so the tests can run in parallel with each other and with the rest of the
suite. ``ASCEND_BASE_PORT = 21000 + 700 × slot`` puts a slot's HIXL ports at
``21000 + 900 × slot + [0, 200]``: disjoint, and below Linux's ephemeral range. Tests may also
set Mooncake's own ``ASCEND_*`` switches, as its users do (``MOONCAKE_MODES``).

Run only these tests (after ``cargo build -p ferry-cann-emu`` and, for the Ferry side, ``pip
install ./ffi/bindings/python``; see ``scripts/test.sh``)::

    FERRY_MOONCAKE_NPU_PYTHON=$PWD/.venv-mooncake-npu/bin/python \\
        .venv-ferry/bin/python -m pytest -q ffi/bindings/python/tests/test_ascend_direct_interop.py

A child's stderr (the emulator's call log, ``FERRY_CANN_EMU_LOG=1``, and Mooncake's glog lines)
is shown when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

from _support import (
    CANN_LIBRARY_NAMES,
    HIXL_LIBRARY_NAMES,
    PEERS,
    Child,
    emulated_cann,
    emulator_library,
    fetch_descriptor,
    is_identity_variable,
    mooncake_npu_python,
)

PEER = PEERS / "mooncake_npu_peer.py"
LAYERS, BLOCKS, BLOCK_LEN = 2, 32, 64 << 10
TENSORS = 2 * LAYERS
# Non-contiguous on both sides; remote 15,16 -> local 9,10 is one run (one merged request).
REMOTE_BLOCKS = [3, 7, 8, 15, 16]
LOCAL_BLOCKS = [0, 1, 5, 9, 10]
# A second pull or push, one transfer_sync_read/_write per tensor (20,21 -> 30,31 is one run).
SINGLE_REMOTE, SINGLE_LOCAL = [20, 21], [30, 31]
# How long one transfer may take (Mooncake's transfer and connect timeouts are 10 s each; it
# retries once after refreshing the peer's descriptor).
TRANSFER_WAIT_S = 90.0
SEEDS = {"prefill": 1, "decode": 2}  # as in peers/vllm_ascend_worker.py


class Interop:
    """One test's emulated Atlas node: a CANN + HIXL library directory, an ``hccn.conf`` giving
    physical card N the address ``127.<50 + slot>.0.<N + 1>``, two emulated devices and an
    ``ASCEND_BASE_PORT`` of the test's own (see the module docstring), and the peers started."""

    def __init__(self, root: Path, slot: int) -> None:
        self.lib_dir = emulated_cann(root / "cann", hixl=True)
        self.hccn_conf = root / "hccn.conf"
        self.hccn_conf.write_text("".join(f"address_{d}=127.{50 + slot}.0.{d + 1}\n" for d in range(32)))
        self.devices = {"prefill": 2 * slot, "decode": 2 * slot + 1}
        self.base_port = 21000 + 700 * slot
        self.children: Dict[str, Child] = {}

    def env(self, engine: str, extra: Dict[str, str]) -> Dict[str, str]:
        """A peer's environment. Mooncake finds CANN as on a real machine (``LD_LIBRARY_PATH``,
        as CANN's ``set_env.sh`` sets it); Ferry is told its directory (``FERRY_ASCEND_LIB_DIR``)
        and where device IPs are (``FERRY_HCCN_CONF``, for its direct HCCL backend). Both get
        the test's ``ASCEND_BASE_PORT``, Mooncake's variable for the HIXL listen ports; then
        ``extra``."""
        env = {
            "ASCEND_BASE_PORT": str(self.base_port),
            "FERRY_CANN_EMU_DEVICES": "32",
            # The emulator's call log (stderr), shown when a test fails.
            "FERRY_CANN_EMU_LOG": "1",
        }
        if engine == "mooncake":
            env["LD_LIBRARY_PATH"] = str(self.lib_dir)
        else:
            env.update(
                {
                    "FERRY_ASCEND_LIB_DIR": str(self.lib_dir),
                    "FERRY_HCCN_CONF": str(self.hccn_conf),
                    "FERRY_TRANSFER_TIMEOUT_MS": "20000",
                    "HCCL_CONNECT_TIMEOUT": "20",
                }
            )
        return {**env, **extra}

    def start(self, role: str, engine: str, extra: Optional[Dict[str, str]] = None) -> Peer:
        """Starts ``role`` (prefill or decode) on ``engine`` (mooncake or ferry) with ``extra``
        in its environment, waits for its ``ready`` line and checks it."""
        python = str(mooncake_npu_python()) if engine == "mooncake" else sys.executable
        argv = [python, str(PEER), role, "--engine", engine, "--device", str(self.devices[role])]
        argv += ["--layers", str(LAYERS), "--blocks", str(BLOCKS), "--block-len", str(BLOCK_LEN)]
        unset = [k for k in os.environ if is_identity_variable(k) or k == "LD_LIBRARY_PATH"]
        name = f"{engine} {role}"
        self.children[name] = Child(argv, env=self.env(engine, extra or {}), unset=unset)
        peer = Peer(name, self.children[name], self)
        peer.ready = peer.event("ready", timeout=120)
        r = peer.ready
        assert (r["acl_device"], r["physical_device"]) == (self.devices[role], self.devices[role]), r
        assert r["seed"] == SEEDS[role], r
        assert re.fullmatch(r"127\.0\.0\.1:\d+", r["session"]), r
        assert len(r["kv_caches"]) == LAYERS and all(len(kv) == 2 for kv in r["kv_caches"]), r
        emulator = os.path.realpath(emulator_library())
        assert r["acl_objects"] == [emulator], (
            f"{name}: ACL must be the emulator, loaded once and shared with the engine: {r['acl_objects']}"
        )
        rank = fetch_descriptor(r["session"]).get("rank_info") or {}
        peer.endpoint = (rank.get("endpoints") or [None])[0]
        return peer

    def report(self) -> str:
        """Every child's stderr, for a failure message."""
        return "\n" + "\n".join(stderr_report(name, child) for name, child in self.children.items())

    def close(self) -> None:
        for child in self.children.values():
            child.close()


_FAILED_CALL = re.compile(r"^\[ferry-cann-emu [^\]]*\] .*\) -> -?[1-9]")


def stderr_report(name: str, child: Child) -> str:
    """A child's stderr: every distinct emulator call that failed (handles and addresses folded,
    with how often), then the last lines of everything else (Mooncake's log, tracebacks)."""
    child._stderr.flush()
    lines = child.stderr_path.read_text(errors="replace").splitlines()
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


class Peer:
    """A started peer: its ``ready`` line and its commands."""

    def __init__(self, name: str, child: Child, node: Interop) -> None:
        self.name, self.child, self.node = name, child, node
        self.ready: Dict[str, Any] = {}
        self.endpoint: Optional[str] = None  # its HIXL engine, from its descriptor

    def hixl_calls(self, method: str, target: Optional[str] = None, args: str = ".*", result: str = "0") -> int:
        """How many calls of HIXL's ``method`` (a regex; ``adxl::`` or ``hixl::``) on an engine
        answered ``result`` in this peer (the emulator's call log). With ``target``, only calls
        whose first argument is that engine name and whose remaining arguments match ``args``."""
        rest = rf"{re.escape(json.dumps(target))}(?:, {args})?" if target is not None else ".*"
        call = re.compile(
            rf"^\[ferry-cann-emu [^\]]*\] (?:adxl|hixl)\.(?:{method})\(0x[0-9a-f]+, {rest}\) -> {result}$"
        )
        self.child._stderr.flush()
        text = self.child.stderr_path.read_text(errors="replace")
        return sum(1 for line in text.splitlines() if call.match(line))

    def hixl_transfers(self, target: Optional[str], op: int) -> int:
        """How many ``TransferSync``/``TransferAsync`` calls with ``op`` (0 READ, 1 WRITE) to the
        HIXL engine ``target`` succeeded in this peer."""
        if target is None:
            return 0
        return self.hixl_calls("TransferSync|TransferAsync", target, rf"op {op}, .*")

    def over_hixl(self, other: Peer, op: int, before: int, what: str) -> None:
        """The transfer just made went to ``other``'s HIXL engine through the emulated HIXL."""
        assert self.hixl_transfers(other.endpoint, op) > before, (
            f"{self.name} {what} {other.name} without a successful HIXL TransferSync/TransferAsync "
            f"(op {op}) to its engine {other.endpoint} in the emulator's call log" + self.node.report()
        )

    def event(self, want: str, timeout: float = 60.0) -> Dict[str, Any]:
        """The peer's next JSON line, which must be event ``want``."""
        try:
            line = self.child.readline(timeout)
        except AssertionError as e:
            raise AssertionError(f"{self.name}: {e}{self.node.report()}") from None
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"{self.name} printed {line!r}, not a JSON event{self.node.report()}") from None
        assert event.get("event") == want, (
            f"{self.name}: expected {want!r}, got {event.get('event')!r}"
            + (f" at {event.get('step')}: {event.get('error')}" if event.get("event") == "error" else f": {event}")
            + self.node.report()
        )
        return event

    def command(self, cmd: str, body: Dict[str, Any], want: str, timeout: float = TRANSFER_WAIT_S) -> Dict[str, Any]:
        self.child.send(f"{cmd} {json.dumps(body)}")
        return self.event(want, timeout)

    def blocks_of(self, other: Peer, remote: List[int], local: List[int], **extra: Any) -> Dict[str, Any]:
        """A pull/push request for ``other``'s blocks ``remote`` and this side's ``local``."""
        return {
            "session": other.ready["session"],
            "kv_caches": other.ready["kv_caches"],
            "remote_blocks": remote,
            "local_blocks": local,
            "remote_seed": other.ready["seed"],
            **extra,
        }

    def pull(self, other: Peer, remote: List[int], local: List[int], single: bool = False) -> None:
        """Pulls ``other``'s blocks ``remote`` into ``local`` and checks every byte of this
        side's cache."""
        what = "transfer_sync_read per request" if single else "batch_transfer_sync_read"
        before = self.hixl_transfers(other.endpoint, 0)
        got = self.command("pull", self.blocks_of(other, remote, local, single=single), "pulled")
        assert got["requests"] == TENSORS * len(merged_runs(local, remote)), got
        assert got["checked_bytes"] == TENSORS * BLOCKS * BLOCK_LEN, got
        assert got["rc"] == 0 and got["mismatches"] == [], (
            f"{self.name} pulling {remote} -> {local} from {other.name} ({what}): rc {got['rc']} "
            f"({got['error'] or 'no error text'}); {len(got['mismatches'])} block(s) wrong:\n  "
            + "\n  ".join(got["mismatches"])
            + self.node.report()
        )
        self.over_hixl(other, 0, before, "pulled from")

    def push(self, other: Peer, local: List[int], remote: List[int], single: bool = False) -> None:
        """Pushes this side's blocks ``local`` into ``other``'s ``remote``; ``other`` checks
        every byte of its cache."""
        what = "transfer_sync_write per request" if single else "batch_transfer_sync_write"
        before = self.hixl_transfers(other.endpoint, 1)
        got = self.command("push", self.blocks_of(other, remote, local, single=single), "pushed")
        assert got["requests"] == TENSORS * len(merged_runs(local, remote)), got
        assert got["rc"] == 0, (
            f"{self.name} pushing {local} -> {remote} into {other.name} ({what}): rc "
            f"{got['rc']} ({got['error'] or 'no error text'})" + self.node.report()
        )
        self.over_hixl(other, 1, before, "pushed into")
        checked = other.command(
            "check", {"written": [list(p) for p in zip(remote, local)], "remote_seed": self.ready["seed"]}, "checked"
        )
        assert checked["checked_bytes"] == TENSORS * BLOCKS * BLOCK_LEN, checked
        assert checked["mismatches"] == [], (
            f"{other.name} after {self.name} pushed {local} -> {remote}: {len(checked['mismatches'])} block(s) "
            "wrong:\n  " + "\n  ".join(checked["mismatches"]) + self.node.report()
        )

    def quit(self) -> None:
        """Unregisters, closes the engine, frees the cache; must exit 0."""
        self.child.send("quit")
        self.event("bye", timeout=60)
        code = self.child.proc.wait(timeout=30)
        assert code == 0, f"{self.name} exited {code}{self.node.report()}"


def merged_runs(local: List[int], remote: List[int]) -> List[tuple]:
    """The runs the peer merges adjacent block pairs into (one request each)."""
    runs: List[list] = []
    for lb, rb in zip(local, remote):
        if runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == rb:
            runs[-1][2] += 1
        else:
            runs.append([lb, rb, 1])
    return [tuple(r) for r in runs]


@pytest.fixture
def interop(tmp_path) -> Iterator[Callable[[int], Interop]]:
    """``interop(slot)``: the test's node (one per test; its children are closed at the end)."""
    nodes: List[Interop] = []

    def make(slot: int) -> Interop:
        assert not nodes, "one node per test"
        nodes.append(Interop(tmp_path, slot))
        return nodes[0]

    yield make
    for node in nodes:
        node.close()


def check_mooncake_descriptor(peer: Peer, base_port: int, device: int) -> None:
    """The descriptor a Mooncake ``ascend_direct`` node serves over the P2P handshake, as the
    facts say (docs/research/hixl-interop-facts.md §3.1, §3.2)."""
    d = fetch_descriptor(peer.ready["session"])
    assert d.get("protocol") == "ascend", d
    rank = d.get("rank_info", {})
    assert rank.get("hostIp") == "127.0.0.1", rank
    endpoints = rank.get("endpoints")
    assert isinstance(endpoints, list) and len(endpoints) == 1, f"one HIXL engine per process: {rank}"
    host, port = endpoints[0].rsplit(":", 1)
    low = base_port + 100 * device
    assert host == "127.0.0.1" and low <= int(port) <= low + 100, (
        f"Mooncake's listen port is ASCEND_BASE_PORT + 100 × physical id + [0, 100]: {endpoints[0]} "
        f"with ASCEND_BASE_PORT={base_port}, device {device}"
    )
    buffers = {b["addr"]: b for b in d.get("buffers", [])}
    for pair in peer.ready["kv_caches"]:
        for addr in pair:
            b = buffers.get(addr)
            assert b is not None, f"{addr:#x} is not in {peer.name}'s descriptor: {d['buffers']}"
            assert b["length"] == BLOCKS * BLOCK_LEN and b.get("device_id") == device, b


# --- the wheel alone ------------------------------------------------------------------------


LOAD_PROBE = """
import json, os, sys
from mooncake.engine import TransferEngine
TransferEngine()
names = tuple(sys.argv[1:])
seen = set()
for line in open("/proc/self/maps"):
    parts = line.split(maxsplit=5)
    if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(names):
        seen.add(parts[5].strip())
print(json.dumps(sorted(seen)))
"""


def run_probe(lib_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not is_identity_variable(k) and k != "LD_LIBRARY_PATH"}
    env["LD_LIBRARY_PATH"] = str(lib_dir)
    return subprocess.run(
        [
            str(mooncake_npu_python()),
            "-c",
            LOAD_PROBE,
            *CANN_LIBRARY_NAMES,
            *HIXL_LIBRARY_NAMES,
            "libferry_cann_emu.so",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_the_wheel_loads_on_the_emulated_cann_and_hixl_and_on_nothing_else(tmp_path):
    """``import mooncake.engine`` resolves every CANN and HIXL symbol the wheel imports
    (Python loads it with ``RTLD_NOW``) from the emulator, one object under all five names; a
    CANN directory without HIXL's libraries does not load it (so nothing else on the machine
    stands in for the emulator, and the fallback tests' directories stay HIXL-free)."""
    full = run_probe(emulated_cann(tmp_path / "with-hixl", hixl=True))
    assert full.returncode == 0, (
        f"the Mooncake NPU wheel does not load on the emulated CANN + HIXL "
        f"({', '.join(CANN_LIBRARY_NAMES + HIXL_LIBRARY_NAMES)} -> {emulator_library()}):\n{full.stderr[-3000:]}"
    )
    mapped = json.loads(full.stdout.strip().splitlines()[-1])
    assert mapped == [os.path.realpath(emulator_library())], f"CANN/HIXL objects mapped: {mapped}"

    bare = run_probe(emulated_cann(tmp_path / "without-hixl"))
    assert bare.returncode != 0 and "libllm_datadist.so" in bare.stderr, (
        f"without HIXL's libraries the wheel must fail to load naming libllm_datadist.so:\n"
        f"rc {bare.returncode}\n{bare.stdout}\n{bare.stderr[-3000:]}"
    )


# --- Mooncake <-> Mooncake: the emulator against the wheel's own inlined C++ ----------------


# How Mooncake's users run ascend_direct (its ASCEND_* variables): the 0.3.13 default (HIXL's
# AutoConnect, TransferSync), an explicit Connect before the first transfer
# (ASCEND_AUTO_CONNECT=0), and TransferAsync polled with GetTransferStatus
# (ASCEND_USE_ASYNC_TRANSFER; any value enables it).
MOONCAKE_MODES = {
    "auto-connect": {},
    "explicit-connect": {"ASCEND_AUTO_CONNECT": "0"},
    "async": {"ASCEND_USE_ASYNC_TRANSFER": "1"},
}


def check_mode(initiator: Peer, target: Peer, mode: str) -> None:
    """The initiator's HIXL calls show that ``mode`` took effect."""
    connects = initiator.hixl_calls("Connect", target.endpoint, r"\d+ ms")
    syncs = initiator.hixl_calls("TransferSync", target.endpoint)
    asyncs = initiator.hixl_calls("TransferAsync", target.endpoint)
    polls = initiator.hixl_calls("GetTransferStatus", None)
    counts = f"Connect {connects}, TransferSync {syncs}, TransferAsync {asyncs}, GetTransferStatus {polls}"
    if mode == "auto-connect":
        assert connects == 0 and syncs > 0 and asyncs == 0, f"{initiator.name} ({mode}): {counts}"
    elif mode == "explicit-connect":
        assert connects == 1 and syncs > 0, f"{initiator.name} ({mode}): one Connect, then TransferSync: {counts}"
    else:
        assert asyncs > 0 and polls >= asyncs and syncs == 0, f"{initiator.name} ({mode}): {counts}"


@pytest.mark.parametrize("mode,slot", [(m, i) for i, m in enumerate(MOONCAKE_MODES)], ids=list(MOONCAKE_MODES))
def test_mooncake_decode_pulls_from_mooncake_prefill(interop, mode, slot):
    """Two Mooncake processes: decode pulls blocks 3, 7, 8, 15, 16 of every tensor into 0, 1, 5,
    9, 10 in one ``batch_transfer_sync_read``, then 20, 21 into 30, 31 with
    ``transfer_sync_read``; every byte of decode's cache is checked after each. Both
    descriptors are Mooncake's ``ascend_direct`` shape, on its port scheme."""
    node = interop(slot)
    prefill = node.start("prefill", "mooncake", MOONCAKE_MODES[mode])
    check_mooncake_descriptor(prefill, node.base_port, node.devices["prefill"])
    decode = node.start("decode", "mooncake", MOONCAKE_MODES[mode])
    check_mooncake_descriptor(decode, node.base_port, node.devices["decode"])
    decode.pull(prefill, REMOTE_BLOCKS, LOCAL_BLOCKS)
    decode.pull(prefill, SINGLE_REMOTE, SINGLE_LOCAL, single=True)
    check_mode(decode, prefill, mode)
    decode.quit()
    prefill.quit()


@pytest.mark.parametrize(
    "mode,slot", [(m, len(MOONCAKE_MODES) + i) for i, m in enumerate(MOONCAKE_MODES)], ids=list(MOONCAKE_MODES)
)
def test_mooncake_prefill_pushes_into_mooncake_decode(interop, mode, slot):
    """Two Mooncake processes: prefill writes its blocks 3, 7, 8, 15, 16 of every tensor into
    decode's 0, 1, 5, 9, 10 in one ``batch_transfer_sync_write``, then 20, 21 into 30, 31 with
    ``transfer_sync_write``; every byte of decode's cache is checked after each."""
    node = interop(slot)
    prefill = node.start("prefill", "mooncake", MOONCAKE_MODES[mode])
    decode = node.start("decode", "mooncake", MOONCAKE_MODES[mode])
    prefill.push(decode, REMOTE_BLOCKS, LOCAL_BLOCKS)
    prefill.push(decode, SINGLE_REMOTE, SINGLE_LOCAL, single=True)
    check_mode(prefill, decode, mode)
    prefill.quit()
    decode.quit()


def test_a_mooncake_pull_from_a_dead_prefill_fails_and_leaves_the_cache_alone(interop):
    """After one good pull, the prefill process is killed; the next pull must fail (rc < 0,
    not hang), leave every block of decode's cache as it was, and decode must still shut down
    cleanly: the emulated HIXL reports a vanished peer to the real wheel as HIXL would."""
    node = interop(6)
    prefill = node.start("prefill", "mooncake")
    decode = node.start("decode", "mooncake")
    decode.pull(prefill, REMOTE_BLOCKS, LOCAL_BLOCKS)
    prefill.child.proc.kill()
    prefill.child.proc.wait(timeout=30)
    got = decode.command("pull", decode.blocks_of(prefill, SINGLE_REMOTE, SINGLE_LOCAL), "pulled")
    assert got["rc"] < 0, f"a pull from a killed process must fail: {got}{node.report()}"
    assert got["checked_bytes"] == TENSORS * BLOCKS * BLOCK_LEN, got
    assert got["mismatches"] == [], (
        "a failed pull must leave decode's cache as it was:\n  " + "\n  ".join(got["mismatches"]) + node.report()
    )
    decode.quit()


# --- Ferry <-> Mooncake -----------------------------------------------------------------------


def check_ferry_descriptor(peer: Peer, base_port: int, device: int) -> None:
    """Ferry publishes what a Mooncake ``ascend_direct`` initiator needs ("Mooncake's
    descriptor shape"): ``rank_info.hostIp``, ``rank_info.endpoints`` (its HIXL engine's
    ``ip:port``, on Mooncake's port scheme) and each buffer's ``device_id`` (what Mooncake
    publishes: the registering thread's ``aclrtGetDevice``)."""
    d = fetch_descriptor(peer.ready["session"])
    rank = d.get("rank_info") or {}
    endpoints = rank.get("endpoints")
    assert rank.get("hostIp") == "127.0.0.1" and isinstance(endpoints, list) and len(endpoints) == 1, (
        f"Ferry's descriptor must carry Mooncake's rank_info.hostIp and one rank_info.endpoints entry "
        f"(its HIXL engine), got rank_info {rank}"
    )
    host, port = endpoints[0].rsplit(":", 1)
    low = base_port + 100 * device
    assert host == "127.0.0.1" and low <= int(port) <= low + 100, (
        f"Ferry's HIXL engine must listen on Mooncake's scheme, ASCEND_BASE_PORT + 100 × physical id + "
        f"[0, 100]: {endpoints[0]} with ASCEND_BASE_PORT={base_port}, device {device}"
    )
    buffers = {b.get("addr"): b for b in d.get("buffers", [])}
    for pair in peer.ready["kv_caches"]:
        for addr in pair:
            b = buffers.get(addr)
            assert b is not None and b.get("length") == BLOCKS * BLOCK_LEN, f"{addr:#x}: {d.get('buffers')}"
            assert b.get("device_id") == device, f"each buffer's device_id must be its device, {device}: {b}"


def test_ferry_decode_pulls_from_mooncake_prefill(interop):
    """Mooncake prefill, Ferry decode: Ferry finds ``endpoints`` in Mooncake's descriptor, uses
    HIXL, pulls blocks 3, 7, 8, 15, 16 into 0, 1, 5, 9, 10 (``batch_transfer_sync_read``) and
    20, 21 into 30, 31 (``transfer_sync_read``); every byte checked."""
    node = interop(7)
    prefill = node.start("prefill", "mooncake")
    decode = node.start("decode", "ferry")
    decode.pull(prefill, REMOTE_BLOCKS, LOCAL_BLOCKS)
    decode.pull(prefill, SINGLE_REMOTE, SINGLE_LOCAL, single=True)
    decode.quit()
    prefill.quit()


def test_mooncake_decode_pulls_from_ferry_prefill(interop):
    """Ferry prefill, Mooncake decode: Ferry's descriptor has Mooncake's ``ascend_direct``
    fields, and the wheel pulls blocks 3, 7, 8, 15, 16 into 0, 1, 5, 9, 10 through Ferry's HIXL
    engine; every byte checked."""
    node = interop(8)
    prefill = node.start("prefill", "ferry")
    check_ferry_descriptor(prefill, node.base_port, node.devices["prefill"])
    decode = node.start("decode", "mooncake")
    decode.pull(prefill, REMOTE_BLOCKS, LOCAL_BLOCKS)
    decode.pull(prefill, SINGLE_REMOTE, SINGLE_LOCAL, single=True)
    decode.quit()
    prefill.quit()


def test_ferry_prefill_pushes_into_mooncake_decode(interop):
    """Ferry prefill writes its blocks 3, 7, 8, 15, 16 into Mooncake decode's 0, 1, 5, 9, 10
    (``batch_transfer_sync_write`` over HIXL), then 20, 21 into 30, 31 (``transfer_sync_write``);
    every byte of decode's cache checked after each."""
    node = interop(9)
    prefill = node.start("prefill", "ferry")
    decode = node.start("decode", "mooncake")
    prefill.push(decode, REMOTE_BLOCKS, LOCAL_BLOCKS)
    prefill.push(decode, SINGLE_REMOTE, SINGLE_LOCAL, single=True)
    prefill.quit()
    decode.quit()
