//! The `example` transport three ways: driven directly, installed built-in in two
//! `ferry_core` engines, and through its plugin table (in-process, no dlopen).

use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{
    Batch, BufferDesc, Config, EngineBuilder, ErrorKind, InProcessMetadata, Location, MemoryRegistry, MetadataStore,
    Opcode, OpenSegment, RequestStatus, ResolverChain, SegmentDescriptor, SegmentHandle, TransferEngine,
    TransferRequest, TransportContext, TransportFactory, TransportRegistry,
};
use ferry_plugin::ferry_abi::*;

use super::*;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn addr(buf: &[u8]) -> u64 {
    buf.as_ptr() as u64
}

/// A transport of its own, with its own registry, as an engine would create it.
struct Side {
    memory: Arc<MemoryRegistry>,
    transport: Arc<dyn Transport>,
    instance: String,
}

async fn side(name: &str) -> ferry_core::Result<Side> {
    let memory = Arc::new(MemoryRegistry::new());
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let instance = format!("{name}-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let ctx = TransportContext {
        segment_name: name.to_owned(),
        instance: instance.clone(),
        config: Arc::new(Config::embedded()),
        memory: memory.clone(),
        runtime: tokio::runtime::Handle::current(),
        resolvers: ResolverChain::with_defaults(),
        descriptors: None,
    };
    let transport = ExampleTransportFactory.create(&ctx).await?;
    Ok(Side { memory, transport, instance })
}

impl Side {
    fn register(&self, buf: &[u8], location: Location) {
        // SAFETY: every test keeps its buffers alive until its transports are dropped.
        unsafe { self.memory.register(addr(buf), buf.len() as u64, location) }.unwrap();
    }

    /// The descriptor an engine would publish for this side.
    fn descriptor(&self, name: &str) -> SegmentDescriptor {
        let mut d = SegmentDescriptor::new(name, PROTOCOL);
        d.buffers = self
            .memory
            .regions()
            .iter()
            .map(|r| BufferDesc {
                addr: r.addr(),
                length: r.len(),
                name: r.location().to_string(),
                device_id: None,
                extra: Default::default(),
            })
            .collect();
        self.transport.publish(&mut d);
        d
    }

    /// Submits one request to `target` and returns its batch (completed: the copy is inline).
    fn submit(&self, target: &Arc<OpenSegment>, opcode: Opcode, local: u64, remote: u64, len: u64) -> Batch {
        let request =
            TransferRequest { opcode, source: local, target: target.handle(), target_offset: remote, length: len };
        let (batch, submission) = Batch::lease(&self.memory, &[request], vec![target.clone()]).unwrap();
        self.transport.submit(target, submission);
        assert!(batch.all_released(), "an inline transport releases every request before submit returns");
        batch
    }
}

fn failure(batch: &Batch) -> (ErrorKind, String) {
    assert_eq!(batch.request_status(0), Some(RequestStatus::Failed(batch.error(0).unwrap().kind())));
    let e = batch.error(0).unwrap();
    (e.kind(), e.message().to_owned())
}

