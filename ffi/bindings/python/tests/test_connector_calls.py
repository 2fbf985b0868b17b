"""The call sequences of vLLM's MooncakeConnector (prefill pushes, `"rdma"` with MC_FORCE_TCP=1),
SGLang (the same, plus send_probe) and vllm-ascend's Mooncake connector (decode pulls with
register_memory and batch_transfer_sync_read; `tcp` here, its `ascend` protocol needs an NPU),
replayed by peers/connector_calls.py under Mooncake's wheel and under Ferry in both roles. Every
moved block is checked."""

from __future__ import annotations

import json

import pytest

from _support import PEERS, Child, alias_python, mooncake_python

SCRIPT = PEERS / "connector_calls.py"
LAYERS, BLOCKS, BLOCK_LEN = 4, 16, 4096
PAIRS = [(0, 5), (1, 6), (2, 7), (3, 12), (9, 0)]
PAIR_ARG = ",".join(f"{a}:{b}" for a, b in PAIRS)


@pytest.fixture(scope="module")
def ferry_as_mooncake(tmp_path_factory):
    return alias_python(tmp_path_factory.mktemp("alias") / "venv")


def pythons(ferry_as_mooncake):
    return {"mooncake": mooncake_python(), "ferry": ferry_as_mooncake}


@pytest.mark.parametrize("decode,prefill", [("mooncake", "ferry"), ("ferry", "mooncake"), ("ferry", "ferry")])
def test_vllm_and_sglang_push_with_rdma_and_mc_force_tcp(decode, prefill, ferry_as_mooncake, child_factory):
    py = pythons(ferry_as_mooncake)
    env = {"MC_FORCE_TCP": "1"}
    kv = child_factory(
        Child([str(py[decode]), str(SCRIPT), "kv", "rdma", str(LAYERS), str(BLOCKS), str(BLOCK_LEN), "0"], env=env)
    )
    info = kv.read_json()
    push = child_factory(
        Child(
            [str(py[prefill]), str(SCRIPT), "push", "rdma", info["session"], json.dumps(info["bases"]),
             str(LAYERS), str(BLOCKS), str(BLOCK_LEN), "100", PAIR_ARG],
            env=env,
        )
    )
    result = push.read_json(timeout=120)
    assert result == {"probe": 0, "rcs": [0] * LAYERS}, result
    for layer in range(LAYERS):
        for local, remote in PAIRS:
            # The prefill side's block `local` (pattern 100 + layer) is now the decode side's
            # block `remote`: compare against the prefill pattern shifted to that block.
            shift = (local - remote) * BLOCK_LEN
            assert kv.ask(f"check {layer} {remote} {100 + shift}") == "ok", (layer, local, remote)
        assert kv.ask(f"check {layer} 15 0") == "ok", "blocks nobody wrote are untouched"
        assert kv.ask(f"check {layer} 5 0") == "mismatch", "the check can fail"


@pytest.mark.parametrize("prefill,decode", [("mooncake", "ferry"), ("ferry", "mooncake")])
def test_vllm_ascend_style_pull(prefill, decode, ferry_as_mooncake, child_factory):
    py = pythons(ferry_as_mooncake)
    kv = child_factory(
        Child([str(py[prefill]), str(SCRIPT), "kv", "tcp", str(LAYERS), str(BLOCKS), str(BLOCK_LEN), "50"])
    )
    info = kv.read_json()
    pull = child_factory(
        Child(
            [str(py[decode]), str(SCRIPT), "pull", "tcp", info["session"], json.dumps(info["bases"]),
             str(LAYERS), str(BLOCKS), str(BLOCK_LEN), PAIR_ARG]
        )
    )
    result = pull.read_json(timeout=120)
    assert result["rcs"] == [0] * LAYERS, result
    base = bytes(range(251))
    for layer in range(LAYERS):
        for local, remote in PAIRS:
            start = (50 + layer + remote * BLOCK_LEN) % 251
            expect = (base * 20)[start : start + BLOCK_LEN]
            assert result["blocks"][f"{layer}:{local}"] == expect.hex(), (layer, local, remote)
