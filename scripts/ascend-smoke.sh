#!/usr/bin/env bash
# Ferry's Ascend smoke test: one command for whoever has an Atlas node.
#
# It checks the environment (`ferry doctor` for each card, plus the CANN, driver and SoC facts a
# hardware report needs), then runs two engines on two cards of this node with the `ascend`
# transport: a data check (examples/ascend_peer: selected KV blocks read one way and written
# the other, every byte compared) and a throughput run (`ferry bench --device=npu:0`, device
# memory, a read run and a write run). With --peer-host it does the same across two nodes over
# ssh (the target on the other host). The last line it prints is the verdict, exactly one of
#
#   VERDICT: PASS ascend 2 cards one node: read 12.3 GB/s, write 11.9 GB/s[; two nodes: ...]
#   VERDICT: FAIL <reason>
#
# and the exit status is 0 only for PASS. With --emulator it runs on Ferry's emulated CANN
# (ffi/ascend/cann-emu) instead: a check of the script and the build, not of any hardware (the verdict
# says "emulated CANN").
#
# Run `scripts/ascend-smoke.sh --help` for the options.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/ascend-smoke.sh [options] CARD_A CARD_B

Runs two Ferry engines (protocol "ascend") on cards CARD_A and CARD_B of this node, moves device
memory both ways, checks the data and measures throughput, and ends with one line
"VERDICT: PASS ..." or "VERDICT: FAIL <reason>".

CARD_A, CARD_B   the value each process gets as ASCEND_RT_VISIBLE_DEVICES (one card each); on
                 bare metal that is the physical card id (/dev/davinciN, hccn.conf address_N).
                 CARD_A serves (target/prefill), CARD_B initiates (reads and writes).

Options:
  --peer-host HOST       also run across two nodes: the target on HOST (card CARD_B there) over
                         ssh (key-based, non-interactive), the initiator here on CARD_A; HOST
                         needs the same Ferry build at the same path (or --remote-build)
  --peer-ip IP           the address engines on HOST publish (default: HOST resolved)
  --local-ip IP          the address engines on this node publish (default: the first address
                         of `hostname -I`; 127.0.0.1 with --emulator)
  --block-size SIZE      bytes per request in the throughput runs (default 1MiB)
  --batch-size N         requests per batch (default 16)
  --buffer-size SIZE     device buffer per engine (default 1GiB; 64MiB with --emulator)
  --duration SECONDS     length of each throughput run, read and write (default 5; 2 with --emulator)
  --build DIR            the Ferry build to use: DIR/ferry and DIR/examples/ascend_peer
                         (default: target/release if it has them, else target/debug). Build with
                           cargo build --release -p ferry-cli && cargo build --release --example ascend_peer
  --remote-build DIR     the build directory on HOST (default: the same path as --build)
  --emulator             use Ferry's emulated CANN (target/debug/libferry_cann_emu.so, or
                         --emulator-lib) and a generated hccn.conf with loopback device addresses
  --emulator-lib FILE    the emulator library to use with --emulator
  --emulator-net N       device addresses 127.N.0.x with --emulator (default: random in 100..199)
  --backend B            the ascend transport's backend on every engine: auto (default: HIXL
                         when it loads, else direct HCCL), hixl or hccl (FERRY_ASCEND_BACKEND);
                         run once with each of hixl and hccl to verify both on a node
  --keep                 keep the work directory (logs of every process)
  -h, --help             this text

Environment: CANN is found as Ferry always finds it (FERRY_ASCEND_LIB_DIR, ASCEND_HOME_PATH,
the standard install paths); device IPs come from /etc/hccn.conf (or FERRY_HCCN_CONF).
FERRY_TRANSFER_TIMEOUT_MS and HCCL_* variables are passed through.

Report a hardware result (see docs/ascend.md, "Verifying on real hardware"): the VERDICT line,
the `ferry doctor` output and the "environment" block this script prints.
EOF
}

# --- the verdict: printed exactly once, on every way out ----------------------------------------
VERDICT=""
WORK=""
KEEP=0
PIDS=()          # local processes this script started (killed by pid at exit)
REMOTE_PIDS=()   # "HOST PID" of processes started over ssh

verdict() {
    VERDICT="$*"
}