#[tokio::test]
async fn copies_both_ways_and_checks_the_live_registry() {
    let a = side("direct-a").await.unwrap();
    let b = side("direct-b").await.unwrap();
    let src = pattern(8192, 1);
    let dst = vec![0u8; 8192];
    let spare = vec![0u8; 64];
    a.register(&dst, Location::Cpu(0));
    b.register(&src, Location::Cpu(0));
    b.register(&spare, Location::Any);

    let desc = b.descriptor("direct-b");
    assert_eq!(desc.extra[INSTANCE_FIELD], b.instance.as_str(), "publish adds the instance id");
    let peer = a.transport.open(&desc).await;
    let target = Arc::new(OpenSegment::new(SegmentHandle::fresh(), desc.clone(), a.transport.protocol(), peer));
    assert!(a.transport.serves(&desc));

    let batch = a.submit(&target, Opcode::Read, addr(&dst), addr(&src), 8192);
    assert!(batch.status().is_success());
    assert_eq!(dst, src);
    let batch = a.submit(&target, Opcode::Write, addr(&dst) + 10, addr(&spare), 64);
    assert!(batch.status().is_success());
    assert_eq!(spare[..], src[10..74]);

    // The descriptor still lists `spare`, but its owner unregistered it: out of bounds.
    b.memory.unregister(addr(&spare)).unwrap();
    let batch = a.submit(&target, Opcode::Write, addr(&dst), addr(&spare), 64);
    let (kind, message) = failure(&batch);
    assert_eq!(kind, ErrorKind::OutOfBounds);
    assert!(message.contains("segment `direct-b`"), "{message}");
    // Device memory is refused.
    let device = vec![0u8; 16];
    b.register(&device, Location::Npu(0));
    let batch = a.submit(&target, Opcode::Read, addr(&dst), addr(&device), 16);
    assert_eq!(failure(&batch).0, ErrorKind::Unsupported);

    // A cancelled batch is released with a cancelled outcome, nothing moved.
    let before = dst.clone();
    let request = TransferRequest {
        opcode: Opcode::Read,
        source: addr(&dst),
        target: SegmentHandle::fresh(),
        target_offset: addr(&src) + 100,
        length: 8,
    };
    let (batch, submission) = Batch::lease(&a.memory, &[request], vec![target.clone()]).unwrap();
    batch.cancel();
    a.transport.submit(&target, submission);
    assert!(batch.all_released());
    assert_eq!(batch.request_status(0), Some(RequestStatus::Cancelled));
    assert_eq!(dst, before);

    // The peer shuts down: unreachable.
    b.transport.shutdown().await;
    let batch = a.submit(&target, Opcode::Read, addr(&dst), addr(&src), 8);
    let (kind, message) = failure(&batch);
    assert_eq!(kind, ErrorKind::PeerUnreachable);
    assert!(message.contains("direct-b"), "{message}");
    assert!(target.is_stale(), "an unreachable peer marks its descriptor stale");
}

#[tokio::test]
async fn one_live_instance_per_segment_name_and_stale_descriptors_are_recognised() {
    let first = side("names-a").await.unwrap();
    let e = side("names-a").await.err().expect("the name is taken");
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    let src = pattern(64, 2);
    first.register(&src, Location::Cpu(0));
    let old_desc = first.descriptor("names-a");
    drop(first);

    // A new instance under the same name: the old descriptor names the old instance.
    let second = side("names-a").await.unwrap();
    second.register(&src, Location::Cpu(0));
    let reader = side("names-reader").await.unwrap();
    let dst = vec![0u8; 64];
    reader.register(&dst, Location::Cpu(0));
    let peer = reader.transport.open(&old_desc).await;
    let stale = Arc::new(OpenSegment::new(SegmentHandle::fresh(), old_desc, reader.transport.protocol(), peer));
    let batch = reader.submit(&stale, Opcode::Read, addr(&dst), addr(&src), 64);
    let (kind, message) = failure(&batch);
    assert_eq!(kind, ErrorKind::PeerUnreachable);
    assert!(message.contains("restarted"), "{message}");
    let fresh_desc = second.descriptor("names-a");
    let peer = reader.transport.open(&fresh_desc).await;
    let fresh = Arc::new(OpenSegment::new(SegmentHandle::fresh(), fresh_desc, reader.transport.protocol(), peer));
    assert!(reader.submit(&fresh, Opcode::Read, addr(&dst), addr(&src), 64).status().is_success());
    assert_eq!(dst, src);
}

