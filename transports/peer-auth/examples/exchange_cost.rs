//! What the exchange adds to a connection's setup, over loopback: the time to connect alone,
//! and to connect and run the exchange, each the median of many connections.
//!
//! ```text
//! cargo run --release -p ferry-peer-auth --example exchange_cost [-- CONNECTIONS]
//! ```

use std::time::{Duration, Instant};

use ferry_peer_auth::{PeerSecret, SecretSource, initiate, respond};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

const CONTEXT: &[u8] = b"ferry tcp data";

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::io::Result<()> {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2000);
    let secret = PeerSecret::new(b"exchange-cost secret 0123456789", SecretSource::Api).expect("a valid secret");
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server_secret = secret.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let secret = server_secret.clone();
            tokio::spawn(async move {
                let _ = s.set_nodelay(true);
                // The first byte says whether this connection authenticates.
                let mut mode = [0u8; 1];
                if s.read_exact(&mut mode).await.is_err() {
                    return;
                }
                if mode[0] == 1 {
                    let _ =
                        respond(&mut s, &secret, CONTEXT, tokio::time::Instant::now() + Duration::from_secs(5)).await;
                }
                let _ = s.read(&mut mode).await; // until the initiator closes
            });
        }
    });
    let mut plain = Vec::with_capacity(n);
    let mut authenticated = Vec::with_capacity(n);
    for i in 0..n * 2 {
        let auth = i % 2 == 1;
        let t = Instant::now();
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        tokio::io::AsyncWriteExt::write_all(&mut s, &[u8::from(auth)]).await?;
        if auth {
            initiate(&mut s, &secret, CONTEXT, tokio::time::Instant::now() + Duration::from_secs(5))
                .await
                .map_err(std::io::Error::other)?;
            authenticated.push(t.elapsed());
        } else {
            plain.push(t.elapsed());
        }
    }
    let (p, a) = (median(plain), median(authenticated));
    println!(
        "{n} connections each, loopback: connect {:.1} µs, connect + exchange {:.1} µs, exchange {:.1} µs (medians)",
        p.as_secs_f64() * 1e6,
        a.as_secs_f64() * 1e6,
        a.saturating_sub(p).as_secs_f64() * 1e6
    );
    Ok(())
}
