//! `ferry metadata-server` as an operator runs it: the write token (from a file or the
//! environment), the cap on stored bytes.

use std::process::{Child, Command, Stdio};

mod common;

use common::ferry;

/// A server process, killed when dropped.
struct Server(Child, String);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `ferry metadata-server --addr 127.0.0.1:0 ARGS` and returns it with its URL.
fn start(mut command: Command, args: &[&str]) -> Server {
    use std::io::BufRead;
    let mut child = command
        .args(["metadata-server", "--addr", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("metadata server listening on ")
        .unwrap_or_else(|| panic!("metadata-server said {line:?}"))
        .to_owned();
    Server(child, format!("http://{addr}/metadata"))
}

fn tmp(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-cli-metaserver-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_need_the_token_from_the_file_or_the_environment_and_reads_stay_open() {
    let file = tmp("token", "file-token-123\n");
    let by_file = start(ferry(), &["--write-token-file", file.to_str().unwrap()]);
    let mut with_env = ferry();
    with_env.env("FERRY_METADATA_TOKEN", "env-token-456");
    let by_env = start(with_env, &[]);
    let c = reqwest::Client::new();
    for (server, token, other) in
        [(&by_file, "file-token-123", "env-token-456"), (&by_env, "env-token-456", "file-token-123")]
    {
        let url = format!("{}?key=mooncake/ram/a", server.1);
        let r = c.put(&url).body("v").send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "no token");
        assert!(r.headers().get("www-authenticate").is_some());
        let r = c.put(&url).bearer_auth(other).body("v").send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "another token");
        let r = c.get(&url).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 404, "reads need no token; nothing was stored");
        let r = c.put(&url).bearer_auth(token).body("v").send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let r = c.get(&url).send().await.unwrap();
        assert_eq!((r.status().as_u16(), r.text().await.unwrap()), (200, "v".to_owned()));
        let r = c.delete(&url).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "deletes are writes");
        let r = c.delete(&url).bearer_auth(token).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_total_of_stored_bytes_is_capped() {
    let server = start(ferry(), &["--max-total-bytes", "1000", "--max-body-bytes", "600"]);
    let c = reqwest::Client::new();
    let put = |key: &str, len: usize| c.put(format!("{}?key={key}", server.1)).body(vec![b'x'; len]).send();
    assert_eq!(put("a", 500).await.unwrap().status().as_u16(), 200);
    let r = put("b", 500).await.unwrap();
    assert_eq!(r.status().as_u16(), 507, "501 + 501 bytes (keys and values) pass the cap of 1000");
    let body = r.text().await.unwrap();
    assert!(body.contains("1000") && body.contains("--max-total-bytes"), "{body}");
    assert_eq!(c.get(format!("{}?key=b", server.1)).send().await.unwrap().status().as_u16(), 404, "not stored");
    assert_eq!(put("a", 600).await.unwrap().status().as_u16(), 200, "a replaced value counts once");
    let r = put("c", 700).await.unwrap();
    assert_eq!(r.status().as_u16(), 413, "one body above --max-body-bytes");
}
