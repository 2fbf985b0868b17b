//! The store and its factory, on the `etcd-client` crate (the `client` feature).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, ConnectOptions, EventType, PutOptions, WatchOptions};
use ferry_core::{Config, Error, MetadataFactory, MetadataServer, MetadataStore, Result, WatchEvent};
use tokio::sync::mpsc;

use crate::{LEASE_TTL_SECS, REQUEST_TIMEOUT};

/// Factory for the etcd backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct EtcdMetadataFactory;

#[async_trait]
impl MetadataFactory for EtcdMetadataFactory {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    async fn connect(&self, server: &MetadataServer, _config: &Config) -> Result<Arc<dyn MetadataStore>> {
        let MetadataServer::Etcd(endpoints) = server else {
            return Err(Error::config(format!("the etcd backend cannot serve {server:?}")));
        };
        Ok(Arc::new(EtcdMetadata::connect(endpoints).await?))
    }
}

/// etcd metadata backend.
pub struct EtcdMetadata {
    endpoints: Vec<String>,
    client: Client,
    lease: Arc<AtomicI64>,
    keeper: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for EtcdMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdMetadata").field("endpoints", &self.endpoints).finish_non_exhaustive()
    }
}

impl Drop for EtcdMetadata {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

fn err(endpoints: &[String], what: &str, e: etcd_client::Error) -> Error {
    let msg = format!("etcd {}: {what}: {e}", endpoints.join(","));
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => {
            Error::unreachable(msg).with_source(e)
        }
        // gRPC UNAVAILABLE (14), DEADLINE_EXCEEDED (4), CANCELLED (1), and UNKNOWN carrying a
        // transport failure (a connection that broke): the cluster cannot be reached.
        etcd_client::Error::GRpcStatus(ref s)
            if matches!(i32::from(s.code()), 1 | 4 | 14)
                || (i32::from(s.code()) == 2 && s.message().contains("transport error")) =>
        {
            Error::unreachable(msg).with_source(e)
        }
        _ => Error::transport(msg).with_source(e),
    }
}

async fn timed<T>(
    endpoints: &[String],
    what: &str,
    fut: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
        Err(_) => Err(Error::timeout(format!(
            "etcd {}: {what} did not finish within {REQUEST_TIMEOUT:?}",
            endpoints.join(",")
        ))),
        Ok(r) => r.map_err(|e| err(endpoints, what, e)),
    }
}

impl EtcdMetadata {
    /// Connects to `endpoints` (`host:port` each), grants this engine's lease and starts keeping
    /// it alive.
    pub async fn connect(endpoints: &[String]) -> Result<Self> {
        let urls: Vec<String> = endpoints.iter().map(|e| format!("http://{e}")).collect();
        let opts = ConnectOptions::new().with_connect_timeout(REQUEST_TIMEOUT).with_timeout(REQUEST_TIMEOUT);
        let client = timed(endpoints, "connect", Client::connect(urls, Some(opts))).await?;
        let mut c = client.clone();
        let lease = timed(endpoints, "grant a lease", c.lease_grant(LEASE_TTL_SECS, None)).await?.id();
        let lease = Arc::new(AtomicI64::new(lease));
        let keeper = tokio::spawn(keep_alive(client.clone(), lease.clone(), endpoints.to_vec()));
        Ok(Self { endpoints: endpoints.to_vec(), client, lease, keeper })
    }

    /// The lease this engine's keys are attached to.
    pub fn lease_id(&self) -> i64 {
        self.lease.load(Ordering::Relaxed)
    }
}

/// Refreshes the lease every third of its TTL; after a failure (etcd down or restarted) grants a
/// new one as soon as etcd answers again.
async fn keep_alive(client: Client, lease: Arc<AtomicI64>, endpoints: Vec<String>) {
    let period = Duration::from_secs((LEASE_TTL_SECS / 3).max(1) as u64);
    loop {
        let mut c = client.clone();
        let id = lease.load(Ordering::Relaxed);
        // Every round is bounded: a silent partition must not stall the refresh past the TTL.
        let alive = async {
            let (mut keeper, mut stream) = tokio::time::timeout(REQUEST_TIMEOUT, c.lease_keep_alive(id))
                .await
                .map_err(|_| "keep-alive stream not opened in time".to_owned())?
                .map_err(|e| e.to_string())?;
            loop {
                let round = async {
                    keeper.keep_alive().await?;
                    stream.message().await
                };
                match tokio::time::timeout(REQUEST_TIMEOUT, round).await {
                    Err(_) => return Err("keep-alive not answered in time".to_owned()),
                    Ok(Err(e)) => return Err(e.to_string()),
                    Ok(Ok(Some(r))) if r.ttl() > 0 => {}
                    Ok(Ok(_)) => return Ok(()), // expired: grant a new one
                }
                tokio::time::sleep(period).await;
            }
        };
        if let Err(e) = alive.await {
            tracing::warn!(endpoints = endpoints.join(","), error = %e, "etcd lease keep-alive failed; retrying");
        }
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let mut c = client.clone();
            if let Ok(Ok(r)) = tokio::time::timeout(REQUEST_TIMEOUT, c.lease_grant(LEASE_TTL_SECS, None)).await {
                lease.store(r.id(), Ordering::Relaxed);
                tracing::info!(lease = r.id(), "etcd lease granted again");
                break;
            }
        }
    }
}

#[async_trait]
impl MetadataStore for EtcdMetadata {
    fn name(&self) -> &str {
        "etcd"
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let mut c = self.client.clone();
        let r = timed(&self.endpoints, "get", c.get(key, None)).await?;
        Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        if key.is_empty() {
            return Err(Error::invalid("metadata key is empty"));
        }
        let mut c = self.client.clone();
        let opts = PutOptions::new().with_lease(self.lease_id());
        timed(&self.endpoints, "put", c.put(key, value, Some(opts))).await.map(|_| ())
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let mut c = self.client.clone();
        timed(&self.endpoints, "delete", c.delete(key, None)).await.map(|_| ())
    }

    async fn watch(&self, prefix: &str) -> Result<Option<mpsc::Receiver<WatchEvent>>> {
        let (tx, rx) = mpsc::channel(256);
        let (client, prefix, endpoints) = (self.client.clone(), prefix.to_owned(), self.endpoints.clone());
        tokio::spawn(async move {
            while !tx.is_closed() {
                let mut c = client.clone();
                let watched = async {
                    let (_watcher, mut stream) =
                        c.watch(prefix.as_str(), Some(WatchOptions::new().with_prefix())).await?;
                    loop {
                        // Stop as soon as the engine is gone, even on a quiet prefix.
                        let resp = tokio::select! {
                            r = stream.message() => match r? {
                                Some(r) => r,
                                None => break,
                            },
                            _ = tx.closed() => return Ok(()),
                        };
                        for ev in resp.events() {
                            let Some(kv) = ev.kv() else { continue };
                            let key = String::from_utf8_lossy(kv.key()).into_owned();
                            let event = match ev.event_type() {
                                EventType::Put => WatchEvent::Put { key },
                                EventType::Delete => WatchEvent::Delete { key },
                            };
                            if tx.send(event).await.is_err() {
                                return Ok(());
                            }
                        }
                    }
                    Ok::<(), etcd_client::Error>(())
                };
                if let Err(e) = watched.await {
                    tracing::debug!(endpoints = endpoints.join(","), error = %e, "etcd watch broke; re-subscribing");
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        Ok(Some(rx))
    }
}