cleanup() {
    local status=$?
    set +e
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null
    done
    for entry in "${REMOTE_PIDS[@]}"; do
        # shellcheck disable=SC2086
        set -- $entry
        ssh -o BatchMode=yes "$1" "kill $2" 2>/dev/null
    done
    wait 2>/dev/null
    if [ -n "$WORK" ]; then
        if [ "$KEEP" = 1 ]; then
            echo "work directory kept: $WORK"
        else
            rm -rf "$WORK"
        fi
    fi
    if [ -z "$VERDICT" ]; then
        VERDICT="FAIL the script stopped unexpectedly (exit status $status; see the output above)"
    fi
    echo "VERDICT: $VERDICT"
    case "$VERDICT" in PASS*) exit 0 ;; *) exit 1 ;; esac
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() {
    verdict "FAIL $*"
    exit 1
}

say() { printf '\n==> %s\n' "$*"; }

# --- arguments ----------------------------------------------------------------------------------
PEER_HOST="" PEER_IP="" LOCAL_IP="" BLOCK_SIZE="1MiB" BATCH_SIZE=16 BUFFER_SIZE="" DURATION=""
BUILD="" REMOTE_BUILD="" EMULATOR=0 EMULATOR_LIB="" EMULATOR_NET="" BACKEND=${FERRY_ASCEND_BACKEND:-auto}
CARDS=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h | --help) usage; VERDICT="none (help printed)"; trap - EXIT; exit 0 ;;
        --peer-host) PEER_HOST=${2:?--peer-host needs a value}; shift ;;
        --peer-ip) PEER_IP=${2:?--peer-ip needs a value}; shift ;;
        --local-ip) LOCAL_IP=${2:?--local-ip needs a value}; shift ;;
        --block-size) BLOCK_SIZE=${2:?--block-size needs a value}; shift ;;
        --batch-size) BATCH_SIZE=${2:?--batch-size needs a value}; shift ;;
        --buffer-size) BUFFER_SIZE=${2:?--buffer-size needs a value}; shift ;;
        --duration) DURATION=${2:?--duration needs a value}; shift ;;
        --build) BUILD=${2:?--build needs a value}; shift ;;
        --remote-build) REMOTE_BUILD=${2:?--remote-build needs a value}; shift ;;
        --emulator) EMULATOR=1 ;;
        --emulator-lib) EMULATOR_LIB=${2:?--emulator-lib needs a value}; shift ;;
        --emulator-net) EMULATOR_NET=${2:?--emulator-net needs a value}; shift ;;
        --backend) BACKEND=${2:?--backend needs a value}; shift ;;
        --keep) KEEP=1 ;;
        -*) fail "unknown option $1 (see --help)" ;;
        *) CARDS+=("$1") ;;
    esac
    shift
done
[ ${#CARDS[@]} -eq 2 ] || fail "give two cards, CARD_A and CARD_B (see --help)"
CARD_A=${CARDS[0]} CARD_B=${CARDS[1]}
for c in "$CARD_A" "$CARD_B"; do
    [[ "$c" =~ ^[0-9]+$ ]] || fail "card \"$c\" is not a device id"
done
[ "$CARD_A" != "$CARD_B" ] || fail "CARD_A and CARD_B must be two different cards"
[[ "$BATCH_SIZE" =~ ^[1-9][0-9]*$ ]] || fail "--batch-size \"$BATCH_SIZE\" is not a positive number"

REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "$BUILD" ]; then
    if [ -x "$REPO/target/release/ferry" ] && [ -x "$REPO/target/release/examples/ascend_peer" ]; then
        BUILD="$REPO/target/release"
    else
        BUILD="$REPO/target/debug"
    fi
fi
BUILD=$(cd "$BUILD" 2>/dev/null && pwd) || fail "--build directory does not exist"
FERRY="$BUILD/ferry"
PEER="$BUILD/examples/ascend_peer"
for bin in "$FERRY" "$PEER"; do
    [ -x "$bin" ] || fail "$bin is missing: build it with \`cargo build --release -p ferry-cli && cargo build --release --example ascend_peer\` (or point --build at a build that has both)"
done
REMOTE_BUILD=${REMOTE_BUILD:-$BUILD}

# Each process is given its card by ASCEND_RT_VISIBLE_DEVICES alone; a local rank inherited
# from the shell (a vLLM environment, say) would point the identity chain elsewhere.
unset LOCAL_RANK FERRY_LOCAL_RANK
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry-ascend-smoke.XXXXXX")
export FERRY_TRANSFER_TIMEOUT_MS=${FERRY_TRANSFER_TIMEOUT_MS:-20000}

# --- the emulated node --------------------------------------------------------------------------
if [ "$EMULATOR" = 1 ]; then
    [ -z "$PEER_HOST" ] || fail "--peer-host and --emulator do not go together (the emulator has no second node)"
    if [ -z "$EMULATOR_LIB" ]; then
        for candidate in "$BUILD/libferry_cann_emu.so" "$REPO/target/debug/libferry_cann_emu.so"; do
            if [ -f "$candidate" ]; then EMULATOR_LIB=$candidate; break; fi
        done
    fi
    [ -n "$EMULATOR_LIB" ] && [ -f "$EMULATOR_LIB" ] \
        || fail "the emulated CANN library is missing: build it with \`cargo build -p ferry-cann-emu\` (or give --emulator-lib)"
    EMULATOR_NET=${EMULATOR_NET:-$((100 + RANDOM % 100))}
    mkdir -p "$WORK/cann"
    ln -s "$(cd "$(dirname "$EMULATOR_LIB")" && pwd)/$(basename "$EMULATOR_LIB")" "$WORK/cann/libascendcl.so"
    ln -s "$(readlink "$WORK/cann/libascendcl.so")" "$WORK/cann/libhccl.so"
    if [ "$BACKEND" != hccl ]; then
        # The emulated HIXL lives in the same library (CANN's three HIXL library names).
        for name in libllm_datadist.so libcann_hixl.so libmetadef.so; do
            ln -s "$(readlink "$WORK/cann/libascendcl.so")" "$WORK/cann/$name"
        done
    fi
    for d in 0 1 2 3 4 5 6 7; do
        echo "address_$d=127.$EMULATOR_NET.0.$((d + 1))"
    done >"$WORK/hccn.conf"
    export FERRY_ASCEND_LIB_DIR="$WORK/cann" FERRY_HCCN_CONF="$WORK/hccn.conf"
    export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-20}
    LOCAL_IP=${LOCAL_IP:-127.0.0.1}
    BUFFER_SIZE=${BUFFER_SIZE:-64MiB}
    DURATION=${DURATION:-2}
    if [ "$BACKEND" = hccl ]; then
        WHAT="ascend/$BACKEND (emulated CANN, not hardware)"
    else
        WHAT="ascend/$BACKEND (emulated CANN and HIXL, not hardware)"
    fi
