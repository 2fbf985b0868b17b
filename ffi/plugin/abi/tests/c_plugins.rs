//! The C plugins under `ffi/plugin/examples/c` are compiled against `ffi/include/ferry_abi.h` with the
//! system C compiler (warnings are errors), loaded with `dlopen`, and checked: the working
//! `memcpy_plugin.c` end to end through its table, polled and with the completion callback of
//! ABI 1.1, the broken ones for exactly the defect each is meant to show the loader. The
//! plugins that build against the ABI 1.0 header too (`ffi/plugin/examples/c/abi-1.0`) are checked to
//! have the 1.0 table then.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, Result, ensure};
use ferry_abi::*;
use libloading::Library;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../..")
}

/// Compiles `ffi/plugin/examples/c/<name>.c` three ways (strict C11, C99 as the host's tests build it,
/// and the plain flags docs/plugins.md gives) and returns the path of the strict build, named
/// as the host expects.
fn compile(name: &str, protocol: &str) -> Result<PathBuf> {
    compile_with(name, protocol, &repo().join("ffi/include"), &[])
}

/// [`compile`] against the header in `include`, with `extra` compiler arguments.
fn compile_with(name: &str, protocol: &str, include: &Path, extra: &[String]) -> Result<PathBuf> {
    static BUILDS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let build = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ferry-c-plugins-{}-{build}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let source = repo().join(format!("ffi/plugin/examples/c/{name}.c"));
    let strict = dir.join(format!("{FERRY_PLUGIN_FILE_PREFIX}{protocol}.so"));
    let builds: [(&[&str], PathBuf); 3] = [
        (&["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic"], strict.clone()),
        (&["-std=c99", "-Wall", "-Werror", "-O2"], dir.join("c99.so")),
        (&["-Wall", "-Werror"], dir.join("plain.so")),
    ];
    for (flags, output) in builds {
        let out = Command::new("cc")
            .args(["-shared", "-fPIC"])
            .args(flags)
            .args(extra)
            .arg("-I")
            .arg(include)
            .arg("-o")
            .arg(&output)
            .arg(&source)
            .output()
            .context("running the C compiler `cc`")?;
        ensure!(
            out.status.success(),
            "{} does not compile with {flags:?}:\n{}",
            source.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(strict)
}

/// Symbols the library defines in its dynamic symbol table (`nm -D --defined-only`).
fn exported(lib: &Path) -> Result<Vec<String>> {
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(lib).output().context("running `nm`")?;
    ensure!(out.status.success(), "nm failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?.lines().filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned)).collect())
}

fn open(path: &Path) -> Result<Library> {
    // SAFETY: the libraries are this repository's test plugins; loading them runs no
    // initialisers beyond the C runtime's.
    unsafe { Library::new(path) }.with_context(|| format!("dlopen {}", path.display()))
}

fn table(lib: &Library) -> Result<&'static FerryPluginApi> {
    // SAFETY: the symbol has type `FerryPluginEntryFn` in every plugin.
    let entry = unsafe { lib.get::<FerryPluginEntryFn>(FERRY_PLUGIN_ENTRY_SYMBOL.as_bytes()) }?;
    // SAFETY: calling the entry with the host's version; it returns a static table or null.
    let api = unsafe { entry(FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR) };
    ensure!(!api.is_null(), "the entry returned null");
    // SAFETY: non-null pointers from the entry point to a static table that lives as long as
    // the library, which the tests keep loaded (they leak it, as the host does).
    Ok(unsafe { &*api })
}

unsafe extern "C" fn record(ctx: *mut c_void, level: u32, message: *const c_char) {
    // SAFETY: `ctx` is the test's `Mutex<Vec<..>>`, alive while instances exist; `message` is
    // valid during the call.
    let (lines, message) = unsafe { (&*ctx.cast::<Mutex<Vec<(u32, String)>>>(), CStr::from_ptr(message)) };
    lines.lock().unwrap().push((level, message.to_string_lossy().into_owned()));
}

unsafe extern "C" fn collect_field(ctx: *mut c_void, key: *const c_char, value: *const c_char) {
    // SAFETY: `ctx` is the map passed to `publish` for this call; both strings are valid.
    unsafe {
        let fields = &mut *ctx.cast::<BTreeMap<String, String>>();
        fields.insert(
            CStr::from_ptr(key).to_string_lossy().into_owned(),
            CStr::from_ptr(value).to_string_lossy().into_owned(),
        );
    }
}

/// One instance of the C plugin, called through its table.
struct Instance<'a> {
    api: &'a FerryPluginApi,
    inst: *mut FerryPluginInstance,
}

impl<'a> Instance<'a> {
    fn create(api: &'a FerryPluginApi, host: &FerryHostServices, name: &str) -> std::result::Result<Self, i32> {
        let name = CString::new(name).unwrap();
        let mut inst = std::ptr::null_mut();
        // SAFETY: valid pointers; `host` outlives the instance in every test.
        let code = unsafe { (api.create.unwrap())(host, name.as_ptr(), c"{}".as_ptr(), &mut inst) };
        if code == FERRY_OK { Ok(Self { api, inst }) } else { Err(code) }
    }

    fn register(&self, buf: &[u8], location: &CStr) -> i32 {
        // SAFETY: a live instance; the tests keep registered buffers alive.
        unsafe {
            (self.api.register_memory.unwrap())(self.inst, buf.as_ptr() as u64, buf.len() as u64, location.as_ptr())
        }
    }

    fn unregister(&self, buf: &[u8]) -> i32 {
        // SAFETY: a live instance.
        unsafe { (self.api.unregister_memory.unwrap())(self.inst, buf.as_ptr() as u64, buf.len() as u64) }
    }

    fn publish(&self) -> BTreeMap<String, String> {
        let mut fields = BTreeMap::new();
        // SAFETY: a live instance; `fields` matches `collect_field` and outlives the call.
        let code = unsafe {
            (self.api.publish.unwrap())(
                self.inst,
                c"{\"name\":\"x\",\"protocol\":\"cmemcpy\"}".as_ptr(),
                Some(collect_field),
                (&mut fields as *mut BTreeMap<String, String>).cast(),
            )
        };
        assert_eq!(code, FERRY_OK);
        fields
    }

    fn open(&self, descriptor: &str) -> std::result::Result<*mut FerryPluginTarget, i32> {
        let text = CString::new(descriptor).unwrap();
        let mut target = std::ptr::null_mut();
        // SAFETY: a live instance, valid string and out pointer.
        let code = unsafe { (self.api.open_target.unwrap())(self.inst, text.as_ptr(), &mut target) };
        if code == FERRY_OK { Ok(target) } else { Err(code) }
    }

    /// Submits `requests`, polls once, reads each error text, frees the batch.
    fn transfer(
        &self,
        target: *mut FerryPluginTarget,
        requests: &[FerryTransferRequest],
    ) -> std::result::Result<Vec<(FerryTransferStatus, String)>, i32> {
        let mut batch = std::ptr::null_mut();
        // SAFETY: a live instance and target, a valid slice and out pointer.
        let code =
            unsafe { (self.api.submit.unwrap())(self.inst, target, requests.as_ptr(), requests.len(), &mut batch) };
        if code != FERRY_OK {
            return Err(code);
        }
        let mut statuses = vec![FerryTransferStatus::default(); requests.len()];
        // SAFETY: a live batch; the buffers have the sizes given; the batch is freed once.
        unsafe {
            assert_eq!(
                (self.api.poll.unwrap())(self.inst, batch, statuses.as_mut_ptr(), statuses.len() + 1),
                FERRY_E_INVALID_ARGUMENT,
                "count must match"
            );
            assert_eq!((self.api.poll.unwrap())(self.inst, batch, statuses.as_mut_ptr(), statuses.len()), 0);
            (self.api.cancel.unwrap())(self.inst, batch);
            let mut out = Vec::new();
            for (i, status) in statuses.iter().enumerate() {
                let mut text = [0u8; 200];
                let len = (self.api.batch_error.unwrap())(self.inst, batch, i, text.as_mut_ptr().cast(), text.len());
                let text = CStr::from_bytes_until_nul(&text).unwrap().to_str().unwrap().to_owned();
                assert_eq!(len, text.len());
                out.push((*status, text));
            }
            (self.api.free_batch.unwrap())(self.inst, batch);
            Ok(out)
        }
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

fn read(local: &[u8], remote: &[u8], len: usize) -> FerryTransferRequest {
    FerryTransferRequest {
        opcode: FERRY_OPCODE_READ,
        flags: 0,
        target: 0,
        local_addr: local.as_ptr() as u64,
        remote_addr: remote.as_ptr() as u64,
        length: len as u64,
    }
}

const COMPLETED: i32 = FERRY_STATE_COMPLETED;
const FAILED: i32 = FERRY_STATE_FAILED;

#[test]
fn the_c_memcpy_plugin_works_end_to_end() -> Result<()> {
    let path = compile("memcpy_plugin", "cmemcpy")?;
    assert_eq!(exported(&path)?, [FERRY_PLUGIN_ENTRY_SYMBOL], "only the entry point is exported");
    let lib = open(&path)?;
    let api = table(&lib)?;
    assert_eq!(api.struct_size, FERRY_PLUGIN_API_V1_1_SIZE);
    assert_eq!((api.abi_major, api.abi_minor), (FERRY_PLUGIN_ABI_MAJOR, 1));
    assert!(api.set_completion_sink.is_some(), "built against ABI 1.1: takes the completion callback");
    // Not offered one here: the plugin is polled, as by a host of ABI 1.0.
    // SAFETY: a static NUL-terminated string.
    assert_eq!(unsafe { CStr::from_ptr(api.protocol) }, c"cmemcpy");
    assert_eq!(api.capabilities, FERRY_CAP_READ | FERRY_CAP_WRITE | FERRY_CAP_HOST_MEMORY);
    // SAFETY: the entry may be called again; another major version gets null.
    let entry = unsafe { lib.get::<FerryPluginEntryFn>(FERRY_PLUGIN_ENTRY_SYMBOL.as_bytes()) }?;
    // SAFETY: as above.
    assert!(unsafe { entry(FERRY_PLUGIN_ABI_MAJOR + 1, 0) }.is_null());

    let lines = Mutex::new(Vec::<(u32, String)>::new());
    let host = FerryHostServices {
        struct_size: std::mem::size_of::<FerryHostServices>() as u64,
        abi_major: FERRY_PLUGIN_ABI_MAJOR,
        abi_minor: FERRY_PLUGIN_ABI_MINOR,
        ctx: (&lines as *const Mutex<Vec<(u32, String)>>).cast_mut().cast(),
        log: Some(record),
    };
    let a = Instance::create(api, &host, "c-a").map_err(|c| anyhow::anyhow!("create: {c}"))?;
    // The peer's name needs JSON escapes to be matched: `café "b"`.
    let b = Instance::create(api, &host, "café \"b\"").map_err(|c| anyhow::anyhow!("create: {c}"))?;
    assert_eq!(Instance::create(api, &host, "c-a").err(), Some(FERRY_E_ALREADY_EXISTS));
    assert!(lines.lock().unwrap().iter().any(|(l, m)| *l == FERRY_LOG_INFO && m.contains("segment `c-a`")));

    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let dst = vec![0u8; 4096];
    let extra = vec![1u8; 64];
    assert_eq!(a.register(&dst, c"cpu:0"), FERRY_OK);
    assert_eq!(b.register(&src, c"*"), FERRY_OK);
    assert_eq!(b.register(&extra, c"cpu:1"), FERRY_OK);
    assert_eq!(b.register(&src[100..200], c"cpu:0"), FERRY_E_ALREADY_EXISTS);
    assert_eq!(b.register(&src[..0], c"cpu:0"), FERRY_E_INVALID_ARGUMENT);
    assert_eq!(b.register(&dst, c"npu:0"), FERRY_E_UNSUPPORTED);
    assert_eq!(b.unregister(&extra[..32]), FERRY_E_INVALID_ARGUMENT, "wrong length");

    let published = b.publish();
    let id = published.get("cmemcpy_instance").context("publish adds cmemcpy_instance")?.clone();
    assert!(id.parse::<u64>().is_ok(), "a JSON number: {id}");
    // Fields around the name exercise the reader: nesting, escaped quotes and brackets.
    let descriptor = format!(
        r#" {{ "buffers": [{{"addr": 1, "length": 2, "name": "cpu:0"}}, []], "note": "a \"quoted\" }} ] text\\",
             "protocol": "cmemcpy", "ok": true, "none": null, "n": -1.5e3,
             "name": "caf\u00e9 \"b\"", "cmemcpy_instance": {id} }} "#
    );
    let target = a.open(&descriptor).map_err(|c| anyhow::anyhow!("open_target: {c}"))?;
    for bad in [
        "{",
        "[]",
        r#"{"name": "x"}"#,
        r#"{"name": "x", "protocol": "cmemcpy"} trailing"#,
        r#"{"name":"\ud800","protocol":"cmemcpy"}"#,
    ] {
        assert_eq!(a.open(bad).err(), Some(FERRY_E_INVALID_ARGUMENT), "{bad}");
    }
    assert_eq!(a.open(r#"{"name":"x","protocol":"tcp"}"#).err(), Some(FERRY_E_UNSUPPORTED));

    let results = a
        .transfer(
            target,
            &[
                read(&dst, &src, 4096),
                FerryTransferRequest { opcode: FERRY_OPCODE_WRITE, ..read(&dst[..8], &extra, 8) },
            ],
        )
        .map_err(|c| anyhow::anyhow!("submit: {c}"))?;
    assert_eq!(results[0].0, FerryTransferStatus { state: COMPLETED, code: FERRY_OK, transferred: 4096 });
    assert_eq!(results[1].0.state, COMPLETED);
    assert_eq!(dst, src);
    assert_eq!(extra[..8], src[..8], "the write landed");
    assert_eq!(results[0].1, "", "no error text for a completed request");

    // Bad requests start nothing.
    assert_eq!(a.transfer(target, &[]).err(), Some(FERRY_E_INVALID_ARGUMENT));
    assert_eq!(
        a.transfer(target, &[FerryTransferRequest { opcode: 9, ..read(&dst, &src, 8) }]).err(),
        Some(FERRY_E_INVALID_ARGUMENT)
    );
    assert_eq!(
        a.transfer(target, &[FerryTransferRequest { flags: 1, ..read(&dst, &src, 8) }]).err(),
        Some(FERRY_E_INVALID_ARGUMENT)
    );

    // Ranges outside what either side registered fail, with a message.
    assert_eq!(b.unregister(&extra), FERRY_OK);
    let results = a
        .transfer(target, &[read(&dst, &extra, 64), read(&dst[4000..], &src, 200), read(&dst, &src, 64)])
        .map_err(|c| anyhow::anyhow!("submit: {c}"))?;
    assert_eq!((results[0].0.state, results[0].0.code), (FAILED, FERRY_E_OUT_OF_BOUNDS));
    assert!(results[0].1.contains("remote range") && results[0].1.contains("café"), "{}", results[0].1);
    assert_eq!((results[1].0.state, results[1].0.code), (FAILED, FERRY_E_OUT_OF_BOUNDS));
    assert!(results[1].1.starts_with("local range"), "{}", results[1].1);
    assert_eq!(results[2].0.state, COMPLETED, "one bad request does not fail the others");

    // The peer goes away, or comes back as another instance: unreachable.
    b.destroy();
    let results = a.transfer(target, &[read(&dst, &src, 8)]).map_err(|c| anyhow::anyhow!("submit: {c}"))?;
    assert_eq!((results[0].0.state, results[0].0.code), (FAILED, FERRY_E_PEER_UNREACHABLE));
    let b2 = Instance::create(api, &host, "café \"b\"").map_err(|c| anyhow::anyhow!("create: {c}"))?;
    assert_eq!(b2.register(&src, c"cpu:0"), FERRY_OK);
    let results = a.transfer(target, &[read(&dst, &src, 8)]).map_err(|c| anyhow::anyhow!("submit: {c}"))?;
    assert_eq!(results[0].0.code, FERRY_E_PEER_UNREACHABLE);
    assert!(results[0].1.contains("restarted"), "{}", results[0].1);
    a.close(target);

    // After shutdown an instance refuses work.
    let own = a.open(r#"{"name":"c-a","protocol":"cmemcpy"}"#).map_err(|c| anyhow::anyhow!("{c}"))?;
    // SAFETY: a live instance.
    unsafe { (api.shutdown.unwrap())(a.inst) };
    assert_eq!(a.transfer(own, &[read(&dst, &dst, 8)]).err(), Some(FERRY_E_SHUTDOWN));
    a.close(own);
    // SAFETY: shut down above; destroyed once.
    unsafe { (api.destroy.unwrap())(a.inst) };
    b2.destroy();
    std::mem::forget(lib); // a host never unloads a plugin
    Ok(())
}

#[test]
fn the_c_plugin_reads_only_what_the_host_struct_covers() -> Result<()> {
    let lib = open(&compile("memcpy_plugin", "cmemcpy")?)?;
    let api = table(&lib)?;
    let lines = Mutex::new(Vec::<(u32, String)>::new());
    let host = FerryHostServices {
        // An older, shorter host struct: the callback lies past its end.
        struct_size: std::mem::offset_of!(FerryHostServices, ctx) as u64,
        abi_major: FERRY_PLUGIN_ABI_MAJOR,
        abi_minor: 0,
        ctx: (&lines as *const Mutex<Vec<(u32, String)>>).cast_mut().cast(),
        log: Some(record),
    };
    let inst = Instance::create(api, &host, "c-short").map_err(|c| anyhow::anyhow!("create: {c}"))?;
    inst.destroy();
    assert!(lines.lock().unwrap().is_empty());
    let other = FerryHostServices { abi_major: FERRY_PLUGIN_ABI_MAJOR + 1, ..host };
    assert_eq!(Instance::create(api, &other, "c-other").err(), Some(FERRY_E_INVALID_ARGUMENT));
    std::mem::forget(lib);
    Ok(())
}

#[test]
fn the_broken_c_plugins_have_exactly_their_defect() -> Result<()> {
    let wrong = compile("wrong_major", "wrongmajor")?;
    let lib = open(&wrong)?;
    let api = table(&lib)?;
    assert_eq!(api.abi_major, FERRY_PLUGIN_ABI_MAJOR + 1);
    assert_eq!(api.struct_size, FERRY_PLUGIN_API_V1_1_SIZE, "only the major version is wrong");
    assert!(api.create.is_some() && api.free_batch.is_some());
    std::mem::forget(lib);

    let small = compile("small_struct", "smallstruct")?;
    let lib = open(&small)?;
    let api = table(&lib)?;
    assert_eq!(api.struct_size, 24);
    assert!(api.struct_size < FERRY_PLUGIN_API_V1_0_SIZE);
    assert_eq!(api.abi_major, FERRY_PLUGIN_ABI_MAJOR);
    // SAFETY: `protocol` lies within the 24 declared bytes and points to a static string.
    assert_eq!(unsafe { CStr::from_ptr(api.protocol) }, c"smallstruct");
    std::mem::forget(lib);

    let none = compile("no_entry", "noentry")?;
    assert!(!exported(&none)?.iter().any(|s| s == FERRY_PLUGIN_ENTRY_SYMBOL));
    let lib = open(&none)?;
    // SAFETY: only looked up, never called.
    let missing = unsafe { lib.get::<FerryPluginEntryFn>(FERRY_PLUGIN_ENTRY_SYMBOL.as_bytes()) };
    assert!(missing.is_err(), "no entry symbol");
    std::mem::forget(lib);
    Ok(())
}

/// What a host's completion callback received: (batch, index, status, message).
type Reported = Mutex<Vec<(usize, usize, FerryTransferStatus, Option<String>)>>;

unsafe extern "C" fn report(
    ctx: *mut c_void,
    batch: *mut FerryPluginBatch,
    index: usize,
    status: *const FerryTransferStatus,
    message: *const c_char,
) {
    // SAFETY: `ctx` is the test's `Reported`, alive until the instance is destroyed; `status`
    // and `message` (null or NUL-terminated) are valid during the call.
    let (reported, status, message) = unsafe {
        (
            &*ctx.cast::<Reported>(),
            *status,
            (!message.is_null()).then(|| CStr::from_ptr(message).to_string_lossy().into_owned()),
        )
    };
    reported.lock().unwrap().push((batch as usize, index, status, message));
}

#[test]
fn the_c_memcpy_plugin_reports_every_request_through_the_completion_callback() -> Result<()> {
    let lib = open(&compile("memcpy_plugin", "cmemcpy")?)?;
    let api = table(&lib)?;
    let set_sink = api.set_completion_sink.context("the ABI 1.1 build has set_completion_sink")?;
    let host = FerryHostServices {
        struct_size: std::mem::size_of::<FerryHostServices>() as u64,
        abi_major: FERRY_PLUGIN_ABI_MAJOR,
        abi_minor: FERRY_PLUGIN_ABI_MINOR,
        ctx: std::ptr::null_mut(),
        log: None,
    };
    let a = Instance::create(api, &host, "cb-a").map_err(|c| anyhow::anyhow!("create: {c}"))?;
    let b = Instance::create(api, &host, "cb-b").map_err(|c| anyhow::anyhow!("create: {c}"))?;
    let reported = Reported::default();
    let ctx = (&reported as *const Reported).cast_mut().cast();
    // SAFETY: a live instance, right after create; `reported` outlives it.
    unsafe {
        assert_eq!(set_sink(a.inst, None, ctx), FERRY_E_INVALID_ARGUMENT);
        assert_eq!(set_sink(a.inst, Some(report), ctx), FERRY_OK);
    }
    let src: Vec<u8> = (0..256u32).map(|i| i as u8).collect();
    let dst = vec![0u8; 256];
    assert_eq!(a.register(&dst, c"cpu:0"), FERRY_OK);
    assert_eq!(b.register(&src[..128], c"cpu:0"), FERRY_OK);
    let id = b.publish()["cmemcpy_instance"].clone();
    let target = a
        .open(&format!(r#"{{"name":"cb-b","protocol":"cmemcpy","cmemcpy_instance":{id}}}"#))
        .map_err(|c| anyhow::anyhow!("open_target: {c}"))?;
    let requests = [read(&dst[..128], &src[..128], 128), read(&dst[128..], &src[128..], 128)];
    let mut batch = std::ptr::null_mut();
    // SAFETY: a live instance and target, a valid slice and out pointer.
    let code = unsafe { (api.submit.unwrap())(a.inst, target, requests.as_ptr(), requests.len(), &mut batch) };
    assert_eq!(code, FERRY_OK);
    // Both were reported before submit returned, under the pointer it returned.
    let seen = reported.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|r| r.0 == batch as usize));
    assert_eq!(
        (seen[0].1, seen[0].2, seen[0].3.as_deref()),
        (0, FerryTransferStatus { state: COMPLETED, code: FERRY_OK, transferred: 128 }, None)
    );
    assert_eq!(dst[..128], src[..128]);
    assert_eq!((seen[1].1, seen[1].2.state, seen[1].2.code), (1, FAILED, FERRY_E_OUT_OF_BOUNDS));
    assert!(seen[1].3.as_deref().is_some_and(|m| m.starts_with("remote range")), "{:?}", seen[1].3);
    // SAFETY: every request was reported: the batch is freed once; then the rest is torn down.
    unsafe { (api.free_batch.unwrap())(a.inst, batch) };
    a.close(target);
    a.destroy();
    b.destroy();
    assert_eq!(reported.lock().unwrap().len(), 2, "nothing more was reported");
    std::mem::forget(lib);
    Ok(())
}

/// `struct_size`, `abi_major`, `abi_minor` and `protocol` of a table: the fields every 1.x
/// table has, read without assuming the table is as long as this crate's.
fn table_head(lib: &Library) -> Result<(u64, u32, u32, String)> {
    // SAFETY: the symbol has type `FerryPluginEntryFn` in every plugin.
    let entry = unsafe { lib.get::<FerryPluginEntryFn>(FERRY_PLUGIN_ENTRY_SYMBOL.as_bytes()) }?;
    // SAFETY: calling the entry with the host's version; it returns a static table or null.
    let api = unsafe { entry(FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR) };
    ensure!(!api.is_null(), "the entry returned null");
    // SAFETY: a table of any 1.x minor starts with these fields (the first 24 bytes), and its
    // `protocol` is a static NUL-terminated string.
    Ok(unsafe {
        (
            (&raw const (*api).struct_size).read(),
            (&raw const (*api).abi_major).read(),
            (&raw const (*api).abi_minor).read(),
            CStr::from_ptr((&raw const (*api).protocol).read()).to_string_lossy().into_owned(),
        )
    })
}

#[test]
fn c_plugins_built_against_the_abi_1_0_header_have_the_1_0_table() -> Result<()> {
    let old = repo().join("ffi/plugin/examples/c/abi-1.0");
    for (name, protocol) in [("memcpy_plugin", "oldmemcpy"), ("lingering", "oldlinger")] {
        let path = compile_with(name, protocol, &old, &[format!("-DPROTOCOL=\"{protocol}\"")])?;
        let lib = open(&path)?;
        let (size, major, minor, declared) = table_head(&lib)?;
        assert_eq!((size, major, minor), (FERRY_PLUGIN_API_V1_0_SIZE, FERRY_PLUGIN_ABI_MAJOR, 0), "{name}");
        assert_eq!(declared, protocol);
        std::mem::forget(lib);
        // The same source against the current header has the 1.1 table.
        let lib = open(&compile_with(name, protocol, &repo().join("ffi/include"), &[])?)?;
        let (size, _, minor, _) = table_head(&lib)?;
        assert_eq!((size, minor), (FERRY_PLUGIN_API_V1_1_SIZE, FERRY_PLUGIN_ABI_MINOR), "{name}");
        std::mem::forget(lib);
    }
    Ok(())
}
