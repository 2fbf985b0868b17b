//! What the plugin ABI costs: the same transport (`ferry-transport-example`, same-process
//! memcpy) installed built in and loaded as `libferry_transport_example.so`, moving batches of
//! 64-byte requests (so the copy itself is negligible). The difference per request is the
//! plugin boundary's cost (request conversion, the plugin-side lease and batch, poll).
//!
//! Run: `cargo build --release -p ferry-transport-example && cargo bench --bench plugin`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ferry::{
    Config, EngineBuilder, InProcessMetadata, Location, MetadataStore, Opcode, TransferEngine, TransferRequest,
    TransportRegistry,
};

const REQ: u64 = 64;

fn plugin_dir() -> PathBuf {
    // target/release/deps/plugin-<hash> -> target/release
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|p| p.parent()).unwrap().to_path_buf();
    let lib = dir.join("libferry_transport_example.so");
    assert!(lib.is_file(), "{} missing: run `cargo build --release -p ferry-transport-example` first", lib.display());
    dir
}

fn engine(
    rt: &tokio::runtime::Runtime,
    reg: TransportRegistry,
    config: Config,
    meta: &Arc<InProcessMetadata>,
    name: &str,
) -> TransferEngine {
    rt.block_on(
        EngineBuilder::new()
            .config(config)
            .transports(reg)
            .segment_name(name)
            .metadata(meta.clone() as Arc<dyn MetadataStore>)
            .build(),
    )
    .unwrap()
}

fn boundary(c: &mut Criterion) {
    let mut g = c.benchmark_group("plugin");
    g.measurement_time(Duration::from_secs(4));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let dir = plugin_dir();
    for how in ["builtin", "plugin"] {
        let meta = InProcessMetadata::new();
        let (reg, config) = if how == "builtin" {
            let reg = TransportRegistry::new().with(Arc::new(ferry_transport_example::ExampleTransportFactory));
            (reg, Config::from_json_str(r#"{"protocol":"example"}"#, None).unwrap())
        } else {
            let reg = TransportRegistry::new().with_source(Arc::new(ferry_plugin_host::PluginSource));
            let text = serde_json::json!({"protocol": "example", "plugins": [dir]}).to_string();
            (reg, Config::from_json_str(&text, None).unwrap())
        };
        let a = engine(&rt, reg.clone(), config.clone(), &meta, &format!("{how}-a"));
        let b = engine(&rt, reg, config, &meta, &format!("{how}-b"));
        let src = vec![1u8; 128 * REQ as usize];
        let dst = vec![0u8; 128 * REQ as usize];
        // SAFETY: the buffers outlive the engines' use of them (the benchmark loop below).
        rt.block_on(unsafe { a.register_memory(src.as_ptr() as u64, src.len() as u64, Location::Cpu(0)) }).unwrap();
        // SAFETY: as above.
        rt.block_on(unsafe { b.register_memory(dst.as_ptr() as u64, dst.len() as u64, Location::Cpu(0)) }).unwrap();
        let peer = rt.block_on(b.open_segment(a.segment_name())).unwrap();
        for n in [1u64, 128] {
            let reqs: Vec<TransferRequest> = (0..n)
                .map(|i| TransferRequest {
                    opcode: Opcode::Read,
                    source: dst.as_ptr() as u64 + i * REQ,
                    target: peer,
                    target_offset: src.as_ptr() as u64 + i * REQ,
                    length: REQ,
                })
                .collect();
            g.throughput(Throughput::Elements(n));
            g.bench_function(format!("{how}/64B_x{n}"), |bench| {
                bench.iter(|| {
                    rt.block_on(async {
                        let batch = b.submit(&reqs).await.unwrap();
                        batch.wait_ok(Duration::from_secs(5)).await.unwrap();
                    })
                })
            });
        }
        assert_eq!(std::hint::black_box(&dst)[..16], [1u8; 16][..], "{how}: bytes moved");
        rt.block_on(b.unregister_memory(dst.as_ptr() as u64)).unwrap();
        rt.block_on(a.unregister_memory(src.as_ptr() as u64)).unwrap();
    }
    g.finish();
}

criterion_group!(benches, boundary);
criterion_main!(benches);
