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
