//! C++ exceptions never unwind into Rust: they come back as [`HixlError::Exception`].
//!
//! The emulated HIXL never throws, so this test compiles its own tiny `hixl::Hixl`
//! (`tests/fixtures/throwing_hixl.cpp`) with the system C++ compiler (`c++`, or `$CXX`) and
//! loads it like any HIXL. Its Initialize also checks, with libstdc++'s own `std::map` lookup,
//! that the options map the shim builds is ordered by the library's `operator<`.

use std::path::Path;
use std::process::Command;

use ferry_ascend_sys::test_support::TempDir;
use ferry_hixl_sys::{ApiChoice, HixlApi, HixlEngine, HixlError, HixlLibrary, SearchPath, TransferOp, TransferOpDesc};

#[test]
fn exceptions_become_errors_and_the_options_map_is_ordered_by_the_librarys_operator() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/throwing_hixl.cpp");
    let dir = TempDir::new("ferry-hixl-throwing").unwrap();
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-shared", "-fPIC", "-o"])
        .arg(dir.path().join("libcann_hixl.so"))
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cxx}: {e}"));
    assert!(out.status.success(), "{cxx} failed:\n{}", String::from_utf8_lossy(&out.stderr));

    let lib = HixlLibrary::load_with(&SearchPath::only(dir.path()), ApiChoice::Hixl).unwrap();
    assert_eq!(lib.api(), HixlApi::Hixl);
    assert!(!lib.has_async() && !lib.has_capability_query());
    assert_eq!(lib.capability(ferry_hixl_sys::FeatureType::AUTO_CONNECT), None);
    assert_eq!(
        lib.missing_optional(),
        ["hixl::Hixl::TransferAsync", "hixl::Hixl::GetTransferStatus", "hixl::Hixl::GetCapability"]
    );

    let mut engine = HixlEngine::new(lib.clone()).unwrap();
    let e = engine.initialize("oom", &[]).unwrap_err();
    assert_eq!(e, HixlError::Exception { call: "hixl::Hixl::Initialize", what: "std::bad_alloc".into() });
    // Keys in an order that is not sorted: the library finds each through the map.
    let options = [("zeta", "1"), ("AutoConnect", "0"), ("Count", "5"), ("alpha", ""), ("LocalCommRes", "{}")];
    engine.initialize("127.0.0.1:1", &options).unwrap();

    let e = engine.connect("throw", 1000).unwrap_err();
    assert_eq!(e.to_string(), "hixl::Hixl::Connect threw a C++ exception: no route to throw");
    engine.connect("peer", 1000).unwrap();
    let d = [TransferOpDesc { local_addr: 8, remote_addr: 16, len: 0 }];
    // SAFETY: this library copies nothing (its TransferSync only throws).
    let e = unsafe { engine.transfer_sync("peer", TransferOp::Read, &d, 1000) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "hixl::Hixl::TransferSync threw a C++ exception: an exception that is not a std::exception"
    );
    // SAFETY: refused before any call (this library has no TransferAsync).
    let e = unsafe { engine.transfer_async("peer", TransferOp::Read, &d) }.unwrap_err();
    assert!(e.is_unsupported(), "{e}");
    engine.disconnect("peer", 1000).unwrap();
    engine.finalize();

    // A Finalize that throws (at drop) is caught too: the destructor still runs.
    let mut engine = HixlEngine::new(lib).unwrap();
    engine.initialize("127.0.0.1:2", &[("ThrowInFinalize", "1"), ("Count", "2")]).unwrap();
    drop(engine);
}
