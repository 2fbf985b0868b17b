"""Shared helpers of the ferry Python test suite: data patterns, paths, child processes, and a
minimal speaker of the P2P handshake (to read a peer's descriptor and to impersonate a peer
whose data port never answers)."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[4]
"""The Ferry repository (tests live in ffi/bindings/python/tests)."""

PEERS = Path(__file__).resolve().parent / "peers"

_BASE = bytes(range(251))


def pattern(offset: int, length: int, seed: int) -> bytes:
    """Byte k of a patterned buffer is (k + seed) % 251 (as in transports/tcp/tests/interop/mooncake_peer.py)."""
    start = (offset + seed) % 251
    reps = (start + length) // 251 + 1
    return (_BASE * reps)[start : start + length]


def ferry_bin() -> Path:
    """The `ferry` CLI binary: $FERRY_BIN, else target/debug/ferry. Fails loudly when missing."""
    path = Path(os.environ.get("FERRY_BIN") or REPO / "target" / "debug" / "ferry")
    assert path.is_file(), (
        f"\n*** the ferry CLI binary {path} does not exist: build it with `cargo build -p ferry-cli` "
        f"or point FERRY_BIN at it\n"
    )
    return path


def emulator_library() -> Path:
    """The built emulated CANN library; fails the test (never skips) when it is missing."""
    explicit = os.environ.get("FERRY_CANN_EMU_LIB")
    if explicit:
        candidates = [Path(explicit)]
    else:
        target = os.environ.get("CARGO_TARGET_DIR")
        candidates = [Path(target) / "debug" / "libferry_cann_emu.so"] if target else []
        candidates.append(REPO / "target" / "debug" / "libferry_cann_emu.so")
    for path in candidates:
        if path.is_file():
            return path.resolve()
    pytest.fail(
        "the emulated CANN library is missing (looked for "
        + ", ".join(str(p) for p in candidates)
        + "): build it with `cargo build -p ferry-cann-emu` from the repository root, or point "
        "FERRY_CANN_EMU_LIB at libferry_cann_emu.so",
        pytrace=False,
    )


CANN_LIBRARY_NAMES = ("libascendcl.so", "libhccl.so")
"""The names the emulated CANN answers to: ACL's runtime and HCCL."""

HIXL_LIBRARY_NAMES = ("libllm_datadist.so", "libcann_hixl.so", "libmetadef.so")
"""The names the emulated HIXL answers to: ``adxl::AdxlEngine`` (``libllm_datadist.so``),
``hixl::Hixl`` (``libcann_hixl.so``) and ``ge::AscendString`` (``libmetadef.so``)."""


def emulated_cann(directory: Path, hixl: bool = False) -> Path:
    """Makes ``directory`` a CANN installation's library directory backed by the emulator: the
    built library linked as ``libascendcl.so`` and ``libhccl.so``, and with ``hixl`` also as
    HIXL's three libraries. Without ``hixl`` it is a CANN without HIXL, where Ferry's ``ascend``
    transport falls back to direct HCCL and Mooncake's NPU wheel cannot load. Returns
    ``directory``."""
    lib = emulator_library()
    directory.mkdir(parents=True, exist_ok=True)
    for name in CANN_LIBRARY_NAMES + (HIXL_LIBRARY_NAMES if hixl else ()):
        (directory / name).symlink_to(lib)
    return directory


def is_identity_variable(name: str) -> bool:
    """Variables an Ascend test process must not inherit: anything naming a card,
    a rank, a Ferry or Mooncake setting, CANN's install or the emulator's switches."""
    if name in ("FERRY_CAPI_LIB", "FERRY_BIN"):  # which Ferry build to test, not an identity
        return False
    return name.startswith(("FERRY_", "ASCEND_", "HCCL_", "MC_")) or name in (
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "PHYSICAL_DEVICES",
        "MOONCAKE_CONFIG_PATH",
        "DISAGGREGATED_PREFILL_RANK_TABLE_PATH",
    )


