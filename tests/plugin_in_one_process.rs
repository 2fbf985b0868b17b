//! Two engines of one process built the way users build them (`ferry::builder()`, every
//! compiled-in transport plus the plugin loader) and configured for a plugin's protocol: the
//! same-process `local` transport is installed beside the plugin and tried first, so the plugin
//! never carries their transfers — unless `local_transport: false` leaves it out. The example
//! plugin (loaded with `dlopen`) counts the requests it is given, which tells the two apart.
//!
//! Needs the plugin library built first (`scripts/test.sh` does it):
//! `cargo build -p ferry-transport-example`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use ferry::{Config, InProcessMetadata, Location, MetadataStore, Opcode, TransferEngine, TransferRequest};
use ferry_test_support::Buffer;

/// `target/<profile>`, where cargo puts the plugin library.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/plugin_in_one_process-<hash>
    exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf()
}

/// A directory holding a copy of the built example plugin, as a config's `plugins` entry.
fn plugin_dir() -> Result<PathBuf> {
    let built = target_dir().join("libferry_transport_example.so");
    ensure!(
        built.is_file(),
        "{} is missing: build the plugin first (`cargo build -p ferry-transport-example`; scripts/test.sh does it)",
        built.display()
    );
    let dir = target_dir().join("plugin-tests").join(format!("one-process-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(&built, dir.join("libferry_transport_example.so"))?;
    Ok(dir)
}

/// Requests the loaded example plugin was given so far (its exported counter).
fn plugin_requests() -> Result<u64> {
    let plugin = ferry_plugin_host::already_loaded("example").context("the example plugin is loaded")?;
    // SAFETY: the library is already loaded by the plugin host, which never unloads it (so this
    // runs no initialisers); `dlopen` of its path returns the same handle.
    let lib = unsafe { libloading::Library::new(plugin.path()) }?;
    // SAFETY: the example plugin exports `ferry_transport_example_requests` with this signature.
    let count = unsafe { lib.get::<extern "C" fn() -> u64>(b"ferry_transport_example_requests\0") }?;
    Ok(count())
}

/// Prefill and decode engines on one in-process store, `protocol: "example"`, with `extra`
/// fields in their config.
async fn engines(dir: &Path, extra: &str) -> Result<(TransferEngine, TransferEngine)> {
    let text = format!(r#"{{"protocol": "example", "plugins": [{dir:?}], "transfer_timeout_ms": 5000 {extra}}}"#);
    let meta = InProcessMetadata::new() as Arc<dyn MetadataStore>;
    let mut pair = Vec::new();
    for name in ["prefill", "decode"] {
        let config = Config::from_json_str(&text, None)?;
        pair.push(ferry::builder().config(config).metadata(meta.clone()).segment_name(name).build().await?);
    }
    let decode = pair.pop().context("decode")?;
    Ok((pair.pop().context("prefill")?, decode))
}

/// Decode reads two pieces of prefill's buffer and writes one back (three requests), every byte
/// checked; returns the protocol of the transport that served prefill's segment.
async fn transfer(prefill: &TransferEngine, decode: &TransferEngine) -> Result<String> {
    let src = Buffer::filled(64 << 10, 7);
    let dst = Buffer::zeroed(64 << 10);
    // SAFETY: both buffers outlive their registrations: they are unregistered below, after
    // every transfer completed.
    unsafe { prefill.register_memory(src.addr(), src.len(), Location::Cpu(0)).await }?;
    // SAFETY: as above.
    unsafe { decode.register_memory(dst.addr(), dst.len(), Location::Cpu(0)).await }?;
    let peer = decode.open_segment(prefill.segment_name()).await?;
    let read = |at: u64, from: u64, length: u64| TransferRequest {
        opcode: Opcode::Read,
        source: dst.addr() + at,
        target: peer,
        target_offset: src.addr() + from,
        length,
    };
    decode.transfer(&[read(0, 0, 4096), read(4096, 8192, 28 << 10)]).await?;
    ensure!(dst.bytes()[..4096] == src.bytes()[..4096], "first read differs");
    ensure!(dst.bytes()[4096..32 << 10] == src.bytes()[8192..8192 + (28 << 10)], "second read differs");
    let write =
        TransferRequest { opcode: Opcode::Write, target_offset: src.addr() + (32 << 10), ..read(0, 0, 32 << 10) };
    decode.transfer(&[write]).await?;
    ensure!(src.bytes()[32 << 10..] == dst.bytes()[..32 << 10], "write differs");
    let protocol = decode.segment(peer)?.protocol().to_owned();
    decode.unregister_memory(dst.addr()).await?;
    prefill.unregister_memory(src.addr()).await?;
    Ok(protocol)
}

/// One test for both settings: the counter is the process's, so the two phases must not overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_carries_in_process_transfers_only_when_local_transport_is_false() -> Result<()> {
    let dir = plugin_dir()?;

    // The default: `local` beside the plugin, tried first; the plugin is loaded but never called.
    let (prefill, decode) = engines(&dir, "").await?;
    assert_eq!(decode.protocols(), vec!["local", "example"], "the same-process shortcut is installed");
    let before = plugin_requests()?;
    let served_by = transfer(&prefill, &decode).await?;
    assert_eq!(served_by, "local", "a peer in this process is reached by the same-process shortcut");
    assert_eq!(plugin_requests()?, before, "the plugin was never given a request");
    prefill.shutdown().await?;
    decode.shutdown().await?;

    // `local_transport: false`: the plugin is the engines' only transport and carries all three.
    let (prefill, decode) = engines(&dir, r#", "local_transport": false"#).await?;
    assert_eq!(decode.protocols(), vec!["example"], "no same-process shortcut");
    let before = plugin_requests()?;
    let served_by = transfer(&prefill, &decode).await?;
    assert_eq!(served_by, "example", "the plugin serves the peer's segment");
    assert_eq!(plugin_requests()? - before, 3, "the plugin was given each of the three requests");
    prefill.shutdown().await?;
    decode.shutdown().await?;
    Ok(())
}
