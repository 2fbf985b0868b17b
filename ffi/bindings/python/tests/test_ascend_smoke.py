"""``scripts/ascend-smoke.sh`` in emulator mode: the script an Atlas owner
runs must work end to end before it reaches one. It runs ``ferry doctor`` for both cards, a data
check (``examples/ascend_peer``) and a throughput run (``ferry bench --device=npu:0``) in both
directions on the emulated CANN, and ends with exactly one verdict line.

Needs the workspace built as ``scripts/test.sh`` builds it: the ``ferry`` CLI (``$FERRY_BIN``, else
``target/debug/ferry``), ``target/debug/examples/ascend_peer`` beside it, and the emulator
(``cargo build -p ferry-cann-emu``). Missing pieces fail the test with the command to run.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Dict, List

import pytest

from _support import REPO, emulator_library, ferry_bin, is_identity_variable

SCRIPT = REPO / "scripts" / "ascend-smoke.sh"
PASS = re.compile(
    r"VERDICT: PASS ascend/(hixl|hccl) \(emulated CANN( and HIXL)?, not hardware\) 2 cards one node: "
    r"read (\d+\.\d\d) GB/s, write (\d+\.\d\d) GB/s"
)


def smoke(net: int, extra_env: Dict[str, str], backend: str = "hccl") -> subprocess.CompletedProcess:
    """Runs the script on cards 4 and 5 of an emulated node (device addresses 127.<net>.0.x),
    one second per direction, with the environment of this process minus anything naming a card
    or a Ferry setting."""
    build = ferry_bin().parent
    peer = build / "examples" / "ascend_peer"
    assert peer.is_file(), f"{peer} is missing: build it with `cargo build --example ascend_peer`"
    env = {k: v for k, v in os.environ.items() if not is_identity_variable(k)}
    env.update(extra_env)
    argv = [str(SCRIPT), "--emulator", "--emulator-lib", str(emulator_library()), "--emulator-net", str(net)]
    argv += ["--build", str(build), "--duration", "1", "--buffer-size", "16MiB", "--backend", backend, "4", "5"]
    return subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)


def verdicts(output: str) -> List[str]:
    return [line for line in output.splitlines() if line.startswith("VERDICT:")]


@pytest.mark.parametrize("backend,net", [("hccl", 45), ("hixl", 47)])
def test_the_smoke_script_passes_on_the_emulator_with_one_verdict_line_and_rates(backend: str, net: int):
    run = smoke(net, {}, backend)
    out = run.stdout
    assert verdicts(out) == [out.splitlines()[-1]], f"exactly one verdict, the last line:\n{out}"
    m = PASS.fullmatch(out.splitlines()[-1])
    assert m and run.returncode == 0, f"exit {run.returncode}:\n{out}"
    assert m.group(1) == backend and bool(m.group(2)) == (backend == "hixl"), out
    assert float(m.group(3)) > 0 and float(m.group(4)) > 0, out
    # Both cards' identities checked by ferry doctor, data checked both ways.
    assert out.count("status:           OK") == 2, out
    assert "physical_device  = 4" in out and "physical_device  = 5" in out, out
    assert "read blocks checked" in out and "written blocks checked" in out, out


def test_a_failing_transfer_gives_a_fail_verdict_naming_it():
    run = smoke(46, {"FERRY_CANN_EMU_FAIL": "HcclBatchGet:*"})
    out = run.stdout
    assert run.returncode == 1, out
    assert verdicts(out) == [out.splitlines()[-1]], out
    last = out.splitlines()[-1]
    assert last.startswith("VERDICT: FAIL data check, one-node: decode failed") and "HcclBatchGet" in last, out
