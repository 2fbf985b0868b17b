//! The `ferry` binary, run as a user runs it.

use std::process::Command;

mod common;

use common::ferry;

fn tmp(name: &str, text: &str) -> std::path::PathBuf {
    common::tmp_in("test", name, text)
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
fn demo_two_process_mode_moves_blocks_over_tcp() {
    let out = ferry()
        .args(["demo", "--two-process", "--transfers", "10", "--blocks", "64", "--block-size", "4KiB"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("two processes") && stdout.contains("transport `tcp`"), "{stdout}");
    assert!(stdout.contains("read back whole matches"), "{stdout}");
    assert!(stdout.trim_end().ends_with("verified: OK"), "{stdout}");
}

/// Starts `ferry ARGS` and waits for its first line, which must start with `prefix`; returns
/// the process and the rest of that line.
fn serve(args: &[&str], prefix: &str) -> (std::process::Child, String) {
    serve_with(ferry(), args, prefix)
}

fn serve_with(mut command: Command, args: &[&str], prefix: &str) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child =
        command.args(args).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let rest = line.trim().strip_prefix(prefix).unwrap_or_else(|| panic!("`ferry {args:?}` said {line:?}")).to_owned();
    (child, rest)
}

#[test]
fn bench_target_and_initiator_talk_like_mooncakes() {
    let (mut target, segment) = serve(&["bench", "--mode=target", "--buffer_size=8MiB"], "listening on ");
    for op in ["read", "write"] {
        let out = ferry()
            .args(["bench", "--buffer_size=8MiB", "--block_size=4096", "--batch_size=8", "--threads=2", "--duration=1"])
            .arg(format!("--segment_id={segment}"))
            .arg(format!("--operation={op}"))
            .output()
            .unwrap();
        let s = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{s}{}", String::from_utf8_lossy(&out.stderr));
        let tput = s.lines().last().and_then(|l| l.strip_prefix("throughput ")).expect("Mooncake's last line");
        let gbs: f64 = tput.trim_end_matches(" GB/s").parse().unwrap();
        assert!(gbs > 0.0, "{s}");
        assert!(s.contains("p99") && s.contains("peak RSS"), "{s}");
    }
    // Both block patterns run; the JSON names the one used (Mooncake's, `same`, by default).
    for (flag, name) in [(None, "same"), (Some("--access=rotate"), "rotate")] {
        let out = ferry()
            .args(["bench", "--buffer_size=8MiB", "--block_size=4096", "--batch_size=8", "--threads=1", "--duration=1"])
            .args(["--json", &format!("--segment_id={segment}")])
            .args(flag)
            .output()
            .unwrap();
        let s = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{s}{}", String::from_utf8_lossy(&out.stderr));
        let summary: serde_json::Value = serde_json::from_str(s.trim()).unwrap();
        assert_eq!(summary["access"], name, "{s}");
        assert!(summary["bytes"].as_u64().unwrap() > 0, "{s}");
    }
    // A buffer too small for every thread's batch would have threads move the same blocks.
    let out = ferry()
        .args(["bench", "--buffer_size=16KiB", "--block_size=4096", "--batch_size=8", "--threads=2", "--duration=1"])
        .arg(format!("--segment_id={segment}"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("fewer than --batch_size x --threads = 16"), "{err}");
    let out =
        ferry().args(["bench", "--segment_id=127.0.0.1:1", "--duration=1", "--buffer_size=1MiB"]).output().unwrap();
    assert!(!out.status.success(), "an unreachable target is an error");
    let _ = target.kill();
    let _ = target.wait();
}

/// A missing, empty or malformed `--segment_id` is refused before the buffer is allocated: with
/// a 64 GiB buffer (more than this machine can register) the answer is about the segment, not
/// the buffer, and it comes at once.
#[test]
fn bench_checks_the_segment_before_allocating_the_buffer() {
    for (arg, says) in [
        (None, "--segment_id is required"),
        (Some("--segment_id="), "--segment_id is required"),
        (Some("--segment_id=nohost"), "is host:port"),
    ] {
        let started = std::time::Instant::now();
        let mut cmd = ferry();
        cmd.args(["bench", "--buffer_size=64GiB", "--duration=1"]);
        cmd.args(arg);
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains(says), "{arg:?}: {err}");
        assert!(err.contains("listening on"), "{arg:?}: the error says where a segment comes from: {err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "{arg:?}: {:?}", started.elapsed());
    }
}

#[test]
fn bench_device_memory_needs_cann_and_says_so() {
    // Only host and NPU buffers are supported.
    let out = ferry().args(["bench", "--device=cuda:0", "--segment_id=127.0.0.1:1"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("cuda:0 buffers are not supported"), "{err}");
    // npu:N without CANN: the loader's error, before any engine starts.
    let empty = std::env::temp_dir().join(format!("ferry-cli-no-cann-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = ferry()
        .args(["bench", "--mode=target", "--protocol=ascend", "--device=npu:0", "--buffer_size=1MiB"])
        .env("FERRY_ASCEND_LIB_DIR", &empty)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("loading CANN for --device") && err.contains("libascendcl.so"), "{err}");
    let _ = std::fs::remove_dir(&empty);
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
    assert!(s.contains("control channel:  none: the in-process store runs no listener"), "{s}");
    assert!(s.contains("status:           OK"), "{s}");
}

#[test]
fn doctor_names_the_control_channel_beside_a_store() {
    let p = tmp(
        "store.json",
        r#"{"local_hostname": "10.1.2.3:17000", "protocol": "tcp", "metadata_server": "http://127.0.0.1:1/metadata",
            "rpc_port": 15123}"#,
    );
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("control channel:  handshake listener beside the store, on RPC port 15123 ["), "{s}");
    let p = tmp("p2p.json", r#"{"local_hostname": "10.1.2.3", "protocol": "tcp", "metadata_server": "P2PHANDSHAKE"}"#);
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("control channel:  the P2P handshake itself"), "{s}");
}

#[test]
fn doctor_says_whether_the_same_process_shortcut_is_installed() {
    let p = tmp("shortcut.json", r#"{"local_hostname": "10.1.2.3:17000", "protocol": "tcp"}"#);
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("also installed:   local (tried first for same-process peers)"), "{s}");
    let out = ferry().args(["doctor", "--config"]).arg(&p).env("FERRY_LOCAL_TRANSPORT", "0").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(
        s.contains("left out:         local (local_transport false [env FERRY_LOCAL_TRANSPORT]: peers in this process are reached through tcp)"),
        "{s}"
    );
    // The embedded default's protocol is `local`: leaving it out is a problem that says why.
    let out = ferry()
        .args(["doctor"])
        .env_remove("MOONCAKE_CONFIG_PATH")
        .env("FERRY_LOCAL_TRANSPORT", "off")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("field `local_transport` (from environment variable FERRY_LOCAL_TRANSPORT): is false"),
        "{text}"
    );
}

#[test]
fn doctor_lists_every_declared_option_with_its_value_and_source() {
    let p = tmp(
        "tcp-options.json",
        "{\n  \"protocol\": \"tcp\",\n  \"tcp_lanes\": 8,\n  \"tcp_data_port\": 18000,\n  \"widget\": 1\n}",
    );
    let out = ferry().args(["doctor", "--config"]).arg(&p).env("FERRY_TCP_IO_THREADS", "2").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains(&format!("  tcp_lanes          = 8 [file {}]", p.display())), "{s}");
    assert!(s.contains("  tcp_data_port      = 18000 [file "), "{s}");
    assert!(s.contains("  tcp_io_threads     = 2 [env FERRY_TCP_IO_THREADS]"), "{s}");
    assert!(s.contains("  hccl_retries       = 2 [default]"), "every transport's options, whatever the protocol: {s}");
    assert!(s.contains("unknown fields:   widget (kept, not used)"), "declared options are not unknown: {s}");

    // A value out of range is a problem naming the field, its position and the accepted range.
    let out = ferry().args(["doctor", "--config"]).arg(&p).env("FERRY_TCP_LANES", "100").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("  tcp_lanes          = 100 [env FERRY_TCP_LANES] INVALID (see below)"), "{s}");
    assert!(
        s.contains(
            "- field `tcp_lanes` (from environment variable FERRY_TCP_LANES): is 100; expected 1 to 64 connections per peer"
        ),
        "{s}"
    );
}

