//! The shared library exports the C symbols (checked with `nm -D`), the build without the
//! `onesided` feature (an "older CANN") lacks the one-sided ones, and every `acl*` symbol
//! Mooncake's NPU wheel imports is exported (`tests/fixtures/mooncake-npu-acl-imports.txt`), as
//! is every `adxl::`/`ge::` symbol it imports and every `hixl::Hixl` symbol Ferry's HIXL shim
//! binds (`tests/fixtures/mooncake-npu-hixl-imports.txt`; checked with `dlsym` on the library).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use ferry_cann_emu::{BASE_SYMBOLS, ONE_SIDED_SYMBOLS, exported_symbols};

/// `target/<profile>`: the test binary lives in `target/<profile>/deps`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

fn defined_symbols(so: &Path) -> BTreeSet<String> {
    assert!(so.exists(), "{} is missing: build it with `cargo build -p ferry-cann-emu`", so.display());
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(so)
        .output()
        .expect("run `nm` (binutils) to list the library's dynamic symbols");
    assert!(out.status.success(), "nm failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            match (f.next(), f.next(), f.next()) {
                (Some(_), Some("T"), Some(name)) => Some(name.to_string()),
                _ => None,
            }
        })
        .collect()
}

fn c_api(symbols: &BTreeSet<String>) -> BTreeSet<String> {
    symbols.iter().filter(|s| s.starts_with("acl") || s.starts_with("Hccl")).cloned().collect()
}

#[test]
fn the_library_exports_exactly_the_c_surface() {
    let so = profile_dir().join("libferry_cann_emu.so");
    let exported = c_api(&defined_symbols(&so));
    let expected: BTreeSet<String> = exported_symbols().iter().map(|s| s.to_string()).collect();
    assert_eq!(exported, expected, "C symbols of {}", so.display());
    assert_eq!(ONE_SIDED_SYMBOLS.iter().all(|s| exported.contains(*s)), cfg!(feature = "onesided"));
}

#[test]
fn the_legacy_build_lacks_the_one_sided_symbols() {
    let profile = profile_dir();
    let root = profile.parent().expect("target dir");
    // When this test itself runs in the legacy build, build into that same directory.
    let target_dir = if root.ends_with("cann-emu-legacy") { root.to_path_buf() } else { root.join("cann-emu-legacy") };
    let mut cmd = Command::new(env!("CARGO"));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "-p", "ferry-cann-emu", "--no-default-features", "--target-dir"])
        .arg(&target_dir);
    let profile_name = profile.file_name().and_then(|n| n.to_str()).unwrap_or("debug");
    if profile_name == "release" {
        cmd.arg("--release");
    }
    let out = cmd.output().expect("run cargo");
    assert!(out.status.success(), "legacy build failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let so = target_dir.join(profile_name).join("libferry_cann_emu.so");
    let exported = c_api(&defined_symbols(&so));
    for s in ONE_SIDED_SYMBOLS {
        assert!(!exported.contains(*s), "{s} must be absent from {}", so.display());
    }
    for s in ["HcclGetRootInfo", "HcclCommInitRootInfo", "HcclSend", "HcclRecv", "aclrtSetDevice", "aclrtMemcpyAsync"] {
        assert!(exported.contains(s), "{s} must be present in {}", so.display());
    }
    let two_sided: BTreeSet<String> = BASE_SYMBOLS.iter().map(|s| s.to_string()).collect();
    assert_eq!(exported, two_sided);
}

/// The `acl*` symbols of `tests/fixtures/mooncake-npu-acl-imports.txt`, with their `nm` type.
fn wheel_acl_imports() -> Vec<(String, String)> {
    let text = include_str!("fixtures/mooncake-npu-acl-imports.txt");
    let imports: Vec<(String, String)> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let mut f = l.split_whitespace();
            let name = f.next().expect("a symbol").to_string();
            let kind = f.next().unwrap_or_else(|| panic!("{l:?}: no nm type")).to_string();
            assert!(name.starts_with("acl"), "{l:?}: not an acl* symbol");
            assert!(kind == "U" || kind == "w", "{l:?}: nm type must be U or w");
            (name, kind)
        })
        .collect();
    assert_eq!(imports.iter().filter(|(_, k)| k == "U").count(), 34, "the fixture lists 34 strong imports");
    imports
}

#[test]
fn every_acl_symbol_the_mooncake_npu_wheel_imports_is_exported() {
    let imports = wheel_acl_imports();
    let listed: BTreeSet<&str> = exported_symbols().into_iter().collect();
    let missing: Vec<&str> = imports.iter().map(|(n, _)| n.as_str()).filter(|n| !listed.contains(n)).collect();
    assert!(missing.is_empty(), "exported_symbols() lacks {missing:?}");
    // Every build exports them: none is one-sided HCCL.
    assert!(imports.iter().all(|(n, _)| BASE_SYMBOLS.contains(&n.as_str())));

    let so = profile_dir().join("libferry_cann_emu.so");
    let defined = defined_symbols(&so);
    let missing: Vec<&str> = imports.iter().map(|(n, _)| n.as_str()).filter(|n| !defined.contains(*n)).collect();
    assert!(missing.is_empty(), "{} does not define {missing:?}", so.display());
}

/// The symbols of `tests/fixtures/mooncake-npu-hixl-imports.txt`: `(name, nm type or "ferry")`.
fn wheel_hixl_imports() -> Vec<(String, String)> {
    let text = include_str!("fixtures/mooncake-npu-hixl-imports.txt");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let mut f = l.split_whitespace();
            let name = f.next().expect("a symbol").to_string();
            let kind = f.next().unwrap_or_else(|| panic!("{l:?}: no type")).to_string();
            assert!(kind == "U" || kind == "w" || kind == "ferry", "{l:?}: type must be U, w or ferry");
            (name, kind)
        })
        .collect()
}

#[test]
fn every_hixl_symbol_the_wheel_imports_or_the_shim_binds_is_exported() {
    let imports = wheel_hixl_imports();
    let count = |k: &str| imports.iter().filter(|(_, t)| t == k).count();
    assert_eq!((count("U"), count("w"), count("ferry")), (11, 6, 12), "the fixture's counts");
    // The crate's lists name exactly these symbols.
    let listed: BTreeSet<&str> = ferry_cann_emu::hixl::ADXL_EXPORTS
        .iter()
        .chain(ferry_cann_emu::hixl::HIXL_EXPORTS)
        .chain(ferry_cann_emu::hixl::GE_EXPORTS)
        .copied()
        .collect();
    let fixture: BTreeSet<&str> = imports.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(listed, fixture, "ADXL_EXPORTS + HIXL_EXPORTS + GE_EXPORTS == the fixture");

    let so = profile_dir().join("libferry_cann_emu.so");
    let defined = defined_symbols(&so);
    let missing: Vec<&str> = fixture.iter().copied().filter(|n| !defined.contains(*n)).collect();
    assert!(missing.is_empty(), "{} does not define {missing:?}", so.display());

    // dlsym finds each one in the library loaded under HIXL's name.
    let dir = std::env::temp_dir().join(format!("ferry-hixl-exports-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let alias = dir.join("libllm_datadist.so");
    std::os::unix::fs::symlink(&so, &alias).unwrap();
    let path = std::ffi::CString::new(alias.to_str().unwrap()).unwrap();
    // SAFETY: a valid path; the library's constructors are Rust/C++ statics only.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!handle.is_null(), "dlopen {}", alias.display());
    for name in &fixture {
        let c = std::ffi::CString::new(*name).unwrap();
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
        assert!(!p.is_null(), "dlsym({name}) on {}", alias.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
