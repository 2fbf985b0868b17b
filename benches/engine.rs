//! Engine overhead and `local` transport bandwidth.
//!
//! - `overhead/*`: submit + complete + wait of 128 requests of 4 KiB, through the no-op `null`
//!   transport (pure engine cost) and through the `local` transport (engine + memcpy), on a
//!   single-threaded runtime (one core).
//! - `bandwidth/*`: one request of 1 MiB or 64 MiB through `local`, beside a plain memcpy of the
//!   same size.
//!
//! Run: `cargo bench --bench engine`.

use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ferry::{InProcessMetadata, Location, MetadataStore, Opcode, TransferEngine, TransferRequest, TransportRegistry};

const BATCH: usize = 128;
const REQ: u64 = 4096;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn engine(
    rt: &tokio::runtime::Runtime,
    reg: TransportRegistry,
    protocol: &str,
    meta: &Arc<InProcessMetadata>,
    name: &str,
) -> TransferEngine {
    rt.block_on(
        ferry::builder()
            .transports(reg)
            .protocol(protocol)
            .segment_name(name)
            .metadata(meta.clone() as Arc<dyn MetadataStore>)
            .build(),
    )
    .unwrap()
}

fn overhead(c: &mut Criterion) {
    let mut g = c.benchmark_group("overhead");
    g.throughput(Throughput::Elements(BATCH as u64));
    g.measurement_time(Duration::from_secs(4));

    let rt = runtime();
    for protocol in ["null", "local"] {
        let meta = InProcessMetadata::new();
        // Only the transport under test: no local companion beside `null`.
        let factory: Arc<dyn ferry::TransportFactory> = if protocol == "null" {
            Arc::new(ferry_transport_null::NullTransportFactory)
        } else {
            Arc::new(ferry_transport_local::LocalTransportFactory)
        };
        let reg = TransportRegistry::new().with(factory);
        let a = engine(&rt, reg.clone(), protocol, &meta, &format!("{protocol}-a"));
        let b = engine(&rt, reg, protocol, &meta, &format!("{protocol}-b"));
        let src = vec![1u8; BATCH * REQ as usize];
        let dst = vec![0u8; BATCH * REQ as usize];
        // SAFETY: the buffers outlive the engines' use of them (the benchmark loop below).
        rt.block_on(unsafe { a.register_memory(src.as_ptr() as u64, src.len() as u64, Location::Cpu(0)) }).unwrap();
        // SAFETY: as above.
        rt.block_on(unsafe { b.register_memory(dst.as_ptr() as u64, dst.len() as u64, Location::Cpu(0)) }).unwrap();
        let peer = rt.block_on(b.open_segment(a.segment_name())).unwrap();
        assert_eq!(b.segment(peer).unwrap().protocol(), protocol);
        let reqs: Vec<TransferRequest> = (0..BATCH as u64)
            .map(|i| TransferRequest {
                opcode: Opcode::Read,
                source: dst.as_ptr() as u64 + i * REQ,
                target: peer,
                target_offset: src.as_ptr() as u64 + i * REQ,
                length: REQ,
            })
            .collect();
        g.bench_function(format!("{protocol}/4KiB_x128"), |bench| {
            bench.iter(|| {
                rt.block_on(async {
                    let batch = b.submit(&reqs).await.unwrap();
                    batch.wait_ok(Duration::from_secs(5)).await.unwrap();
                })
            })
        });
        let moved = std::hint::black_box(&dst)[..16] == [1u8; 16][..];
        assert_eq!(moved, protocol == "local", "{protocol}: bytes move through local only");
    }
    g.finish();
}

fn bandwidth(c: &mut Criterion) {
    let mut g = c.benchmark_group("bandwidth");
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(4));
    let rt = runtime();
    let meta = InProcessMetadata::new();
    let reg = TransportRegistry::new().with(Arc::new(ferry_transport_local::LocalTransportFactory));
    let a = engine(&rt, reg.clone(), "local", &meta, "bw-a");
    let b = engine(&rt, reg, "local", &meta, "bw-b");
    for (label, size) in [("1MiB", 1usize << 20), ("64MiB", 64usize << 20)] {
        let src = vec![7u8; size];
        let mut dst = vec![1u8; size];
        // SAFETY: both buffers are unregistered below before they are dropped.
        rt.block_on(unsafe { a.register_memory(src.as_ptr() as u64, size as u64, Location::Cpu(0)) }).unwrap();
        // SAFETY: as above.
        rt.block_on(unsafe { b.register_memory(dst.as_ptr() as u64, size as u64, Location::Cpu(0)) }).unwrap();
        let peer = rt.block_on(b.open_segment("bw-a")).unwrap();
        let req = [TransferRequest {
            opcode: Opcode::Read,
            source: dst.as_ptr() as u64,
            target: peer,
            target_offset: src.as_ptr() as u64,
            length: size as u64,
        }];
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(format!("local/{label}"), |bench| {
            bench.iter(|| {
                rt.block_on(async { b.submit(&req).await.unwrap().wait_ok(Duration::from_secs(5)).await.unwrap() })
            })
        });
        g.bench_function(format!("memcpy/{label}"), |bench| {
            bench.iter(|| {
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&dst);
            })
        });
        rt.block_on(b.unregister_memory(dst.as_ptr() as u64)).unwrap();
        rt.block_on(a.unregister_memory(src.as_ptr() as u64)).unwrap();
    }
    g.finish();
}

criterion_group!(benches, overhead, bandwidth);
criterion_main!(benches);
