#!/usr/bin/env bash
# Ferry's whole test suite: installs what is missing, starts the servers the suite needs on
# loopback, runs formatting, lint, docs and every test, and stops the servers again.
#
# Usage: scripts/test.sh            (from anywhere; CI calls it through .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n==> %s\n' "$*"; }

# One full run, not an edit-compile loop: incremental caches would add about 4 GB to the ~3 GB
# the debug build takes (the dev profile keeps only line tables, see Cargo.toml), and CI's disk
# is not large. A caller's own CARGO_INCREMENTAL wins.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# --- prerequisites -------------------------------------------------------------------------
if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo not found; install a Rust toolchain (rustup) first" >&2
    exit 1
fi
rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt clippy 2>/dev/null || true
if cargo nextest --version >/dev/null 2>&1; then
    RUNNER=(cargo nextest run --workspace --all-features --no-fail-fast)
else
    echo "cargo-nextest not found; using cargo test"
    RUNNER=(cargo test --workspace --all-features --no-fail-fast)
fi

# Mooncake's wheel, for the interop tests (transports/tcp/tests/interop_mooncake.rs). If it cannot
# be installed those tests fail and say why; nothing is skipped.
need_debs=()
# protoc builds the etcd client; etcd and Redis serve the metadata tests. The Mooncake wheels link
# libcurl.so.4 (the OpenSSL flavour, libcurl4) besides libibverbs and libnuma.
for pkg in libibverbs1 libnuma1 librdmacm1 libcurl4 python3-venv protobuf-compiler etcd-server redis-server; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_debs+=("$pkg")
done
if [ ${#need_debs[@]} -gt 0 ]; then
    say "apt-get install ${need_debs[*]}"
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_debs[@]}") >/dev/null \
            || echo "WARNING: could not install ${need_debs[*]}; the tests that need them will fail" >&2
    else
        echo "WARNING: not root; install ${need_debs[*]} for the interop and metadata tests" >&2
    fi
fi
VENV=.venv-mooncake
if ! "$VENV/bin/python" -c 'import mooncake.engine' >/dev/null 2>&1; then
    say "pip install mooncake-transfer-engine-non-cuda into $VENV"
    { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q mooncake-transfer-engine-non-cuda; } \
        || echo "WARNING: could not install the Mooncake wheel; the interop tests will fail and say so" >&2
fi
export FERRY_MOONCAKE_PYTHON="$PWD/$VENV/bin/python"
# Mooncake's NPU wheel (its ascend_direct transport, on HIXL) for the HIXL interop tests
# (ffi/bindings/python/tests/test_ascend_direct_interop.py), run on the emulated CANN and HIXL. It provides
# the same `mooncake` package as the wheel above, hence a venv of its own. Pinned: the emulator
# exports what this version imports. PyPI has it only as cp311 and cp312, manylinux_2_35 x86_64, so
# the venv is made with the first of python3, python3.12, python3.11 that is 3.11 or 3.12. Its
# declared dependencies are aiohttp, requests and msgpack (no torch, no CANN), so a plain install
# is right; the CANN libraries it links come from the emulator's directory at run time. If this
# fails, those tests fail and say why.
NPU_VENV=.venv-mooncake-npu
NPU_WHEEL=mooncake-transfer-engine-npu==0.3.13.post1
if ! "$NPU_VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("mooncake-transfer-engine-npu") != "0.3.13.post1")' >/dev/null 2>&1; then
    npu_python=""
    for py in python3 python3.12 python3.11; do
        if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 11), (3, 12)))'; then
            npu_python=$py
            break
        fi
    done
    if [ -z "$npu_python" ]; then
        echo "WARNING: no python3.11 or python3.12 for $NPU_WHEEL (PyPI has only cp311/cp312 wheels); the ascend_direct interop tests will fail and say so" >&2
    else
        say "pip install $NPU_WHEEL into $NPU_VENV ($npu_python)"
        { rm -rf "$NPU_VENV" && "$npu_python" -m venv "$NPU_VENV" && "$NPU_VENV/bin/pip" install -q "$NPU_WHEEL"; } \
            || echo "WARNING: could not install $NPU_WHEEL; the ascend_direct interop tests will fail and say so" >&2
    fi
fi
export FERRY_MOONCAKE_NPU_PYTHON="$PWD/$NPU_VENV/bin/python"

