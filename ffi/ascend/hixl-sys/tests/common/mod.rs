//! Helpers shared by the tests that run against Ferry's emulated HIXL.
//!
//! The emulator reads its environment once per process and keeps process-wide state (devices,
//! engines, listening sockets), so every test plays its parts in child processes: the test
//! re-executes its own binary (`current_exe() --exact <test>`) with `FERRY_HIXL_TEST_ROLE=<role>`
//! and the environment it needs; inside the child the same test function sees the role and
//! plays it. Parent and children talk over stdin/stdout lines prefixed `EMU ` (the pattern of
//! `ffi/ascend/cann-emu/tests/common`).

#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use ferry_ascend_sys::test_support::{Emulator, TempDir, emulator_lib_dir_with_hixl};

/// The variable that tells a re-executed test binary which role to play.
pub const ROLE: &str = "FERRY_HIXL_TEST_ROLE";

/// Variables that would change where libraries come from or how the emulator behaves; removed
/// from every child unless the test sets them.
const CLEARED: &[&str] = &[
    "FERRY_HIXL_API",
    "FERRY_ASCEND_LIB_DIR",
    "ASCEND_HOME_PATH",
    "ASCEND_TOOLKIT_HOME",
    "ASCEND_RT_VISIBLE_DEVICES",
    "HCCL_IF_IP",
];

/// The emulated CANN with HIXL in a fresh directory (`libascendcl.so`, `libhccl.so`,
/// `libllm_datadist.so`, `libcann_hixl.so`, `libmetadef.so`).
pub fn emu_dir() -> TempDir {
    emulator_lib_dir_with_hixl(Emulator::Current).unwrap_or_else(|e| panic!("{e}"))
}

/// The role this process plays, if it is a child.
pub fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().unwrap().port()
}

/// The bytes of pattern `seed` at offsets `start..start + len`.
pub fn pattern(seed: u8, start: usize, len: usize) -> Vec<u8> {
    (start..start + len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).rotate_left(u32::from(seed % 8)))
        .collect()
}

/// Asserts `got == want` byte for byte, naming the first difference.
pub fn assert_bytes(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: byte {i} is {:#04x}, expected {:#04x}", got[i], want[i]);
    }
}

/// A child process driven over stdin/stdout.
pub struct Peer {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Receiver<String>,
}

impl Peer {
    /// Starts `test` of this binary as `role`, with `envs` set (and [`CLEARED`] removed).
    pub fn spawn(test: &str, role: &str, envs: &[(&str, &str)]) -> Peer {
        let exe = std::env::current_exe().expect("current test binary");
        let mut c = Command::new(exe);
        c.args(["--exact", test, "--nocapture", "--test-threads=1"]);
        for (k, _) in std::env::vars() {
            if k.starts_with("FERRY_CANN_EMU") || CLEARED.contains(&k.as_str()) {
                c.env_remove(k);
            }
        }
        c.env(ROLE, role);
        for (k, v) in envs {
            c.env(k, v);
        }
        let mut child =
            c.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn a child");
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
    pub fn expect(&mut self, prefix: &str, timeout: Duration) -> String {
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
    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}").expect("write to the child");
        stdin.flush().expect("flush to the child");
    }

    /// Waits for the child to exit successfully; returns its stderr.
    pub fn finish(&mut self, timeout: Duration) -> String {
        self.stdin.take();
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("wait for the child") {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                let err = self.stderr.recv_timeout(Duration::from_secs(5)).unwrap_or_default();
                panic!("{}: still running after {timeout:?}; stderr:\n{err}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = self.stderr.recv_timeout(Duration::from_secs(10)).unwrap_or_default();
        assert!(status.success(), "{} failed ({status}); stderr:\n{err}", self.name);
        err
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

/// Runs `test` as `role` to completion and returns its `EMU ` lines starting with `prefix`.
pub fn run_child(test: &str, role: &str, envs: &[(&str, &str)], prefix: &str) -> String {
    let mut p = Peer::spawn(test, role, envs);
    let line = p.expect(prefix, Duration::from_secs(60));
    p.finish(Duration::from_secs(60));
    line
}

/// Prints a line for the parent.
pub fn say(line: &str) {
    println!("\nEMU {line}");
    std::io::stdout().flush().expect("flush stdout");
}

/// Waits for the stdin line `prefix …` from the parent and returns the rest.
pub fn hear(prefix: &str) -> String {
    let mut s = String::new();
    std::io::stdin().read_line(&mut s).expect("read from the parent");
    let line = s.trim();
    line.strip_prefix(prefix).unwrap_or_else(|| panic!("expected {prefix:?}, got {line:?}")).trim().to_string()
}

/// This process's environment variable `k` (set by the parent).
pub fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("the parent sets {k}"))
}
