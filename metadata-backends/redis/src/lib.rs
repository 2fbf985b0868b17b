//! # ferry-metadata-redis
//!
//! A [`MetadataStore`] on Redis for `metadata_server: "redis://host:port"` (`rediss://` is refused:
//! this build has no TLS),
//! honouring Mooncake's `MC_REDIS_PASSWORD`, `MC_REDIS_USERNAME` and `MC_REDIS_DB_INDEX`. The
//! connection reconnects by itself after a Redis restart; every command has a timeout.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{Config, Error, MetadataFactory, MetadataServer, MetadataStore, Result};
use redis::AsyncCommands;
use redis::IntoConnectionInfo;
use redis::aio::ConnectionManager;

/// Time allowed for one command (and for the first connection).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// Factory for the Redis backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct RedisMetadataFactory;

#[async_trait]
impl MetadataFactory for RedisMetadataFactory {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn connect(&self, server: &MetadataServer, _config: &Config) -> Result<Arc<dyn MetadataStore>> {
        let MetadataServer::Redis(url) = server else {
            return Err(Error::config(format!("the Redis backend cannot serve {server:?}")));
        };
        Ok(Arc::new(RedisMetadata::connect(url, |k| std::env::var(k).ok()).await?))
    }
}

/// Redis metadata backend.
#[derive(Clone)]
pub struct RedisMetadata {
    url: String,
    conn: ConnectionManager,
}

impl std::fmt::Debug for RedisMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisMetadata").field("url", &self.url).finish_non_exhaustive()
    }
}

impl RedisMetadata {
    /// Connects to `url`; `env` supplies `MC_REDIS_PASSWORD`, `MC_REDIS_USERNAME` and
    /// `MC_REDIS_DB_INDEX` (they override the URL's).
    pub async fn connect(url: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut info =
            url.into_connection_info().map_err(|e| Error::config(format!("Redis URL {url:?} does not parse: {e}")))?;
        if let Some(p) = env("MC_REDIS_PASSWORD").filter(|v| !v.is_empty()) {
            info.redis.password = Some(p);
        }
        if let Some(u) = env("MC_REDIS_USERNAME").filter(|v| !v.is_empty()) {
            info.redis.username = Some(u);
        }
        if let Some(db) = env("MC_REDIS_DB_INDEX").filter(|v| !v.is_empty()) {
            info.redis.db =
                db.parse().map_err(|_| Error::config(format!("MC_REDIS_DB_INDEX={db:?} is not a database number")))?;
        }
        let client = redis::Client::open(info).map_err(|e| Error::config(format!("Redis {url}: {e}")))?;
        // One plain connection first: a refused port fails at once (the manager would retry).
        tokio::time::timeout(COMMAND_TIMEOUT, client.get_multiplexed_async_connection())
            .await
            .map_err(|_| Error::timeout(format!("Redis {url} did not answer within {COMMAND_TIMEOUT:?}")))?
            .map_err(|e| Error::unreachable(format!("Redis {url}: cannot connect: {e}")).with_source(e))?;
        let conn = tokio::time::timeout(COMMAND_TIMEOUT, ConnectionManager::new(client))
            .await
            .map_err(|_| Error::timeout(format!("Redis {url} did not answer within {COMMAND_TIMEOUT:?}")))?
            .map_err(|e| Error::unreachable(format!("Redis {url}: cannot connect: {e}")).with_source(e))?;
        let me = Self { url: url.to_owned(), conn };
        // A PING proves the credentials and the database index, not just the socket.
        let mut c = me.conn.clone();
        me.run("PING", async move { redis::cmd("PING").query_async::<String>(&mut c).await }).await?;
        Ok(me)
    }

    async fn run<T>(&self, what: &str, fut: impl std::future::Future<Output = redis::RedisResult<T>>) -> Result<T> {
        match tokio::time::timeout(COMMAND_TIMEOUT, fut).await {
            Err(_) => {
                Err(Error::timeout(format!("Redis {}: {what} did not finish within {COMMAND_TIMEOUT:?}", self.url)))
            }
            Ok(Err(e)) if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() => {
                Err(Error::unreachable(format!("Redis {}: {what}: {e}", self.url)).with_source(e))
            }
            Ok(Err(e)) => Err(Error::transport(format!("Redis {}: {what}: {e}", self.url)).with_source(e)),
            Ok(Ok(v)) => Ok(v),
        }
    }
}

#[async_trait]
impl MetadataStore for RedisMetadata {
    fn name(&self) -> &str {
        "redis"
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let mut c = self.conn.clone();
        self.run("GET", async move { c.get::<_, Option<Vec<u8>>>(key).await }).await
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        if key.is_empty() {
            return Err(Error::invalid("metadata key is empty"));
        }
        let mut c = self.conn.clone();
        self.run("SET", async move { c.set::<_, _, ()>(key, value).await }).await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let mut c = self.conn.clone();
        self.run("DEL", async move { c.del::<_, ()>(key).await }).await
    }
}
