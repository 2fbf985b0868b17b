//! The floor under one TCP request at a time: a std socket ping-pong, 24 bytes out (a request
//! header) and 4 KiB back (a block), over loopback, between this process and a child process
//! serving it (target and initiator are separate processes in `ferry bench` too).
//!
//! Two modes:
//! - `blocking` (the default): blocking sockets and one buffer on each side. Every round trip
//!   wakes the server and then the client, as one request of a transfer engine that sleeps
//!   between requests must at least.
//! - `polling`: non-blocking sockets that both sides poll without ever sleeping, each round trip
//!   to the next block of a 256 MiB buffer on both sides, as `ferry bench --access=rotate`
//!   moves its blocks (`polling same`: one block on each side, reused, as `ferry bench
//!   --access=same` and Mooncake's bench move theirs). No wake-up, no protocol, no bookkeeping:
//!   what one request at a time can reach at most here, copies included. An engine's batch-1
//!   one-thread rate is bounded by it.
//!
//! ```sh
//! cargo run --release -p ferry-transport-tcp --example pingpong_floor -- [ROUND_TRIPS] [RESPONSE_BYTES] [blocking|polling [rotate|same [CONGESTION]]]
//! ```
//!
//! `CONGESTION`: the sockets' TCP congestion control, `system` (the host's, the default) or a
//! name such as `reno` (what Ferry's `tcp_local_congestion` gives loopback connections).
//!
//! Prints `round trips N, response B bytes, MODE, p50 X us, p99 Y us, Z ops/s` (the same
//! `p50 ... us` form as `ferry bench`, for `bench/tcp_vs_mooncake.py --floor`). `serve BYTES
//! MODE ACCESS CONGESTION` is the child's mode: it prints its port and answers every 24 bytes with BYTES bytes.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const REQUEST: usize = 24;
/// The buffer each side's blocks rotate through in `polling` mode.
const ROTATE_OVER: usize = 256 << 20;

/// Fills `buf` from `s`, polling a non-blocking socket without sleeping. False at end of stream.
fn read_polling(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut at = 0;
    while at < buf.len() {
        match s.read(&mut buf[at..]) {
            Ok(0) => return Ok(false),
            Ok(n) => at += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Writes all of `buf` to a non-blocking `s`, polling without sleeping.
fn write_polling(s: &mut TcpStream, buf: &[u8]) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        match s.write(&buf[at..]) {
            Ok(n) => at += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The blocks of a buffer of `ROTATE_OVER` (at least one block), in turn; or one block, again
/// and again.
struct Rotation {
    buf: Vec<u8>,
    block: usize,
    next: usize,
}

impl Rotation {
    /// `fill` is not zero: every page is touched up front (no first-touch faults measured).
    fn new(block: usize, fill: u8, rotate: bool) -> Self {
        Self { buf: vec![fill; if rotate { ROTATE_OVER.max(block) } else { block }], block, next: 0 }
    }

    fn next_block(&mut self) -> &mut [u8] {
        if self.next + self.block > self.buf.len() {
            self.next = 0;
        }
        let at = self.next;
        self.next += self.block;
        &mut self.buf[at..at + self.block]
    }
}

/// Gives `s` the congestion control `name` (`system`: leaves the host's default).
fn use_congestion(s: &TcpStream, name: &str) -> std::io::Result<()> {
    if name == "system" {
        return Ok(());
    }
    socket2::SockRef::from(s).set_tcp_congestion(name.as_bytes())
}

fn serve(response: usize, polling: bool, rotate: bool, congestion: &str) -> std::io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    let (mut s, _) = listener.accept()?;
    s.set_nodelay(true)?;
    use_congestion(&s, congestion)?;
    let mut req = [0u8; REQUEST];
    if polling {
        s.set_nonblocking(true)?;
        let mut blocks = Rotation::new(response, 7, rotate);
        while read_polling(&mut s, &mut req)? {
            write_polling(&mut s, blocks.next_block())?;
        }
    } else {
        let out = vec![7u8; response];
        while s.read_exact(&mut req).is_ok() {
            s.write_all(&out)?;
        }
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let polling_arg = |i: usize| match args.get(i).map(String::as_str) {
        None | Some("blocking") => Ok(false),
        Some("polling") => Ok(true),
        Some(other) => Err(std::io::Error::other(format!("mode {other:?}: blocking or polling"))),
    };
    let rotate_arg = |i: usize| match args.get(i).map(String::as_str) {
        None | Some("rotate") => Ok(true),
        Some("same") => Ok(false),
        Some(other) => Err(std::io::Error::other(format!("access {other:?}: rotate or same"))),
    };
    if args.first().map(String::as_str) == Some("serve") {
        let congestion = args.get(4).map_or("system", String::as_str);
        return serve(
            args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4096),
            polling_arg(2)?,
            rotate_arg(3)?,
            congestion,
        );
    }
    let rounds: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(20_000).max(1);
    let response: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4096).max(1);
    let polling = polling_arg(2)?;
    let rotate = rotate_arg(3)?;
    let mode = if polling { "polling" } else { "blocking" };
    let access = if rotate { "rotate" } else { "same" };
    let congestion = args.get(4).map_or("system", String::as_str);
    let mut child = Command::new(std::env::current_exe()?)
        .args(["serve", &response.to_string(), mode, access, congestion])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    let port: u16 = line
        .trim()
        .strip_prefix("port ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("the server said {line:?}")))?;
    let mut c = TcpStream::connect(("127.0.0.1", port))?;
    c.set_nodelay(true)?;
    use_congestion(&c, congestion)?;
    c.set_nonblocking(polling)?;
    let req = [1u8; REQUEST];
    // Blocking: one buffer, as this floor always measured; polling: rotating blocks (or one).
    let (mut blocks, mut back) =
        if polling { (Some(Rotation::new(response, 1, rotate)), Vec::new()) } else { (None, vec![0u8; response]) };
    let warmup = (rounds / 10).max(100);
    let mut times = Vec::with_capacity(rounds);
    for i in 0..warmup + rounds {
        let t = Instant::now();
        if let Some(blocks) = blocks.as_mut() {
            write_polling(&mut c, &req)?;
            if !read_polling(&mut c, blocks.next_block())? {
                return Err(ErrorKind::UnexpectedEof.into());
            }
        } else {
            c.write_all(&req)?;
            c.read_exact(&mut back)?;
        }
        if i >= warmup {
            times.push(t.elapsed());
        }
    }
    drop(c);
    child.wait()?;
    let total: Duration = times.iter().sum();
    times.sort_unstable();
    let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    println!(
        "round trips {rounds}, response {response} bytes, {mode}{}, p50 {:.1} us, p99 {:.1} us, {:.0} ops/s",
        if polling { format!(" {access}") } else { String::new() },
        at(0.50),
        at(0.99),
        rounds as f64 / total.as_secs_f64()
    );
    Ok(())
}