def mooncake_python() -> Path:
    """A Python that imports mooncake.engine: $FERRY_MOONCAKE_PYTHON, else the repository's
    .venv-mooncake. Fails loudly (these tests are never skipped)."""
    path = Path(os.environ.get("FERRY_MOONCAKE_PYTHON") or REPO / ".venv-mooncake" / "bin" / "python")
    ok = (
        path.is_file()
        and subprocess.run(
            [str(path), "-c", "import mooncake.engine"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ).returncode
        == 0
    )
    assert ok, (
        f"\n*** Mooncake interop cannot run: {path} cannot import mooncake.engine.\n*** Install the wheel: "
        f"python3 -m venv .venv-mooncake && .venv-mooncake/bin/pip install mooncake-transfer-engine-non-cuda "
        f"(plus Debian libibverbs1 libnuma1 librdmacm1), or set FERRY_MOONCAKE_PYTHON.\n"
    )
    return path


MOONCAKE_NPU_WHEEL = ("mooncake-transfer-engine-npu", "0.3.13.post1")
"""The Mooncake NPU wheel the ascend_direct interop tests judge Ferry by, and its pinned version
(scripts/test.sh installs it)."""


def mooncake_npu_python() -> Path:
    """The Python of the venv holding Mooncake's NPU wheel: $FERRY_MOONCAKE_NPU_PYTHON, else the
    repository's .venv-mooncake-npu. Checks the wheel's version only: it cannot import without
    CANN (the tests give it the emulated one). Fails loudly (these tests are never skipped)."""
    path = Path(os.environ.get("FERRY_MOONCAKE_NPU_PYTHON") or REPO / ".venv-mooncake-npu" / "bin" / "python")
    name, version = MOONCAKE_NPU_WHEEL
    found = ""
    if path.is_file():
        found = subprocess.run(
            [str(path), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    assert found == version, (
        f"\n*** the Mooncake NPU wheel ({name} {version}) is not installed for {path}"
        + (f" (found {found})" if found else "")
        + f": run scripts/test.sh, or python3.11 -m venv .venv-mooncake-npu && .venv-mooncake-npu/bin/pip "
        f"install {name}=={version} (PyPI has cp311/cp312 manylinux_2_35 x86_64 builds), or set "
        f"FERRY_MOONCAKE_NPU_PYTHON.\n"
    )
    return path


class Child:
    """A child process spoken to line by line over stdin/stdout. Its environment is this
    process's, without the variables named in `unset`, plus `env`. close() sends `quit` (if not
    None), then SIGTERM, then SIGKILL."""

    def __init__(
        self,
        argv: List[str],
        env: Optional[Dict[str, str]] = None,
        quit: Optional[str] = "quit",
        unset: Sequence[str] = (),
    ) -> None:
        self.argv = argv
        self.quit = quit
        self.stderr_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"ferry-pytest-child-{os.getpid()}-{id(self)}.log"
        self._stderr = open(self.stderr_path, "w+b")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**{k: v for k, v in os.environ.items() if k not in unset}, **(env or {})},
            text=True,
            bufsize=1,
        )

    def stderr_text(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def readline(self, timeout: float = 60.0) -> str:
        """The next stdout line (without the newline); fails with the child's stderr on EOF or
        timeout."""
        result: List[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise AssertionError(f"{self.argv[:3]}: no output within {timeout} s\nstderr:\n{self.stderr_text()}")
        line = result[0]
        if not line:
            code = self.proc.wait(timeout=10)
            raise AssertionError(f"{self.argv[:3]} exited ({code}) without output\nstderr:\n{self.stderr_text()}")
        return line.rstrip("\n")

    def read_json(self, timeout: float = 60.0) -> Any:
        return json.loads(self.readline(timeout))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def ask(self, line: str, timeout: float = 60.0) -> str:
        self.send(line)
        return self.readline(timeout)

    def close(self) -> None:
        if self.proc.poll() is None and self.quit is not None:
            try:
                self.send(self.quit)
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._stderr.close()
        self.stderr_path.unlink(missing_ok=True)


# --- the P2P handshake (Mooncake's framing: u64 LE length of type byte + payload, type, JSON) ---

FRAME_METADATA = 1


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("handshake peer closed the connection")
        data += chunk
    return data


def _frame(kind: int, payload: bytes) -> bytes:
    return struct.pack("<QB", len(payload) + 1, kind) + payload


def _read_frame(sock: socket.socket) -> tuple:
    (length,) = struct.unpack("<Q", _recv_exact(sock, 8))
    body = _recv_exact(sock, length)
    return body[0], body[1:]


def fetch_descriptor(segment: str, timeout: float = 10.0) -> Dict[str, Any]:
    """The segment descriptor a P2P-handshake peer (`host:port`) serves."""
    host, port = segment.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(_frame(FRAME_METADATA, b"{}"))
        kind, payload = _read_frame(s)
    assert kind == FRAME_METADATA, f"{segment} answered a metadata request with frame type {kind}"
    return json.loads(payload)


class SilentPeer:
    """A fake P2P-handshake peer: it answers metadata requests with a `tcp` descriptor whose
    data port accepts connections and never says a word, so every transfer to it runs into the
    initiator's transfer timeout. `segment` is its name; `addr`/`length` its one buffer."""

    def __init__(self, addr: int = 0x10000, length: int = 1 << 20) -> None:
        self.addr, self.length = addr, length
        self.data = socket.socket()
        self.data.bind(("127.0.0.1", 0))
        self.data.listen(64)
        self.rpc = socket.socket()
        self.rpc.bind(("127.0.0.1", 0))
        self.rpc.listen(64)
        self.segment = f"127.0.0.1:{self.rpc.getsockname()[1]}"
        self._held: List[socket.socket] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._serve_rpc, daemon=True),
            threading.Thread(target=self._hold_data, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def descriptor(self) -> Dict[str, Any]:
        return {
            "name": self.segment,
            "protocol": "tcp",
            "buffers": [{"addr": self.addr, "length": self.length, "name": "cpu:0"}],
            "tcp_data_host": "127.0.0.1",
            "tcp_data_port": self.data.getsockname()[1],
            "tcp_proto_version": 2,
        }

    def _serve_rpc(self) -> None:
        self.rpc.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.rpc.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5)
                    kind, _ = _read_frame(conn)
                    if kind == FRAME_METADATA:
                        conn.sendall(_frame(FRAME_METADATA, json.dumps(self.descriptor()).encode()))
                except (OSError, ConnectionError):
                    pass

    def _hold_data(self) -> None:
        self.data.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.data.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._held.append(conn)  # accepted, never read from or written to

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for s in self._held + [self.rpc, self.data]:
            s.close()


def python_child(script: Path, *args: str, env: Optional[Dict[str, str]] = None, unset: Sequence[str] = ()) -> Child:
    """Runs `script` under this interpreter (the one with ferry installed)."""
    return Child([sys.executable, str(script), *args], env=env, unset=unset)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_answers(url: str) -> bool:
    """Whether `url` answers an HTTP GET (any status)."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=1)
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def mooncake_metadata_server(port: int) -> Child:
    """Mooncake's own HTTP metadata server from the wheel (`mooncake_http_metadata_server`, as
    Mooncake's scripts/run_tests.sh starts it) on 127.0.0.1:`port`; its URL is
    http://127.0.0.1:`port`/metadata."""
    server = mooncake_python().parent / "mooncake_http_metadata_server"
    assert server.is_file(), f"{server} is missing: the Mooncake wheel installs it"
    child = Child([str(server), "--host", "127.0.0.1", "--port", str(port)], quit=None)
    assert wait_until(lambda: http_answers(f"http://127.0.0.1:{port}/metadata?key=probe"), timeout=30), (
        f"Mooncake's metadata server did not start:\n{child.stderr_text()}"
    )
    return child


def ferry_metadata_server(port: int) -> Child:
    """`ferry metadata-server` on 127.0.0.1:`port` (URL http://127.0.0.1:`port`/metadata)."""
    child = Child([str(ferry_bin()), "metadata-server", "--addr", f"127.0.0.1:{port}"], quit=None)
    assert wait_until(lambda: http_answers(f"http://127.0.0.1:{port}/health"), timeout=30), (
        f"ferry metadata-server did not start:\n{child.stderr_text()}"
    )
    return child


def make_venv(path: Path, *site_dirs: Path) -> Path:
    """A fresh virtual environment at `path` (no pip) that also sees `site_dirs` (through a .pth
    file: their packages are importable and their distributions visible); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if site_dirs:
        Path(purelib, "zz_ferry_tests.pth").write_text("".join(f"{d}\n" for d in site_dirs))
    return python


def ferry_site() -> Path:
    """The site directory the installed `ferry` package lives in."""
    import ferry

    return Path(ferry.__file__).resolve().parent.parent


def alias_python(path: Path) -> Path:
    """A fresh environment at `path` where Ferry is installed and `python -m ferry.alias install`
    ran: `import mooncake.engine` loads Ferry there. Returns its python."""
    python = make_venv(path, ferry_site())
    done = subprocess.run([str(python), "-m", "ferry.alias", "install"], capture_output=True, text=True)
    assert done.returncode == 0, f"ferry.alias install failed:\n{done.stdout}{done.stderr}"
    return python
