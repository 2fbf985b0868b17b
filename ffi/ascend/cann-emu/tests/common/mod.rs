//! Helpers shared by the integration tests.
//!
//! The emulator reads its environment once per process, and environment variables are
//! process-global, so every test that depends on them runs its body in a child process: the
//! test re-executes its own test binary (`current_exe() --exact <test> --nocapture`) with
//! `FERRY_CANN_EMU_TEST_ROLE=<role>` and the environment it needs (set with `Command::env`
//! only, and the emulator's variables removed otherwise). Inside the child the same test
//! function sees the role and plays it. Multi-process tests talk to their children over
//! stdin/stdout lines prefixed `EMU `.

#![allow(dead_code)]

use std::ffi::{CStr, c_void};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use ferry_cann_emu::*;

/// The variable that tells a re-executed test binary which role to play.
pub(crate) const ROLE: &str = "FERRY_CANN_EMU_TEST_ROLE";

/// Variables the emulator reads; removed from every child unless the test sets them.
const EMU_VARS: &[&str] = &[
    "ASCEND_RT_VISIBLE_DEVICES",
    "FERRY_CANN_EMU_DEVICES",
    "FERRY_CANN_EMU_FAIL",
    "FERRY_CANN_EMU_DELAY_US",
    "FERRY_CANN_EMU_NO_ONESIDED",
    "FERRY_CANN_EMU_LOG",
    "HCCL_IF_IP",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
    "HCCL_INTRA_ROCE_ENABLE",
    "FERRY_CANN_EMU_MOUNTED",
    "FERRY_CANN_EMU_SOC",
    "FERRY_CANN_EMU_SUPER_POD",
    "FERRY_CANN_EMU_SUPER_DEVICE_BASE",
    "FERRY_CANN_EMU_HIXL_MAX_LINKS",
];

/// The role this process plays, if it is a child.
pub(crate) fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// A command re-running `test` of this binary as `role` with exactly `envs` of the emulator's
/// variables.
pub(crate) fn child_command(test: &str, role: &str, envs: &[(&str, &str)]) -> Command {
    let exe = std::env::current_exe().expect("current test binary");
    let mut c = Command::new(exe);
    c.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    for v in EMU_VARS {
        c.env_remove(v);
    }
    c.env(ROLE, role);
    for (k, v) in envs {
        c.env(k, v);
    }
    c
}

/// Runs a child to completion and returns its `EMU ` lines; panics (with its output) if it
/// failed or ran longer than `timeout`.
pub(crate) fn run_child(test: &str, role: &str, envs: &[(&str, &str)], timeout: Duration) -> (Vec<String>, String) {
    let mut p = Peer::spawn(test, role, envs);
    let stderr = p.finish(timeout);
    let lines = p.drain();
    (lines, stderr)
}

/// A child process driven over stdin/stdout.
pub(crate) struct Peer {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Receiver<String>,
}

