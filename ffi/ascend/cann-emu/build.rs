//! Compiles the C++ half of the emulated HIXL (`cpp/hixl_layout.cc`): the libstdc++ layout
//! work (`ge::AscendString`, `std::map`, `std::vector`) behind the mangled exports. Its symbols
//! stay local to the library (the cdylib exports only what the Rust side exports).

fn main() {
    println!("cargo:rerun-if-changed=cpp/hixl_layout.cc");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("cpp/hixl_layout.cc")
        .flag_if_supported("-fvisibility=hidden")
        .warnings(true)
        .compile("ferry_cann_emu_hixl_layout");
}