# --- servers -------------------------------------------------------------------------------
# Redis and etcd on free loopback ports, data in $WORK, stopped on exit. The contract tests use
# them (FERRY_TEST_REDIS, FERRY_TEST_ETCD); restart tests start private ones of their own.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry-test.XXXXXX")
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_port() {
    for _ in $(seq 1 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.1
    done
    echo "WARNING: nothing listens on 127.0.0.1:$1 ($2)" >&2
}
if command -v redis-server >/dev/null 2>&1; then
    port=$(free_port)
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK" >"$WORK/redis.log" 2>&1 &
    PIDS+=($!)
    wait_port "$port" redis
    export FERRY_TEST_REDIS="redis://127.0.0.1:$port"
    say "redis on $FERRY_TEST_REDIS"
fi
if command -v etcd >/dev/null 2>&1; then
    port=$(free_port); peer=$(free_port)
    etcd --name ferry-ci --data-dir "$WORK/etcd" \
        --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
        --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
        --initial-cluster "ferry-ci=http://127.0.0.1:$peer" >"$WORK/etcd.log" 2>&1 &
    PIDS+=($!)
    wait_port "$port" etcd
    export FERRY_TEST_ETCD="etcd://127.0.0.1:$port"
    say "etcd on $FERRY_TEST_ETCD"
fi

# --- checks --------------------------------------------------------------------------------
# A first `cargo build --workspace` needs no system package: nothing it builds may depend on
# etcd-client, whose build script runs protoc (it comes only with the `etcd` features).
say "a plain cargo build --workspace needs no protoc"
if [ -n "$(cargo tree --workspace --locked -e normal,build -i etcd-client 2>/dev/null)" ]; then
    echo "error: cargo build --workspace builds etcd-client (needs protoc); keep it behind the etcd features:" >&2
    cargo tree --workspace --locked -e normal,build -i etcd-client >&2
    exit 1
fi

say "cargo fmt --check"
cargo fmt --all -- --check

say "cargo clippy (warnings denied)"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

say "cargo doc (warnings denied)"
RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --all-features --no-deps --locked

say "example: kv_blocks"
cargo run --locked --quiet --example kv_blocks

say "doc tests"
cargo test --workspace --all-features --doc --locked

# Every crate meant for crates.io packages: a manifest cargo accepts, versioned dependencies on
# the other workspace crates, the files it needs (docs/architecture.md, "Public API and
# publishing"). The crates marked `publish = false` are left out, read from the manifests.
# Verifying every package (building each from its packaged sources: `cargo package --workspace`
# without --no-verify) took 3 min 43 s on the 2-core CI VM even with the dependencies already
# built, since each package rebuilds its dependencies with its own features; too slow for every
# run. So the set is packaged without building, and the leaf crate ferry-core, which every other
# depends on, is verified fully with `cargo publish --dry-run` (about 20 s from cold).
# --allow-dirty: the working tree is what is checked (local runs have uncommitted changes).
say "cargo package (the published crates), cargo publish --dry-run -p ferry-core"
mapfile -t unpublished < <(cargo metadata --no-deps --format-version 1 --locked |
    python3 -c 'import json, sys; print("\n".join(p["name"] for p in json.load(sys.stdin)["packages"] if p["publish"] == []))')
cargo package --workspace --no-verify --allow-dirty --locked "${unpublished[@]/#/--exclude=}"
cargo publish --dry-run --allow-dirty --locked -p ferry-core

# The test binaries do not build the shared libraries the tests load (the plugins, libferry_c.so
# for the Python package) nor the `ferry` binary pytest talks to: one build of everything first.
say "cargo build (libraries, plugins, the ferry CLI)"
cargo build --workspace --all-features --locked
# The emulated CANN of an older release (no one-sided HCCL symbols) for the fallback tests; its
# own target dir keeps cargo from unifying the feature with the default build.
cargo build --locked -p ferry-cann-emu --no-default-features --target-dir target/cann-emu-legacy
# The prefill/decode peer program the HCCL tests run as separate processes.
cargo build --workspace --all-features --locked --examples

status=0
say "tests (disk: $(df -h --output=used,avail . | tail -1 | awk '{print $1" used, "$2" free"}'))"
"${RUNNER[@]}" --locked || status=1

# The fuzz targets of the decoders of untrusted input (fuzz/, see docs/testing.md), each for a
# bounded time from its committed corpus (new inputs go to a scratch directory). They need a
# nightly toolchain; without one the same decoders are still exercised by the property tests
# above, on stable.
FUZZ_SECONDS=${FERRY_FUZZ_SECONDS:-10}
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    say "fuzzing not run: no nightly toolchain (rustup toolchain install nightly); the decoders' property tests ran on stable"
else
    if ! cargo fuzz --version >/dev/null 2>&1; then
        say "cargo install cargo-fuzz"
        cargo install cargo-fuzz --locked >/dev/null || { echo "error: cargo-fuzz could not be installed" >&2; status=1; }
    fi
    if cargo fuzz --version >/dev/null 2>&1; then
        say "fuzzing (${FUZZ_SECONDS} s per target)"
        cargo +nightly fuzz build --sanitizer none --debug-assertions || status=1
        for target in tcp_wire p2p_frame descriptor config; do
            mkdir -p "$WORK/fuzz-$target"
            if cargo +nightly fuzz run --sanitizer none --debug-assertions "$target" "$WORK/fuzz-$target" \
                "fuzz/corpus/$target" -- -max_total_time="$FUZZ_SECONDS" >"$WORK/fuzz-$target.log" 2>&1; then
                echo "$target: $(grep -E '^Done' "$WORK/fuzz-$target.log" || echo done)"
            else
                tail -n 40 "$WORK/fuzz-$target.log"
                echo "error: fuzz target $target failed; the input is saved under fuzz/artifacts/$target" >&2
                status=1
            fi
        done
    fi
fi

# The Python package, installed the way README says (one pip command), then its pytest suite:
# two Python processes over P2PHANDSHAKE, Python against the Rust `ferry` binary and against
# Mooncake's wheel; Mooncake's CI check of its transfer engine with the wheel and Ferry in both
# roles on the wheel's own `mooncake_http_metadata_server` (tests/test_mooncake_ci.py), the calls
# of vLLM, SGLang and vllm-ascend, and `python -m ferry.alias` in throw-away venvs (python3-venv
# above). FERRY_CARGO_PROFILE=debug reuses the build above.
say "python: pip install ./ffi/bindings/python, pytest"
PYVENV=.venv-ferry
if [ ! -x "$PYVENV/bin/python" ]; then
    python3 -m venv "$PYVENV"
fi
"$PYVENV/bin/pip" install -q --upgrade pytest
FERRY_CARGO_PROFILE=debug "$PYVENV/bin/pip" install -q --force-reinstall --no-deps ./ffi/bindings/python
FERRY_BIN="$PWD/target/debug/ferry" "$PYVENV/bin/python" -m pytest -q ffi/bindings/python/tests || status=1

exit $status
