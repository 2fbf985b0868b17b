//! Transport plugins loaded at run time: the example plugin (Rust) and a C plugin move data when
//! a config names their protocol, a peer's descriptor makes an engine load one, and broken
//! plugins fail with clear errors while the host keeps running. Plugins of ABI 1.1 report their
//! completions through the host's callback (no host thread polls them); plugins built against
//! ABI 1.0 are still loaded, and polled.
//!
//! Needs the plugin libraries built first (`scripts/test.sh` does it):
//! `cargo build -p ferry-transport-example -p ferry-transport-panicky`.
//! The C plugins are compiled here with the system `cc`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use ferry::{
    Config, EngineBuilder, ErrorKind, Location, Opcode, SegmentDescriptor, TransferEngine, TransferRequest,
    TransportRegistry,
};
use ferry_plugin_host::PluginSource;
use ferry_test_support::Buffer;

/// The cargo target directory of this build (`target/<profile>`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/plugins-<hash>
    exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf()
}

fn built_plugin(crate_lib: &str) -> Result<PathBuf> {
    let path = target_dir().join(format!("lib{crate_lib}.so"));
    ensure!(
        path.is_file(),
        "{} is missing: build the plugins first (`cargo build -p ferry-transport-example -p ferry-transport-panicky`; scripts/test.sh does it)",
        path.display()
    );
    Ok(path)
}

/// The workspace root, where the C plugins and the headers are.
fn repo() -> PathBuf {
    ferry_test_support::workspace_root()
}