#[test]
fn doctor_says_whether_authentication_is_on_and_never_shows_the_secret() {
    let p = tmp("auth.json", "{\n  \"protocol\": \"tcp\"\n}");
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("authentication:   off: anyone who reaches the data and handshake ports is served"), "{s}");
    assert!(s.contains("  auth_secret        = none (authentication off) [default]"), "{s}");

    let secret = "do-not-print-me-0123456789";
    let out = ferry().args(["doctor", "--config"]).arg(&p).env("FERRY_AUTH_SECRET", secret).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(
        s.contains(
            "authentication:   on (hmac-sha256-v1): secret from environment variable FERRY_AUTH_SECRET (26 bytes)"
        ),
        "{s}"
    );
    assert!(s.contains("  auth_secret        = (set, 26 bytes, hidden) [env FERRY_AUTH_SECRET]"), "{s}");
    assert!(!s.contains(secret) && !String::from_utf8_lossy(&out.stderr).contains(secret), "{s}");

    // Too short: a problem that names the variable, not the value.
    let out = ferry().args(["doctor", "--config"]).arg(&p).env("FERRY_AUTH_SECRET", "hunter2").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("  auth_secret        = (hidden) [env FERRY_AUTH_SECRET] INVALID (see below)"), "{s}");
    assert!(
        s.contains("- the peer authentication secret from environment variable FERRY_AUTH_SECRET is 7 bytes"),
        "{s}"
    );
    assert!(!s.contains("hunter2"), "{s}");

    // From a file others can read: on, with a warning.
    let file = tmp("auth-secret", "0123456789abcdef0123456789abcdef\n");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let cfg = tmp("auth-file.json", &format!(r#"{{"protocol": "tcp", "auth_secret_file": "{}"}}"#, file.display()));
    let out = ferry().args(["doctor", "--config"]).arg(&cfg).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains(&format!("authentication:   on (hmac-sha256-v1): secret from file {}", file.display())), "{s}");
    assert!(s.contains("(mode 644); make it readable by its owner only (chmod 600)"), "{s}");
    assert!(!s.contains("unknown fields"), "auth_secret_file is declared: {s}");
    assert!(!s.contains("0123456789abcdef"), "{s}");
}

