//! `ferry metadata-server`: Mooncake's HTTP metadata protocol, persistent with `--data-dir`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use ferry_metadata_http::server::{Limits, serve};
use ferry_metadata_http::store::Store;

/// Options of `ferry metadata-server`.
#[derive(Debug, Args)]
pub(crate) struct ServerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:8080")]
    addr: String,
    /// Directory for the write-ahead log; without it the data lives in memory only.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Longest key accepted, in bytes (longer: 400).
    #[arg(long, default_value_t = Limits::default().max_key)]
    max_key_bytes: usize,
    /// Largest value accepted, in bytes (larger: 413).
    #[arg(long, default_value_t = Limits::default().max_body)]
    max_body_bytes: usize,
}

pub(crate) async fn run(args: ServerArgs) -> Result<std::process::ExitCode> {
    let store = match &args.data_dir {
        Some(dir) => Store::open(dir).with_context(|| format!("opening the metadata store in {}", dir.display()))?,
        None => Store::in_memory(),
    };
    let listener =
        tokio::net::TcpListener::bind(&args.addr).await.with_context(|| format!("listening on {}", args.addr))?;
    println!("metadata server listening on {}", listener.local_addr()?);
    let limits = Limits { max_key: args.max_key_bytes, max_body: args.max_body_bytes, ..Limits::default() };
    serve(listener, Arc::new(store), limits, async {
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
