//! The `ascend` transport across processes, on the emulated CANN (`ffi/ascend/cann-emu`): a prefill
//! process and a decode process (`examples/ascend_peer.rs`) on different emulated cards move
//! selected KV blocks both ways, with the data checked on both sides, and every process shuts
//! down promptly once told to (no device thread left waiting on HCCL).
//!
//! Every environment variable is set on the child processes only. The emulator must be built
//! (`cargo build -p ferry-cann-emu`, and for the older-CANN case
//! `cargo build -p ferry-cann-emu --no-default-features --target-dir target/cann-emu-legacy`),
//! as must the peer, an example of the `ferry` facade (`cargo build -p ferry --example
//! ascend_peer`), all from the workspace root into the target directory these tests run from; a
//! test names the command when one is missing.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_transport_hccl::sys::test_support::{Emulator, TempDir, emulator_lib_dir, target_dir};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(90);
/// How long a peer may take to exit once told to stop (the engine's shutdown included).
const SHUTDOWN: Duration = Duration::from_secs(3);

fn peer_binary() -> PathBuf {
    let (target, profile) = target_dir().expect("the cargo target directory");
    let bin = target.join(profile).join("examples").join("ascend_peer");
    assert!(bin.is_file(), "{} is missing: build it with `cargo build -p ferry --example ascend_peer`", bin.display());
    bin
}

/// A test's emulated node: the CANN library directory and an hccn.conf giving every device its
/// own loopback address in `127.<net>.0.0/24`, so tests running at once never share an endpoint.
struct Node {
    lib: TempDir,
    conf: TempDir,
}

impl Node {
    fn new(variant: Emulator, net: u8) -> Self {
        let lib = emulator_lib_dir(variant).unwrap_or_else(|e| panic!("{e}"));
        let conf = TempDir::new("ferry-hccn").unwrap();
        let text: String =
            (0..8).map(|d| format!("address_{d}=127.{net}.0.{}\nnetdetect_{d}=127.{net}.0.254\n", d + 1)).collect();
        std::fs::write(conf.path().join("hccn.conf"), text).unwrap();
        Self { lib, conf }
    }

    fn env(&self) -> Vec<(String, String)> {
        vec![
            ("FERRY_ASCEND_LIB_DIR".into(), self.lib.path().display().to_string()),
            ("FERRY_HCCN_CONF".into(), self.conf.path().join("hccn.conf").display().to_string()),
            ("FERRY_TRANSFER_TIMEOUT_MS".into(), "20000".into()),
            ("HCCL_CONNECT_TIMEOUT".into(), "20".into()),
        ]
    }
}

