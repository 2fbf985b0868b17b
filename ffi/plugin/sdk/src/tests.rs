//! The shims exercised in-process: the table's functions are called directly (no dlopen),
//! around a small test transport whose behaviour each target's descriptor selects.

use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ferry_abi::*;
use ferry_core::{
    Capabilities, Error, ErrorKind, Location, MemoryPromise, Opcode, OpenSegment, Region, Result, SegmentDescriptor,
    Submission, Transport, TransportContext, TransportFactory,
};

const PROTOCOL: &str = "shimtest";

crate::declare_plugin!(protocol = "shimtest", factory = TestFactory);

/// Gates the `async` mode waits for (named by a target's `gate` field).
static OPEN_GATES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Set by the `hold` mode just before it releases its requests.
static HOLD_RELEASED: AtomicBool = AtomicBool::new(false);

struct TestFactory;

#[async_trait]
impl TransportFactory for TestFactory {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    async fn create(&self, ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
        if ctx.config.device_name.as_deref() == Some("refuse") {
            return Err(Error::new(ErrorKind::Unsupported, "this test transport refuses device `refuse`"));
        }
        if ctx.config.device_name.as_deref() == Some("panic") {
            panic!("shimtest factory exploded");
        }
        tracing::error!(segment = %ctx.segment_name, "shimtest transport created");
        Ok(Arc::new(TestTransport { instance: ctx.instance.clone(), runtime: ctx.runtime.clone() }))
    }
}

struct TestTransport {
    instance: String,
    runtime: tokio::runtime::Handle,
}

/// Copies request `i` between two addresses of this process.
fn copy(submission: &Submission, i: u32) {
    let r = &submission.request(i).request;
    let (src, dst) = match r.opcode {
        Opcode::Read => (r.target_offset, r.source),
        Opcode::Write => (r.source, r.target_offset),
    };
    // SAFETY: the tests point every request at buffers they keep alive until the batch is
    // done (local ranges are registered; remote ranges are live `Vec`s of the test).
    unsafe { std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, r.length as usize) };
}

#[async_trait]
impl Transport for TestTransport {
    fn protocol(&self) -> &str {
        PROTOCOL
    }

    fn capabilities(&self) -> Capabilities {
        crate::DEFAULT_CAPABILITIES
    }

    fn publish(&self, descriptor: &mut SegmentDescriptor) {
        if descriptor.name == "panic-publish" {
            panic!("shimtest publish exploded");
        }
        descriptor.extra.insert("shimtest_instance".into(), self.instance.clone().into());
        descriptor.extra.insert("tcp_data_port".into(), 4242.into());
    }

    async fn register_memory(&self, region: &Region, _promise: MemoryPromise) -> Result<()> {
        match region.location() {
            Location::Cuda(_) => Err(Error::new(ErrorKind::Unsupported, "shimtest moves no CUDA memory")),
            Location::Npu(99) => panic!("shimtest register exploded"),
            _ => Ok(()),
        }
    }

    fn submit(&self, target: &Arc<OpenSegment>, mut submission: Submission) {
        let mode = target.descriptor().extra.get("mode").and_then(|m| m.as_str()).unwrap_or("copy").to_owned();
        match mode.as_str() {
            "copy" => {
                for i in submission.indices().to_vec() {
                    copy(&submission, i);
                    submission.complete(i, Ok(()));
                }
            }
            "async" => {
                // Completes later, on the runtime, once the test opened the target's gate.
                let gate = target.descriptor().extra.get("gate").and_then(|g| g.as_str()).map(str::to_owned);
                self.runtime.spawn(async move {
                    while gate.as_ref().is_some_and(|g| !OPEN_GATES.lock().unwrap().contains(g)) {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    for i in submission.indices().to_vec() {
                        copy(&submission, i);
                        submission.complete(i, Ok(()));
                    }
                });
            }
            "hold" => {
                // Holds the requests until cancelled, then keeps "touching" them a while.
                self.runtime.spawn(async move {
                    while !submission.is_cancelled() {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    tokio::time::sleep(Duration::from_millis(40)).await;
                    HOLD_RELEASED.store(true, Ordering::SeqCst);
                    submission.fail_all(&Error::new(ErrorKind::Cancelled, "seen the cancellation"));
                });
            }
            "fail" => {
                let cause = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
                submission.fail_all(&Error::unreachable("peer gone").with_source(cause));
            }
            "reject" => submission.fail_all(&Error::transport("shimtest rejects this batch")),
            "panic" => panic!("shimtest submit exploded"),
            other => submission.fail_all(&Error::invalid(format!("unknown test mode {other}"))),
        }
    }
}

/// A host: records every log line its plugin instances send.
#[derive(Default)]
struct Recorder {
    lines: Mutex<Vec<(u32, String)>>,
}

impl Recorder {
    fn contains(&self, level: u32, needle: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|(l, m)| *l == level && m.contains(needle))
    }
    fn any(&self, needle: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|(_, m)| m.contains(needle))
    }
}

unsafe extern "C" fn record(ctx: *mut c_void, level: u32, message: *const c_char) {
    // SAFETY: `ctx` is the `Recorder` the fixture keeps alive until `destroy` returned, and
    // `message` a NUL-terminated string valid during the call (the ABI's log contract).
    let (recorder, message) = unsafe { (&*ctx.cast::<Recorder>(), CStr::from_ptr(message)) };
    recorder.lines.lock().unwrap().push((level, message.to_string_lossy().into_owned()));
}