async fn engine(meta: &Arc<InProcessMetadata>, name: &str) -> TransferEngine {
    EngineBuilder::new()
        .protocol(PROTOCOL)
        .segment_name(name)
        .transports(TransportRegistry::new().with(Arc::new(ExampleTransportFactory)))
        .metadata(meta.clone() as Arc<dyn MetadataStore>)
        .transfer_timeout(Duration::from_secs(5))
        .build()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_move_kv_blocks_with_the_transport_built_in() {
    let meta = InProcessMetadata::new();
    let prefill = engine(&meta, "builtin-prefill").await;
    let decode = engine(&meta, "builtin-decode").await;
    let src = pattern(1 << 20, 5);
    let dst = vec![0u8; 1 << 20];
    // SAFETY: both buffers outlive the engines' registrations (shut down below).
    unsafe { prefill.register_memory(addr(&src), src.len() as u64, Location::Cpu(0)).await }.unwrap();
    // SAFETY: as above.
    unsafe { decode.register_memory(addr(&dst), dst.len() as u64, Location::Cpu(0)).await }.unwrap();
    let desc = prefill.local_descriptor();
    assert_eq!(desc.protocol, PROTOCOL);
    assert!(desc.extra.contains_key(INSTANCE_FIELD));

    let peer = decode.open_segment(prefill.segment_name()).await.unwrap();
    let block = 4096u64;
    let requests: Vec<TransferRequest> = (0..64u64)
        .map(|i| TransferRequest {
            opcode: Opcode::Read,
            source: addr(&dst) + i * 2 * block,
            target: peer,
            target_offset: addr(&src) + i * 2 * block,
            length: block,
        })
        .collect();
    decode.transfer(&requests).await.unwrap();
    for i in 0..64usize {
        let at = i * 2 * block as usize;
        assert_eq!(dst[at..at + block as usize], src[at..at + block as usize], "block {i}");
        assert!(dst[at + block as usize..at + 2 * block as usize].iter().all(|&b| b == 0), "gap after block {i}");
    }
    // Writes go the other way.
    decode
        .transfer(&[TransferRequest {
            opcode: Opcode::Write,
            source: addr(&dst),
            target: peer,
            target_offset: addr(&src) + 4096,
            length: 100,
        }])
        .await
        .unwrap();
    assert_eq!(src[4096..4196], dst[..100]);

    // The peer leaves: transfers to it fail as unreachable, not with a crash.
    prefill.shutdown().await.unwrap();
    let e = decode
        .transfer(&[TransferRequest {
            opcode: Opcode::Read,
            source: addr(&dst),
            target: peer,
            target_offset: addr(&src),
            length: 8,
        }])
        .await
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::PeerUnreachable | ErrorKind::NotFound), "{e}");
    decode.shutdown().await.unwrap();
}

// ---- Through the plugin table, in-process ----

unsafe extern "C" fn collect_field(ctx: *mut c_void, key: *const c_char, value: *const c_char) {
    // SAFETY: `ctx` is the map `publish` was given for the duration of the call; both strings
    // are valid NUL-terminated UTF-8 during the call.
    unsafe {
        let fields = &mut *ctx.cast::<serde_json::Map<String, serde_json::Value>>();
        let value = serde_json::from_str(CStr::from_ptr(value).to_str().unwrap()).unwrap();
        fields.insert(CStr::from_ptr(key).to_str().unwrap().to_owned(), value);
    }
}

struct AbiInstance {
    api: &'static FerryPluginApi,
    inst: *mut FerryPluginInstance,
    name: String,
    _host: Box<FerryHostServices>,
}

impl AbiInstance {
    fn new(name: &str) -> Self {
        let table = ferry_transport_plugin_entry(FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR);
        // SAFETY: the entry returns a static table.
        let api = unsafe { &*table };
        let host = Box::new(FerryHostServices {
            struct_size: std::mem::size_of::<FerryHostServices>() as u64,
            abi_major: FERRY_PLUGIN_ABI_MAJOR,
            abi_minor: FERRY_PLUGIN_ABI_MINOR,
            ctx: std::ptr::null_mut(),
            log: None,
        });
        let (segment, config) = (CString::new(name).unwrap(), c"{\"protocol\":\"example\"}");
        let mut inst = std::ptr::null_mut();
        // SAFETY: valid pointers; `host` lives in the returned value until destroy.
        let code = unsafe { (api.create.unwrap())(&*host, segment.as_ptr(), config.as_ptr(), &mut inst) };
        assert_eq!(code, FERRY_OK);
        Self { api, inst, name: name.to_owned(), _host: host }
    }

    fn register(&self, buf: &[u8]) -> i32 {
        // SAFETY: a live instance; the tests keep registered buffers alive.
        unsafe { (self.api.register_memory.unwrap())(self.inst, addr(buf), buf.len() as u64, c"cpu:0".as_ptr()) }
    }

    fn unregister(&self, buf: &[u8]) -> i32 {
        // SAFETY: a live instance.
        unsafe { (self.api.unregister_memory.unwrap())(self.inst, addr(buf), buf.len() as u64) }
    }

