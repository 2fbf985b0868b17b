//! A C++ program compiled with the system `c++` against Ferry's own declarations
//! (`cpp/ferry_hixl_abi.hpp`) and linked against the built emulator under the name
//! `libllm_datadist.so` does what Mooncake's `ascend_transport.so` does inline: `make_shared`s
//! an engine, builds the `std::map<AscendString, AscendString>` of options and the
//! `std::vector<TransferOpDesc>` with its own libstdc++, copies AscendStrings, and transfers
//! between two processes (READ and WRITE, every byte checked). This proves the layouts.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// A directory with the emulator under every CANN name the program needs, and the program.
fn build(tag: &str) -> (PathBuf, PathBuf) {
    let so = profile_dir().join("libferry_cann_emu.so");
    assert!(so.exists(), "{} is missing: build it with `cargo build -p ferry-cann-emu`", so.display());
    let dir = std::env::temp_dir().join(format!("ferry-hixl-cxx-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["libascendcl.so", "libllm_datadist.so", "libcann_hixl.so", "libmetadef.so"] {
        std::os::unix::fs::symlink(&so, dir.join(name)).unwrap();
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = dir.join("wheel_like");
    let out = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .args(["-std=c++17", "-O1", "-Wall", "-Werror", "-I"])
        .arg(manifest.join("cpp"))
        .arg(manifest.join("tests/cxx/wheel_like.cc"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", dir.display()))
        .args(["-lllm_datadist", "-lascendcl"])
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .output()
        .expect("run the system C++ compiler (c++)");
    assert!(out.status.success(), "c++ failed:\n{}", String::from_utf8_lossy(&out.stderr));
    (dir, exe)
}

fn run(api: &str) {
    let (dir, exe) = build(api);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let clean = |c: &mut Command| {
        for (k, _) in std::env::vars() {
            if k.starts_with("FERRY_CANN_EMU") || k == "ASCEND_RT_VISIBLE_DEVICES" {
                c.env_remove(k);
            }
        }
    };
    let mut sc = Command::new(&exe);
    sc.args(["server", api, &port.to_string()]).stdin(Stdio::piped()).stdout(Stdio::piped());
    clean(&mut sc);
    let mut server = sc.spawn().expect("start the server program");
    let mut lines = BufReader::new(server.stdout.take().unwrap()).lines();
    let ready = lines.next().expect("a line from the server").unwrap();
    let addrs: Vec<&str> =
        ready.strip_prefix("ready ").unwrap_or_else(|| panic!("server said {ready:?}")).split(' ').collect();
    let mut cc = Command::new(&exe);
    cc.args(["client", api, &format!("127.0.0.1:{port}"), addrs[0], addrs[1]]);
    clean(&mut cc);
    let client = cc.output().expect("run the client program");
    let said = String::from_utf8_lossy(&client.stdout);
    assert!(
        client.status.success() && said.contains("done"),
        "client: {said}\n{}",
        String::from_utf8_lossy(&client.stderr)
    );
    writeln!(server.stdin.as_mut().unwrap(), "check").unwrap();
    let checked = lines.next().expect("the server's verdict").unwrap();
    assert_eq!(checked, "checked ok", "the server's dst holds the client's bytes");
    assert!(server.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_cxx_caller_moves_bytes_through_adxl() {
    run("adxl");
}

#[test]
fn a_cxx_caller_moves_bytes_through_hixl() {
    run("hixl");
}