/// A running peer process.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Peer {
    fn spawn(args: &[&str], env: &[(String, String)]) -> Self {
        let mut cmd = Command::new(peer_binary());
        cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        for var in [
            "LOCAL_RANK",
            "FERRY_LOCAL_RANK",
            "ASCEND_RT_VISIBLE_DEVICES",
            "ASCEND_NPU_PHY_ID",
            "PHYSICAL_DEVICES",
            "FERRY_CANN_EMU_FAIL",
            "FERRY_CANN_EMU_DELAY_US",
            "FERRY_CANN_EMU_LOG",
            "FERRY_CANN_EMU_NO_ONESIDED",
            "ASCEND_HOME_PATH",
            "ASCEND_TOOLKIT_HOME",
            "MOONCAKE_CONFIG_PATH",
        ] {
            cmd.env_remove(var);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawning ascend_peer");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let (err_pipe, sink) = (child.stderr.take().unwrap(), stderr.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err_pipe).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        let stdin = child.stdin.take();
        Self { child, stdin, lines, stderr }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The JSON after the first stdout line starting with `prefix`.
    fn expect(&mut self, prefix: &str) -> Value {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return serde_json::from_str(rest.trim()).unwrap_or(Value::String(rest.trim().to_owned()));
                    }
                }
                Err(_) => {
                    let status = self.child.try_wait().ok().flatten();
                    panic!("no `{prefix}` line (exit status {status:?}); stderr:\n{}", self.stderr());
                }
            }
        }
    }

    /// The next stdout line starting with `prefix`, as text.
    fn expect_text(&mut self, prefix: &str) -> String {
        match self.expect(prefix) {
            Value::String(s) => s,
            other => other.to_string(),
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Waits for the process to exit; returns its code.
    fn wait(mut self) -> (i32, String) {
        drop(self.stdin.take());
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Give the stderr reader a moment to drain.
                std::thread::sleep(Duration::from_millis(50));
                return (status.code().unwrap_or(-1), self.stderr());
            }
            assert!(std::time::Instant::now() < deadline, "process did not exit; stderr:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `quit`, waits for the exit and checks it succeeded within [`SHUTDOWN`].
    fn quit(mut self, name: &str) {
        self.send("quit");
        let asked = Instant::now();
        let (code, err) = self.wait();
        let took = asked.elapsed();
        assert_eq!(code, 0, "{name} failed:\n{err}");
        assert!(took < SHUTDOWN, "{name} took {took:?} to exit after `quit`; stderr:\n{err}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn with(mut env: Vec<(String, String)>, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env
}

/// Runs a prefill process and a decode process; the decode side reads blocks 3,4,5,9,40 into its
/// 0..5 and writes its 6,7 into prefill's 20,21, both checked. Returns (prefill READY, decode DONE).
fn exchange(
    node: &Node,
    prefill_env: &[(&str, &str)],
    decode_env: &[(&str, &str)],
    extra_args: &[&str],
) -> (Value, Value) {
    let mut prefill_args = vec!["prefill"];
    prefill_args.extend_from_slice(extra_args);
    let mut prefill = Peer::spawn(&prefill_args, &with(node.env(), prefill_env));
    let ready = prefill.expect("READY");
    let segment = ready["segment"].as_str().unwrap().to_owned();
    let layout = ready["layout"].to_string();
    let mut decode_args = vec!["decode", "--peer", &segment, "--peer-layout", &layout];
    decode_args.extend_from_slice(extra_args);
    let mut decode = Peer::spawn(&decode_args, &with(node.env(), decode_env));
    let done = decode.expect("DONE");
    let finished = Instant::now();
    let (code, err) = decode.wait();
    let took = finished.elapsed();
    assert_eq!(code, 0, "decode failed:\n{err}");
    assert!(took < SHUTDOWN, "decode took {took:?} to exit after DONE; stderr:\n{err}");
    prefill.send("verify 20:6,21:7 2");
    let verified = prefill.expect_text("VERIFIED");
    assert_eq!(verified, "ok", "blocks written by decode: {verified}; prefill stderr:\n{}", prefill.stderr());
    prefill.quit("prefill");
    (ready, done)
}

#[test]
fn prefill_and_decode_on_different_cards_move_selected_blocks_both_ways_one_sided() {
    let node = Node::new(Emulator::Current, 21);
    let (ready, done) = exchange(&node, &[("LOCAL_RANK", "0")], &[("LOCAL_RANK", "1")], &[]);
    assert_eq!(ready["rank_info"]["devicePhyId"], 0);
    assert_eq!(done["rank_info"]["devicePhyId"], 1);
    assert_eq!(done["rank_info"]["deviceIp"], "127.21.0.2", "device IP from hccn.conf address_1");
    assert_eq!(done["peer_rank_info"]["deviceIp"], "127.21.0.1");
    assert_ne!(done["peer_rank_info"]["hostPort"], 0, "the control port is published");
    assert_eq!(done["buffers"][0]["device_id"], 1, "device buffers carry the physical device id");
    assert_eq!(done["buffers"][0]["name"], "npu:1");
    let stats = &done["stats"];
    assert!(stats["one_sided_batches"].as_u64().unwrap() >= 2, "{stats}");
    assert_eq!(stats["two_sided_chunks"], 0, "{stats}");
    assert_eq!(stats["failed_attempts"], 0, "{stats}");
}

#[test]
fn in_a_container_the_published_ids_are_physical() {
    let node = Node::new(Emulator::Current, 22);
    let visible = ("ASCEND_RT_VISIBLE_DEVICES", "4,5");
    let (ready, done) = exchange(&node, &[visible, ("LOCAL_RANK", "0")], &[visible, ("LOCAL_RANK", "1")], &[]);
    // ACL numbers the visible cards 0 and 1 ...
    assert_eq!(ready["acl_device"], 0);
    assert_eq!(done["acl_device"], 1);
    assert_eq!(ready["rank_info"]["deviceLogicId"], 0);
    assert_eq!(done["rank_info"]["deviceLogicId"], 1);
    // ... but the identities published (and the rank tables built from them) are physical.
    assert_eq!(ready["rank_info"]["devicePhyId"], 4);
    assert_eq!(done["rank_info"]["devicePhyId"], 5);
    assert_eq!(ready["rank_info"]["deviceIp"], "127.22.0.5", "hccn.conf address_4");
    assert_eq!(done["rank_info"]["deviceIp"], "127.22.0.6", "hccn.conf address_5");
    assert_eq!(done["buffers"][0]["device_id"], 5);
}

#[test]
fn an_older_cann_without_the_one_sided_service_uses_send_and_receive() {
    let node = Node::new(Emulator::Legacy, 23);
    let (_, done) = exchange(&node, &[("LOCAL_RANK", "2")], &[("LOCAL_RANK", "3")], &[]);
    let stats = &done["stats"];
    assert_eq!(stats["one_sided_batches"], 0, "{stats}");
    assert!(stats["two_sided_chunks"].as_u64().unwrap() >= 2, "{stats}");
}

#[test]
fn one_sided_not_supported_at_run_time_falls_back_to_two_sided_with_host_memory() {
    let node = Node::new(Emulator::Current, 24);
    let off = ("FERRY_CANN_EMU_NO_ONESIDED", "1");
    let (_, done) = exchange(&node, &[off, ("LOCAL_RANK", "0")], &[off, ("LOCAL_RANK", "1")], &["--host-memory"]);
    let stats = &done["stats"];
    assert_eq!(stats["one_sided_batches"], 0, "{stats}");
    assert!(stats["two_sided_chunks"].as_u64().unwrap() >= 2, "{stats}");
    assert_eq!(done["buffers"][0]["name"], "cpu:0");
    assert!(done["buffers"][0].get("device_id").is_none(), "host buffers carry no device id");
}

#[test]
fn an_injected_failure_is_recovered_by_rebuilding_the_communicator() {
    let node = Node::new(Emulator::Current, 25);
    let (_, done) =
        exchange(&node, &[("LOCAL_RANK", "0")], &[("LOCAL_RANK", "1"), ("FERRY_CANN_EMU_FAIL", "HcclBatchGet:1")], &[]);
    let stats = &done["stats"];
    assert_eq!(stats["failed_attempts"], 1, "{stats}");
    assert!(stats["communicators_built"].as_u64().unwrap() >= 2, "rebuilt after the failure: {stats}");
    assert!(stats["one_sided_batches"].as_u64().unwrap() >= 2, "{stats}");
}

#[test]
fn a_failure_on_every_attempt_fails_the_blocks_with_the_hccl_error() {
    let node = Node::new(Emulator::Current, 26);
    let mut prefill = Peer::spawn(&["prefill"], &with(node.env(), &[("LOCAL_RANK", "0")]));
    let ready = prefill.expect("READY");
    let (segment, layout) = (ready["segment"].as_str().unwrap().to_owned(), ready["layout"].to_string());
    let mut decode = Peer::spawn(
        &["decode", "--peer", &segment, "--peer-layout", &layout, "--expect-failure"],
        &with(node.env(), &[("LOCAL_RANK", "1"), ("FERRY_CANN_EMU_FAIL", "HcclBatchGet:*")]),
    );
    let failed = decode.expect("FAILED");
    let (code, err) = decode.wait();
    assert_eq!(code, 0, "{err}");
    assert_eq!(failed["kind"], "transport", "{failed}");
    let text = failed["error"].as_str().unwrap();
    assert!(text.contains("HcclBatchGet") && text.contains("after 3 attempts"), "{failed}");
    assert!(failed["source"].as_str().unwrap().contains("HCCL error"), "the HCCL text is the source: {failed}");
    assert_eq!(failed["failed_blocks"], serde_json::json!([0, 1, 2, 3, 4]));
    prefill.quit("prefill");
}

#[test]
fn the_prefill_side_also_initiates_transfers_after_the_decode_side_did() {
    let node = Node::new(Emulator::Current, 28);
    let mut prefill = Peer::spawn(&["prefill"], &with(node.env(), &[("LOCAL_RANK", "0")]));
    let ready = prefill.expect("READY");
    let (segment, layout) = (ready["segment"].as_str().unwrap().to_owned(), ready["layout"].to_string());
    // Decode reads prefill's 3,4,5,9,40 into its 0..4 (checked there), writes its 6,7 into
    // prefill's 20,21, then stays up.
    let mut decode = Peer::spawn(
        &["decode", "--peer", &segment, "--peer-layout", &layout, "--stay"],
        &with(node.env(), &[("LOCAL_RANK", "1")]),
    );
    let done = decode.expect("DONE");
    assert_eq!(done["stats"]["failed_attempts"], 0, "{done}");
    prefill.send("verify 20:6,21:7 2");
    assert_eq!(prefill.expect_text("VERIFIED"), "ok", "prefill stderr:\n{}", prefill.stderr());

    // Now prefill initiates: it reads decode's 10,11,12 into its 30,31,32 (checked against
    // decode's pattern) and writes its 8,9 into decode's 40,41.
    let (d_segment, d_layout) = (done["segment"].as_str().unwrap(), done["layout"].to_string());
    prefill.send(&format!("transfer {d_segment} {d_layout} 10:30,11:31,12:32 8:40,9:41 2"));
    let moved = prefill.expect("TRANSFERRED");
    assert!(moved["error"].is_null(), "{moved}; prefill stderr:\n{}", prefill.stderr());
    let stats = &moved["stats"];
    assert!(stats["one_sided_batches"].as_u64().unwrap() >= 2, "{stats}");
    assert_eq!(stats["two_sided_chunks"], 0, "{stats}");
    assert_eq!(stats["failed_attempts"], 0, "{stats}");
    assert_eq!(
        stats["communicators_built"], 1,
        "the communicator built at decode's request carries both ways: {stats}"
    );
    decode.send("verify 40:8,41:9 1");
    assert_eq!(decode.expect_text("VERIFIED"), "ok", "decode stderr:\n{}", decode.stderr());

    prefill.quit("prefill");
    decode.quit("decode");
}

#[test]
fn without_cann_the_engine_does_not_start_and_names_every_path_tried() {
    let empty = TempDir::new("ferry-no-cann").unwrap();
    let env = vec![
        ("FERRY_ASCEND_LIB_DIR".to_owned(), empty.path().display().to_string()),
        ("LOCAL_RANK".into(), "0".into()),
    ];
    let (code, err) = Peer::spawn(&["prefill"], &env).wait();
    assert_eq!(code, 1, "{err}");
    for path in [
        format!("{}/libascendcl.so (FERRY_ASCEND_LIB_DIR): no such file", empty.path().display()),
        "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so".to_owned(),
        "/usr/local/Ascend/cann/lib64/libascendcl.so".to_owned(),
        "libascendcl.so (dynamic loader search path): cannot be loaded".to_owned(),
    ] {
        assert!(err.contains(&path), "`{path}` missing from:\n{err}");
    }
}

#[test]
fn a_process_whose_card_cannot_be_told_refuses_to_start() {
    let node = Node::new(Emulator::Current, 27);
    // Eight cards visible, no local rank, nothing naming the card: no guess, an error.
    let (code, err) = Peer::spawn(&["prefill"], &node.env()).wait();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot tell which physical NPU"), "{err}");
    assert!(err.contains("LOCAL_RANK"), "{err}");
    // A card hccn.conf has no address for: named.
    let (code, err) =
        Peer::spawn(&["prefill"], &with(node.env(), &[("FERRY_HCCN_CONF", "/dev/null"), ("LOCAL_RANK", "3")])).wait();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("address_3"), "{err}");
}

/// `--read` pairs moving 300 scattered remote blocks (0, 2, 4, ...) into scattered local ones
/// (9, 11, 13, ..., clear of the blocks 6 and 7 the decode side writes back): no two are
/// adjacent, so each is a request of its own.
fn scattered_reads() -> String {
    (0..300).map(|i| format!("{}:{}", 2 * i, 2 * i + 9)).collect::<Vec<_>>().join(",")
}

#[test]
fn three_hundred_scattered_blocks_take_two_one_sided_calls_and_arrive_intact() {
    let node = Node::new(Emulator::Current, 29);
    let reads = scattered_reads();
    let args = ["--regions", "1", "--blocks", "700", "--block-len", "256", "--read", &reads];
    let (_, done) = exchange(&node, &[("LOCAL_RANK", "0")], &[("LOCAL_RANK", "1")], &args);
    let stats = &done["stats"];
    assert_eq!(stats["one_sided_batches"], 2, "one batch of reads, one of writes: {stats}");
    // 300 reads: 256 + 44 descriptors; the 2 writes: one more call.
    assert_eq!(stats["one_sided_calls"], 3, "{stats}");
    assert_eq!(stats["failed_attempts"], 0, "{stats}");
}

#[test]
fn three_hundred_scattered_blocks_go_in_several_two_sided_chunks_and_arrive_intact() {
    let node = Node::new(Emulator::Legacy, 30);
    let reads = scattered_reads();
    let args = ["--regions", "1", "--blocks", "700", "--block-len", "256", "--read", &reads, "--host-memory"];
    let (_, done) = exchange(&node, &[("LOCAL_RANK", "2")], &[("LOCAL_RANK", "3")], &args);
    let stats = &done["stats"];
    // 300 reads: chunks of 256 and 44; the 2 writes: one more.
    assert_eq!(stats["two_sided_chunks"], 3, "{stats}");
    assert_eq!(stats["one_sided_batches"], 0, "{stats}");
    assert_eq!(stats["failed_attempts"], 0, "{stats}");
}

/// One emulator call from a `FERRY_CANN_EMU_LOG=1` line: name, arguments, result.
#[derive(Debug)]
struct Call {
    name: String,
    args: Vec<String>,
    result: String,
}

fn calls(stderr: &str) -> Vec<Call> {
    stderr
        .lines()
        .filter(|l| l.starts_with("[ferry-cann-emu "))
        .filter_map(|l| {
            let body = &l[l.find("] ")? + 2..];
            let (name, rest) = body.split_once('(')?;
            let (args, result) = rest.split_once(") -> ")?;
            let args = args.split(", ").map(str::to_owned).collect();
            Some(Call { name: name.to_owned(), args, result: result.to_owned() })
        })
        .collect()
}

#[test]
fn a_failed_receive_drains_the_stream_before_its_staging_buffers_are_freed() {
    let node = Node::new(Emulator::Legacy, 31);
    let mut prefill = Peer::spawn(&["prefill", "--host-memory"], &with(node.env(), &[("LOCAL_RANK", "0")]));
    let ready = prefill.expect("READY");
    let (segment, layout) = (ready["segment"].as_str().unwrap().to_owned(), ready["layout"].to_string());
    // The second HcclRecv fails while the first is queued on the stream, receiving into a
    // staging buffer (host memory goes through device buffers).
    let mut decode = Peer::spawn(
        &["decode", "--peer", &segment, "--peer-layout", &layout, "--host-memory"],
        &with(node.env(), &[("LOCAL_RANK", "1"), ("FERRY_CANN_EMU_FAIL", "HcclRecv:2"), ("FERRY_CANN_EMU_LOG", "1")]),
    );
    let done = decode.expect("DONE");
    assert_eq!(done["stats"]["failed_attempts"], 1, "retried after the failure: {done}");
    let (code, err) = decode.wait();
    assert_eq!(code, 0, "{err}");
    let calls = calls(&err);
    let failed = calls
        .iter()
        .position(|c| c.name == "HcclRecv" && c.result != "0")
        .unwrap_or_else(|| panic!("no failed HcclRecv in the call log:\n{err}"));
    let first = calls[..failed].iter().rev().find(|c| c.name == "HcclRecv").expect("a receive queued before");
    let (staging, stream) = (&first.args[0], &first.args[5]);
    let freed = failed
        + calls[failed..]
            .iter()
            .position(|c| c.name == "aclrtFree" && &c.args[0] == staging)
            .unwrap_or_else(|| panic!("staging buffer {staging} never freed:\n{err}"));
    let drained = calls[failed..freed]
        .iter()
        .any(|c| (c.name == "aclrtSynchronizeStream" || c.name == "aclrtStreamAbort") && &c.args[0] == stream);
    let window: Vec<String> =
        calls[failed..=freed].iter().map(|c| format!("{}({})", c.name, c.args.join(", "))).collect();
    assert!(drained, "staging buffer {staging} was freed before stream {stream} was drained:\n{}", window.join("\n"));
    prefill.send("verify 20:6,21:7 2");
    assert_eq!(prefill.expect_text("VERIFIED"), "ok", "prefill stderr:\n{}", prefill.stderr());
    prefill.quit("prefill");
}

/// Prefill and a decode process whose one read must time out: the read is delayed by
/// `delay_us` on the emulated device, past the 1.5 s transfer timeout, and the stream the
/// transport would replace after the failure cannot be created (the second aclrtCreateStream
/// fails), so the old stream, still running the read, is what is left.
fn timed_out_read(net: u8, delay_us: &str, extra: &[&str]) -> (Node, Peer, Peer) {
    let node = Node::new(Emulator::Current, net);
    let mut prefill = Peer::spawn(&["prefill"], &with(node.env(), &[("LOCAL_RANK", "0")]));
    let ready = prefill.expect("READY");
    let (segment, layout) = (ready["segment"].as_str().unwrap().to_owned(), ready["layout"].to_string());
    let mut args = vec!["decode", "--peer", &segment, "--peer-layout", &layout, "--expect-timeout"];
    args.extend_from_slice(extra);
    let decode = Peer::spawn(
        &args,
        &with(
            node.env(),
            &[
                ("LOCAL_RANK", "1"),
                ("FERRY_TRANSFER_TIMEOUT_MS", "1500"),
                ("FERRY_CANN_EMU_DELAY_US", delay_us),
                ("FERRY_CANN_EMU_FAIL", "aclrtCreateStream:2"),
            ],
        ),
    );
    (node, prefill, decode)
}

#[test]
fn a_timed_out_read_is_reported_at_the_deadline_and_its_memory_released_only_after_the_device_is_done() {
    let (_node, prefill, mut decode) = timed_out_read(32, "HcclBatchGet:5000000", &[]);
    let out = decode.expect("TIMED_OUT");
    assert_eq!(out["kind"], "timeout", "{out}; stderr:\n{}", decode.stderr());
    let seen = out["seen_ms"].as_u64().unwrap();
    assert!(seen < 3500, "the caller heard of the timeout after {seen} ms (timeout 1500 ms): {out}");
    assert_eq!(out["released_when_seen"], false, "released while the read was still running: {out}");
    let released = out["released_ms"].as_u64().unwrap_or_else(|| panic!("never released: {out}"));
    assert!(released >= 5000, "released after {released} ms, before the 5 s read finished: {out}");
    let bye = decode.expect("SHUTDOWN");
    assert_eq!(bye["threads_left_running"], 0, "{bye}");
    let (code, err) = decode.wait();
    assert_eq!(code, 0, "{err}");
    prefill.quit("prefill");
}

#[test]
fn a_shutdown_with_a_device_thread_still_busy_says_so() {
    let (_node, prefill, mut decode) = timed_out_read(33, "HcclBatchGet:12000000", &["--no-wait-release"]);
    let out = decode.expect("TIMED_OUT");
    assert_eq!(out["kind"], "timeout", "{out}");
    let bye = decode.expect("SHUTDOWN");
    assert_eq!(bye["threads_left_running"], 1, "the peer's thread still waits for the read: {bye}");
    let (code, err) = decode.wait();
    assert_eq!(code, 0, "{err}");
    prefill.quit("prefill");
}

#[test]
fn memory_still_bound_to_a_communicator_is_not_reported_unregistered() {
    let node = Node::new(Emulator::Current, 34);
    let mut prefill = Peer::spawn(&["prefill"], &with(node.env(), &[("LOCAL_RANK", "0")]));
    let ready = prefill.expect("READY");
    let (segment, layout) = (ready["segment"].as_str().unwrap().to_owned(), ready["layout"].to_string());
    // The first unbind fails, and so does destroying the communicator instead.
    let mut decode = Peer::spawn(
        &["decode", "--peer", &segment, "--peer-layout", &layout, "--stay"],
        &with(node.env(), &[("LOCAL_RANK", "1"), ("FERRY_CANN_EMU_FAIL", "HcclCommUnbindMem:1,HcclCommDestroy:1")]),
    );
    decode.expect("DONE");
    decode.send("unregister 0");
    let first = decode.expect("UNREGISTERED");
    assert_eq!(first["kind"], "busy", "{first}");
    assert!(first["error"].as_str().unwrap().contains("may still be bound"), "{first}");
    // The communicator is gone now: the next region unbinds from nothing and is deregistered.
    decode.send("unregister 1");
    let second = decode.expect("UNREGISTERED");
    assert!(second["error"].is_null(), "{second}");
    // Asking again for the first region changes nothing: it may still be bound on the device,
    // so it is never reported unregistered (the engine does not retry a transport's refusal
    // into a success).
    decode.send("unregister 0");
    let again = decode.expect("UNREGISTERED");
    assert_eq!(again["kind"], "busy", "{again}");
    decode.quit("decode");
    prefill.quit("prefill");
}
