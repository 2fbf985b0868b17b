//! Load failures need no HIXL: the message must say what was looked for, where, and why each
//! candidate was not used (the Ascend transport prints it in `ferry doctor`).

use ferry_ascend_sys::test_support::TempDir;
use ferry_hixl_sys::{ApiChoice, HixlApi, HixlLibrary, LoadError, SearchPath};

fn libc_path() -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("/libc.so") || p.contains("/libc-"))
        .expect("this test process maps libc")
        .to_owned()
}

#[test]
fn an_empty_directory_names_both_libraries_and_the_directory() {
    let dir = TempDir::new("ferry-hixl-empty").unwrap();
    let err = HixlLibrary::load_with(&SearchPath::only(dir.path()), ApiChoice::Auto).unwrap_err();
    let LoadError::NotFound { choice, failures } = &err else { panic!("{err:?}") };
    assert_eq!(*choice, ApiChoice::Auto);
    assert_eq!(failures.iter().map(|f| f.api).collect::<Vec<_>>(), vec![HixlApi::Hixl, HixlApi::Adxl]);
    let text = err.to_string();
    let d = dir.path().display();
    assert!(text.starts_with("HIXL could not be loaded (looked for hixl::Hixl, then adxl::AdxlEngine"), "{text}");
    assert!(text.contains("FERRY_HIXL_API picks one"), "{text}");
    assert!(text.contains("hixl::Hixl in libcann_hixl.so:"), "{text}");
    assert!(text.contains(&format!("{d}/libcann_hixl.so (explicit directory): no such file")), "{text}");
    assert!(text.contains("adxl::AdxlEngine in libllm_datadist.so:"), "{text}");
    assert!(text.contains(&format!("{d}/libllm_datadist.so (explicit directory): no such file")), "{text}");
}

#[test]
fn an_override_tries_only_its_api() {
    let dir = TempDir::new("ferry-hixl-empty").unwrap();
    let err = HixlLibrary::load_with(&SearchPath::only(dir.path()), ApiChoice::Adxl).unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("HIXL could not be loaded (FERRY_HIXL_API=adxl;"), "{text}");
    assert!(text.contains("libllm_datadist.so") && !text.contains("libcann_hixl.so"), "{text}");
}

#[test]
fn a_library_without_the_entry_points_is_named_with_what_it_lacks() {
    let dir = TempDir::new("ferry-hixl-notlib").unwrap();
    std::os::unix::fs::symlink(libc_path(), dir.path().join("libcann_hixl.so")).unwrap();
    std::fs::write(dir.path().join("libllm_datadist.so"), b"not an ELF file").unwrap();
    let err = HixlLibrary::load_with(&SearchPath::only(dir.path()), ApiChoice::Auto).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("libcann_hixl.so (explicit directory): loaded, but it lacks hixl::Hixl::Hixl, hixl::Hixl::~Hixl, hixl::Hixl::Initialize"),
        "{text}"
    );
    assert!(text.contains("hixl::Hixl::TransferSync (not HIXL"), "{text}");
    assert!(!text.contains("TransferAsync"), "optional entry points are not required: {text}");
    assert!(text.contains("libllm_datadist.so (explicit directory): cannot be loaded:"), "{text}");
}
