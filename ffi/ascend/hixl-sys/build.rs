//! Builds the C++ shim (`cpp/hixl_shim.cpp`) with the system C++ compiler. It needs no CANN
//! header or library: every declaration in it is Ferry's own.

fn main() {
    println!("cargo:rerun-if-changed=cpp/hixl_shim.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("cpp/hixl_shim.cpp")
        .warnings(true)
        .extra_warnings(true)
        .compile("ferry_hixl_shim");
}