#[test]
fn bench_engines_with_a_shared_secret_talk_and_one_without_it_is_refused() {
    let secret = "bench-secret-0123456789";
    let mut command = ferry();
    command.env("FERRY_AUTH_SECRET", secret);
    let (mut target, segment) = serve_with(command, &["bench", "--mode=target", "--buffer_size=8MiB"], "listening on ");
    let bench = |with: Option<&str>| {
        let mut c = ferry();
        c.args(["bench", "--buffer_size=8MiB", "--block_size=4096", "--batch_size=8", "--threads=1", "--duration=1"])
            .arg(format!("--segment_id={segment}"));
        if let Some(s) = with {
            c.env("FERRY_AUTH_SECRET", s);
        }
        c.output().unwrap()
    };
    let out = bench(Some(secret));
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}{}", String::from_utf8_lossy(&out.stderr));
    assert!(s.lines().last().is_some_and(|l| l.starts_with("throughput ")), "{s}");
    let out = bench(None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("requires peer authentication") && err.contains("no auth secret is configured here"), "{err}");
    let out = bench(Some("another-secret-0123456789"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("the two auth secrets differ"), "{err}");
    let _ = target.kill();
    let _ = target.wait();
}

#[test]
fn doctor_reports_every_problem_with_file_and_position() {
    let p = tmp("bad.json", "{\n  \"protocol\": \"rdma\",\n  \"metadata_server\": \"gopher://h:70\"\n}");
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("2 problem(s)"), "{s}");
    // The installed list depends on the features of this build (`null` with --all-features).
    assert!(s.contains("protocol \"rdma\" needs an RDMA transport") && s.contains("MC_FORCE_TCP=1"), "{s}");
    assert!(s.contains("installed: ascend, local, ") && s.contains("line 2"), "{s}");
    assert!(s.contains("unknown scheme \"gopher\"") && s.contains("line 3"), "{s}");

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

/// vllm-ascend's prefill/decode rank table for one 8-card node: cards 0-3 prefill, 4-7 decode.
const NODE_RANK_TABLE: &str = r#"{"version": "1.2", "server_count": "1", "status": "completed",
  "prefill_device_list": [
    {"server_id": "10.0.0.5", "device_id": "0", "device_ip": "29.0.0.1", "cluster_id": "1"},
    {"server_id": "10.0.0.5", "device_id": "1", "device_ip": "29.0.0.2", "cluster_id": "2"},
    {"server_id": "10.0.0.5", "device_id": "2", "device_ip": "29.0.0.3", "cluster_id": "3"},
    {"server_id": "10.0.0.5", "device_id": "3", "device_ip": "29.0.0.4", "cluster_id": "4"}],
  "decode_device_list": [
    {"server_id": "10.0.0.5", "device_id": "4", "device_ip": "29.0.0.5", "cluster_id": "5"},
    {"server_id": "10.0.0.5", "device_id": "5", "device_ip": "29.0.0.6", "cluster_id": "6"},
    {"server_id": "10.0.0.5", "device_id": "6", "device_ip": "29.0.0.7", "cluster_id": "7"},
    {"server_id": "10.0.0.5", "device_id": "7", "device_ip": "29.0.0.8", "cluster_id": "8"}]}"#;

