#!/usr/bin/env bash
# Runs Mooncake's own CI check of its transfer engine (mooncake-wheel/tests/transfer_engine_target.py
# and transfer_engine_initiator_test.py from a Mooncake checkout) the way Mooncake's
# scripts/run_tests.sh does (its HTTP metadata server from the wheel, MC_FORCE_TCP=true, tcp),
# twice: Ferry as target with the wheel as initiator, then the wheel as target with Ferry as
# initiator. Ferry runs the files unchanged through `python -m ferry.alias install` in a
# throw-away environment.
#
# Usage: scripts/mooncake-ci.sh /path/to/Mooncake
# Needs: .venv-mooncake (the wheel) and .venv-ferry (ferry installed), as scripts/test.sh makes them.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:?usage: scripts/mooncake-ci.sh /path/to/Mooncake}
TESTS="$SRC/mooncake-wheel/tests"
for f in transfer_engine_target.py transfer_engine_initiator_test.py; do
    [ -f "$TESTS/$f" ] || { echo "error: $TESTS/$f not found" >&2; exit 1; }
done
MC=$PWD/.venv-mooncake/bin
FERRY_PY=$PWD/.venv-ferry/bin/python
"$MC/python" -c 'import mooncake.engine' || { echo "error: .venv-mooncake lacks the wheel" >&2; exit 1; }
"$FERRY_PY" -c 'import ferry' || { echo "error: .venv-ferry lacks ferry (pip install ./ffi/bindings/python)" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry-mooncake-ci.XXXXXX")
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
python3 -m venv --without-pip "$WORK/alias"
purelib=$("$WORK/alias/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$FERRY_PY" -c 'import ferry, pathlib; print(pathlib.Path(ferry.__file__).resolve().parent.parent)' >"$purelib/ferry-site.pth"
"$WORK/alias/bin/python" -m ferry.alias install
ALIAS=$WORK/alias/bin/python

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$MC/mooncake_http_metadata_server" --host 127.0.0.1 --port "$port" >"$WORK/metadata.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
export MC_METADATA_SERVER="http://127.0.0.1:$port/metadata" MC_FORCE_TCP=true

status=0
run() { # run TARGET_PYTHON INITIATOR_PYTHON LABEL
    local name="127.0.0.1:$((20000 + RANDOM % 10000))"
    echo "==> $3"
    (cd "$TESTS" && TARGET_SERVER_NAME=$name exec "$1" transfer_engine_target.py) >"$WORK/target.log" 2>&1 &
    local target=$!
    PIDS+=("$target")
    for _ in $(seq 1 100); do grep -q "Target server ready" "$WORK/target.log" && break; sleep 0.1; done
    (cd "$TESTS" && TARGET_SERVER_NAME=$name INITIATOR_SERVER_NAME="127.0.0.1:$((30000 + RANDOM % 10000))" "$2" transfer_engine_initiator_test.py) || status=1
    kill "$target" 2>/dev/null || true
}
run "$ALIAS" "$MC/python" "Ferry target, Mooncake wheel initiator"
run "$MC/python" "$ALIAS" "Mooncake wheel target, Ferry initiator"
exit $status
