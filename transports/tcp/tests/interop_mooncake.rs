//! Interop with a peer nobody here wrote: Mooncake Transfer Engine's PyPI wheel
//! (`mooncake-transfer-engine-non-cuda`), through P2PHANDSHAKE and the TCP data protocol, both
//! directions, sizes from 1 byte to 64 MiB, every byte verified.
//!
//! The Python with the wheel is `$FERRY_MOONCAKE_PYTHON`, else `.venv-mooncake/bin/python` at the
//! workspace root (`scripts/test.sh` installs it). Without it these tests fail, loudly: they are
//! not skipped. The Mooncake side runs this crate's `tests/interop/mooncake_peer.py`.

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use ferry::{Location, Opcode, TransferRequest};
use ferry_test_support::{
    Buffer, await_notification, free_port, p2p_tcp_engine, pattern, pattern_buffer, read_across, tcp_engine_on,
    workspace_root,
};

const SIZES: [u64; 7] = [1, 7, 4096, 65_537, 1 << 20, 8 << 20, 64 << 20];
const T: Duration = Duration::from_secs(30);

fn mooncake_python() -> PathBuf {
    let candidate = std::env::var_os("FERRY_MOONCAKE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv-mooncake/bin/python"));
    let ok = Command::new(&candidate)
        .args(["-c", "import mooncake.engine"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "\n\n*** Mooncake interop cannot run: {} cannot import mooncake.engine.\n*** Install the wheel at the workspace root: \
         python3 -m venv .venv-mooncake && .venv-mooncake/bin/pip install mooncake-transfer-engine-non-cuda \
         (plus Debian libibverbs1 libnuma1 librdmacm1), or point FERRY_MOONCAKE_PYTHON at a Python that has it.\n",
        candidate.display()
    );
    candidate
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/mooncake_peer.py")
}

