//! `ferry metadata-server`: Mooncake's HTTP metadata protocol, persistent with `--data-dir`,
//! on loopback unless told otherwise, with a cap on what it stores and an optional write token.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use ferry_metadata_http::server::{Limits, serve_with};
use ferry_metadata_http::store::Store;
use ferry_metadata_http::token::{TOKEN_ENV, Token};

/// Options of `ferry metadata-server`.
#[derive(Debug, Args)]
pub(crate) struct ServerArgs {
    /// Address to listen on. Loopback by default: other machines reach the server only with
    /// an address of theirs, or every interface (`--addr 0.0.0.0:8080`); anyone who reaches it
    /// can read every entry, and write unless a write token is set.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub(crate) addr: String,
    /// Directory for the write-ahead log; without it the data lives in memory only.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Longest key accepted, in bytes (longer: 400).
    #[arg(long, default_value_t = Limits::default().max_key)]
    max_key_bytes: usize,
    /// Largest value accepted, in bytes (larger: 413).
    #[arg(long, default_value_t = Limits::default().max_body)]
    max_body_bytes: usize,
    /// Most bytes of keys and values stored at once (256 MiB by default); a write that would
    /// pass it gets 507 and stores nothing.
    #[arg(long, default_value_t = Limits::default().max_total)]
    max_total_bytes: usize,
    /// File holding the write token: PUT and DELETE then need `Authorization: Bearer <token>`
    /// (401 without it); reads stay open. Without this flag the token is taken from
    /// $FERRY_METADATA_TOKEN when it is set. Mooncake engines send no token: they cannot publish
    /// to a server that has one.
    #[arg(long, value_name = "PATH")]
    write_token_file: Option<PathBuf>,
}

pub(crate) async fn run(args: ServerArgs) -> Result<std::process::ExitCode> {
    let store = match &args.data_dir {
        Some(dir) => Store::open(dir).with_context(|| format!("opening the metadata store in {}", dir.display()))?,
        None => Store::in_memory(),
    };
    let token = match &args.write_token_file {
        Some(path) => Some(Token::from_file(path).map_err(anyhow::Error::msg)?),
        None => match std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty()) {
            Some(text) => {
                Some(Token::new(text.trim()).map_err(|e| anyhow::anyhow!("environment variable {TOKEN_ENV}: {e}"))?)
            }
            None => None,
        },
    };
    let listener =
        tokio::net::TcpListener::bind(&args.addr).await.with_context(|| format!("listening on {}", args.addr))?;
    println!("metadata server listening on {}", listener.local_addr()?);
    if token.is_none() && !listener.local_addr()?.ip().is_loopback() {
        tracing::warn!(
            "metadata server on {} without a write token: anyone who reaches it can change or delete every entry \
             (--write-token-file or {TOKEN_ENV})",
            args.addr
        );
    }
    let limits = Limits {
        max_key: args.max_key_bytes,
        max_body: args.max_body_bytes,
        max_total: args.max_total_bytes,
        ..Limits::default()
    };
    serve_with(listener, Arc::new(store), limits, token, async {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(t) => t,
            Err(_) => return,
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("metadata server shutting down");
    })
    .await?;
    Ok(std::process::ExitCode::SUCCESS)
}
