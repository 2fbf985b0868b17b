//! The floor under one TCP request at a time: a blocking std socket ping-pong, 24 bytes out (a
//! request header) and 4 KiB back (a block), over loopback, between this process and a child
//! process serving it (target and initiator are separate processes in `ferry bench` too). Every
//! round trip wakes the server and then the client, as one request of a transfer engine must at
//! least; nothing else happens.
//!
//! ```sh
//! cargo run --release -p ferry-transport-tcp --example pingpong_floor -- [ROUND_TRIPS] [RESPONSE_BYTES]
//! ```
//!
//! Prints `round trips N, response B bytes, p50 X us, p99 Y us, Z ops/s` (the same `p50 ... us`
//! form as `ferry bench`, for `bench/tcp_vs_mooncake.py --floor`). `serve BYTES` is the child's
//! mode: it prints its port and answers every 24 bytes with BYTES bytes.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const REQUEST: usize = 24;

fn serve(response: usize) -> std::io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    let (mut s, _) = listener.accept()?;
    s.set_nodelay(true)?;
    let (mut req, out) = ([0u8; REQUEST], vec![7u8; response]);
    while s.read_exact(&mut req).is_ok() {
        s.write_all(&out)?;
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        return serve(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4096));
    }
    let rounds: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(20_000).max(1);
    let response: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4096);
    let mut child =
        Command::new(std::env::current_exe()?).args(["serve", &response.to_string()]).stdout(Stdio::piped()).spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    let port: u16 = line
        .trim()
        .strip_prefix("port ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("the server said {line:?}")))?;
    let mut c = TcpStream::connect(("127.0.0.1", port))?;
    c.set_nodelay(true)?;
    let (req, mut back) = ([1u8; REQUEST], vec![0u8; response]);
    let warmup = (rounds / 10).max(100);
    let mut times = Vec::with_capacity(rounds);
    for i in 0..warmup + rounds {
        let t = Instant::now();
        c.write_all(&req)?;
        c.read_exact(&mut back)?;
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
        "round trips {rounds}, response {response} bytes, p50 {:.1} us, p99 {:.1} us, {:.0} ops/s",
        at(0.50),
        at(0.99),
        rounds as f64 / total.as_secs_f64()
    );
    Ok(())
}
