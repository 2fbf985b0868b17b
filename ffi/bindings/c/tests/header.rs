//! `ffi/include/ferry.h` is exactly what cbindgen generates from this crate with
//! `ffi/bindings/c/cbindgen.toml`. `FERRY_BLESS=1 cargo test -p ferry-capi --test header` rewrites it.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn header_path() -> PathBuf {
    crate_dir().join("../../include/ferry.h")
}

fn generate() -> anyhow::Result<String> {
    let dir = crate_dir();
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml"))
        .map_err(|e| anyhow::anyhow!("reading cbindgen.toml: {e}"))?;
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .context("cbindgen could not generate the header")?;
    let mut out = Vec::new();
    bindings.write(&mut out);
    Ok(String::from_utf8(out)?)
}

fn first_difference(a: &str, b: &str) -> String {
    for (n, (x, y)) in a.lines().zip(b.lines()).enumerate() {
        if x != y {
            return format!("line {}: committed {x:?}, generated {y:?}", n + 1);
        }
    }
    format!("lengths differ: committed {} lines, generated {} lines", a.lines().count(), b.lines().count())
}

#[test]
fn committed_header_matches_the_generated_one() -> anyhow::Result<()> {
    let generated = generate()?;
    let path = header_path();
    if std::env::var("FERRY_BLESS").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("has a parent"))?;
        std::fs::write(&path, &generated).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
        return Ok(());
    }
    let committed = std::fs::read_to_string(&path).with_context(|| {
        format!("reading {} (generate it with FERRY_BLESS=1 cargo test -p ferry-capi --test header)", path.display())
    })?;
    if committed != generated {
        bail!(
            "{} is stale ({}): regenerate it with FERRY_BLESS=1 cargo test -p ferry-capi --test header",
            path.display(),
            first_difference(&committed, &generated)
        );
    }
    Ok(())
}

/// Every exported function of the crate, as the spec names them.
const FUNCTIONS: &[&str] = &[
    "ferry_version",
    "ferry_last_error",
    "ferry_last_error_copy",
    "ferry_clear_last_error",
    "ferry_engine_create",
    "ferry_engine_create_from_file",
    "ferry_engine_create_from_env",
    "ferry_engine_destroy",
    "ferry_engine_segment_name",
    "ferry_engine_rpc_port",
    "ferry_register_memory",
    "ferry_unregister_memory",
    "ferry_open_segment",
    "ferry_close_segment",
    "ferry_submit",
    "ferry_batch_poll",
    "ferry_batch_wait",
    "ferry_batch_cancel",
    "ferry_batch_free",
    "ferry_batch_len",
    "ferry_batch_released",
    "ferry_batch_failed_blocks",
    "ferry_transfer_sync",
    "ferry_notify",
    "ferry_drain_notifications",
    "ferry_kv_layout_register",
    "ferry_kv_layout_unregister",
    "ferry_kv_submit_blocks",
];

#[test]
fn header_declares_the_api_and_borrows_the_abi_types() -> anyhow::Result<()> {
    let h = generate()?;
    assert!(h.contains("#ifndef FERRY_H") && h.contains("#define FERRY_H"), "include guard FERRY_H");
    assert!(h.contains("#include \"ferry_abi.h\""), "includes ferry_abi.h");
    assert!(h.contains("cargo build --release -p ferry-capi"), "says how to build and link");
    for f in FUNCTIONS {
        assert!(h.contains(&format!(" {f}(")) || h.contains(&format!("*{f}(")), "{f} is not declared");
    }
    assert!(h.contains("typedef uint64_t FerryEngine;") && h.contains("typedef uint64_t FerryBatch;"));
    assert!(
        h.contains("typedef void (*FerryNotificationFn)(void *ctx, const char *from, const char *message);"),
        "callback type"
    );
    assert!(h.contains("int32_t ferry_submit(FerryEngine engine,"), "handles are typed");
    assert!(h.contains("size_t count"), "usize is size_t");
    for abi_type in ["struct FerryTransferRequest {", "struct FerryTransferStatus {", "#define FERRY_OK"] {
        assert!(!h.contains(abi_type), "{abi_type} belongs to ferry_abi.h, not ferry.h");
    }
    // The safety contract of registration reaches the C reader.
    assert!(h.contains("caller's promise that the memory is valid"));
    Ok(())
}

#[test]
fn the_abi_header_sits_beside_it() {
    // ferry.h is unusable without ferry_abi.h (generated from the ferry-abi crate).
    let abi = crate_dir().join("../../include/ferry_abi.h");
    assert!(Path::new(&abi).is_file(), "{} is missing", abi.display());
}