unsafe extern "C" fn collect_field(ctx: *mut c_void, key: *const c_char, value: *const c_char) {
    // SAFETY: `ctx` is the `Vec` passed to `publish` for the duration of the call; both strings
    // are valid NUL-terminated UTF-8 during the call.
    unsafe {
        let fields = &mut *ctx.cast::<Vec<(String, String)>>();
        fields.push((
            CStr::from_ptr(key).to_string_lossy().into_owned(),
            CStr::from_ptr(value).to_string_lossy().into_owned(),
        ));
    }
}

/// The forwarding subscriber with a fixed filter, whatever `RUST_LOG` the tests run under
/// (installed before any `create` of this process, which would read the environment).
fn install_test_logging() {
    crate::log::install_with(|| tracing_subscriber::EnvFilter::new("info"));
}

#[test]
fn the_log_filter_comes_from_the_environment() {
    let env = |vars: &'static [(&'static str, &'static str)]| {
        move |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    };
    assert_eq!(crate::log::filter_directives(env(&[])), "info");
    assert_eq!(crate::log::filter_directives(env(&[("RUST_LOG", "debug")])), "debug");
    assert_eq!(crate::log::filter_directives(env(&[("RUST_LOG", "debug"), ("FERRY_PLUGIN_LOG", "warn")])), "warn");
    assert_eq!(crate::log::filter_directives(env(&[("RUST_LOG", "trace"), ("FERRY_PLUGIN_LOG", " ")])), "trace");
}

fn api() -> &'static FerryPluginApi {
    let table = ferry_transport_plugin_entry(FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR);
    assert!(!table.is_null());
    // SAFETY: the entry returns a pointer to a static table.
    unsafe { &*table }
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

const CONFIG: &str = r#"{"protocol": "shimtest", "transfer_timeout_ms": 300}"#;

/// One plugin instance with its host services and log recorder.
struct Fixture {
    api: &'static FerryPluginApi,
    recorder: Box<Recorder>,
    _host: Box<FerryHostServices>,
    inst: *mut FerryPluginInstance,
    destroyed: bool,
}

fn host_services(recorder: &Recorder) -> Box<FerryHostServices> {
    Box::new(FerryHostServices {
        struct_size: std::mem::size_of::<FerryHostServices>() as u64,
        abi_major: FERRY_PLUGIN_ABI_MAJOR,
        abi_minor: FERRY_PLUGIN_ABI_MINOR,
        ctx: recorder as *const Recorder as *mut c_void,
        log: Some(record),
    })
}

impl Fixture {
    fn try_new(segment: &str, config: &str) -> std::result::Result<Self, (i32, Box<Recorder>)> {
        install_test_logging();
        let api = api();
        let recorder = Box::<Recorder>::default();
        let host = host_services(&recorder);
        let mut inst = std::ptr::null_mut();
        let (segment, config) = (c(segment), c(config));
        // SAFETY: valid host services (kept in the fixture until destroy), strings and out.
        let code = unsafe { (api.create.unwrap())(&*host, segment.as_ptr(), config.as_ptr(), &mut inst) };
        if code != FERRY_OK {
            assert!(inst.is_null(), "a failed create stores no instance");
            return Err((code, recorder));
        }
        Ok(Self { api, recorder, _host: host, inst, destroyed: false })
    }

    fn new(segment: &str) -> Self {
        Self::try_new(segment, CONFIG).unwrap_or_else(|(code, _)| panic!("create failed with {code}"))
    }

    fn register(&self, addr: u64, len: u64, location: &str) -> i32 {
        let location = c(location);
        // SAFETY: a live instance; the tests register only memory they keep alive meanwhile.
        unsafe { (self.api.register_memory.unwrap())(self.inst, addr, len, location.as_ptr()) }
    }

    fn unregister(&self, addr: u64, len: u64) -> i32 {
        // SAFETY: a live instance.
        unsafe { (self.api.unregister_memory.unwrap())(self.inst, addr, len) }
    }

    fn publish(&self, descriptor: &str) -> (i32, Vec<(String, String)>) {
        let mut fields: Vec<(String, String)> = Vec::new();
        let json = c(descriptor);
        // SAFETY: a live instance; `fields` outlives the call and matches `collect_field`.
        let code = unsafe {
            (self.api.publish.unwrap())(
                self.inst,
                json.as_ptr(),
                Some(collect_field),
                (&mut fields as *mut Vec<(String, String)>).cast(),
            )
        };
        (code, fields)
    }