    /// The descriptor the host would publish: its own fields plus what the plugin adds.
    fn descriptor(&self, buffers: &[&[u8]]) -> String {
        let base = serde_json::json!({
            "name": self.name,
            "protocol": "example",
            "buffers": buffers.iter().map(|b| serde_json::json!({"addr": addr(b), "length": b.len(), "name": "cpu:0"})).collect::<Vec<_>>(),
        });
        let text = CString::new(base.to_string()).unwrap();
        let mut fields = serde_json::Map::new();
        // SAFETY: a live instance; `fields` outlives the call and matches `collect_field`.
        let code = unsafe {
            (self.api.publish.unwrap())(
                self.inst,
                text.as_ptr(),
                Some(collect_field),
                (&mut fields as *mut serde_json::Map<String, serde_json::Value>).cast(),
            )
        };
        assert_eq!(code, FERRY_OK);
        assert_eq!(fields.keys().collect::<Vec<_>>(), [INSTANCE_FIELD]);
        let mut full = base;
        full.as_object_mut().unwrap().extend(fields);
        full.to_string()
    }

    fn open(&self, descriptor: &str) -> *mut FerryPluginTarget {
        let text = CString::new(descriptor).unwrap();
        let mut target = std::ptr::null_mut();
        // SAFETY: a live instance, valid string and out pointer.
        assert_eq!(unsafe { (self.api.open_target.unwrap())(self.inst, text.as_ptr(), &mut target) }, FERRY_OK);
        target
    }

    /// Submits one read and returns its final status and error text.
    fn read(&self, target: *mut FerryPluginTarget, local: u64, remote: u64, len: u64) -> (FerryTransferStatus, String) {
        let request = FerryTransferRequest {
            opcode: FERRY_OPCODE_READ,
            flags: 0,
            target: 1,
            local_addr: local,
            remote_addr: remote,
            length: len,
        };
        let mut batch = std::ptr::null_mut();
        let mut status = FerryTransferStatus::default();
        let mut text = [0u8; 256];
        // SAFETY: a live instance and target; one request; the status and text buffers have
        // room for what is asked; the batch is freed once.
        unsafe {
            assert_eq!((self.api.submit.unwrap())(self.inst, target, &request, 1, &mut batch), FERRY_OK);
            assert_eq!((self.api.poll.unwrap())(self.inst, batch, &mut status, 1), 0, "finished inline");
            (self.api.batch_error.unwrap())(self.inst, batch, 0, text.as_mut_ptr().cast(), text.len());
            (self.api.free_batch.unwrap())(self.inst, batch);
        }
        (status, CStr::from_bytes_until_nul(&text).unwrap().to_str().unwrap().to_owned())
    }

    fn close(&self, target: *mut FerryPluginTarget) {
        // SAFETY: a live target, closed once.
        unsafe { (self.api.close_target.unwrap())(self.inst, target) }
    }

    fn destroy(self) {
        // SAFETY: a live instance, shut down and destroyed once.
        unsafe {
            (self.api.shutdown.unwrap())(self.inst);
            (self.api.destroy.unwrap())(self.inst);
        }
    }
}

#[test]
fn the_plugin_table_moves_bytes_and_reports_failures() {
    let a = AbiInstance::new("abi-a");
    let b = AbiInstance::new("abi-b");
    let src = pattern(4096, 9);
    let extra = pattern(64, 3);
    let dst = vec![0u8; 4096];
    assert_eq!(a.register(&dst), FERRY_OK);
    assert_eq!(b.register(&src), FERRY_OK);
    assert_eq!(b.register(&extra), FERRY_OK);
    let target = a.open(&b.descriptor(&[&src, &extra]));

    let (status, _) = a.read(target, addr(&dst), addr(&src), 4096);
    assert_eq!(status, FerryTransferStatus { state: FERRY_STATE_COMPLETED, code: FERRY_OK, transferred: 4096 });
    assert_eq!(dst, src);

    // b unregisters `extra`: the descriptor a holds still lists it, b's live registry does not.
    assert_eq!(b.unregister(&extra), FERRY_OK);
    let (status, text) = a.read(target, addr(&dst), addr(&extra), 64);
    assert_eq!((status.state, status.code), (FERRY_STATE_FAILED, FERRY_E_OUT_OF_BOUNDS));
    assert!(text.contains("segment `abi-b`"), "{text}");

    // b goes away: unreachable.
    b.destroy();
    let (status, text) = a.read(target, addr(&dst), addr(&src), 64);
    assert_eq!((status.state, status.code), (FERRY_STATE_FAILED, FERRY_E_PEER_UNREACHABLE));
    assert!(text.contains("abi-b"), "{text}");
    a.close(target);
    assert_eq!(a.unregister(&dst), FERRY_OK);
    a.destroy();
}