#[test]
fn doctor_explains_identity_in_a_container() {
    // The seed's case: the process sees cards 4 and 5, so aclrtGetDevice says 0 and 1; rank 1 is
    // user device 1, whose physical card the ACL runtime (here the emulated CANN) names, and the
    // port comes from the one shared config.
    let p = tmp("container.json", r#"{"local_hostname": "10.0.0.5", "base_port": 17000, "protocol": "local"}"#);
    let hccn = tmp("container-hccn.conf", "address_4=29.0.0.5\naddress_5=29.0.0.6\naddress_7=29.0.0.8\n");
    let emu = ferry_ascend_sys::test_support::emulator_lib_dir(ferry_ascend_sys::test_support::Emulator::Current)
        .unwrap_or_else(|e| panic!("{e}"));
    let doctor = |visible: &str, mounted: Option<&str>, extra: &[&str], env: &[(&str, &str)]| {
        let mut c = ferry();
        c.args(["doctor", "--config"]).arg(&p).args(extra);
        c.env("ASCEND_RT_VISIBLE_DEVICES", visible)
            .env("FERRY_HCCN_CONF", &hccn)
            .env("FERRY_ASCEND_LIB_DIR", emu.path());
        c.env_remove("FERRY_CANN_EMU_MOUNTED").env_remove("LOCAL_RANK").env_remove("FERRY_LOCAL_RANK");
        if let Some(m) = mounted {
            c.env("FERRY_CANN_EMU_MOUNTED", m);
        }
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (ok, s) = doctor("4,5", None, &[], &[("LOCAL_RANK", "1")]);
    assert!(ok, "{s}");
    assert!(
        s.contains("segment name:     10.0.0.5:17001") && s.contains("port = base_port 17000 + local rank 1"),
        "{s}"
    );
    assert!(s.contains("local rank:       1 [env LOCAL_RANK]"), "{s}");
    assert!(
        s.contains(
            "user_device      = 1                    (from env) user device 1 = local rank 1; \
             ASCEND_RT_VISIBLE_DEVICES=\"4,5\" entry 1 is its logical id 5"
        ),
        "{s}"
    );
    assert!(s.contains("physical_device  = 5                    (from acl) aclrtGetPhyDevIdByUserDevId(1) = 5"), "{s}");
    assert!(
        s.contains("device_ip        = 29.0.0.6") && s.contains("(from hccn_conf)") && s.contains("line 2 address_5"),
        "{s}"
    );
    assert!(s.contains("env -> acl -> hccn_conf") && !s.contains("not in this build"), "{s}");
    // In a container the entries are logical ids: one mounting cards 6 and 7 calls them 0 and 1.
    let (ok, s) = doctor("0,1", Some("6,7"), &[], &[("LOCAL_RANK", "1")]);
    assert!(ok, "{s}");
    assert!(s.contains("physical_device  = 7                    (from acl)"), "{s}");
    assert!(s.contains("device_ip        = 29.0.0.8"), "{s}");

    // FERRY_LOCAL_RANK wins over LOCAL_RANK, and --local-rank over both.
    let run = |extra: &[&str]| doctor("4,5", None, extra, &[("LOCAL_RANK", "1"), ("FERRY_LOCAL_RANK", "0")]).1;
    let s = run(&[]);
    assert!(s.contains("physical_device  = 4") && s.contains("[env FERRY_LOCAL_RANK]"), "{s}");
    let s = run(&["--local-rank", "1"]);
    assert!(s.contains("physical_device  = 5") && s.contains("10.0.0.5:17001"), "{s}");
    assert!(s.contains("local rank:       1 [--local-rank]"), "{s}");

    // Variables Ferry cannot trust: an error naming the variable and its value, never device 0.
    for (value, rank, needle) in [
        ("4, 5", "1", "entry 1 (\" 5\") contains whitespace"),
        ("5,4", "0", "entries must ascend"),
        ("4,99", "0", "out of range"),
        ("4,5", "2", "user device 2 = local rank 2 does not exist"),
    ] {
        let out = ferry()
            .args(["doctor", "--config"])
            .arg(&p)
            .env("ASCEND_RT_VISIBLE_DEVICES", value)
            .env("LOCAL_RANK", rank)
            .output()
            .unwrap();
        let s = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{s}");
        assert!(s.contains(&format!("ASCEND_RT_VISIBLE_DEVICES={value:?}")) && s.contains(needle), "{value}: {s}");
        assert!(!s.contains("physical_device"), "{s}");
    }
}

#[test]
fn doctor_explains_identity_from_a_rank_table() {
    let rt = tmp("node-ranktable.json", NODE_RANK_TABLE);
    let cfg = format!(
        r#"{{"prefill_url": "10.0.0.5", "decode_url": "10.0.0.5", "protocol": "local",
            "base_port": {{"prefill": 17000, "decode": 17100}}, "rank_table_path": "{}"}}"#,
        rt.display()
    );
    let p = tmp("node.json", &cfg);
    let out = ferry()
        .args(["doctor", "--config"])
        .arg(&p)
        .args(["--peer", "10.0.0.5:17001:npu_1"])
        .env("FERRY_ROLE", "decode")
        .env("LOCAL_RANK", "2")
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("segment name:     10.0.0.5:17102") && s.contains("base_port 17100 + local rank 2"), "{s}");
    assert!(s.contains("(vllm-ascend prefill/decode, 8 device(s))"), "{s}");
    assert!(
        s.contains("[config field `rank_table_path` in ") && !s.contains("unknown fields"),
        "the Ascend options are declared, not unknown: {s}"
    );
    assert!(
        s.contains("physical_device  = 6                    (from rank_table)") && s.contains("decode_device_list[2]"),
        "{s}"
    );
    assert!(s.contains("device_ip        = 29.0.0.7             (from rank_table)"), "{s}");
    assert!(s.contains("peer 10.0.0.5:17001:npu_1:") && s.contains("device_ip        = 29.0.0.2"), "{s}");

    // The same table through vllm-ascend's variable, and a table that is not ready.
    let out = ferry()
        .args(["doctor", "--config"])
        .arg(tmp("node2.json", r#"{"local_hostname": "10.0.0.5", "role": "prefill", "protocol": "local"}"#))
        .env("DISAGGREGATED_PREFILL_RANK_TABLE_PATH", &rt)
        .env("FERRY_LOCAL_RANK", "3")
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("[environment variable DISAGGREGATED_PREFILL_RANK_TABLE_PATH]"), "{s}");
    assert!(s.contains("physical_device  = 3") && s.contains("prefill_device_list[3]"), "{s}");

    let pending = tmp("pending.json", &NODE_RANK_TABLE.replace("completed", "initializing"));
    for (table, rank, needle) in [
        (&pending, "0", "`status` is \"initializing\"; expected \"completed\""),
        (&rt, "4", "local rank 4 has no entry"),
    ] {
        let out = ferry()
            .args(["doctor", "--config"])
            .arg(&p)
            .env("FERRY_RANK_TABLE", table)
            .env("FERRY_ROLE", "decode")
            .env("LOCAL_RANK", rank)
            .output()
            .unwrap();
        let s = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{s}");
        assert!(
            s.contains("resolver `rank_table`") && s.contains(&table.display().to_string()) && s.contains(needle),
            "{s}"
        );
    }
}

