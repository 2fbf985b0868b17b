//! The mangled names in `src/symbols.rs` are what the system C++ compiler gives Ferry's own
//! declarations of the entry points (`tests/fixtures/declarations.cpp`): compiled with `c++`
//! (or `$CXX`), read back with `nm` (or `$NM`).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use ferry_hixl_sys::{ADXL, ASCEND_STRING, HIXL};

#[test]
fn the_resolved_names_are_the_compilers_names_of_ferrys_declarations() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let nm = std::env::var("NM").unwrap_or_else(|_| "nm".into());
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/declarations.cpp");
    let dir = std::env::temp_dir().join(format!("ferry-hixl-mangle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let obj = dir.join("declarations.o");
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-c"])
        .arg(&src)
        .arg("-o")
        .arg(&obj)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cxx} (the C++ compiler the shim is built with): {e}"));
    assert!(out.status.success(), "{cxx} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(&nm)
        .args(["-u", "--format=just-symbols"])
        .arg(&obj)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {nm}: {e}"));
    assert!(out.status.success(), "{nm} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
    let compiled: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|s| s.starts_with("_ZN4hixl") || s.starts_with("_ZN4adxl") || s.contains("2ge12AscendString"))
        .map(str::to_owned)
        .collect();
    let ours: BTreeSet<String> =
        HIXL.iter().chain(ADXL.iter()).chain(ASCEND_STRING.iter()).map(|s| s.mangled.to_owned()).collect();
    assert_eq!(ours.len(), 26);
    assert_eq!(
        compiled,
        ours,
        "only compiled: {:?}\nonly in symbols.rs: {:?}",
        compiled.difference(&ours).collect::<Vec<_>>(),
        ours.difference(&compiled).collect::<Vec<_>>()
    );
}

/// Every `adxl::` and `ge::` name Ferry resolves is one the real `mooncake-transfer-engine-npu`
/// wheel imports (the fixture `ffi/ascend/cann-emu/tests/fixtures/mooncake-npu-hixl-imports.txt`,
/// read from the wheels with `nm`), and Ferry's required/optional split is the wheel's
/// strong/weak split.
#[test]
fn the_adxl_names_are_the_ones_mooncakes_wheel_imports() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../cann-emu/tests/fixtures/mooncake-npu-hixl-imports.txt");
    let text = std::fs::read_to_string(&fixture).unwrap_or_else(|e| panic!("{}: {e}", fixture.display()));
    let wheel: std::collections::HashMap<&str, &str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?, f.next()?))
        })
        .collect();
    for s in ADXL.iter().chain(ASCEND_STRING.iter()) {
        let kind =
            wheel.get(s.mangled).unwrap_or_else(|| panic!("{} ({}) is not imported by the wheel", s.name, s.mangled));
        let expected = if s.required { "U" } else { "w" };
        assert_eq!(*kind, expected, "{}: the wheel imports it as {kind}", s.name);
    }
}
