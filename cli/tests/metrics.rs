//! The Prometheus endpoints as an operator scrapes them: an engine's (`FERRY_METRICS_ADDR`)
//! during `ferry bench`, and `ferry metadata-server`'s `/metrics` after a PUT and a GET.

use std::io::BufRead;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::ferry;

/// A child process, killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port free a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The first line of `child`'s stdout, after `prefix`.
fn first_line(child: &mut Child, prefix: &str) -> String {
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    line.trim().strip_prefix(prefix).unwrap_or_else(|| panic!("said {line:?}")).to_owned()
}

/// The value of the first sample of `name` whose labels contain every one of `labels`
/// (`key="value"` strings), if any.
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn scrape(client: &reqwest::Client, url: &str) -> Option<(String, String)> {
    let r = client.get(url).timeout(Duration::from_secs(2)).send().await.ok()?;
    let content_type = r.headers().get("content-type")?.to_str().ok()?.to_owned();
    Some((content_type, r.text().await.ok()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_metrics_show_the_transfers_of_a_running_bench() {
    let (target_port, initiator_port) = (free_port(), free_port());
    let mut cmd = ferry();
    cmd.env("FERRY_METRICS_ADDR", format!("127.0.0.1:{target_port}"));
    let mut target = Killed(
        cmd.args(["bench", "--mode=target", "--buffer_size=8MiB"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let segment = first_line(&mut target.0, "listening on ");
    let client = reqwest::Client::new();

    // The target's endpoint: its registered buffer, nothing it initiated.
    let (content_type, text) = scrape(&client, &format!("http://127.0.0.1:{target_port}/metrics")).await.unwrap();
    assert!(content_type.starts_with("application/openmetrics-text"), "{content_type}");
    let seg = format!("segment=\"{segment}\"");
    assert_eq!(sample(&text, "ferry_registered_bytes", &[&seg]), Some(8.0 * 1024.0 * 1024.0), "{text}");
    assert_eq!(sample(&text, "ferry_registered_regions", &[&seg]), Some(1.0), "{text}");
    assert!(sample(&text, "ferry_transfer_requests_total", &[]).is_none(), "the target initiated nothing: {text}");
    assert!(text.contains("# TYPE ferry_batch_latency_seconds histogram"), "{text}");

    // The initiator's, while it runs.
    let mut cmd = ferry();
    cmd.env("FERRY_METRICS_ADDR", format!("127.0.0.1:{initiator_port}"));
    // Not killed on a failed assertion: it ends by itself after its 4 s.
    let initiator = cmd
        .args(["bench", "--buffer_size=8MiB", "--block_size=4096", "--batch_size=8", "--threads=1", "--duration=4"])
        .args(["--json", &format!("--segment_id={segment}")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{initiator_port}/metrics");
    let peer = format!("peer=\"{segment}\"");
    let route: [&str; 3] = ["transport=\"tcp\"", &peer, "opcode=\"read\""];
    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        if let Some((_, text)) = scrape(&client, &url).await
            && sample(&text, "ferry_transfer_requests_total", &route).is_some_and(|n| n > 0.0)
        {
            break text;
        }
        assert!(Instant::now() < deadline, "no transfer counted at {url} within 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let requests = sample(&text, "ferry_transfer_requests_total", &route).unwrap();
    let bytes = sample(&text, "ferry_transfer_bytes_total", &route).unwrap();
    assert_eq!(bytes, requests * 4096.0, "{text}");
    assert_eq!(sample(&text, "ferry_transfer_failed_requests_total", &route), Some(0.0), "{text}");
    assert_eq!(sample(&text, "ferry_open_segments", &[]), Some(1.0), "{text}");
    assert!(sample(&text, "ferry_batch_latency_seconds_count", &[]).is_some_and(|n| n > 0.0), "{text}");
    let p99 = sample(&text, "ferry_batch_latency_quantile_seconds", &["quantile=\"0.99\""]).unwrap();
    assert!(p99 > 0.0 && p99 < 30.0, "{text}");
    assert_eq!(sample(&text, "ferry_request_failures_total", &["kind=\"timeout\""]), Some(0.0), "{text}");

    // The bench's own summary has the same percentiles, by name.
    let out = tokio::task::spawn_blocking(move || initiator.wait_with_output().unwrap()).await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let lat = &summary["batch_latency_us"];
    for p in ["p50", "p90", "p99", "p999"] {
        assert!(lat[p].as_f64().is_some_and(|v| v > 0.0), "{p}: {summary}");
    }
    assert!(lat["p50"].as_f64() <= lat["p90"].as_f64() && lat["p90"].as_f64() <= lat["p99"].as_f64());
    // The initiator shut down: its endpoint is gone.
    assert!(scrape(&client, &url).await.is_none(), "{url} still answers after the bench ended");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metadata_servers_metrics_count_requests_by_route_and_status_and_the_store() {
    let mut server = Killed(
        ferry()
            .args(["metadata-server", "--addr", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let addr = first_line(&mut server.0, "metadata server listening on ");
    let c = reqwest::Client::new();
    let key = format!("http://{addr}/metadata?key=mooncake/ram/a");
    assert_eq!(c.put(&key).body("0123456789").send().await.unwrap().status().as_u16(), 200);
    assert_eq!(c.get(&key).send().await.unwrap().status().as_u16(), 200);
    let missing = format!("http://{addr}/metadata?key=mooncake/ram/none");
    assert_eq!(c.get(&missing).send().await.unwrap().status().as_u16(), 404);
    assert_eq!(c.get(format!("http://{addr}/nothing")).send().await.unwrap().status().as_u16(), 404);

    let (content_type, text) = scrape(&c, &format!("http://{addr}/metrics")).await.unwrap();
    assert!(content_type.starts_with("application/openmetrics-text"), "{content_type}");
    let count = |route: &str, method: &str, status: &str| {
        sample(
            &text,
            "ferry_metadata_requests_total",
            &[&format!("route=\"{route}\""), &format!("method=\"{method}\""), &format!("status=\"{status}\"")],
        )
    };
    assert_eq!(count("/metadata", "PUT", "200"), Some(1.0), "{text}");
    assert_eq!(count("/metadata", "GET", "200"), Some(1.0), "{text}");
    assert_eq!(count("/metadata", "GET", "404"), Some(1.0), "{text}");
    assert_eq!(count("other", "GET", "404"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "ferry_metadata_keys", &[]), Some(1.0), "{text}");
    let stored = sample(&text, "ferry_metadata_stored_bytes", &[]).unwrap();
    assert!(stored >= 10.0 + "mooncake/ram/a".len() as f64, "{text}");
}
