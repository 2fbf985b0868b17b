//! The `ferry` binary, run as a user runs it.

use std::process::Command;

fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("MOONCAKE_CONFIG_PATH").env_remove("LOCAL_RANK");
    for (k, _) in std::env::vars() {
        if k.starts_with("FERRY_") || k == "MC_METADATA_CLUSTER_ID" {
            c.env_remove(k);
        }
    }
    c
}

fn tmp(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn demo_runs_a_verified_block_transfer_with_no_config() {
    let out = ferry().args(["demo", "--transfers", "10", "--blocks", "64", "--block-size", "4KiB"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("transport `local`"), "{stdout}");
    assert!(stdout.contains("read :") && stdout.contains("write:"), "{stdout}");
    assert!(stdout.contains("p99"), "{stdout}");
    assert!(stdout.trim_end().ends_with("verified: OK"), "{stdout}");
}

#[test]
fn demo_json_summary_counts_what_moved() {
    let out = ferry()
        .args([
            "demo",
            "--json",
            "--layers",
            "1",
            "--transfers",
            "5",
            "--blocks",
            "32",
            "--blocks-per-transfer",
            "4",
            "--block-size",
            "1KiB",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verified"], true);
    assert_eq!(v["regions"], 2);
    let read = &v["phases"][0];
    assert_eq!(read["blocks"], 20);
    assert_eq!(read["bytes"], 20 * 1024 * 2);
    assert_eq!(read["verified_block_pairs"], 20);
    let requests = read["requests"].as_u64().unwrap();
    assert!((2..=40).contains(&requests), "{requests}");
}

#[test]
fn demo_rejects_impossible_shapes() {
    let out = ferry().args(["demo", "--blocks", "4", "--blocks-per-transfer", "8"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--blocks (4)"));
    let out = ferry().args(["demo", "--block-size", "12XB"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown unit"));
}

#[test]
fn doctor_explains_a_good_config() {
    let p = tmp(
        "good.json",
        r#"{"local_hostname": "10.1.2.3:17000:npu_6", "protocol": "local", "metadata_server": "", "rdma_devices": "x"}"#,
    );
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("store style"), "{s}");
    assert!(s.contains("10.1.2.3:17000:npu_6"), "{s}");
    assert!(s.contains("physical_device  = 6") && s.contains("(from hostname)"), "{s}");
    assert!(s.contains("unknown fields:   rdma_devices"), "{s}");
    assert!(s.contains("status:           OK"), "{s}");
}

#[test]
fn doctor_reports_every_problem_with_file_and_position() {
    let p = tmp("bad.json", "{\n  \"protocol\": \"rdma\",\n  \"metadata_server\": \"etcd://h:2379\"\n}");
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("2 problem(s)"), "{s}");
    assert!(s.contains("unknown protocol \"rdma\"; installed: local") && s.contains("line 2"), "{s}");
    assert!(s.contains("metadata backend `etcd` is not built"), "{s}");

    let p = tmp("broken.json", "{\"protocol\": ");
    let out = ferry().args(["doctor", "-c"]).arg(&p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(s.contains("INVALID") && s.contains("broken.json") && s.contains("not valid JSON"), "{s}");
}

#[test]
fn doctor_follows_mooncake_config_path_and_env_overrides() {
    let p =
        tmp("env.json", r#"{"prefill_url": "10.0.0.1:13003", "decode_url": "10.0.0.2:13003", "protocol": "local"}"#);
    let out = ferry().arg("doctor").env("MOONCAKE_CONFIG_PATH", &p).env("FERRY_ROLE", "decode").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("connector style") && s.contains("10.0.0.2:13003"), "{s}");
    let out = ferry().arg("doctor").env("MOONCAKE_CONFIG_PATH", &p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(s.contains("FERRY_ROLE"), "{s}");
}