#[test]
fn doctor_rejects_bad_resolver_lists_and_device_suffixes() {
    let p = tmp("resolvers.json", "{\n  \"protocol\": \"local\",\n  \"resolvers\": [\"hostname\", \"dns\"]\n}");
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("field `resolvers` at line 3") && s.contains("unknown resolver \"dns\""), "{s}");
    assert!(
        s.contains("known resolvers: current_device, config, hostname, rank_table, env, acl, hccn_conf, port_offset"),
        "{s}"
    );

    let out = ferry()
        .args(["doctor", "--config"])
        .arg(tmp("order.json", r#"{"local_hostname": "10.0.0.5:17000:npu_3", "protocol": "local"}"#))
        .env("FERRY_RESOLVERS", "env,hostname")
        .env("ASCEND_NPU_PHY_ID", "2")
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("resolver chain: env -> hostname [env FERRY_RESOLVERS]"), "{s}");
    assert!(s.contains("physical_device  = 2                    (from env)"), "{s}");
    assert!(s.contains("note: `hostname` said physical_device = 3"), "{s}");
    // Two sources naming different cards is a problem, not a note to skip over.
    assert!(!out.status.success(), "{s}");
    assert!(
        s.contains("the identity sources disagree about the device: physical_device: `env` says 2 (ASCEND_NPU_PHY_ID=\"2\"), but `hostname` says 3"),
        "{s}"
    );

    for (name, needle) in [
        ("10.0.0.5:17000:npu_77", "device part \"npu_77\" is out of range (device ids are below 64)"),
        ("10.0.0.5:17000:64", "device part \"64\" is out of range (device ids are below 64)"),
    ] {
        let cfg = format!(r#"{{"local_hostname": "{name}", "protocol": "local"}}"#);
        let out = ferry().args(["doctor", "--config"]).arg(tmp("npu77.json", &cfg)).output().unwrap();
        let s = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{s}");
        assert!(s.contains("field `local_hostname`") && s.contains(needle), "{s}");
    }
    let out = ferry()
        .args(["doctor", "--config"])
        .arg(tmp("phys.json", "{\n  \"protocol\": \"local\",\n  \"physical_devices\": [4, 99]\n}"))
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{s}");
    assert!(
        s.contains("INVALID")
            && s.contains("field `physical_devices` at line 3")
            && s.contains("entry 1 (99) is out of range (device ids are below 64)"),
        "{s}"
    );

    let out = ferry()
        .args(["doctor", "--config"])
        .arg(tmp("npu.json", r#"{"local_hostname": "10.0.0.5:17000:npu_x", "protocol": "local"}"#))
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("field `local_hostname`") && s.contains("device part \"npu_x\""), "{s}");
}

#[test]
fn doctor_binds_a_rank_table_card_by_its_position_among_the_visible_cards() {
    // Decode worker 0 on a node where every card is visible: the rank table says card 4, so the
    // user device is 4 (binding user device 0 would drive card 0 and publish card 4).
    let rt = tmp("position-ranktable.json", NODE_RANK_TABLE);
    let cfg = format!(
        r#"{{"prefill_url": "10.0.0.5", "decode_url": "10.0.0.5", "protocol": "ascend",
            "base_port": {{"prefill": 17000, "decode": 17100}}, "rank_table_path": "{}"}}"#,
        rt.display()
    );
    let p = tmp("position.json", &cfg);
    let run = |visible: &str, rank: &str| {
        let out = ferry()
            .args(["doctor", "--config"])
            .arg(&p)
            .env("FERRY_ROLE", "decode")
            .env("LOCAL_RANK", rank)
            .env("ASCEND_RT_VISIBLE_DEVICES", visible)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (ok, s) = run("0,1,2,3,4,5,6,7", "0");
    assert!(ok, "{s}");
    assert!(s.contains("physical_device  = 4                    (from rank_table)"), "{s}");
    assert!(
        s.contains(
            "user_device      = 4                    (from env) user device 4, the position of 4 (the physical \
             device resolved earlier"
        ),
        "{s}"
    );
    assert!(!s.contains("note:"), "no disagreement: {s}");
    assert!(s.contains("status:           OK"), "the ascend transport's identity check passes: {s}");
    // The decode instance that sees only its own cards: card 5 is user device 1.
    let (ok, s) = run("4,5,6,7", "1");
    assert!(ok, "{s}");
    assert!(s.contains("physical_device  = 5") && s.contains("user_device      = 1"), "{s}");
    // A visible list without the rank table's card: an error naming the variable and value.
    let (ok, s) = run("0,1,2,3", "0");
    assert!(!ok, "{s}");
    assert!(s.contains("local rank 0 has no entry") && s.contains("ASCEND_RT_VISIBLE_DEVICES=\"0,1,2,3\""), "{s}");
}

#[test]
fn doctor_runs_the_ascend_transports_identity_check() {
    let ascend = |name: &str, cfg: &str, env: &[(&str, &str)]| {
        let mut c = ferry();
        c.args(["doctor", "--config"]).arg(tmp(name, cfg));
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    // No physical id from anywhere.
    let (ok, s) = ascend("ascend-none.json", r#"{"local_hostname": "10.0.0.5:17000", "protocol": "ascend"}"#, &[]);
    assert!(!ok, "{s}");
    assert!(s.contains("- ascend transport: cannot tell which physical NPU this process drives"), "{s}");
    // A physical id but no user id (no visible list; the acl link finds no CANN here).
    let hccn = tmp("ascend-hccn.conf", "address_4=29.0.0.5\n").display().to_string();
    let npu4 = r#"{"local_hostname": "10.0.0.5:17000:npu_4", "protocol": "hccl"}"#;
    let (ok, s) = ascend("ascend-nouser.json", npu4, &[("FERRY_HCCN_CONF", &hccn)]);
    assert!(!ok, "{s}");
    assert!(s.contains("- ascend transport: physical NPU 4 is known but not which device id ACL uses"), "{s}");
    // Physical and user ids but no device IP; the list omits `acl`, which the transport adds.
    let (ok, s) = ascend(
        "ascend-noip.json",
        r#"{"local_hostname": "10.0.0.5:17000:npu_4", "protocol": "ascend", "resolvers": ["hostname", "env"]}"#,
        &[("ASCEND_RT_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")],
    );
    assert!(!ok, "{s}");
    assert!(s.contains("resolver chain: hostname -> env -> acl [file "), "{s}");
    assert!(s.contains("`acl` inserted by the ascend transport"), "{s}");
    assert!(s.contains("user_device      = 4"), "{s}");
    assert!(s.contains("- ascend transport: no device IP for physical NPU 4; add `address_4=<ip>`"), "{s}");
    assert!(!s.contains("resolved so far"), "the explanation is printed once, above: {s}");
    // With the visible list and hccn.conf the identity is complete.
    let (ok, s) =
        ascend("ascend-ok.json", npu4, &[("ASCEND_RT_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7"), ("FERRY_HCCN_CONF", &hccn)]);
    assert!(ok, "{s}");
    assert!(s.contains("device_ip        = 29.0.0.5") && s.contains("status:           OK"), "{s}");
    assert!(
        s.contains("  hccl_retries       = 2 [default]")
            && s.contains("  hccl_control_port  = any free port [default]"),
        "{s}"
    );
    // The transport's options, each with where it came from.
    let (ok, s) = ascend(
        "ascend-options.json",
        npu4,
        &[
            ("ASCEND_RT_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7"),
            ("FERRY_HCCN_CONF", &hccn),
            ("FERRY_HCCL_RETRIES", "5"),
            ("FERRY_HCCL_CONTROL_PORT", "18000"),
        ],
    );
    assert!(ok, "{s}");
    assert!(s.contains("  hccl_retries       = 5 [env FERRY_HCCL_RETRIES]"), "{s}");
    assert!(s.contains("  hccl_control_port  = 18000 [env FERRY_HCCL_CONTROL_PORT]"), "{s}");
    assert!(s.contains(&format!("  hccn_conf_path     = {hccn} [env FERRY_HCCN_CONF]")), "{s}");
    let (ok, s) = ascend("ascend-bad-retries.json", npu4, &[("FERRY_HCCL_RETRIES", "many")]);
    assert!(!ok, "{s}");
    assert!(s.contains("- environment variable FERRY_HCCL_RETRIES=\"many\": not a whole number"), "{s}");
    // The same incomplete identity is fine for a transport that needs no device.
    let (ok, s) = ascend("local-none.json", r#"{"local_hostname": "10.0.0.5:17000", "protocol": "local"}"#, &[]);
    assert!(ok, "{s}");
}

#[test]
fn doctor_refuses_a_fixed_control_port_with_base_port() {
    let p = tmp(
        "control-port.json",
        r#"{"local_hostname": "10.0.0.5", "base_port": 17000, "protocol": "local", "hccl_control_port": 18000}"#,
    );
    let out = ferry().args(["doctor", "--config"]).arg(&p).env("LOCAL_RANK", "1").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("field `hccl_control_port`") && s.contains("every rank would bind the same port"), "{s}");
    assert!(s.contains("leave it unset"), "{s}");
    let p = tmp("control-port-env.json", r#"{"local_hostname": "10.0.0.5", "base_port": 17000, "protocol": "local"}"#);
    let out = ferry()
        .args(["doctor", "--config"])
        .arg(&p)
        .env("LOCAL_RANK", "1")
        .env("FERRY_HCCL_CONTROL_PORT", "18000")
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("(from environment variable FERRY_HCCL_CONTROL_PORT)"), "{s}");
}

/// Starts `ferry bench --mode=target` on `port` and returns it with its segment name.
/// A bench target on RPC port `port` (FERRY_RPC_PORT: under P2PHANDSHAKE a port in the name is
/// ignored, as by Mooncake).
fn bench_target(port: u16) -> (std::process::Child, String) {
    let mut command = ferry();
    command.env("FERRY_RPC_PORT", port.to_string());
    serve_with(
        command,
        &["bench", "--mode=target", "--buffer_size=64MiB", "--local_server_name=127.0.0.1"],
        "listening on ",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_transfer_fails_its_requests_in_time_and_is_reachable_after_restart() {
    use ferry::{ErrorKind, Location, Opcode, TransferRequest};
    use std::time::{Duration, Instant};
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (mut target, segment) = bench_target(port);
    let cfg = ferry::Config::from_json_str(
        r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "transfer_timeout_ms": 3000}"#,
        None,
    )
    .unwrap();
    let engine = ferry::builder().config(cfg).build().await.unwrap();
    let mut local = vec![0u8; 64 << 20];
    let addr = local.as_mut_ptr() as u64;
    // SAFETY: `local` outlives `engine`, which is shut down at the end of the test.
    unsafe { engine.register_memory(addr, local.len() as u64, Location::Cpu(0)).await }.unwrap();
    let peer = engine.open_segment(&segment).await.unwrap();
    let remote = engine.segment(peer).unwrap().descriptor().buffers[0].addr;
    let reqs: Vec<TransferRequest> = (0..64u64)
        .map(|i| TransferRequest {
            opcode: Opcode::Read,
            source: addr + (i << 20),
            target: peer,
            target_offset: remote + (i << 20),
            length: 1 << 20,
        })
        .collect();
    engine.transfer(&reqs).await.unwrap();

    // Kill -9 while a large batch is in flight.
    let batch = engine.submit(&reqs).await.unwrap();
    target.kill().unwrap();
    target.wait().unwrap();
    let t = Instant::now();
    let st = batch.wait(Duration::from_secs(10)).await.expect("no hang: every request gets an outcome");
    assert!(t.elapsed() < Duration::from_secs(5), "outcomes within the configured timeout, took {:?}", t.elapsed());
    assert_eq!(st.failed + st.completed, st.total);
    assert!(st.failed > 0, "the kill landed mid-batch: {st:?}");
    let kinds: std::collections::HashSet<_> =
        (0..reqs.len()).filter_map(|i| batch.error(i)).map(|e| e.kind()).collect();
    assert!(kinds.iter().all(|k| *k == ErrorKind::PeerUnreachable), "failed requests: {kinds:?}");
    drop(batch);

    // Restarted on the same port: reachable again (the stale descriptor is refetched).
    let (mut again, segment2) = bench_target(port);
    assert_eq!(segment2, segment);
    let mut ok = false;
    for _ in 0..3 {
        let remote = match engine.refresh_segment(peer).await {
            Ok(()) => engine.segment(peer).unwrap().descriptor().buffers[0].addr,
            Err(_) => continue,
        };
        let r =
            TransferRequest { opcode: Opcode::Read, source: addr, target: peer, target_offset: remote, length: 4096 };
        if engine.transfer(&[r]).await.is_ok() {
            ok = true;
            break;
        }
    }
    assert!(ok, "the restarted peer is reachable");
    engine.shutdown().await.unwrap();
    let _ = again.kill();
    let _ = again.wait();
    drop(local);
}

/// Starts `ferry metadata-server` on `addr` with `dir`; returns it and its URL.
fn metadata_server(addr: &str, dir: &std::path::Path) -> (std::process::Child, String) {
    let dir = dir.to_str().unwrap();
    let (child, bound) =
        serve(&["metadata-server", "--addr", addr, "--data-dir", dir], "metadata server listening on ");
    (child, format!("http://{bound}/metadata"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_server_killed_with_sigkill_loses_nothing_with_a_data_dir() {
    let dir = std::env::temp_dir().join(format!("ferry-meta-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut server, url) = metadata_server("127.0.0.1:0", &dir);
    let port = url.trim_start_matches("http://127.0.0.1:").trim_end_matches("/metadata").to_owned();
    let c = reqwest::Client::new();
    for i in 0..50 {
        let r = c.put(format!("{url}?key=mooncake/ram/seg{i}")).body(format!("{{\"i\":{i}}}")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
    c.delete(format!("{url}?key=mooncake/ram/seg7")).send().await.unwrap();
    server.kill().unwrap(); // SIGKILL: no chance to flush anything
    server.wait().unwrap();
    let (mut again, url2) = metadata_server(&format!("127.0.0.1:{port}"), &dir);
    assert_eq!(url2, url);
    for i in 0..50 {
        let r = c.get(format!("{url}?key=mooncake/ram/seg{i}")).send().await.unwrap();
        if i == 7 {
            assert_eq!(r.status().as_u16(), 404, "the delete survived too");
        } else {
            assert_eq!(r.status().as_u16(), 200, "key {i} lost");
            assert_eq!(r.text().await.unwrap(), format!("{{\"i\":{i}}}"));
        }
    }
    let _ = again.kill();
    let _ = again.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn doctor_names_the_plugin_that_serves_the_protocol_and_where_it_looked() {
    // The example plugin, built by `cargo build --workspace` (scripts/test.sh) beside this binary.
    let bin_dir = std::path::Path::new(env!("CARGO_BIN_EXE_ferry")).parent().unwrap().to_path_buf();
    let lib = bin_dir.join("libferry_transport_example.so");
    assert!(lib.is_file(), "{} missing: run `cargo build -p ferry-transport-example` first", lib.display());
    let good = tmp("plugin.json", &format!(r#"{{"protocol": "example", "plugins": ["{}"]}}"#, bin_dir.display()));
    let out = ferry().args(["doctor", "--config"]).arg(&good).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("-> transport `example` (plugin ") && s.contains("libferry_transport_example.so"), "{s}");
    assert!(s.contains(&format!("plugin search:    {}", bin_dir.display())), "{s}");

    let missing = tmp("noplugin.json", r#"{"protocol": "nosuchplugin"}"#);
    let out = ferry().args(["doctor", "--config"]).arg(&missing).output().unwrap();
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("unknown protocol \"nosuchplugin\"") && all.contains("FERRY_PLUGIN_DIR"), "{all}");
}

/// `ferry doctor` says which Ascend backend runs and why, and with `--peer` which one
/// reaches that peer (its descriptor read from the metadata service) and why: a Mooncake
/// `ascend_direct` node (endpoints only) and a Ferry node without HIXL (direct-HCCL fields
/// only), on a node with the emulated HIXL and on one without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_says_which_ascend_backend_reaches_each_peer_and_why() {
    use ferry_ascend_sys::test_support::{Emulator, emulator_lib_dir, emulator_lib_dir_with_hixl};
    let dir = std::env::temp_dir().join(format!("ferry-doctor-backends-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut server, url) = metadata_server("127.0.0.1:0", &dir);
    let c = reqwest::Client::new();
    let mooncake = r#"{"name":"10.0.0.9:16000","protocol":"ascend","buffers":[{"addr":4096,"length":8192,"name":"npu:0","device_id":0}],
        "rank_info":{"rankId":4294967295,"hostIp":"10.0.0.9","hostPort":0,"deviceLogicId":0,"devicePhyId":0,"deviceType":5,
        "deviceIp":"","devicePort":0,"pid":0,"endpoints":["10.0.0.9:20213"]}}"#;
    let ferry_hccl = r#"{"name":"10.0.0.8:16000","protocol":"ascend","buffers":[{"addr":4096,"length":8192,"name":"npu:3","device_id":3}],
        "rank_info":{"rankId":3,"hostIp":"10.0.0.8","hostPort":17123,"deviceLogicId":3,"devicePhyId":3,"deviceType":0,
        "deviceIp":"29.0.0.4","devicePort":16666,"pid":7}}"#;
    for (name, body) in [("10.0.0.9:16000", mooncake), ("10.0.0.8:16000", ferry_hccl)] {
        let r = c.put(format!("{url}?key=mooncake/ram/{name}")).body(body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
    let cfg = tmp(
        "backends.json",
        &format!(r#"{{"local_hostname": "10.0.0.5:17000:npu_4", "protocol": "ascend", "metadata_server": "{url}"}}"#),
    );
    let hccn = tmp("backends-hccn.conf", "address_4=29.0.0.5\n");
    let doctor = |lib: &std::path::Path, peer: &str| {
        let out = ferry()
            .args(["doctor", "--config"])
            .arg(&cfg)
            .args(["--peer", peer])
            .env("ASCEND_RT_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
            .env("FERRY_HCCN_CONF", &hccn)
            .env("FERRY_ASCEND_LIB_DIR", lib)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let with = emulator_lib_dir_with_hixl(Emulator::Current).unwrap_or_else(|e| panic!("{e}"));
    let without = emulator_lib_dir(Emulator::Current).unwrap_or_else(|e| panic!("{e}"));

    let s = doctor(with.path(), "10.0.0.9:16000");
    assert!(s.contains("ascend backend:   auto"), "{s}");
    assert!(s.contains("HIXL:           on: hixl::Hixl (") && s.contains("libcann_hixl.so"), "{s}");
    assert!(s.contains("direct HCCL:    on, for peers publishing deviceIp/hostPort and no HIXL endpoint"), "{s}");
    assert!(s.contains("reached via:    HIXL: it publishes HIXL endpoint(s) [\"10.0.0.9:20213\"]"), "{s}");
    let s = doctor(with.path(), "10.0.0.8:16000");
    assert!(
        s.contains("reached via:    direct HCCL: it publishes no HIXL endpoint; it publishes deviceIp 29.0.0.4"),
        "{s}"
    );

    let s = doctor(without.path(), "10.0.0.9:16000");
    assert!(s.contains("HIXL:           off: HIXL cannot be loaded: HIXL could not be loaded"), "{s}");
    assert!(s.contains("libllm_datadist.so"), "the missing library is named: {s}");
    assert!(s.contains("direct HCCL:    on, for every peer (fallback: HIXL is off)"), "{s}");
    assert!(
        s.contains("reached via:    nothing: ascend transport cannot reach segment `10.0.0.9:16000`: it publishes HIXL \
                    endpoint(s) [\"10.0.0.9:20213\"] (a Mooncake ascend_direct node or a Ferry node with HIXL), but HIXL \
                    does not run here"),
        "{s}"
    );
    let s = doctor(without.path(), "10.0.0.8:16000");
    assert!(s.contains("reached via:    direct HCCL: it publishes no HIXL endpoint"), "{s}");
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