else
    LOCAL_IP=${LOCAL_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}
    [ -n "$LOCAL_IP" ] || fail "cannot tell this node's IP address: give --local-ip"
    BUFFER_SIZE=${BUFFER_SIZE:-1GiB}
    DURATION=${DURATION:-5}
    WHAT="ascend/$BACKEND"
fi
case "$BACKEND" in auto | hixl | hccl) ;; *) fail "--backend must be auto, hixl or hccl, not $BACKEND" ;; esac
export FERRY_ASCEND_BACKEND="$BACKEND"
if [ -n "$PEER_HOST" ] && [ -z "$PEER_IP" ]; then
    PEER_IP=$(getent ahostsv4 "$PEER_HOST" 2>/dev/null | awk 'NR == 1 {print $1}')
    PEER_IP=${PEER_IP:-$PEER_HOST}
fi

# --- the environment ----------------------------------------------------------------------------
say "environment"
echo "ferry build:      $BUILD ($("$FERRY" --version 2>/dev/null || echo unknown))"
echo "git commit:       $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "host:             $(hostname) ($LOCAL_IP), $(uname -srm)"
if [ "$EMULATOR" = 1 ]; then
    echo "CANN:             Ferry's emulated CANN ($EMULATOR_LIB), device addresses 127.$EMULATOR_NET.0.x"
