//! A transport plugin across processes: `ferry bench --mode=target` in a child process serves
//! its buffer through a plugin (`tcp_plugin`, the `tcp` transport built as
//! `libferry_transport_tcp_plugin.so`), and an engine in this process reads it through the same
//! plugin, every byte checked. No same-process shortcut applies between two processes, and
//! `tcp_plugin` is built into neither side, so only the plugin can have carried the bytes.
//!
//! Needs the plugin library built first (`scripts/test.sh` does it):
//! `cargo build -p ferry-transport-tcp-plugin`.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result, ensure};
use ferry::{Config, Location, Opcode, TransferRequest};

mod common;

/// `target/<profile>`, where cargo puts the plugin library.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/plugin_two_process-<hash>
    exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf()
}

/// The child process, killed when the test ends however it ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_carries_a_transfer_between_two_processes() -> Result<()> {
    let plugin = target_dir().join("libferry_transport_tcp_plugin.so");
    ensure!(
        plugin.is_file(),
        "{} is missing: build it first (`cargo build -p ferry-transport-tcp-plugin`; scripts/test.sh does it)",
        plugin.display()
    );
    let dir = target_dir().join("plugin-tests").join(format!("two-process-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(&plugin, dir.join("libferry_transport_tcp_plugin.so"))?;

    // The target: `ferry bench` fills its 1 MiB buffer with page numbers (byte 0 of page i is
    // i, the rest 0) and serves it through the plugin found in FERRY_PLUGIN_DIR.
    let mut child = common::ferry()
        .args(["bench", "--mode=target", "--protocol=tcp_plugin", "--metadata_server=P2PHANDSHAKE"])
        .args(["--local_server_name=127.0.0.1", "--buffer_size=1MiB"])
        .env("FERRY_PLUGIN_DIR", &dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().context("the target's stdout")?;
    let child = Child(child);
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line)?;
    let segment = line.trim().strip_prefix("listening on ").with_context(|| format!("the target said {line:?}"))?;

    // This side: an engine on the same plugin, with the facade's transports (`local` and the
    // built-in `tcp` among them).
    let text = format!(
        r#"{{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp_plugin",
            "plugins": [{dir:?}], "transfer_timeout_ms": 10000}}"#
    );
    let engine = ferry::builder().config(Config::from_json_str(&text, None)?).build().await?;
    let peer = engine.open_segment(segment).await?;
    let remote = engine.segment(peer)?;
    assert_eq!(remote.protocol(), "tcp_plugin", "the plugin serves the peer's segment");
    assert_eq!(remote.descriptor().protocol, "tcp_plugin", "the peer published the plugin's protocol");
    assert!(
        remote.descriptor().extra.contains_key("tcp_data_port"),
        "the plugin in the child published its data port: {:?}",
        remote.descriptor()
    );
    let source = remote.descriptor().buffers.first().context("the target publishes its buffer")?.clone();
    assert_eq!(source.length, 1 << 20);

    let len = 64 << 10;
    let dst = vec![0xffu8; len];
    let addr = dst.as_ptr() as u64;
    // SAFETY: `dst` outlives the registration (unregistered below, after the transfer completed)
    // and is read only once the transfer completed.
    unsafe { engine.register_memory(addr, len as u64, Location::Cpu(0)).await }?;
    let read = TransferRequest {
        opcode: Opcode::Read,
        source: addr,
        target: peer,
        target_offset: source.addr,
        length: len as u64,
    };
    engine.transfer(&[read]).await?;
    engine.unregister_memory(addr).await?;
    for (i, page) in dst.chunks(4096).enumerate() {
        assert_eq!(page[0], i as u8, "byte 0 of page {i}");
        assert!(page[1..].iter().all(|&b| b == 0), "the rest of page {i}");
    }
    engine.shutdown().await?;
    drop(child);
    Ok(())
}