impl Peer {
    /// Starts `test` as `role`.
    pub(crate) fn spawn(test: &str, role: &str, envs: &[(&str, &str)]) -> Peer {
        let mut child = child_command(test, role, envs)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn a child test process");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest may print "test name ... " on the same line first.
                if let Some(i) = line.find("EMU ") {
                    let _ = tx.send(line[i + 4..].to_string());
                }
            }
        });
        let (etx, stderr_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            let _ = etx.send(s);
        });
        Peer { name: role.to_string(), stdin: child.stdin.take(), child, lines, stderr: stderr_rx }
    }

    /// Waits for the next `EMU ` line starting with `prefix` and returns the rest.
    pub(crate) fn expect(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return rest.trim().to_string();
                    }
                }
                Err(e) => {
                    let _ = self.child.kill();
                    let err = self.stderr.recv_timeout(Duration::from_secs(5)).unwrap_or_default();
                    let why = match e {
                        mpsc::RecvTimeoutError::Timeout => format!("not within {timeout:?}"),
                        mpsc::RecvTimeoutError::Disconnected => "the child exited first".to_string(),
                    };
                    panic!("{}: no line {prefix:?} ({why}); stderr:\n{err}", self.name);
                }
            }
        }
    }

    /// Sends one line to the child's stdin.
    pub(crate) fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}").expect("write to the child");
        stdin.flush().expect("flush to the child");
    }

    /// Waits for the child to exit successfully; returns its stderr.
    pub(crate) fn finish(&mut self, timeout: Duration) -> String {
        self.stdin.take();
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("wait for the child") {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let err = self.stderr.recv_timeout(Duration::from_secs(5)).unwrap_or_default();
                panic!("{}: still running after {timeout:?}; stderr:\n{err}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = self.stderr.recv_timeout(Duration::from_secs(10)).unwrap_or_default();
        assert!(status.success(), "{} failed ({status}); stderr:\n{err}", self.name);
        err
    }

    /// Every `EMU ` line not consumed yet.
    pub(crate) fn drain(&mut self) -> Vec<String> {
        std::thread::sleep(Duration::from_millis(50));
        self.lines.try_iter().collect()
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

/// Prints a line for the parent.
pub(crate) fn say(line: &str) {
    println!("\nEMU {line}");
    std::io::stdout().flush().expect("flush stdout");
}

/// Reads the next stdin line (from the parent), trimmed.
pub(crate) fn hear() -> String {
    let mut s = String::new();
    std::io::stdin().read_line(&mut s).expect("read from the parent");
    s.trim().to_string()
}

/// Waits for the stdin line `prefix …` and returns the rest.
pub(crate) fn hear_expect(prefix: &str) -> String {
    let line = hear();
    line.strip_prefix(prefix).unwrap_or_else(|| panic!("expected {prefix:?}, got {line:?}")).trim().to_string()
}

/// This thread's recent error text (clears it).
pub(crate) fn recent_error() -> String {
    // SAFETY: the returned pointer is NULL or a NUL-terminated string valid until the next call.
    let p = unsafe { aclGetRecentErrMsg() };
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: non-null, NUL-terminated (see above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Asserts an emulator call returned 0, naming the call and the recent error text.
#[track_caller]
pub(crate) fn ok(code: i32, what: &str) {
    assert_eq!(code, 0, "{what} failed with {code}: {}", recent_error());
}

/// Two distinct free TCP ports on 127.0.0.1 (bound together, then released).
pub(crate) fn free_ports() -> (u16, u16) {
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    (a.local_addr().unwrap().port(), b.local_addr().unwrap().port())
}

/// Allocates `len` bytes of device memory on the current device.
pub(crate) fn dev_alloc(len: usize) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-parameter.
    ok(unsafe { aclrtMalloc(&mut p, len, 0) }, "aclrtMalloc");
    p
}

/// Copies `data` into device memory at `dst`.
pub(crate) fn upload(dst: *mut c_void, data: &[u8]) {
    // SAFETY: `data` is a live host buffer of `data.len()` bytes; the emulator checks `dst`.
    ok(unsafe { aclrtMemcpy(dst, data.len(), data.as_ptr().cast(), data.len(), ACL_MEMCPY_HOST_TO_DEVICE) }, "upload");
}

/// Reads `len` bytes of device memory at `src`.
pub(crate) fn download(src: *const c_void, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `out` is a live host buffer of `len` bytes; the emulator checks `src`.
    ok(unsafe { aclrtMemcpy(out.as_mut_ptr().cast(), len, src, len, ACL_MEMCPY_DEVICE_TO_HOST) }, "download");
    out
}

/// A recognisable byte pattern.
pub(crate) fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i as u32).wrapping_mul(7).wrapping_add(seed.wrapping_mul(31)) % 251) as u8).collect()
}

/// Creates a stream on the current device.
pub(crate) fn new_stream() -> AclrtStream {
    let mut s = std::ptr::null_mut();
    // SAFETY: `s` is a valid out-parameter.
    ok(unsafe { aclrtCreateStream(&mut s) }, "aclrtCreateStream");
    s
}

/// Sets the calling thread's device.
pub(crate) fn set_device(id: i32) {
    // SAFETY: no pointers.
    ok(unsafe { aclrtSetDevice(id) }, "aclrtSetDevice");
}
