#!/usr/bin/env bash
# Ferry's whole test suite: installs what is missing, starts the servers the suite needs on
# loopback, runs formatting, lint, docs and every test, and stops the servers again.
#
# Usage: scripts/test.sh            (from anywhere; CI calls it through .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n==> %s\n' "$*"; }

# --- prerequisites -------------------------------------------------------------------------
if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo not found; install a Rust toolchain (rustup) first" >&2
    exit 1
fi
rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt clippy 2>/dev/null || true
if cargo nextest --version >/dev/null 2>&1; then
    RUNNER=(cargo nextest run --workspace --no-fail-fast)
else
    echo "cargo-nextest not found; using cargo test"
    RUNNER=(cargo test --workspace --no-fail-fast)
fi

# Mooncake's wheel, for the interop tests (tests/interop_mooncake.rs). If it cannot be installed
# those tests fail and say why; nothing is skipped.
need_debs=()
for pkg in libibverbs1 libnuma1 librdmacm1 python3-venv; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_debs+=("$pkg")
done
if [ ${#need_debs[@]} -gt 0 ]; then
    say "apt-get install ${need_debs[*]}"
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_debs[@]}") >/dev/null \
            || echo "WARNING: could not install ${need_debs[*]}; the Mooncake interop tests will fail" >&2
    else
        echo "WARNING: not root; install ${need_debs[*]} for the Mooncake interop tests" >&2
    fi
fi
VENV=.venv-mooncake
if ! "$VENV/bin/python" -c 'import mooncake.engine' >/dev/null 2>&1; then
    say "pip install mooncake-transfer-engine-non-cuda into $VENV"
    { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q mooncake-transfer-engine-non-cuda; } \
        || echo "WARNING: could not install the Mooncake wheel; the interop tests will fail and say so" >&2
fi
export FERRY_MOONCAKE_PYTHON="$PWD/$VENV/bin/python"

# --- servers -------------------------------------------------------------------------------
# The suite needs no external server yet: the embedded in-process metadata store serves every
# test. Metadata backends that need etcd or Redis start them here, on loopback, in $WORK.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry-test.XXXXXX")
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT

# --- checks --------------------------------------------------------------------------------
say "cargo fmt --check"
cargo fmt --all -- --check

say "cargo clippy (warnings denied)"
cargo clippy --workspace --all-targets --locked -- -D warnings

say "cargo doc (warnings denied)"
RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps --locked

say "example: kv_blocks"
cargo run --locked --quiet --example kv_blocks

say "doc tests"
cargo test --workspace --doc --locked

say "tests"
"${RUNNER[@]}" --locked
