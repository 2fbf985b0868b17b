//! Real etcd and Redis servers for the tests, on free loopback ports in temporary directories.
//! The binaries come from Debian's `etcd-server` and `redis-server` (scripts/test.sh installs
//! them); without them the tests that need them fail and say so.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// A server process, killed when dropped.
pub struct Server {
    child: Option<Child>,
    /// The loopback port it listens on (the same across [`Server::stop`] and [`Server::start`]).
    pub port: u16,
    dir: PathBuf,
    kind: &'static str,
}

fn need(bin: &str, package: &str) {
    let ok = Command::new(bin).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
    assert!(ok, "\n\n*** `{bin}` is not installed: apt-get install {package} (scripts/test.sh does).\n");
}

fn wait_for(port: u16, what: &str) {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "{what} did not start listening on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Server {
    /// Starts a private Redis.
    pub fn redis() -> Self {
        need("redis-server", "redis-server");
        let dir = std::env::temp_dir().join(format!("ferry-redis-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut s = Server { child: None, port: free_port(), dir, kind: "redis" };
        s.start();
        s
    }

    /// Starts a private etcd.
    pub fn etcd() -> Self {
        need("etcd", "etcd-server");
        let dir = std::env::temp_dir().join(format!("ferry-etcd-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut s = Server { child: None, port: free_port(), dir, kind: "etcd" };
        s.start();
        s
    }

    /// (Re)starts the process on the same port and data directory.
    pub fn start(&mut self) {
        let port = self.port.to_string();
        let child = match self.kind {
            "redis" => Command::new("redis-server")
                .args(["--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir"])
                .arg(&self.dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
            _ => {
                let client = format!("http://127.0.0.1:{port}");
                let peer = format!("http://127.0.0.1:{}", free_port());
                Command::new("etcd")
                    .args(["--name", "ferry-test", "--data-dir"])
                    .arg(self.dir.join("data"))
                    .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
                    .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
                    .args(["--initial-cluster", &format!("ferry-test={peer}")])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap()
            }
        };
        self.child = Some(child);
        wait_for(self.port, self.kind);
    }

    /// Kills the process (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `redis://127.0.0.1:PORT` or `etcd://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.kind, self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