/// A Mooncake process, killed when dropped.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(args: &[String]) -> Self {
        let mut child = Command::new(mooncake_python())
            .arg(script())
            .args(args)
            .env("GLOG_minloglevel", "2")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the Mooncake peer");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Self { child, stdin, stdout }
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.stdout.read_line(&mut l).expect("read from the Mooncake peer");
        assert!(!l.is_empty(), "the Mooncake peer exited early (see its stderr above)");
        l.trim().to_owned()
    }

    fn json(&mut self) -> serde_json::Value {
        let l = self.line();
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("the Mooncake peer printed {l:?}: {e}"))
    }

    fn say(&mut self, s: &str) {
        writeln!(self.stdin, "{s}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ferry_initiator_reads_and_writes_a_mooncake_target() {
    const SIZE: u64 = 160 << 20;
    let mut mc = tokio::task::spawn_blocking(|| {
        let mut p = Peer::spawn(&["target".into(), SIZE.to_string(), "5".into()]);
        let info = p.json();
        (p, info)
    })
    .await
    .unwrap();
    let (segment, addr) = (mc.1["segment"].as_str().unwrap().to_owned(), mc.1["addr"].as_u64().unwrap());

    let ferry = p2p_tcp_engine(T).await;
    let local = Buffer::zeroed(64 << 20);
    unsafe { ferry.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = ferry.open_segment(&segment).await.unwrap();
    let desc = ferry.segment(peer).unwrap().descriptor().clone();
    assert_eq!(desc.protocol, "tcp", "Mooncake's descriptor, fetched through its handshake: {desc:?}");

    for size in SIZES {
        for off in [0u64, 4097] {
            ferry
                .transfer(&[TransferRequest {
                    opcode: Opcode::Read,
                    source: local.addr(),
                    target: peer,
                    target_offset: addr + off,
                    length: size,
                }])
                .await
                .unwrap_or_else(|e| panic!("read of {size} bytes at +{off}: {e}"));
            let got = &local.bytes()[..size as usize];
            let bad = got.iter().enumerate().position(|(k, &b)| b != pattern(k as u64 + off, 5));
            assert_eq!(bad, None, "read of {size} bytes at +{off}: first wrong byte");
        }
    }

    // Writes: pattern 99 into the upper part of Mooncake's buffer, verified by Mooncake itself.
    let src = pattern_buffer(64 << 20, 99);
    unsafe { ferry.register_memory(src.addr(), src.len(), Location::Cpu(0)).await }.unwrap();
    let dest = 80u64 << 20;
    for size in SIZES {
        ferry
            .transfer(&[TransferRequest {
                opcode: Opcode::Write,
                source: src.addr(),
                target: peer,
                target_offset: addr + dest,
                length: size,
            }])
            .await
            .unwrap_or_else(|e| panic!("write of {size} bytes: {e}"));
        let answer = tokio::task::block_in_place(|| {
            mc.0.say(&format!("check {dest} {size} 99"));
            mc.0.line()
        });
        assert_eq!(answer, "ok", "Mooncake's check of a {size}-byte write");
    }
    // A notification after a write reaches Mooncake through its handshake socket.
    ferry
        .transfer_with_notification(
            &[TransferRequest {
                opcode: Opcode::Write,
                source: src.addr(),
                target: peer,
                target_offset: addr + dest,
                length: 4096,
            }],
            "req-42:done",
        )
        .await
        .unwrap();
    let notes = tokio::task::block_in_place(|| {
        mc.0.say("notifies");
        mc.0.json()
    });
    let text = notes.to_string();
    assert!(text.contains("req-42:done") && text.contains(ferry.segment_name()), "Mooncake received {text}");

    // A batch of many small requests over the pipelined lanes.
    let reqs: Vec<TransferRequest> = (0..256u64)
        .map(|i| TransferRequest {
            opcode: Opcode::Read,
            source: local.addr() + i * 4096,
            target: peer,
            target_offset: addr + i * 4096,
            length: 4096,
        })
        .collect();
    ferry.transfer(&reqs).await.unwrap();
    assert!(local.bytes()[..1 << 20].iter().enumerate().all(|(k, &b)| b == pattern(k as u64, 5)));

    // One request at a time from a thread that waits for each (the direct path: done on that
    // thread once the peer's direct connection is open; the first goes through a lane).
    let (engine, into, from) = (ferry.clone(), local.addr(), src.addr());
    let direct = tokio::task::block_in_place(|| {
        std::thread::spawn(move || {
            let mut direct = 0;
            for _ in 0..50 {
                for (opcode, source, offset) in [(Opcode::Read, into, 4097), (Opcode::Write, from, dest)] {
                    for size in [4096u64, 1 << 20, 8 << 20] {
                        let r = TransferRequest {
                            opcode,
                            source,
                            target: peer,
                            target_offset: addr + offset,
                            length: size,
                        };
                        let batch = engine.submit_for_blocking_wait(&[r]).unwrap();
                        direct += u32::from(batch.is_done());
                        batch.wait_ok_blocking(T).unwrap_or_else(|e| panic!("{opcode:?} of {size} bytes: {e}"));
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            direct
        })
        .join()
        .unwrap()
    });
    assert!(direct >= 250, "{direct} of 300 requests ran on the caller's thread");
    let got = &local.bytes()[..8 << 20];
    assert_eq!(got.iter().enumerate().position(|(k, &b)| b != pattern(k as u64 + 4097, 5)), None);
    let answer = tokio::task::block_in_place(|| {
        mc.0.say(&format!("check {dest} {} 99", 8 << 20));
        mc.0.line()
    });
    assert_eq!(answer, "ok", "Mooncake's check of the direct writes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mooncake_initiator_reads_and_writes_a_ferry_target() {
    let ferry = p2p_tcp_engine(T).await;
    let buf = pattern_buffer(160 << 20, 5);
    unsafe { ferry.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let write_at = 80u64 << 20;
    let mut args = vec![
        "initiator".to_owned(),
        ferry.segment_name().to_owned(),
        buf.addr().to_string(),
        "5".into(),
        write_at.to_string(),
        "77".into(),
    ];
    args.extend(SIZES.iter().map(|s| s.to_string()));
    let result = tokio::task::spawn_blocking(move || {
        let mut p = Peer::spawn(&args);
        p.json()
    })
    .await
    .unwrap();
    for r in result["reads"].as_array().unwrap() {
        assert_eq!(r["rc"], 0, "Mooncake read {r}");
        assert_eq!(r["ok"], true, "Mooncake read wrong bytes: {r}");
    }
    assert_eq!(result["reads"].as_array().unwrap().len(), SIZES.len() * 2);
    for w in result["writes"].as_array().unwrap() {
        assert_eq!(w["rc"], 0, "Mooncake write {w}");
    }
    // The last (largest) write is what the region holds now; the byte before it is untouched.
    let last = *SIZES.last().unwrap() as usize;
    let region = &buf.bytes()[write_at as usize..write_at as usize + last];
    let bad = region.iter().enumerate().position(|(k, &b)| b != pattern(k as u64, 77));
    assert_eq!(bad, None, "first wrong byte of Mooncake's write");
    assert_eq!(buf.bytes()[write_at as usize - 1], pattern(write_at - 1, 5));
}

/// A Ferry target with peer authentication on, reached by a Mooncake initiator (Mooncake has
/// no authentication) through the P2P handshake: its descriptor is not handed out, no request
/// is served, and the target's memory is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mooncake_initiator_is_refused_by_a_ferry_target_with_authentication() {
    let mut cfg = ferry::Config::from_json_str(
        r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}"#,
        None,
    )
    .unwrap();
    cfg.set_option(&ferry_peer_auth::SECRET, "the cluster's shared secret");
    let ferry = ferry::builder().config(cfg).transports(ferry_test_support::tcp_only()).build().await.unwrap();
    let buf = pattern_buffer(1 << 20, 5);
    unsafe { ferry.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let args = vec![
        "initiator".to_owned(),
        ferry.segment_name().to_owned(),
        buf.addr().to_string(),
        "5".into(),
        "0".into(),
        "77".into(),
        "4096".into(),
    ];
    mooncake_is_refused(args, &buf).await;
}

/// The same through an HTTP metadata server, where Mooncake reads the descriptor from the store
/// and goes straight to the data port: the connection is refused before any request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mooncake_initiator_is_refused_on_the_data_port_of_a_ferry_target_with_authentication() {
    let (url, _stop) = ferry_metadata_server().await;
    let name = format!("127.0.0.1:{}", free_port());
    let mut cfg = ferry::Config::from_json_str(
        &format!(r#"{{"local_hostname": "{name}", "metadata_server": "{url}", "protocol": "tcp"}}"#),
        None,
    )
    .unwrap();
    cfg.set_option(&ferry_peer_auth::SECRET, "the cluster's shared secret");
    let ferry = ferry::builder().config(cfg).transports(ferry_test_support::tcp_only()).build().await.unwrap();
    let buf = pattern_buffer(1 << 20, 5);
    unsafe { ferry.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let args = vec![
        "initiator-on".to_owned(),
        url,
        name,
        buf.addr().to_string(),
        "5".into(),
        "0".into(),
        "77".into(),
        "4096".into(),
    ];
    mooncake_is_refused(args, &buf).await;
    ferry.shutdown().await.unwrap();
}

/// Runs the Mooncake peer with `args` against a Ferry target with authentication whose buffer
/// `buf` holds pattern 5: every request of Mooncake's fails, nothing is written, and the refusal
/// comes in time.
async fn mooncake_is_refused(args: Vec<String>, buf: &Buffer) {
    let started = std::time::Instant::now();
    let result = tokio::task::spawn_blocking(move || {
        let mut p = Peer::spawn(&args);
        p.json()
    })
    .await
    .unwrap();
    for r in result["reads"].as_array().unwrap().iter().chain(result["writes"].as_array().unwrap()) {
        assert_ne!(r["rc"], 0, "Mooncake's request must fail: {r}");
    }
    assert!(buf.bytes().iter().enumerate().all(|(k, &b)| b == pattern(k as u64, 5)), "nothing was written");
    assert!(started.elapsed() < Duration::from_secs(60), "refused in {:?}", started.elapsed());
}

/// A `ferry metadata-server` (the library's server) on loopback.
async fn ferry_metadata_server() -> (String, tokio::sync::oneshot::Sender<()>) {
    use ferry_metadata_http::server::{Limits, serve};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/metadata", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let store = std::sync::Arc::new(ferry_metadata_http::store::Store::in_memory());
    tokio::spawn(serve(listener, store, Limits::default(), async move {
        let _ = rx.await;
    }));
    (url, tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_engines_find_each_other_through_ferry_metadata_server() {
    let (url, _stop) = ferry_metadata_server().await;
    let result = tokio::task::spawn_blocking(move || {
        let mut p = Peer::spawn(&["http-pair".into(), url, (4u64 << 20).to_string()]);
        p.json()
    })
    .await
    .unwrap();
    assert_eq!(result["rc"], 0, "{result}");
    assert_eq!(result["ok"], true, "{result}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferry_engines_work_against_mooncakes_own_http_metadata_server() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let server = mooncake_python().parent().unwrap().join("mooncake_http_metadata_server");
    let mut child = Command::new(&server)
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--log-level", "WARNING"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", server.display()));
    let url = format!("http://127.0.0.1:{port}/metadata");
    // Wait until it answers.
    let c = reqwest::Client::new();
    for _ in 0..100 {
        if c.get(format!("{url}?key=probe")).send().await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let a = tcp_engine_on(&url, "127.0.0.1:40101").await;
    let b = tcp_engine_on(&url, "127.0.0.1:40102").await;
    // Registration republishes the descriptor (not the rpc entry, which Mooncake's Python server
    // refuses to accept twice).
    read_across(&a, &b).await;
    b.shutdown().await.unwrap();
    // `a` "crashes" (no clean shutdown: its entries stay) and restarts under the same name: the
    // Python server refuses the second PUT of its rpc entry, which now names another RPC port;
    // the stale entry is replaced.
    drop(a);
    let again = tcp_engine_on(&url, "127.0.0.1:40101").await;
    let entry = c.get(format!("{url}?key=mooncake/rpc_meta/127.0.0.1:40101")).send().await.unwrap();
    let entry: serde_json::Value = serde_json::from_slice(&entry.bytes().await.unwrap()).unwrap();
    assert_eq!(entry["rpc_port"], again.rpc_port().unwrap(), "{entry}");
    again.shutdown().await.unwrap();
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_cross_both_ways_with_mooncake_on_an_http_metadata_server() {
    // On a store backend both sides send notifications to the port the other's `rpc_meta`
    // entry names, where its handshake listener runs.
    let (url, _stop) = ferry_metadata_server().await;
    let u = url.clone();
    let mut mc = tokio::task::spawn_blocking(move || {
        let mut p = Peer::spawn(&["target".into(), (1u64 << 20).to_string(), "3".into(), u]);
        let info = p.json();
        (p, info)
    })
    .await
    .unwrap();
    let (segment, addr) = (mc.1["segment"].as_str().unwrap().to_owned(), mc.1["addr"].as_u64().unwrap());
    let name = format!("127.0.0.1:{}", free_port());
    let ferry = tcp_engine_on(&url, &name).await;
    let buf = pattern_buffer(1 << 20, 11);
    unsafe { ferry.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();

    // Ferry -> Mooncake: a write, then the notification.
    let peer = ferry.open_segment(&segment).await.unwrap();
    ferry
        .transfer_with_notification(
            &[TransferRequest {
                opcode: Opcode::Write,
                source: buf.addr(),
                target: peer,
                target_offset: addr,
                length: 4096,
            }],
            "kv-ready:7",
        )
        .await
        .unwrap();
    let notes = tokio::task::block_in_place(|| {
        mc.0.say("notifies");
        mc.0.json()
    });
    let text = notes.to_string();
    assert!(text.contains("kv-ready:7") && text.contains(&name), "Mooncake received {text}");

    // Mooncake -> Ferry: Mooncake writes 16 bytes into Ferry's buffer with a notification.
    let rc = tokio::task::block_in_place(|| {
        mc.0.say(&format!("write-notify {name} {} decode-done:7", buf.addr() + 4096));
        mc.0.line()
    });
    assert_eq!(rc, "0", "Mooncake's transfer_sync with a notification");
    let note = await_notification(&ferry, "decode-done:7").await;
    assert_eq!(note.name, "mooncake", "the name Mooncake's sender put in its notification");
    // Mooncake sent the start of its buffer, which holds what Ferry wrote there above (pattern
    // 11 from offset 0), over Ferry's own pattern at 4096.
    let landed = &buf.bytes()[4096..4096 + 16];
    assert!(landed.iter().enumerate().all(|(k, &b)| b == pattern(k as u64, 11)), "Mooncake's bytes: {landed:?}");
    assert_ne!(landed[0], pattern(4096, 11), "the bytes were replaced");
    ferry.shutdown().await.unwrap();
}