/// A fresh directory under the target dir.
fn scratch(name: &str) -> PathBuf {
    let dir = target_dir().join("plugin-tests").join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Compiles `ffi/plugin/examples/c/<source>` into `dir/<file>` with the system C compiler.
fn compile_c_plugin(source: &str, dir: &Path, file: &str) -> Result<PathBuf> {
    compile_c_plugin_with(source, dir, file, &repo().join("ffi/include"), &[])
}

/// Compiles a C plugin the way a plugin built against ABI 1.0 was: with the 1.0 header (so no
/// completion callback), serving `protocol`.
fn compile_abi_1_0_plugin(source: &str, dir: &Path, protocol: &str) -> Result<PathBuf> {
    let file = format!("libferry_transport_{protocol}.so");
    compile_c_plugin_with(
        source,
        dir,
        &file,
        &repo().join("ffi/plugin/examples/c/abi-1.0"),
        &[format!("-DPROTOCOL=\"{protocol}\"")],
    )
}

/// [`compile_c_plugin`] against the header in `include`, with `extra` compiler arguments.
fn compile_c_plugin_with(source: &str, dir: &Path, file: &str, include: &Path, extra: &[String]) -> Result<PathBuf> {
    let out = dir.join(file);
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-std=c99", "-Wall", "-Werror", "-O2"])
        .args(extra)
        .arg("-I")
        .arg(include)
        .arg(repo().join("ffi/plugin/examples/c").join(source))
        .arg("-o")
        .arg(&out)
        .arg("-lpthread")
        .status()
        .context("running cc")?;
    ensure!(status.success(), "cc failed for {source}");
    Ok(out)
}

/// Threads of this process that poll `protocol`'s plugin instances: the host names them
/// `ferry-poll-<protocol>`, of which the kernel keeps 15 bytes.
fn poll_threads(protocol: &str) -> usize {
    let name = format!("{}{protocol}", ferry_plugin_host::POLL_THREAD_PREFIX);
    let shown = &name.as_bytes()[..name.len().min(15)];
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|task| std::fs::read(task.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.strip_suffix(b"\n").unwrap_or(comm) == shown)
        .count()
}

/// Waits (up to 5 s) until `poll_threads(protocol)` is `n`: a thread takes its name once it
/// runs, and a polled plugin that finishes inside `submit` gives its thread no reason to.
async fn wait_for_poll_threads(protocol: &str, n: usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let found = poll_threads(protocol);
        if found == n || std::time::Instant::now() >= deadline {
            return found;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Writes a mooncake.json naming `protocol` with `plugins` pointing at `plugin_dir`.
fn write_config(dir: &Path, protocol: &str, plugin_dir: &Path) -> PathBuf {
    let path = dir.join(format!("mooncake-{protocol}.json"));
    let text = serde_json::json!({ "protocol": protocol, "plugins": [plugin_dir], "transfer_timeout_ms": 5000 });
    std::fs::write(&path, serde_json::to_vec_pretty(&text).unwrap()).unwrap();
    path
}

/// An engine whose only transports come from plugins (no same-process shortcut, so the
/// plugin carries every byte), on a private in-process metadata store.
async fn plugin_engine(
    meta: &Arc<ferry::InProcessMetadata>,
    config: Config,
    name: &str,
    registry: TransportRegistry,
) -> ferry::Result<TransferEngine> {
    EngineBuilder::new()
        .config(config)
        .transports(registry.with_source(Arc::new(PluginSource)))
        .metadata(meta.clone() as Arc<dyn ferry::MetadataStore>)
        .segment_name(name)
        .build()
        .await
}

/// Reads and writes between two engines and checks every byte.
async fn round_trip(a: &TransferEngine, b: &TransferEngine) -> Result<()> {
    let src = Buffer::filled(64 << 10, 7);
    let dst = Buffer::zeroed(64 << 10);
    // SAFETY: both buffers outlive the transfers (the engines are shut down by the caller
    // before the buffers drop... and every batch is waited for below).
    unsafe { a.register_memory(src.addr(), src.len(), Location::Cpu(0)).await }?;
    // SAFETY: as above.
    unsafe { b.register_memory(dst.addr(), dst.len(), Location::Cpu(0)).await }?;
    let peer = b.open_segment(a.segment_name()).await?;
    // Read two pieces, then write one back into a's second half.
    let reqs = [
        TransferRequest {
            opcode: Opcode::Read,
            source: dst.addr(),
            target: peer,
            target_offset: src.addr(),
            length: 4096,
        },
        TransferRequest {
            opcode: Opcode::Read,
            source: dst.addr() + 4096,
            target: peer,
            target_offset: src.addr() + 8192,
            length: 28 << 10,
        },
    ];
    let batch = b.submit(&reqs).await?;
    batch.wait_ok_blocking(b.transfer_timeout())?;
    ensure!(dst.bytes()[..4096] == src.bytes()[..4096], "first read differs");
    ensure!(dst.bytes()[4096..(32 << 10)] == src.bytes()[8192..8192 + (28 << 10)], "second read differs");
    let write = TransferRequest {
        opcode: Opcode::Write,
        source: dst.addr(),
        target: peer,
        target_offset: src.addr() + (32 << 10),
        length: 32 << 10,
    };
    b.transfer(&[write]).await?;
    ensure!(src.bytes()[32 << 10..] == dst.bytes()[..32 << 10], "write differs");
    // Out of the peer's buffer: refused before the plugin sees it.
    let bad = TransferRequest { length: 1 << 20, ..write };
    let e = b.transfer(&[bad]).await.expect_err("out of bounds");
    ensure!(e.kind() == ErrorKind::OutOfBounds, "{e}");
    b.unregister_memory(dst.addr()).await?;
    a.unregister_memory(src.addr()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_plugin_is_selected_by_protocol_in_mooncake_json_and_moves_data() -> Result<()> {
    let dir = scratch("example");
    let plugins = dir.join("plugins");
    std::fs::create_dir_all(&plugins)?;
    std::fs::copy(built_plugin("ferry_transport_example")?, plugins.join("libferry_transport_example.so"))?;
    // A relative `plugins` entry is resolved against the config file's directory.
    let config_path = dir.join("mooncake.json");
    std::fs::write(&config_path, r#"{"protocol": "example", "plugins": ["plugins"], "transfer_timeout_ms": 5000}"#)?;

    let meta = ferry::InProcessMetadata::new();
    let a = plugin_engine(&meta, Config::from_file(&config_path)?, "prefill", TransportRegistry::new()).await?;
    let b = plugin_engine(&meta, Config::from_file(&config_path)?, "decode", TransportRegistry::new()).await?;
    assert_eq!(a.protocols(), vec!["example"]);
    assert_eq!(a.primary_protocol(), "example");
    let published = a.local_descriptor();
    assert_eq!(published.protocol, "example");
    assert!(
        serde_json::to_value(&published)?.get("example_instance").is_some(),
        "the plugin's publish() added its field: {published:?}"
    );
    round_trip(&a, &b).await?;
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_plugin_reports_its_completions_and_no_host_thread_polls_it() -> Result<()> {
    let dir = scratch("callback");
    std::fs::copy(built_plugin("ferry_transport_example")?, dir.join("libferry_transport_example.so"))?;
    let meta = ferry::InProcessMetadata::new();
    let cfg = write_config(&dir, "example", &dir);
    let a = plugin_engine(&meta, Config::from_file(&cfg)?, "prefill", TransportRegistry::new()).await?;
    let b = plugin_engine(&meta, Config::from_file(&cfg)?, "decode", TransportRegistry::new()).await?;
    let plugin = ferry_plugin_host::already_loaded("example").context("loaded")?;
    assert_eq!(plugin.abi_minor(), ferry_abi::FERRY_PLUGIN_ABI_MINOR);
    assert!(plugin.api().set_completion_sink.is_some(), "the SDK's table offers to report completions");
    // Two instances, every byte through the plugin, and not one polling thread.
    round_trip(&a, &b).await?;
    assert_eq!(poll_threads("example"), 0, "a plugin that reports its completions is not polled");
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_c_plugin_built_against_abi_1_0_still_loads_and_is_polled() -> Result<()> {
    let dir = scratch("abi-1.0");
    compile_abi_1_0_plugin("memcpy_plugin.c", &dir, "oldmemcpy")?;
    let meta = ferry::InProcessMetadata::new();
    let cfg = write_config(&dir, "oldmemcpy", &dir);
    let a = plugin_engine(&meta, Config::from_file(&cfg)?, "prefill", TransportRegistry::new()).await?;
    let b = plugin_engine(&meta, Config::from_file(&cfg)?, "decode", TransportRegistry::new()).await?;
    let plugin = ferry_plugin_host::already_loaded("oldmemcpy").context("loaded")?;
    assert_eq!(plugin.abi_minor(), 0);
    assert!(plugin.api().set_completion_sink.is_none(), "a 1.0 table ends before the 1.1 entry");
    round_trip(&a, &b).await?;
    assert_eq!(wait_for_poll_threads("oldmemcpy", 2).await, 2, "one completion thread per instance");
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_descriptor_makes_the_engine_load_the_plugin() -> Result<()> {
    let dir = scratch("lazy");
    std::fs::copy(built_plugin("ferry_transport_example")?, dir.join("libferry_transport_example.so"))?;
    let meta = ferry::InProcessMetadata::new();
    let example = Config::from_file(write_config(&dir, "example", &dir))?;
    let a = plugin_engine(&meta, example, "prefill", TransportRegistry::new()).await?;
    // b is configured for another protocol; a's descriptor names `example`.
    let null = Config::from_file(write_config(&dir, "null", &dir))?;
    let b = plugin_engine(
        &meta,
        null,
        "decode",
        TransportRegistry::new().with(Arc::new(ferry_transport_null::NullTransportFactory)),
    )
    .await?;
    assert_eq!(b.protocols(), vec!["null"]);
    round_trip(&a, &b).await?;
    assert_eq!(b.protocols(), vec!["null", "example"], "loaded when the peer's descriptor named it");
    assert!(serde_json::to_value(b.local_descriptor())?.get("example_instance").is_some(), "republished");
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_written_in_c_moves_data() -> Result<()> {
    let dir = scratch("cplugin");
    compile_c_plugin("memcpy_plugin.c", &dir, "libferry_transport_cmemcpy.so")?;
    let meta = ferry::InProcessMetadata::new();
    let cfg = write_config(&dir, "cmemcpy", &dir);
    let a = plugin_engine(&meta, Config::from_file(&cfg)?, "prefill", TransportRegistry::new()).await?;
    let b = plugin_engine(&meta, Config::from_file(&cfg)?, "decode", TransportRegistry::new()).await?;
    assert_eq!(a.protocols(), vec!["cmemcpy"]);
    round_trip(&a, &b).await?;
    // Built against the current header, it reports its completions from inside `submit`.
    assert_eq!(poll_threads("cmemcpy"), 0);
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}

/// Builds an engine for `protocol` with `dir` as its plugin directory and returns the error.
async fn load_error(dir: &Path, protocol: &str) -> ferry::Error {
    let meta = ferry::InProcessMetadata::new();
    let cfg = Config::from_file(write_config(dir, protocol, dir)).expect("config");
    match plugin_engine(&meta, cfg, "broken", TransportRegistry::new()).await {
        Ok(_) => panic!("an engine on the broken plugin `{protocol}` was built"),
        Err(e) => e,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_plugins_fail_with_clear_errors_and_the_host_keeps_running() -> Result<()> {
    let dir = scratch("broken");
    compile_c_plugin("wrong_major.c", &dir, "libferry_transport_wrongmajor.so")?;
    compile_c_plugin("small_struct.c", &dir, "libferry_transport_smallstruct.so")?;
    compile_c_plugin("no_entry.c", &dir, "libferry_transport_noentry.so")?;
    std::fs::write(dir.join("libferry_transport_notalib.so"), b"#!/bin/sh\necho this is not a shared library\n")?;

    let e = load_error(&dir, "wrongmajor").await;
    assert_eq!(e.kind(), ErrorKind::Plugin, "{e}");
    assert!(
        e.message().contains("libferry_transport_wrongmajor.so") && e.message().contains("majors must match"),
        "{e}"
    );

    let e = load_error(&dir, "smallstruct").await;
    assert_eq!(e.kind(), ErrorKind::Plugin, "{e}");
    assert!(e.message().contains("smaller than ABI 1.0"), "{e}");

    let e = load_error(&dir, "noentry").await;
    assert_eq!(e.kind(), ErrorKind::Plugin, "{e}");
    assert!(
        e.message().contains("is not a Ferry transport plugin") && e.message().contains("ferry_transport_plugin_entry"),
        "{e}"
    );

    let e = load_error(&dir, "notalib").await;
    assert_eq!(e.kind(), ErrorKind::Plugin, "{e}");
    assert!(e.message().contains("cannot be loaded") && e.message().contains("libferry_transport_notalib.so"), "{e}");

    // Nothing by that name anywhere: a config error that says where Ferry looked.
    let e = load_error(&dir, "absent").await;
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.message().contains("unknown protocol \"absent\"") && e.message().contains(&dir.display().to_string()),
        "{e}"
    );

    // The host is unharmed: a working plugin still moves data in this process.
    std::fs::copy(built_plugin("ferry_transport_example")?, dir.join("libferry_transport_example.so"))?;
    let meta = ferry::InProcessMetadata::new();
    let cfg = write_config(&dir, "example", &dir);
    let a = plugin_engine(&meta, Config::from_file(&cfg)?, "prefill", TransportRegistry::new()).await?;
    let b = plugin_engine(&meta, Config::from_file(&cfg)?, "decode", TransportRegistry::new()).await?;
    round_trip(&a, &b).await?;
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}

/// Two plugin engines on the config at `cfg` with one 4 KiB buffer each, and decode's read of
/// prefill's buffer.
struct OnePage {
    a: TransferEngine,
    b: TransferEngine,
    _src: Buffer,
    dst: Buffer,
    req: TransferRequest,
}

async fn one_page_pair(meta: &Arc<ferry::InProcessMetadata>, cfg: &Path) -> Result<OnePage> {
    let a = plugin_engine(meta, Config::from_file(cfg)?, "prefill", TransportRegistry::new()).await?;
    let b = plugin_engine(meta, Config::from_file(cfg)?, "decode", TransportRegistry::new()).await?;
    let src = Buffer::filled(4096, 1);
    let dst = Buffer::zeroed(4096);
    // SAFETY: the buffers live in the returned value beside the engines, which the tests shut
    // down before dropping it.
    unsafe { a.register_memory(src.addr(), src.len(), Location::Cpu(0)).await }?;
    // SAFETY: as above.
    unsafe { b.register_memory(dst.addr(), dst.len(), Location::Cpu(0)).await }?;
    let peer = b.open_segment("prefill").await?;
    let req = TransferRequest {
        opcode: Opcode::Read,
        source: dst.addr(),
        target: peer,
        target_offset: src.addr(),
        length: 4096,
    };
    Ok(OnePage { a, b, _src: src, dst, req })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_panics_in_submit_fails_the_batch_not_the_process() -> Result<()> {
    let dir = scratch("panicky");
    std::fs::copy(built_plugin("ferry_transport_panicky")?, dir.join("libferry_transport_panicky.so"))?;
    let meta = ferry::InProcessMetadata::new();
    let cfg = write_config(&dir, "panicky", &dir);
    let OnePage { a, b, _src, dst, req } = one_page_pair(&meta, &cfg).await?;
    for _ in 0..3 {
        let e = b.transfer(&[req]).await.expect_err("the plugin panics");
        assert_eq!(e.kind(), ErrorKind::Internal, "{e}");
        assert!(e.message().contains("panicky"), "{e}");
    }
    // Memory held by the failed batches was released: it can be unregistered at once.
    b.unregister_memory(dst.addr()).await?;
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptor_protocols_that_are_not_plugin_names_are_refused() -> Result<()> {
    let dir = scratch("names");
    let meta = ferry::InProcessMetadata::new();
    let cfg = write_config(&dir, "null", &dir);
    let b = plugin_engine(
        &meta,
        Config::from_file(&cfg)?,
        "decode",
        TransportRegistry::new().with(Arc::new(ferry_transport_null::NullTransportFactory)),
    )
    .await?;
    for protocol in ["../../tmp/evil", "rdma"] {
        let desc = SegmentDescriptor::new(format!("peer-{}", protocol.len()), protocol);
        ferry::MetadataStore::put(&*meta, &ferry::MetadataKeys::new(None).segment(&desc.name), &desc.to_json()).await?;
        let e = b.open_segment(&desc.name).await.expect_err("no transport");
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert!(e.message().contains(protocol) && e.message().contains("cannot load"), "{e}");
    }
    b.shutdown().await?;
    Ok(())
}

/// `FERRY_PLUGIN_DIR` is read from the environment: checked in a child process so no test
/// mutates this process's environment.
#[test]
fn plugin_dir_from_the_environment() -> Result<()> {
    if std::env::var_os("FERRY_PLUGIN_ENV_CHILD").is_some() {
        let rt = tokio::runtime::Runtime::new()?;
        return rt.block_on(async {
            let meta = ferry::InProcessMetadata::new();
            let cfg = Config::from_json_str(r#"{"protocol": "example"}"#, None)?;
            let a = plugin_engine(&meta, cfg.clone(), "prefill", TransportRegistry::new()).await?;
            let b = plugin_engine(&meta, cfg, "decode", TransportRegistry::new()).await?;
            round_trip(&a, &b).await?;
            a.shutdown().await?;
            b.shutdown().await?;
            anyhow::Ok(())
        });
    }
    let dir = scratch("envdir");
    std::fs::copy(built_plugin("ferry_transport_example")?, dir.join("libferry_transport_example.so"))?;
    let out = Command::new(std::env::current_exe()?)
        .args(["--exact", "plugin_dir_from_the_environment", "--nocapture", "--test-threads", "1"])
        .env("FERRY_PLUGIN_ENV_CHILD", "1")
        .env("FERRY_PLUGIN_DIR", format!("/nonexistent/ferry:{}", dir.display()))
        .output()?;
    if !out.status.success() {
        bail!("child failed: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Engines on the lingering plugin (`lingering.c`, requests that finish only 300 ms after
/// their cancel) built as `protocol`, with a transfer timeout of `timeout_ms`.
async fn lingering_pair(
    meta: &Arc<ferry::InProcessMetadata>,
    name: &str,
    protocol: &str,
    timeout_ms: u64,
) -> Result<OnePage> {
    let dir = scratch(name);
    if protocol == "lingering" {
        compile_c_plugin("lingering.c", &dir, "libferry_transport_lingering.so")?;
    } else {
        compile_abi_1_0_plugin("lingering.c", &dir, protocol)?;
    }
    let path = dir.join("mooncake.json");
    let text = serde_json::json!({ "protocol": protocol, "plugins": [dir], "transfer_timeout_ms": timeout_ms });
    std::fs::write(&path, text.to_string())?;
    one_page_pair(meta, &path).await
}

/// Waits (up to 5 s) until every request of `batch` was released by its transport.
async fn released(batch: &ferry::Batch) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !batch.all_released() {
        assert!(std::time::Instant::now() < deadline, "never released");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// The caller sees the timeout at once; the memory stays leased until the plugin lets go.
async fn a_timeout_keeps_the_memory_until_the_plugin_lets_go(protocol: &str) -> Result<()> {
    let meta = ferry::InProcessMetadata::new();
    let OnePage { a, b, _src, dst, req } = lingering_pair(&meta, &format!("timeout-{protocol}"), protocol, 200).await?;
    let t = std::time::Instant::now();
    let batch = b.submit(&[req]).await?;
    let e = batch.wait_ok(std::time::Duration::from_secs(5)).await.expect_err("never finishes");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(t.elapsed() < std::time::Duration::from_millis(1500), "reported at the timeout, took {:?}", t.elapsed());
    // The plugin still holds the request (it lingers 300 ms after the cancel): the memory
    // stays leased meanwhile.
    assert!(!batch.all_released(), "released while the plugin still held it");
    released(&batch).await;
    assert!(t.elapsed() >= std::time::Duration::from_millis(450), "released only after the linger: {:?}", t.elapsed());
    // The outcome the caller saw stays.
    assert_eq!(
        batch.wait_ok(std::time::Duration::from_secs(1)).await.expect_err("timed out").kind(),
        ErrorKind::Timeout
    );
    b.unregister_memory(dst.addr()).await?;
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_request_keeps_its_memory_until_the_plugin_lets_go() -> Result<()> {
    // Built against ABI 1.0: polled; poll reports the request pending until it lets go.
    a_timeout_keeps_the_memory_until_the_plugin_lets_go("oldlinger").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_after_the_timeout_releases_the_memory_and_nothing_else() -> Result<()> {
    // Built against ABI 1.1: the report comes 300 ms after the host gave up on the request.
    a_timeout_keeps_the_memory_until_the_plugin_lets_go("lingering").await?;
    assert_eq!(poll_threads("lingering"), 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_after_the_caller_cancelled_releases_the_memory_and_nothing_else() -> Result<()> {
    let meta = ferry::InProcessMetadata::new();
    // A timeout far away: the release must come from the cancel, not the timeout.
    let OnePage { a, b, _src, dst, req } = lingering_pair(&meta, "cancel-lingering", "lingering", 60_000).await?;
    let batch = b.submit(&[req]).await?;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let t = std::time::Instant::now();
    batch.cancel();
    let e = batch.wait_ok(std::time::Duration::from_secs(1)).await.expect_err("cancelled");
    assert_eq!(e.kind(), ErrorKind::Cancelled, "{e}");
    assert!(!batch.all_released(), "the plugin has not let go yet");
    released(&batch).await;
    // The host passed the cancel on at once, and the plugin let go 300 ms later.
    let took = t.elapsed();
    assert!(took >= std::time::Duration::from_millis(290), "released {took:?} after the cancel");
    b.unregister_memory(dst.addr()).await?;
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}

/// Collects what the host logs (through a global `tracing` subscriber).
#[derive(Clone, Default)]
struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_breaks_the_callback_rules_gets_errors_logged_not_a_crash() -> Result<()> {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing_subscriber::filter::LevelFilter::ERROR)
        .finish();
    tracing::subscriber::set_global_default(subscriber).context("the test's log collector")?;
    let dir = scratch("unruly");
    compile_c_plugin("unruly.c", &dir, "libferry_transport_unruly.so")?;
    let meta = ferry::InProcessMetadata::new();
    let cfg = write_config(&dir, "unruly", &dir);
    let OnePage { a, b, _src, dst, req } = one_page_pair(&meta, &cfg).await?;
    // Each batch comes with wrong reports around the right ones; the right ones complete it.
    b.transfer(&[req, TransferRequest { length: 8, ..req }]).await?;
    b.transfer(&[req]).await?;
    let text = logs.text();
    for violation in [
        "a request index outside its batch",
        "a completion with a null status",
        "a request as still pending",
        "a request it had reported already",
        "a batch the host does not know",
    ] {
        assert!(text.contains(violation), "`{violation}` not logged:\n{text}");
    }
    assert!(text.contains("unruly"), "the plugin is named:\n{text}");
    assert_eq!(poll_threads("unruly"), 0);
    b.unregister_memory(dst.addr()).await?;
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}
