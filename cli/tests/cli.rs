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
    use std::io::BufRead;
    let mut child =
        ferry().args(args).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null()).spawn().unwrap();
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
    let out =
        ferry().args(["bench", "--segment_id=127.0.0.1:1", "--duration=1", "--buffer_size=1MiB"]).output().unwrap();
    assert!(!out.status.success(), "an unreachable target is an error");
    let _ = target.kill();
    let _ = target.wait();
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
    let p = tmp("bad.json", "{\n  \"protocol\": \"rdma\",\n  \"metadata_server\": \"gopher://h:70\"\n}");
    let out = ferry().args(["doctor", "--config"]).arg(&p).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("2 problem(s)"), "{s}");
    assert!(s.contains("unknown protocol \"rdma\"; installed: local") && s.contains("line 2"), "{s}");
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

/// Starts `ferry bench --mode=target` on `port` and returns it with its segment name.
fn bench_target(port: u16) -> (std::process::Child, String) {
    let name = format!("--local_server_name=127.0.0.1:{port}");
    serve(&["bench", "--mode=target", "--buffer_size=64MiB", &name], "listening on ")
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