else
    for f in "${ASCEND_HOME_PATH:-/nonexistent}/version.cfg" \
        /usr/local/Ascend/ascend-toolkit/latest/version.cfg \
        /usr/local/Ascend/cann/version.cfg \
        /usr/local/Ascend/ascend-toolkit/latest/*/ascend_toolkit_install.info; do
        if [ -f "$f" ]; then echo "CANN version ($f):"; sed 's/^/    /' "$f"; break; fi
    done
    if [ -f /usr/local/Ascend/driver/version.info ]; then
        echo "driver (/usr/local/Ascend/driver/version.info):"
        sed 's/^/    /' /usr/local/Ascend/driver/version.info
    else
        echo "driver:           /usr/local/Ascend/driver/version.info not found"
    fi
    if command -v npu-smi >/dev/null 2>&1; then
        echo "npu-smi info:"
        npu-smi info 2>&1 | sed 's/^/    /' || true
    else
        echo "npu-smi:          not on PATH (the SoC name is in ferry doctor's output only if CANN reports it)"
    fi
fi

cat >"$WORK/mooncake.json" <<EOF
{"local_hostname": "$LOCAL_IP", "metadata_server": "P2PHANDSHAKE", "protocol": "ascend", "device_name": ""}
EOF
for card in "$CARD_A" "$CARD_B"; do
    say "ferry doctor (ASCEND_RT_VISIBLE_DEVICES=$card)"
    if ! ASCEND_RT_VISIBLE_DEVICES=$card "$FERRY" doctor --config "$WORK/mooncake.json" 2>&1 | tee "$WORK/doctor-$card.txt"; then
        fail "ferry doctor reports a problem for card $card (see its output above)"
    fi
    grep -q '^status: *OK' "$WORK/doctor-$card.txt" || fail "ferry doctor did not say OK for card $card"
done

# --- helpers ------------------------------------------------------------------------------------

# Replaces the calling (background) subshell with a command line run on HOST with the given
# environment (HOST empty: here), so that `$!` is the process itself (or its ssh).
#   on HOST VAR=value ... -- program args... &
on() {
    local host=$1
    shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    if [ -z "$host" ]; then
        exec env "${envs[@]}" "$@"
    else
        local quoted
        quoted=$(printf '%q ' env "${envs[@]}" "$@")
        exec ssh -o BatchMode=yes "$host" "echo REMOTE_PID \$\$; exec $quoted"
    fi
}

# The first line of FILE starting with PREFIX (without it), waiting up to SECONDS while PID lives.
await_line() {
    local file=$1 prefix=$2 seconds=$3 pid=$4 line=""
    for _ in $(seq $((seconds * 10))); do
        line=$(grep -m1 "^$prefix" "$file" 2>/dev/null || true)
        if [ -n "$line" ]; then
            echo "${line#"$prefix"}"
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    return 1
}

# Remembers the remote pid a process started with `on HOST` printed in FILE.
remember_remote() {
    local host=$1 file=$2 rpid
    [ -n "$host" ] || return 0
    rpid=$(await_line "$file" "REMOTE_PID " 30 "${PIDS[-1]}") || return 0
    REMOTE_PIDS+=("$host $rpid")
}

# A JSON field of a one-line JSON document (python3, always present where Ferry's tests run).
json_field() {
    python3 -c 'import json, sys; v = json.loads(sys.argv[1]); [v := v[k] for k in sys.argv[2:]]; print(v if not isinstance(v, (dict, list)) else json.dumps(v))' "$@"
}

# The KV cache of the data check: 4 regions of 64 blocks of 32 KiB. 2 MiB regions come out of
# aclrtMalloc in huge pages, which HCCS IPC between two cards of one node needs.
PEER_SHAPE="--regions 4 --blocks 64 --block-len 32768"

# Data check: prefill (serving) on TARGET_HOST card A, decode here on card B; decode reads blocks
# 3,4,5,9,40 of every region into its 0..4 (checked there) and writes its 6,7 into prefill's
# 20,21 (checked by prefill).  data_check LABEL TARGET_HOST TARGET_IP TARGET_CARD TARGET_BUILD LOCAL_CARD
data_check() {
    local label=$1 host=$2 ip=$3 tcard=$4 tbuild=$5 lcard=$6
    say "data check, $label: ascend_peer prefill on card $tcard${host:+ of $host}, decode on card $lcard"
    local in="$WORK/prefill-$label.in" out="$WORK/prefill-$label.out" err="$WORK/prefill-$label.err"
    mkfifo "$in"
    on "$host" ASCEND_RT_VISIBLE_DEVICES="$tcard" FERRY_ASCEND_BACKEND="$BACKEND" FERRY_LOCAL_HOSTNAME="$ip" \
        FERRY_TRANSFER_TIMEOUT_MS="$FERRY_TRANSFER_TIMEOUT_MS" -- "$tbuild/examples/ascend_peer" prefill $PEER_SHAPE \
        <"$in" >"$out" 2>"$err" &
    PIDS+=($!)
    local prefill=$!
    exec {feed}>"$in"
    remember_remote "$host" "$out"
    local ready
    ready=$(await_line "$out" "READY " 120 "$prefill") \
        || fail "data check, $label: the prefill process did not start: $(tail -3 "$err" | tr '\n' ' ')"
    local segment layout
    segment=$(json_field "$ready" segment)
    layout=$(json_field "$ready" layout)
    echo "prefill: $segment, physical card $(json_field "$ready" rank_info devicePhyId), device IP $(json_field "$ready" rank_info deviceIp)"
    local done_line
    if ! done_line=$(ASCEND_RT_VISIBLE_DEVICES="$lcard" FERRY_LOCAL_HOSTNAME="$LOCAL_IP" \
        "$PEER" decode --peer "$segment" --peer-layout "$layout" $PEER_SHAPE 2>"$WORK/decode-$label.err" | grep '^DONE '); then
        fail "data check, $label: decode failed: $(grep -v '^\[ferry-cann-emu' "$WORK/decode-$label.err" | tail -3 | tr '\n' ' ')"
    fi
    done_line=${done_line#DONE }
    echo "decode:  read blocks checked; stats $(json_field "$done_line" stats)"
    echo "verify 20:6,21:7 2" >&"$feed"
    local verified
    verified=$(await_line "$out" "VERIFIED " 60 "$prefill") || fail "data check, $label: prefill did not answer verify"
    [ "$verified" = "ok" ] || fail "data check, $label: blocks written to prefill are wrong: $verified"
    echo "prefill: written blocks checked"
    echo "quit" >&"$feed"
    exec {feed}>&-
    wait "$prefill" || fail "data check, $label: prefill exited with an error: $(tail -3 "$err" | tr '\n' ' ')"
}

# Throughput: `ferry bench` target on TARGET_HOST card A, initiator here on card B, device memory
# on both sides, a read run then a write run. Sets READ_GBPS and WRITE_GBPS.
#   throughput LABEL TARGET_HOST TARGET_IP TARGET_CARD TARGET_BUILD LOCAL_CARD
throughput() {
    local label=$1 host=$2 ip=$3 tcard=$4 tbuild=$5 lcard=$6
    say "throughput, $label: ferry bench, device memory, block $BLOCK_SIZE x $BATCH_SIZE per batch, ${DURATION}s per direction"
    local out="$WORK/target-$label.out" err="$WORK/target-$label.err"
    on "$host" ASCEND_RT_VISIBLE_DEVICES="$tcard" FERRY_ASCEND_BACKEND="$BACKEND" FERRY_TRANSFER_TIMEOUT_MS="$FERRY_TRANSFER_TIMEOUT_MS" -- \
        "$tbuild/ferry" bench --mode=target --protocol=ascend --device=npu:0 \
        --local_server_name="$ip" --buffer_size="$BUFFER_SIZE" </dev/null >"$out" 2>"$err" &
    PIDS+=($!)
    local target=$!
    remember_remote "$host" "$out"
    local segment
    segment=$(await_line "$out" "listening on " 120 "$target") \
        || fail "throughput, $label: the bench target did not start: $(tail -3 "$err" | tr '\n' ' ')"
    local op result rate
    for op in read write; do
        if ! result=$(ASCEND_RT_VISIBLE_DEVICES="$lcard" "$FERRY" bench --protocol=ascend --device=npu:0 \
            --local_server_name="$LOCAL_IP" --segment_id="$segment" --operation="$op" \
            --buffer_size="$BUFFER_SIZE" --block_size="$BLOCK_SIZE" --batch_size="$BATCH_SIZE" --threads=1 \
            --duration="$DURATION" --json 2>"$WORK/bench-$label-$op.err"); then
            fail "throughput, $label: $op failed: $(tail -3 "$WORK/bench-$label-$op.err" | tr '\n' ' ')"
        fi
        echo "$op: $result"
        rate=$(json_field "$result" throughput)
        printf -v rate '%.2f' "$rate"
        if [ "$op" = read ]; then READ_GBPS=$rate; else WRITE_GBPS=$rate; fi
    done
    kill "$target" 2>/dev/null || true
    wait "$target" 2>/dev/null || true
}

# --- one node, then two -------------------------------------------------------------------------
data_check one-node "" "$LOCAL_IP" "$CARD_A" "$BUILD" "$CARD_B"
throughput one-node "" "$LOCAL_IP" "$CARD_A" "$BUILD" "$CARD_B"
SUMMARY="$WHAT 2 cards one node: read $READ_GBPS GB/s, write $WRITE_GBPS GB/s"

if [ -n "$PEER_HOST" ]; then
    ssh -o BatchMode=yes "$PEER_HOST" "test -x $(printf '%q' "$REMOTE_BUILD/ferry") && test -x $(printf '%q' "$REMOTE_BUILD/examples/ascend_peer")" \
        || fail "$PEER_HOST: ssh failed, or $REMOTE_BUILD/ferry and examples/ascend_peer are not there (see --remote-build)"
    data_check two-nodes "$PEER_HOST" "$PEER_IP" "$CARD_B" "$REMOTE_BUILD" "$CARD_A"
    throughput two-nodes "$PEER_HOST" "$PEER_IP" "$CARD_B" "$REMOTE_BUILD" "$CARD_A"
    SUMMARY="$SUMMARY; two nodes ($(hostname) card $CARD_A <- $PEER_HOST card $CARD_B): read $READ_GBPS GB/s, write $WRITE_GBPS GB/s"
fi

verdict "PASS $SUMMARY"