    fn open(&self, name: &str, mode: &str) -> *mut FerryPluginTarget {
        let (code, target) = self.try_open(&format!(r#"{{"name":"{name}","protocol":"shimtest","mode":"{mode}"}}"#));
        assert_eq!(code, FERRY_OK);
        target
    }

    fn try_open(&self, descriptor: &str) -> (i32, *mut FerryPluginTarget) {
        let json = c(descriptor);
        let mut target = std::ptr::null_mut();
        // SAFETY: a live instance, a valid string and out pointer.
        let code = unsafe { (self.api.open_target.unwrap())(self.inst, json.as_ptr(), &mut target) };
        (code, target)
    }

    fn close(&self, target: *mut FerryPluginTarget) {
        // SAFETY: a live target of this instance, closed once.
        unsafe { (self.api.close_target.unwrap())(self.inst, target) }
    }

    fn submit(
        &self,
        target: *mut FerryPluginTarget,
        requests: &[FerryTransferRequest],
    ) -> (i32, *mut FerryPluginBatch) {
        let mut batch = std::ptr::null_mut();
        // SAFETY: a live instance and target; `requests` is a valid slice.
        let code =
            unsafe { (self.api.submit.unwrap())(self.inst, target, requests.as_ptr(), requests.len(), &mut batch) };
        (code, batch)
    }

    fn poll(&self, batch: *mut FerryPluginBatch, n: usize) -> (i32, Vec<FerryTransferStatus>) {
        let mut statuses = vec![FerryTransferStatus { state: -1, code: 1, transferred: 7 }; n];
        // SAFETY: a live batch; `statuses` has room for `n`.
        let pending = unsafe { (self.api.poll.unwrap())(self.inst, batch, statuses.as_mut_ptr(), n) };
        (pending, statuses)
    }

    fn wait(&self, batch: *mut FerryPluginBatch, n: usize) -> Vec<FerryTransferStatus> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (pending, statuses) = self.poll(batch, n);
            assert!(pending >= 0, "poll failed with {pending}");
            if pending == 0 {
                return statuses;
            }
            assert!(Instant::now() < deadline, "batch still pending");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn cancel(&self, batch: *mut FerryPluginBatch) {
        // SAFETY: a live batch of this instance.
        unsafe { (self.api.cancel.unwrap())(self.inst, batch) }
    }

    fn error(&self, batch: *mut FerryPluginBatch, index: usize, capacity: usize) -> (usize, String) {
        let mut buf = vec![0x55u8; capacity + 1];
        let ptr = if capacity == 0 { std::ptr::null_mut() } else { buf.as_mut_ptr().cast() };
        // SAFETY: a live batch; `buf` has room for `capacity` bytes.
        let len = unsafe { (self.api.batch_error.unwrap())(self.inst, batch, index, ptr, capacity) };
        if capacity == 0 {
            return (len, String::new());
        }
        assert_eq!(buf[capacity], 0x55, "batch_error wrote past `capacity`");
        let text = CStr::from_bytes_until_nul(&buf).expect("NUL-terminated").to_str().unwrap().to_owned();
        (len, text)
    }

    fn free(&self, batch: *mut FerryPluginBatch) {
        // SAFETY: a live batch of this instance, freed once.
        unsafe { (self.api.free_batch.unwrap())(self.inst, batch) }
    }

    fn destroy(&mut self) {
        if !self.destroyed {
            self.destroyed = true;
            // SAFETY: a live instance, shut down then destroyed once.
            unsafe {
                (self.api.shutdown.unwrap())(self.inst);
                (self.api.destroy.unwrap())(self.inst);
            }
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.destroy();
    }
}

fn req(opcode: u32, local: &[u8], remote: &[u8]) -> FerryTransferRequest {
    FerryTransferRequest {
        opcode,
        flags: 0,
        target: 1,
        local_addr: local.as_ptr() as u64,
        remote_addr: remote.as_ptr() as u64,
        length: local.len().min(remote.len()) as u64,
    }
}

fn addr(buf: &[u8]) -> u64 {
    buf.as_ptr() as u64
}

#[test]
fn entry_checks_the_major_version_and_the_table_describes_the_plugin() {
    assert!(ferry_transport_plugin_entry(FERRY_PLUGIN_ABI_MAJOR + 1, 0).is_null());
    assert!(ferry_transport_plugin_entry(0, 0).is_null());
    assert!(!ferry_transport_plugin_entry(FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR + 7).is_null());
    let api = api();
    assert_eq!(api.struct_size, FERRY_PLUGIN_API_V1_1_SIZE);
    assert_eq!((api.abi_major, api.abi_minor), (FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR));
    assert!(api.set_completion_sink.is_some(), "the table takes the host's completion callback");
    // SAFETY: the table's protocol is a static NUL-terminated string.
    assert_eq!(unsafe { CStr::from_ptr(api.protocol) }, c"shimtest");
    assert_eq!(api.capabilities, FERRY_CAP_READ | FERRY_CAP_WRITE | FERRY_CAP_HOST_MEMORY);
    assert_eq!(crate::protocol_cstr("rdma_v2-x\0"), c"rdma_v2-x");
}

#[test]
#[should_panic(expected = "ASCII letters")]
fn protocol_names_are_checked() {
    let _ = crate::protocol_cstr("two words\0");
}

#[test]
fn a_whole_cycle_moves_bytes_and_reports_every_request() {
    let mut f = Fixture::new("cycle-a");
    assert!(f.recorder.contains(FERRY_LOG_INFO, "instance created for segment `cycle-a`"));
    assert!(
        f.recorder.contains(FERRY_LOG_ERROR, "shimtest transport created") && f.recorder.any("segment=cycle-a"),
        "the transport's tracing event reached the host: {:?}",
        f.recorder.lines.lock().unwrap()
    );

    let (code, fields) = f.publish(r#"{"name":"cycle-a","protocol":"shimtest","buffers":[],"custom":1}"#);
    assert_eq!(code, FERRY_OK);
    let keys: Vec<&str> = fields.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["shimtest_instance", "tcp_data_port"], "only added or changed fields are sent");
    assert_eq!(fields[1].1, "4242");
    assert!(fields[0].1.starts_with("\"shimtest-"), "a JSON string: {}", fields[0].1);

    let local = vec![0u8; 4096];
    let remote: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(f.register(addr(&local), 4096, "cpu:0"), FERRY_OK);
    let target = f.open("peer", "copy");
    let reqs = [
        req(FERRY_OPCODE_READ, &local[..1024], &remote[..1024]),
        req(FERRY_OPCODE_WRITE, &local[2048..2049], &remote[4000..4001]),
    ];
    let (code, batch) = f.submit(target, &reqs);
    assert_eq!(code, FERRY_OK);
    let statuses = f.wait(batch, 2);
    assert_eq!(
        statuses,
        [
            FerryTransferStatus { state: FERRY_STATE_COMPLETED, code: FERRY_OK, transferred: 1024 },
            FerryTransferStatus { state: FERRY_STATE_COMPLETED, code: FERRY_OK, transferred: 1 },
        ]
    );
    assert_eq!(&local[..1024], &remote[..1024]);
    assert_eq!(remote[4000], 0, "the write landed");
    assert_eq!(f.error(batch, 0, 64), (0, String::new()), "no error for a completed request");
    f.free(batch);

    // The region may go now: no batch holds it.
    assert_eq!(f.unregister(addr(&local), 4096), FERRY_OK);
    assert_eq!(f.unregister(addr(&local), 4096), FERRY_E_NOT_FOUND);
    f.close(target);
    f.destroy();
}

#[test]
fn an_asynchronous_request_is_pending_until_the_transport_released_it() {
    let f = Fixture::new("async-a");
    let local = vec![0u8; 256];
    let remote = vec![9u8; 256];
    assert_eq!(f.register(addr(&local), 256, "*"), FERRY_OK);
    let (code, target) = f.try_open(r#"{"name":"peer","protocol":"shimtest","mode":"async","gate":"async-a"}"#);
    assert_eq!(code, FERRY_OK);
    let (code, batch) = f.submit(target, &[req(FERRY_OPCODE_READ, &local, &remote)]);
    assert_eq!(code, FERRY_OK);
    let (pending, statuses) = f.poll(batch, 1);
    assert_eq!(pending, 1);
    assert_eq!(statuses[0], FerryTransferStatus { state: FERRY_STATE_PENDING, code: FERRY_OK, transferred: 0 });
    assert!(local.iter().all(|&b| b == 0), "nothing moved yet");
    OPEN_GATES.lock().unwrap().push("async-a".into());
    let statuses = f.wait(batch, 1);
    assert_eq!(statuses[0], FerryTransferStatus { state: FERRY_STATE_COMPLETED, code: FERRY_OK, transferred: 256 });
    assert_eq!(local, remote);
    f.free(batch);
    f.close(target);
}

#[test]
fn a_cancelled_request_stays_pending_until_the_transport_let_go_of_the_memory() {
    let f = Fixture::new("cancel-a");
    let local = vec![0u8; 64];
    let remote = vec![0u8; 64];
    assert_eq!(f.register(addr(&local), 64, "cpu:0"), FERRY_OK);
    let target = f.open("peer", "hold");
    let (code, batch) = f.submit(target, &[req(FERRY_OPCODE_READ, &local, &remote)]);
    assert_eq!(code, FERRY_OK);
    assert_eq!(f.poll(batch, 1).0, 1);
    // In flight: unregistering waits for the lease (transfer timeout 300 ms), then says Busy.
    let started = Instant::now();
    assert_eq!(f.unregister(addr(&local), 64), FERRY_E_BUSY);
    assert!(started.elapsed() >= Duration::from_millis(250), "{:?}", started.elapsed());

    // `cancel` does not block; the request is reported pending until the transport released it.
    f.cancel(batch);
    assert_eq!(f.poll(batch, 1).0, 1, "still touched by the transport (it lets go 40 ms after the cancel)");
    let deadline = Instant::now() + Duration::from_secs(5);
    let (pending, statuses) = loop {
        let (pending, statuses) = f.poll(batch, 1);
        if pending == 0 {
            break (pending, statuses);
        }
        assert!(Instant::now() < deadline, "the transport never released the cancelled request");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert!(HOLD_RELEASED.load(Ordering::SeqCst), "poll said done before the transport released the request");
    assert_eq!(pending, 0);
    assert_eq!(
        statuses[0],
        FerryTransferStatus { state: FERRY_STATE_CANCELLED, code: FERRY_E_CANCELLED, transferred: 0 }
    );
    assert_eq!(f.unregister(addr(&local), 64), FERRY_OK, "released: the region can go");
    f.free(batch);
    f.close(target);
}

#[test]
fn failures_carry_their_code_and_message() {
    let f = Fixture::new("fail-a");
    let local = vec![0u8; 64];
    let remote = vec![0u8; 64];
    assert_eq!(f.register(addr(&local), 64, "cpu:0"), FERRY_OK);

    let failing = f.open("peer", "fail");
    let (code, batch) = f.submit(failing, &[req(FERRY_OPCODE_READ, &local, &remote)]);
    assert_eq!(code, FERRY_OK);
    let statuses = f.wait(batch, 1);
    assert_eq!(
        statuses[0],
        FerryTransferStatus { state: FERRY_STATE_FAILED, code: FERRY_E_PEER_UNREACHABLE, transferred: 0 }
    );
    let full = "peer gone: reset by peer";
    assert_eq!(f.error(batch, 0, 128), (full.len(), full.to_owned()), "the cause is included");
    assert_eq!(f.error(batch, 0, 5), (full.len(), "peer".to_owned()), "truncated, NUL-terminated");
    assert_eq!(f.error(batch, 0, 0).0, full.len(), "a null buffer just measures");
    assert_eq!(f.error(batch, 1, 64).0, 0, "an index past the batch has no error");
    f.free(batch);

    let rejecting = f.open("peer2", "reject");
    // A transport that refuses a whole batch completes its requests with the error (it owns
    // them from the moment it is handed them): the host sees them failed, with the message.
    let (code, batch) = f.submit(rejecting, &[req(FERRY_OPCODE_READ, &local, &remote)]);
    assert_eq!(code, FERRY_OK);
    assert_eq!(
        f.wait(batch, 1)[0],
        FerryTransferStatus { state: FERRY_STATE_FAILED, code: FERRY_E_TRANSPORT, transferred: 0 }
    );
    assert_eq!(f.error(batch, 0, 128).1, "shimtest rejects this batch");
    f.free(batch);
    assert_eq!(f.unregister(addr(&local), 64), FERRY_OK, "a rejected batch holds no lease");
    f.close(failing);
    f.close(rejecting);
}

#[test]
fn bad_arguments_are_refused_with_a_code() {
    install_test_logging();
    let api = api();
    let recorder = Recorder::default();
    let host = host_services(&recorder);
    let (name, config) = (c("bad-args"), c(CONFIG));
    let mut inst = std::ptr::null_mut();
    let create = api.create.unwrap();
    let not_utf8 = [b'a', 0xff, 0xfe, 0];
    // SAFETY: each call passes valid pointers except the one under test, which is null or a
    // NUL-terminated byte string that is not UTF-8.
    unsafe {
        assert_eq!(create(&*host, std::ptr::null(), config.as_ptr(), &mut inst), FERRY_E_INVALID_ARGUMENT);
        assert_eq!(create(&*host, name.as_ptr(), std::ptr::null(), &mut inst), FERRY_E_INVALID_ARGUMENT);
        assert_eq!(create(&*host, name.as_ptr(), config.as_ptr(), std::ptr::null_mut()), FERRY_E_INVALID_ARGUMENT);
        assert_eq!(create(&*host, not_utf8.as_ptr().cast(), config.as_ptr(), &mut inst), FERRY_E_INVALID_ARGUMENT);
        assert_eq!(create(&*host, c"".as_ptr(), config.as_ptr(), &mut inst), FERRY_E_INVALID_ARGUMENT);
        assert_eq!(create(&*host, name.as_ptr(), c"{not json".as_ptr(), &mut inst), FERRY_E_CONFIG);
        assert_eq!(
            create(&*host, name.as_ptr(), c"{\"transfer_timeout_ms\": \"soon\"}".as_ptr(), &mut inst),
            FERRY_E_CONFIG
        );
    }
    assert!(inst.is_null());
    assert!(recorder.contains(FERRY_LOG_WARN, "`segment_name` is null"), "each refusal is explained to the host");
    assert!(recorder.contains(FERRY_LOG_WARN, "not UTF-8"));
    let mut other_major = host_services(&recorder);
    other_major.abi_major += 1;
    // SAFETY: valid pointers.
    assert_eq!(unsafe { create(&*other_major, name.as_ptr(), config.as_ptr(), &mut inst) }, FERRY_E_INVALID_ARGUMENT);
    let refused = Fixture::try_new("refused", r#"{"device_name": "refuse"}"#).err().expect("the factory refuses");
    assert_eq!(refused.0, FERRY_E_UNSUPPORTED, "the factory's error kind");
    assert!(refused.1.any("refuses device `refuse`"));

    let f = Fixture::new("bad-args");
    let null_inst = std::ptr::null_mut();
    let buf = vec![0u8; 128];
    // Registration.
    assert_eq!(f.register(addr(&buf), 128, "gpu:0"), FERRY_E_INVALID_ARGUMENT);
    // SAFETY: a live instance; the location is null or not UTF-8.
    unsafe {
        assert_eq!(
            (f.api.register_memory.unwrap())(f.inst, addr(&buf), 128, std::ptr::null()),
            FERRY_E_INVALID_ARGUMENT
        );
        assert_eq!(
            (f.api.register_memory.unwrap())(f.inst, addr(&buf), 128, not_utf8.as_ptr().cast()),
            FERRY_E_INVALID_ARGUMENT
        );
        assert_eq!(
            (f.api.register_memory.unwrap())(null_inst, addr(&buf), 128, c"*".as_ptr()),
            FERRY_E_INVALID_ARGUMENT
        );
    }
    assert_eq!(f.register(addr(&buf), 0, "*"), FERRY_E_INVALID_ARGUMENT);
    assert_eq!(f.register(u64::MAX - 4, 128, "*"), FERRY_E_OUT_OF_BOUNDS);
    assert_eq!(f.register(addr(&buf), 64, "cuda:0"), FERRY_E_UNSUPPORTED, "the transport refused");
    assert_eq!(f.register(addr(&buf), 128, "cpu:0"), FERRY_OK, "the refused registration was rolled back");
    assert_eq!(f.register(addr(&buf) + 64, 8, "*"), FERRY_E_ALREADY_EXISTS);
    assert_eq!(f.unregister(addr(&buf), 64), FERRY_E_INVALID_ARGUMENT, "wrong length");
    assert_eq!(f.unregister(addr(&buf) + 1, 127), FERRY_E_NOT_FOUND);

    // Publication.
    assert_eq!(f.publish("{").0, FERRY_E_INVALID_ARGUMENT);
    assert_eq!(f.publish(r#"{"name":"","protocol":"shimtest"}"#).0, FERRY_E_INVALID_ARGUMENT);
    let json = c(r#"{"name":"x","protocol":"shimtest"}"#);
    // SAFETY: a live instance; the sink is null.
    let code = unsafe { (f.api.publish.unwrap())(f.inst, json.as_ptr(), None, std::ptr::null_mut()) };
    assert_eq!(code, FERRY_E_INVALID_ARGUMENT);

    // Targets.
    assert_eq!(f.try_open("[]").0, FERRY_E_INVALID_ARGUMENT);
    let (code, target) = f.try_open(r#"{"name":"tcp-peer","protocol":"tcp"}"#);
    assert_eq!((code, target), (FERRY_E_UNSUPPORTED, std::ptr::null_mut()), "a descriptor of another protocol");
    // SAFETY: a live instance; `out` is null.
    let code = unsafe { (f.api.open_target.unwrap())(f.inst, json.as_ptr(), std::ptr::null_mut()) };
    assert_eq!(code, FERRY_E_INVALID_ARGUMENT);
    let target = f.open("peer", "copy");

    // Submission: nothing starts when any request is bad.
    let remote = [0u8; 128];
    let good = req(FERRY_OPCODE_READ, &buf[..16], &remote[..16]);
    assert_eq!(f.submit(target, &[]).0, FERRY_E_INVALID_ARGUMENT);
    assert_eq!(f.submit(target, &[good, FerryTransferRequest { opcode: 7, ..good }]).0, FERRY_E_INVALID_ARGUMENT);
    assert_eq!(f.submit(target, &[FerryTransferRequest { flags: 1, ..good }]).0, FERRY_E_INVALID_ARGUMENT);
    assert_eq!(f.submit(target, &[FerryTransferRequest { length: 0, ..good }]).0, FERRY_E_INVALID_ARGUMENT);
    let outside = FerryTransferRequest { local_addr: addr(&buf) + 120, ..good };
    assert_eq!(f.submit(target, &[good, outside]).0, FERRY_E_OUT_OF_BOUNDS, "runs past the region");
    assert!(f.recorder.contains(FERRY_LOG_WARN, "request 1:"), "the message names the request");
    assert_eq!(f.submit(target, &[FerryTransferRequest { local_addr: 16, ..good }]).0, FERRY_E_OUT_OF_BOUNDS);
    let mut batch = std::ptr::null_mut();
    // SAFETY: a live instance; one pointer under test is null, or a target passed as a batch.
    unsafe {
        let submit = f.api.submit.unwrap();
        assert_eq!(submit(f.inst, target, std::ptr::null(), 1, &mut batch), FERRY_E_INVALID_ARGUMENT);
        assert_eq!(submit(f.inst, target, &good, 1, std::ptr::null_mut()), FERRY_E_INVALID_ARGUMENT);
        assert_eq!(submit(f.inst, std::ptr::null_mut(), &good, 1, &mut batch), FERRY_E_INVALID_ARGUMENT);
        assert_eq!(submit(null_inst, target, &good, 1, &mut batch), FERRY_E_INVALID_ARGUMENT);
        let mut status = FerryTransferStatus::default();
        assert_eq!((f.api.poll.unwrap())(f.inst, target.cast(), &mut status, 1), FERRY_E_INVALID_ARGUMENT);
        assert_eq!((f.api.poll.unwrap())(f.inst, std::ptr::null_mut(), &mut status, 1), FERRY_E_INVALID_ARGUMENT);
        assert_eq!((f.api.batch_error.unwrap())(f.inst, std::ptr::null_mut(), 0, std::ptr::null_mut(), 0), 0);
        // Null handles to the void functions are reported, not dereferenced.
        (f.api.cancel.unwrap())(f.inst, std::ptr::null_mut());
        (f.api.free_batch.unwrap())(f.inst, std::ptr::null_mut());
        (f.api.close_target.unwrap())(f.inst, std::ptr::null_mut());
        (f.api.shutdown.unwrap())(std::ptr::null_mut());
        (f.api.destroy.unwrap())(std::ptr::null_mut());
    }
    assert!(batch.is_null());
    let (code, batch) = f.submit(target, &[good]);
    assert_eq!(code, FERRY_OK);
    assert_eq!(f.poll(batch, 2).0, FERRY_E_INVALID_ARGUMENT, "count must be the batch's length");
    // SAFETY: a live batch; the statuses pointer is null.
    assert_eq!(unsafe { (f.api.poll.unwrap())(f.inst, batch, std::ptr::null_mut(), 1) }, FERRY_E_INVALID_ARGUMENT);
    assert_eq!(f.wait(batch, 1)[0].state, FERRY_STATE_COMPLETED);
    f.free(batch);
    f.close(target);
}

#[test]
fn panics_become_internal_errors_the_host_hears_about() {
    let f = Fixture::new("panic-a");
    let local = vec![0u8; 64];
    let remote = vec![5u8; 64];
    assert_eq!(f.register(addr(&local), 64, "cpu:0"), FERRY_OK);
    let exploding = f.open("peer", "panic");
    let (code, batch) = f.submit(exploding, &[req(FERRY_OPCODE_READ, &local, &remote)]);
    assert_eq!((code, batch), (FERRY_E_INTERNAL, std::ptr::null_mut()));
    assert!(
        f.recorder.contains(FERRY_LOG_ERROR, "plugin `shimtest`: submit panicked: shimtest submit exploded"),
        "{:?}",
        f.recorder.lines.lock().unwrap()
    );

    assert_eq!(f.publish(r#"{"name":"panic-publish","protocol":"shimtest"}"#).0, FERRY_E_INTERNAL);
    assert!(f.recorder.any("publish panicked: shimtest publish exploded"));

    // A panic inside an async method (on the instance's runtime) is caught as well, and the
    // registration it interrupted is rolled back.
    let other = vec![0u8; 32];
    assert_eq!(f.register(addr(&other), 32, "npu:99"), FERRY_E_INTERNAL);
    assert!(f.recorder.any("register_memory panicked: shimtest register exploded"));
    assert_eq!(f.register(addr(&other), 32, "cpu:0"), FERRY_OK, "rolled back");

    // The instance still works.
    let fine = f.open("peer", "copy");
    let (code, batch) = f.submit(fine, &[req(FERRY_OPCODE_READ, &local, &remote)]);
    assert_eq!(code, FERRY_OK);
    assert_eq!(f.wait(batch, 1)[0].state, FERRY_STATE_COMPLETED);
    assert_eq!(local, remote);
    f.free(batch);
    f.close(exploding);
    f.close(fine);

    let failed = Fixture::try_new("panic-b", r#"{"device_name": "panic"}"#).err().expect("create fails");
    assert_eq!(failed.0, FERRY_E_INTERNAL);
    assert!(failed.1.any("create panicked: shimtest factory exploded"));
}

#[test]
fn logging_follows_the_struct_size_and_stops_at_destroy() {
    // A host struct that ends before `ctx` and `log` (as a smaller, older one would): the
    // plugin reads only what `struct_size` covers and logs nothing.
    install_test_logging();
    let api = api();
    let recorder = Recorder::default();
    let mut short = host_services(&recorder);
    short.struct_size = std::mem::offset_of!(FerryHostServices, ctx) as u64;
    let (name, config) = (c("short-host"), c(CONFIG));
    let mut inst = std::ptr::null_mut();
    // SAFETY: valid pointers; the host services outlive the instance.
    unsafe {
        assert_eq!((api.create.unwrap())(&*short, name.as_ptr(), config.as_ptr(), &mut inst), FERRY_OK);
        (api.shutdown.unwrap())(inst);
        (api.destroy.unwrap())(inst);
    }
    assert!(recorder.lines.lock().unwrap().is_empty(), "the log callback lies past struct_size");

    let mut f = Fixture::new("destroyed-a");
    assert!(f.recorder.any("instance created"));
    f.destroy();
    let seen = f.recorder.lines.lock().unwrap().len();
    tracing::error!("after destroy");
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(f.recorder.lines.lock().unwrap().len(), seen, "no callback after destroy");
}

#[test]
fn a_shut_down_instance_refuses_new_work() {
    let f = Fixture::new("shut-a");
    let local = vec![0u8; 64];
    assert_eq!(f.register(addr(&local), 64, "cpu:0"), FERRY_OK);
    let target = f.open("peer", "copy");
    // SAFETY: a live instance.
    unsafe { (f.api.shutdown.unwrap())(f.inst) };
    assert_eq!(f.register(addr(&local) + 64, 64, "cpu:0"), FERRY_E_SHUTDOWN);
    assert_eq!(f.submit(target, &[req(FERRY_OPCODE_READ, &local, &local)]).0, FERRY_E_SHUTDOWN);
    assert_eq!(f.try_open(r#"{"name":"x","protocol":"shimtest"}"#).0, FERRY_E_SHUTDOWN);
    f.close(target);
}

#[tokio::test(flavor = "current_thread")]
async fn the_shims_work_from_inside_a_runtime() {
    // The host's async code may call the table from a runtime thread: the shims block on a
    // channel, never on a runtime of their own.
    let mut f = Fixture::new("inside-a");
    let local = vec![0u8; 64];
    let remote = vec![3u8; 64];
    assert_eq!(f.register(addr(&local), 64, "cpu:0"), FERRY_OK);
    let target = f.open("peer", "async");
    let (code, batch) = f.submit(target, &[req(FERRY_OPCODE_READ, &local, &remote)]);
    assert_eq!(code, FERRY_OK);
    assert_eq!(f.wait(batch, 1)[0].state, FERRY_STATE_COMPLETED);
    f.free(batch);
    assert_eq!(f.unregister(addr(&local), 64), FERRY_OK);
    f.close(target);
    f.destroy();
}

/// One report: (batch, index, status, message).
type Report = (usize, usize, FerryTransferStatus, Option<String>);

/// A host's completion callback: records every report.
#[derive(Default)]
struct Reports {
    seen: Mutex<Vec<Report>>,
}

impl Reports {
    fn of(&self, batch: *mut FerryPluginBatch) -> Vec<(usize, FerryTransferStatus, Option<String>)> {
        let seen = self.seen.lock().unwrap();
        seen.iter().filter(|r| r.0 == batch as usize).map(|r| (r.1, r.2, r.3.clone())).collect()
    }

    fn wait_for(&self, batch: *mut FerryPluginBatch, n: usize) -> Vec<(usize, FerryTransferStatus, Option<String>)> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.of(batch).len() < n {
            assert!(Instant::now() < deadline, "{n} report(s) expected, got {:?}", self.of(batch));
            std::thread::sleep(Duration::from_millis(1));
        }
        self.of(batch)
    }
}

unsafe extern "C" fn report(
    ctx: *mut c_void,
    batch: *mut FerryPluginBatch,
    index: usize,
    status: *const FerryTransferStatus,
    message: *const c_char,
) {
    // SAFETY: `ctx` is the test's `Reports`, alive until the instance is destroyed; `status`
    // and `message` (null or NUL-terminated) are valid during the call (the ABI's contract).
    let (reports, status, message) = unsafe {
        (
            &*ctx.cast::<Reports>(),
            *status,
            (!message.is_null()).then(|| CStr::from_ptr(message).to_string_lossy().into_owned()),
        )
    };
    reports.seen.lock().unwrap().push((batch as usize, index, status, message));
}

impl Fixture {
    fn set_sink(&self, reports: &Reports) -> i32 {
        // SAFETY: a live instance; `reports` outlives it in every test.
        unsafe {
            (self.api.set_completion_sink.unwrap())(
                self.inst,
                Some(report),
                (reports as *const Reports).cast_mut().cast(),
            )
        }
    }
}

#[test]
fn with_the_hosts_completion_sink_every_request_is_reported_once_as_it_is_released() {
    let reports = Reports::default();
    let mut f = Fixture::new("sink-a");
    assert_eq!(f.set_sink(&reports), FERRY_OK);
    assert_eq!(f.set_sink(&reports), FERRY_E_ALREADY_EXISTS, "offered once per instance");
    let local = vec![0u8; 256];
    let remote: Vec<u8> = (0..256u32).map(|i| i as u8).collect();
    assert_eq!(f.register(addr(&local), 256, "cpu:0"), FERRY_OK);

    // A synchronous transport: both requests are reported inside `submit`, under the pointer
    // it returns.
    let copy = f.open("peer", "copy");
    let (code, batch) = f.submit(
        copy,
        &[req(FERRY_OPCODE_READ, &local[..64], &remote[..64]), req(FERRY_OPCODE_READ, &local[64..], &remote[64..])],
    );
    assert_eq!(code, FERRY_OK);
    let done = FerryTransferStatus { state: FERRY_STATE_COMPLETED, code: FERRY_OK, transferred: 64 };
    assert_eq!(reports.of(batch), [(0, done, None), (1, FerryTransferStatus { transferred: 192, ..done }, None)]);
    assert_eq!(local, remote);
    f.free(batch);

    // A failure carries its message.
    let failing = f.open("peer", "fail");
    let (code, batch) = f.submit(failing, &[req(FERRY_OPCODE_READ, &local[..8], &remote[..8])]);
    assert_eq!(code, FERRY_OK);
    let failed = reports.of(batch);
    assert_eq!(failed.len(), 1);
    assert_eq!((failed[0].1.state, failed[0].1.code), (FERRY_STATE_FAILED, FERRY_E_PEER_UNREACHABLE));
    assert_eq!(failed[0].2.as_deref(), Some("peer gone: reset by peer"));
    f.free(batch);

    // An asynchronous one: reported when the transport completes, not before.
    let (code, later) = f.try_open(r#"{"name":"peer","protocol":"shimtest","mode":"async","gate":"sink-a"}"#);
    assert_eq!(code, FERRY_OK);
    let (code, batch) = f.submit(later, &[req(FERRY_OPCODE_WRITE, &local[..16], &remote[..16])]);
    assert_eq!(code, FERRY_OK);
    std::thread::sleep(Duration::from_millis(20));
    assert!(reports.of(batch).is_empty(), "nothing is finished yet");
    OPEN_GATES.lock().unwrap().push("sink-a".into());
    assert_eq!(reports.wait_for(batch, 1)[0].1.state, FERRY_STATE_COMPLETED);
    f.free(batch);

    // A cancelled request is reported only once the transport let go of its memory.
    let hold = f.open("peer", "hold");
    let (code, batch) = f.submit(hold, &[req(FERRY_OPCODE_READ, &local[..8], &remote[..8])]);
    assert_eq!(code, FERRY_OK);
    let cancelled_at = Instant::now();
    f.cancel(batch);
    let seen = reports.wait_for(batch, 1);
    assert!(cancelled_at.elapsed() >= Duration::from_millis(35), "reported before it was released");
    assert_eq!((seen[0].1.state, seen[0].1.code), (FERRY_STATE_CANCELLED, FERRY_E_CANCELLED));
    f.free(batch);

    // A submit that fails reports nothing.
    let exploding = f.open("peer", "panic");
    let before = reports.seen.lock().unwrap().len();
    let (code, batch) = f.submit(exploding, &[req(FERRY_OPCODE_READ, &local[..8], &remote[..8])]);
    assert_eq!((code, batch), (FERRY_E_INTERNAL, std::ptr::null_mut()));
    assert_eq!(reports.seen.lock().unwrap().len(), before, "no report for a batch the host never got");

    let all = reports.seen.lock().unwrap().clone();
    assert!(all.iter().all(|r| r.2.state != FERRY_STATE_PENDING), "reports give final states");
    for t in [copy, failing, later, hold, exploding] {
        f.close(t);
    }
    assert_eq!(f.unregister(addr(&local), 256), FERRY_OK, "every request was released");
    f.destroy();
    assert_eq!(reports.seen.lock().unwrap().len(), all.len());
}

#[test]
fn without_a_completion_sink_batches_are_polled_and_nothing_is_reported() {
    // A host of ABI 1.0 never offers a sink: `poll` is the only way completions are seen.
    let f = Fixture::new("nosink-a");
    let local = vec![0u8; 32];
    let remote = vec![4u8; 32];
    assert_eq!(f.register(addr(&local), 32, "cpu:0"), FERRY_OK);
    let target = f.open("peer", "copy");
    let (code, batch) = f.submit(target, &[req(FERRY_OPCODE_READ, &local, &remote)]);
    assert_eq!(code, FERRY_OK);
    assert_eq!(f.wait(batch, 1)[0].state, FERRY_STATE_COMPLETED);
    assert_eq!(local, remote);
    f.free(batch);
    f.close(target);
}
