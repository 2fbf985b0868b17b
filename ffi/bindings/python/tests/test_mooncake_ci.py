"""Mooncake's CI check of its transfer engine, run the way Mooncake's scripts/run_tests.sh runs it
(its own `mooncake_http_metadata_server`, `MC_FORCE_TCP=true`, protocol `tcp`, a target process
and a unittest initiator process), in every pairing of Mooncake's wheel and Ferry. Ferry runs the
scripts unchanged through `python -m ferry.alias install` (`import mooncake.engine` loads Ferry).

The scripts (mooncake_ci/) are Ferry's own code with the six cases of Mooncake's
mooncake-wheel/tests/transfer_engine_target.py and transfer_engine_initiator_test.py; see
mooncake_ci/README.md. The wheel-with-wheel run shows the cases pass on the reference itself.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from _support import (
    Child,
    alias_python,
    ferry_metadata_server,
    free_port,
    mooncake_metadata_server,
    mooncake_python,
)

HERE = Path(__file__).resolve().parent / "mooncake_ci"
TARGET = HERE / "transfer_target.py"
INITIATOR = HERE / "transfer_initiator.py"


@pytest.fixture(scope="module")
def ferry_as_mooncake(tmp_path_factory) -> Path:
    """A python where `import mooncake.engine` is Ferry (the alias)."""
    return alias_python(tmp_path_factory.mktemp("alias") / "venv")


def run_ci(target_python: Path, initiator_python: Path, url: str, protocol: str = "tcp") -> str:
    env = {
        "MC_METADATA_SERVER": url,
        "MC_FORCE_TCP": "true",
        "PROTOCOL": protocol,
        "TARGET_SERVER_NAME": "127.0.0.1:12345",
        "INITIATOR_SERVER_NAME": "127.0.0.1:12347",
    }
    target = Child([str(target_python), str(TARGET)], env=env, quit=None)
    try:
        line = target.readline(timeout=60)
        assert line == "Target server ready at 127.0.0.1:12345", f"{line}\n{target.stderr_text()}"
        done = subprocess.run(
            [str(initiator_python), str(INITIATOR), "-v"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=600,
        )
        report = done.stdout + done.stderr
        assert done.returncode == 0, f"initiator failed:\n{report[-6000:]}\ntarget:\n{target.stderr_text()}"
        assert "Ran 6 tests" in report and "\nOK" in report, report[-3000:]
        assert target.proc.poll() is None, f"the target died:\n{target.stderr_text()}"
        return report
    finally:
        target.close()


@pytest.mark.parametrize(
    "target_impl,initiator_impl",
    [("mooncake", "mooncake"), ("ferry", "mooncake"), ("mooncake", "ferry"), ("ferry", "ferry")],
)
def test_mooncake_ci_transfer_check_on_mooncakes_metadata_server(target_impl, initiator_impl, ferry_as_mooncake):
    pythons = {"mooncake": mooncake_python(), "ferry": ferry_as_mooncake}
    port = free_port()
    server = mooncake_metadata_server(port)
    try:
        run_ci(pythons[target_impl], pythons[initiator_impl], f"http://127.0.0.1:{port}/metadata")
    finally:
        server.close()


def test_mooncake_ci_transfer_check_with_vllms_rdma_default_and_mc_force_tcp(ferry_as_mooncake):
    """vLLM's and SGLang's `initialize(..., "rdma", ...)` with MC_FORCE_TCP set: TCP, both roles."""
    port = free_port()
    server = mooncake_metadata_server(port)
    try:
        url = f"http://127.0.0.1:{port}/metadata"
        run_ci(ferry_as_mooncake, mooncake_python(), url, protocol="rdma")
    finally:
        server.close()
    port = free_port()
    server = mooncake_metadata_server(port)
    try:
        run_ci(mooncake_python(), ferry_as_mooncake, f"http://127.0.0.1:{port}/metadata", protocol="rdma")
    finally:
        server.close()


def test_mooncake_ci_transfer_check_on_ferry_metadata_server(ferry_as_mooncake):
    port = free_port()
    server = ferry_metadata_server(port)
    try:
        run_ci(ferry_as_mooncake, mooncake_python(), f"http://127.0.0.1:{port}/metadata")
    finally:
        server.close()
