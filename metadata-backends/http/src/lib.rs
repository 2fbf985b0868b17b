//! # ferry-metadata-http
//!
//! Mooncake's HTTP metadata protocol (reference `mooncake-wire.md` §3):
//!
//! - [`HttpMetadata`], a [`MetadataStore`] client for `metadata_server: "http://host:port/metadata"`
//!   (requests to `<url>?key=<escaped key>`; only HTTP 200 counts as success; 404 on GET is an
//!   absent key), with a timeout on every request and bounded retries of transient failures;
//! - [`server`], the `ferry metadata-server` that Mooncake engines can use unchanged, and that
//!   keeps its data across restarts with `--data-dir` ([`store`]).
//!
//! A server may require a write token ([`token`]): the client sends it with every request as
//! `Authorization: Bearer <token>` when it has one, from `FERRY_METADATA_TOKEN` (the token
//! itself) or else the file named by the option `metadata_token_file`
//! ([`METADATA_TOKEN_FILE_OPTION`], variable `FERRY_METADATA_TOKEN_FILE`).
#![forbid(unsafe_code)]

pub mod server;
pub mod store;
pub mod token;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{
    Config, Environment, Error, MetadataFactory, MetadataServer, MetadataStore, OptionSpec, OptionValue, Result,
    Setting,
};

use crate::token::{TOKEN_ENV, Token};

/// Time allowed for one HTTP request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Attempts of a request that failed transiently (connection refused or reset, timeout, 5xx).
pub const ATTEMPTS: u32 = 3;

/// The file holding the write token of a `ferry metadata-server` started with one (its
/// `--write-token-file` or `FERRY_METADATA_TOKEN`). `FERRY_METADATA_TOKEN`, the token itself,
/// wins over it.
pub const METADATA_TOKEN_FILE_OPTION: OptionSpec = OptionSpec {
    key: "metadata_token_file",
    env: Some("FERRY_METADATA_TOKEN_FILE"),
    env_invalid: "",
    default: "none: no token sent",
    doc: "file holding the write token of a `ferry metadata-server` started with one (see metadata.md); the HTTP \
          client sends it as `Authorization: Bearer <token>`. Relative to the config file; the file must exist and \
          hold a token (printable ASCII, no spaces; surrounding white space is ignored). `FERRY_METADATA_TOKEN`, \
          the token itself, wins over it",
};

/// The options of the HTTP backend.
pub const OPTIONS: &[OptionSpec] = &[METADATA_TOKEN_FILE_OPTION];

/// The write token the client sends, if any: `FERRY_METADATA_TOKEN` in `env` (an empty one
/// counts as unset), else the token in the file `metadata_token_file` names (relative to the
/// config file), with where it came from. The token itself is never put in a message.
///
/// # Errors
/// [`ErrorKind::Config`](ferry_core::ErrorKind::Config): the variable holds no valid token,
/// or the file cannot be read or holds none; the error names the variable or the option.
pub fn token_from_config(config: &Config, env: &Environment) -> Result<Option<Setting<Token>>> {
    if let Some(text) = env.get_nonempty(TOKEN_ENV) {
        let token =
            Token::new(text.trim()).map_err(|e| Error::config(format!("environment variable {TOKEN_ENV}: {e}")))?;
        return Ok(Some(Setting { value: token, source: ferry_core::FieldSource::Env(TOKEN_ENV) }));
    }
    let Some(path) = config.option_path(&METADATA_TOKEN_FILE_OPTION, env)? else { return Ok(None) };
    let token = Token::from_file(&path.value)
        .map_err(|e| config.option_error(&METADATA_TOKEN_FILE_OPTION, &path.source, &e))?;
    Ok(Some(path.map(|_| token)))
}

/// Factory for the HTTP backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct HttpMetadataFactory;

#[async_trait]
impl MetadataFactory for HttpMetadataFactory {
    fn kind(&self) -> &'static str {
        "http"
    }

    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    /// `metadata_token_file` as the client reads it: the file is read and its token checked
    /// (never shown); `FERRY_METADATA_TOKEN`, when set, is shown as winning over it.
    fn read_options(&self, config: &Config, env: &Environment) -> Vec<OptionValue> {
        let file = config.option_path(&METADATA_TOKEN_FILE_OPTION, env);
        let read = match token_from_config(config, env) {
            Err(e) => Err(e),
            Ok(Some(t)) if t.source == ferry_core::FieldSource::Env(TOKEN_ENV) => {
                Ok(Some(Setting { value: format!("not read: {TOKEN_ENV} is set and wins"), source: t.source }))
            }
            Ok(_) => file.map(|f| f.map(|f| f.map(|p| format!("{} (holds a token)", p.display())))),
        };
        vec![OptionValue::new(&METADATA_TOKEN_FILE_OPTION, read)]
    }

    async fn connect(&self, server: &MetadataServer, config: &Config) -> Result<Arc<dyn MetadataStore>> {
        let MetadataServer::Http(url) = server else {
            return Err(Error::config(format!("the HTTP backend cannot serve {server:?}")));
        };
        let mut backend = HttpMetadata::new(url)?;
        if let Some(token) = token_from_config(config, &Environment::process())? {
            backend = backend.with_token(token.value);
        }
        // Fail at start, naming the endpoint, rather than at the first lookup.
        backend
            .get("mooncake/__ferry_probe__")
            .await
            .map_err(|e| Error::new(e.kind(), format!("metadata server {url} does not answer: {}", e.message())))?;
        Ok(Arc::new(backend))
    }
}

