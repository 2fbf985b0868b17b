//! The ceiling over loopback TCP on this machine: how many bytes per second plain sockets move
//! from one process to another when nothing but the copies happens. A child process writes
//! `CHUNK`-byte buffers to each of `STREAMS` connections as fast as the kernel takes them, and
//! this process reads them with `CHUNK`-byte reads, for `SECONDS`. No request, no response, no
//! header: any transfer engine over TCP moves at most this (its requests and its own work
//! only take from it).
//!
//! ```sh
//! cargo run --release -p ferry-transport-tcp --example loopback_ceiling -- [SECONDS] [STREAMS] [CHUNK] [CONGESTION]
//! ```
//!
//! Defaults: 2 seconds, 1 stream, 1 MiB, the host's congestion control (`system`; or a name,
//! such as `reno`, which Ferry's `tcp_local_congestion` gives loopback connections by default).
//! Prints `streams N, chunk C bytes, congestion A, X.XX GB/s` (read by
//! `bench/tcp_vs_mooncake.py --ceiling`). `send STREAMS CHUNK PORT CONGESTION` is the child's
//! mode.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Gives `s` the congestion control `name` (`system`: leaves the host's default).
fn use_congestion(s: &TcpStream, name: &str) -> std::io::Result<()> {
    if name == "system" {
        return Ok(());
    }
    socket2::SockRef::from(s).set_tcp_congestion(name.as_bytes())
}

/// The host's default congestion control, or `system` where it cannot be read.
fn host_congestion() -> String {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .map_or_else(|_| "system".into(), |s| s.trim().into())
}

/// The child: `streams` connections to `port`, each written from its own thread until the
/// reader goes away (the parent kills this process once it has measured).
fn send(streams: usize, chunk: usize, port: u16, congestion: &str) -> std::io::Result<()> {
    let threads: Vec<_> = (0..streams)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port))?;
            use_congestion(&s, congestion)?;
            Ok(std::thread::spawn(move || {
                let buf = vec![7u8; chunk];
                while s.write_all(&buf).is_ok() {}
            }))
        })
        .collect::<std::io::Result<_>>()?;
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    if args.first().map(String::as_str) == Some("send") {
        let congestion = args.get(4).map_or("system", String::as_str);
        return send(arg(1, 1).max(1), arg(2, 1 << 20).max(1), arg(3, 0) as u16, congestion);
    }
    let seconds = arg(0, 2).max(1);
    let streams = arg(1, 1).max(1);
    let chunk = arg(2, 1 << 20).max(1);
    let congestion = args.get(3).cloned().unwrap_or_else(|| "system".into());
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let mut child = Command::new(std::env::current_exe()?)
        .args(["send", &streams.to_string(), &chunk.to_string(), &port.to_string(), &congestion])
        .stdin(Stdio::null())
        .spawn()?;
    let conns: Vec<TcpStream> = (0..streams).map(|_| listener.accept().map(|(s, _)| s)).collect::<Result<_, _>>()?;
    for s in &conns {
        use_congestion(s, &congestion)?;
    }
    // A short warm-up lets the kernel grow its buffers before the measured part.
    let warmup = Duration::from_millis(200);
    let measured = Duration::from_secs(seconds as u64);
    let readers: Vec<_> = conns
        .into_iter()
        .map(|mut s| {
            std::thread::spawn(move || -> std::io::Result<u64> {
                let mut buf = vec![0u8; chunk];
                let start = Instant::now();
                while start.elapsed() < warmup {
                    if s.read(&mut buf)? == 0 {
                        return Ok(0);
                    }
                }
                let (start, mut bytes) = (Instant::now(), 0u64);
                while start.elapsed() < measured {
                    match s.read(&mut buf)? {
                        0 => break,
                        n => bytes += n as u64,
                    }
                }
                Ok(bytes)
            })
        })
        .collect();
    let mut total = 0u64;
    for r in readers {
        total += r.join().map_err(|_| std::io::Error::other("a reader panicked"))??;
    }
    let _ = child.kill();
    let _ = child.wait();
    let congestion = if congestion == "system" { host_congestion() } else { congestion };
    println!(
        "streams {streams}, chunk {chunk} bytes, congestion {congestion}, {:.2} GB/s",
        total as f64 / measured.as_secs_f64() / 1e9
    );
    Ok(())
}
