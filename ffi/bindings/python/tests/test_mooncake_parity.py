"""Each behaviour where Ferry could diverge from Mooncake's wheel, probed on both: the same
script (peers/parity_probe.py, written against `mooncake.engine`) runs under the wheel and under
Ferry (the alias), and the results must be equal, except for the differences docs/python.md lists
with their reasons, which are asserted here as they are."""

from __future__ import annotations

import json
import subprocess

import pytest

from _support import PEERS, alias_python, ferry_metadata_server, free_port, mooncake_metadata_server, mooncake_python

PROBE = PEERS / "parity_probe.py"


@pytest.fixture(scope="module")
def ferry_as_mooncake(tmp_path_factory):
    return alias_python(tmp_path_factory.mktemp("alias") / "venv")


def probe(python, *args):
    done = subprocess.run([str(python), str(PROBE), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_p2p_behaviours_match_the_wheel(ferry_as_mooncake):
    wheel, ours = probe(mooncake_python(), "p2p"), probe(ferry_as_mooncake, "p2p")
    # Kept difference: without MC_FORCE_TCP, Mooncake runs "rdma" over TCP on a host without
    # RDMA NICs; Ferry refuses it (docs/python.md).
    assert wheel.pop("rdma_without_force_tcp") == 0
    assert ours.pop("rdma_without_force_tcp") == -1
    # Kept difference: Mooncake's TCP path reads local memory nobody registered; Ferry refuses.
    assert wheel.pop("write_from_unregistered") == 0
    assert ours.pop("write_from_unregistered") == -1
    assert ours == wheel
    # What they agree on, spelled out.
    assert ours["rdma_with_force_tcp"] == ours["rdma_with_force_tcp_0"] == 0
    assert ours["same_name_twice"] == [0, 0] and ours["same_name_ports_differ"] and ours["name_port_ignored"]
    assert ours["notifies"] == [["my-chosen-name", "hello"]]
    assert ours["probe_live"] == 0 and ours["probe_closed_port"] and ours["probe_unknown"]
    assert ours["submit_unknown"] == [0, 0]
    assert ours["topology"] and all(k.startswith("cpu:") and v == [[], []] for k, v in ours["topology"].items())
    assert ours["reinitialize"] == 0 and ours["reinitialize_new_name"]
    assert not ours["old_name_answers_probe"] and ours["new_name_answers_probe"]


def test_store_behaviours_match_the_wheel_on_mooncakes_metadata_server(ferry_as_mooncake):
    results = []
    for python in (mooncake_python(), ferry_as_mooncake):
        port = free_port()
        server = mooncake_metadata_server(port)
        try:
            results.append(probe(python, "http", f"http://127.0.0.1:{port}/metadata"))
        finally:
            server.close()
    wheel, ours = results
    assert ours == wheel
    assert ours == {"same_name_twice": [0, -1], "probe_live": 0, "probe_unknown": -200}


def test_mooncake_engines_detect_a_duplicate_name_on_ferry_metadata_server_as_on_their_own(ferry_as_mooncake):
    """Mooncake engines learn that a name is taken from the server's 400 on the rpc_meta key:
    `ferry metadata-server` answers as Mooncake's server does, for the wheel and for Ferry."""
    for python in (mooncake_python(), ferry_as_mooncake):
        port = free_port()
        server = ferry_metadata_server(port)
        try:
            got = probe(python, "http", f"http://127.0.0.1:{port}/metadata")
        finally:
            server.close()
        assert got == {"same_name_twice": [0, -1], "probe_live": 0, "probe_unknown": -200}, (python, got)