/// Client of an HTTP metadata server.
#[derive(Debug, Clone)]
pub struct HttpMetadata {
    url: reqwest::Url,
    client: reqwest::Client,
    /// Sent with every request as `Authorization: Bearer <token>`.
    token: Option<Token>,
}

impl HttpMetadata {
    /// A client for the endpoint `url` (`http://host:port/metadata`).
    pub fn new(url: &str) -> Result<Self> {
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| Error::config(format!("metadata server URL {url:?} does not parse: {e}")))?;
        if parsed.scheme() != "http" {
            return Err(Error::config(format!("metadata server URL {url:?}: only http:// is supported by this build")));
        }
        let client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| Error::config(format!("HTTP client for {url}")).with_source(e))?;
        Ok(Self { url: parsed, client, token: None })
    }

    /// Sends `token` with every request, as `Authorization: Bearer <token>` (for a server that
    /// takes writes only with it; reads need none, but carry it too).
    pub fn with_token(mut self, token: Token) -> Self {
        self.token = Some(token);
        self
    }

    fn url_for(&self, key: &str) -> reqwest::Url {
        let mut u = self.url.clone();
        u.query_pairs_mut().clear().append_pair("key", key);
        u
    }

    /// Sends a request, retrying transient failures; returns status and body.
    async fn send(&self, method: reqwest::Method, key: &str, body: Option<&[u8]>) -> Result<(u16, Vec<u8>)> {
        let url = self.url_for(key);
        let mut last = None;
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
            }
            let mut req = self.client.request(method.clone(), url.clone());
            if let Some(token) = &self.token {
                req = req.bearer_auth(token.as_str());
            }
            if let Some(b) = body {
                req = req.body(b.to_vec());
            }
            match req.send().await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let bytes = resp.bytes().await.map(|b| b.to_vec());
                    match bytes {
                        Ok(b) if status < 500 => return Ok((status, b)),
                        Ok(b) => {
                            last = Some(Error::unreachable(format!("HTTP {status}: {}", String::from_utf8_lossy(&b))))
                        }
                        Err(e) => last = Some(Error::unreachable(format!("reading the answer: {e}"))),
                    }
                }
                Err(e) if e.is_timeout() => {
                    last = Some(Error::timeout(format!("no answer within {REQUEST_TIMEOUT:?}")))
                }
                Err(e) => last = Some(Error::unreachable(format!("{e}")).with_source(e)),
            }
        }
        let e = last.expect("at least one attempt");
        Err(Error::new(e.kind(), format!("{method} {} ({ATTEMPTS} attempts): {}", self.url, e.message())))
    }

    fn unexpected(&self, what: &str, key: &str, status: u16, body: &[u8]) -> Error {
        let hint = match (status, &self.token) {
            (401, None) => format!(
                " (the server takes writes only with its write token: set {TOKEN_ENV} or the option `{}`)",
                METADATA_TOKEN_FILE_OPTION.key
            ),
            (401, Some(_)) => " (the token sent is not the server's write token)".to_owned(),
            (507, _) => {
                " (the server's store is full: it refuses writes that would pass its --max-total-bytes)".to_owned()
            }
            (404 | 405, _) if !self.url.path().trim_end_matches('/').ends_with("/metadata") => {
                let mut right = self.url.clone();
                right.set_path(&format!("{}/metadata", self.url.path().trim_end_matches('/')));
                format!(
                    " (Mooncake's metadata servers and `ferry metadata-server` serve under /metadata: try \
                     metadata_server \"{right}\")"
                )
            }
            _ => String::new(),
        };
        Error::transport(format!(
            "metadata server {}: {what} of key {key} answered HTTP {status}: {}{hint}",
            self.url,
            String::from_utf8_lossy(body)
        ))
    }
}

#[async_trait]
impl MetadataStore for HttpMetadata {
    fn name(&self) -> &str {
        "http"
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match self.send(reqwest::Method::GET, key, None).await? {
            (200, body) => Ok(Some(body)),
            (404, _) => Ok(None),
            (status, body) => Err(self.unexpected("GET", key, status, &body)),
        }
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.send(reqwest::Method::PUT, key, Some(value)).await? {
            (200, _) => Ok(()),
            // Mooncake's Python servers answer 400 to a second PUT of an rpc_meta key (its
            // issues 2296, 863), which an engine restarted after a crash (its entries left
            // behind) must make. When the stored value is already what we write, the
            // re-publication has in effect succeeded; when it differs (a new RPC port), the
            // stale entry is removed and written again.
            (400, body) => match self.get(key).await {
                Ok(Some(stored)) if stored == value => Ok(()),
                Ok(Some(_)) => {
                    tracing::info!(key, "the metadata server refused to overwrite a stale entry; replacing it");
                    self.delete(key).await?;
                    match self.send(reqwest::Method::PUT, key, Some(value)).await? {
                        (200, _) => Ok(()),
                        (status, body) => Err(self.unexpected("PUT", key, status, &body)),
                    }
                }
                _ => Err(self.unexpected("PUT", key, 400, &body)),
            },
            (status, body) => Err(self.unexpected("PUT", key, status, &body)),
        }
    }

    async fn delete(&self, key: &str) -> Result<()> {
        match self.send(reqwest::Method::DELETE, key, None).await? {
            (200 | 404, _) => Ok(()),
            (status, body) => Err(self.unexpected("DELETE", key, status, &body)),
        }
    }
}
