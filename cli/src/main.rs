//! The `ferry` command line: `ferry demo` runs a verified block-level KV transfer between two
//! engines on the embedded default; `ferry bench` measures transfers with the flags of
//! Mooncake's `transfer_engine_bench`; `ferry metadata-server` serves Mooncake's HTTP metadata
//! protocol; `ferry doctor` validates a config and explains what Ferry resolved from it.

mod bench;
mod demo;
mod doctor;
mod metadata_server;
mod stats;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// Ferry, the KV-cache transfer engine for disaggregated LLM serving: demo, bench,
/// metadata-server, doctor. Logs go to standard error; set FERRY_LOG (or RUST_LOG), e.g.
/// FERRY_LOG=debug or FERRY_LOG=ferry_transport_tcp=trace.
#[derive(Debug, Parser)]
#[command(name = "ferry", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Two engines in this process, KV-shaped buffers, block-level transfers in both directions,
    /// checksums verified. Needs no server and no config.
    Demo(demo::DemoArgs),
    /// Measure transfers against a target, with the flags of Mooncake's transfer_engine_bench
    /// (`--mode=target|initiator`, `--segment_id`, `--operation`, `--block_size`, ...).
    Bench(bench::BenchArgs),
    /// Serve Mooncake's HTTP metadata protocol (Mooncake engines can use it unchanged), with
    /// idempotent re-publish, /health, and persistence across restarts with --data-dir. Listens
    /// on 127.0.0.1:8080 unless told otherwise (`--addr 0.0.0.0:8080`: every interface).
    MetadataServer(metadata_server::ServerArgs),
    /// Validate a mooncake.json (FILE, else $MOONCAKE_CONFIG_PATH, else the embedded default)
    /// and print what Ferry resolved from it.
    Doctor(doctor::DoctorArgs),
}

/// The variable setting the number of the async runtime's worker threads.
const WORKERS_ENV: &str = "FERRY_WORKERS";
/// Accepted values of [`WORKERS_ENV`].
const WORKERS_RANGE: std::ops::RangeInclusive<usize> = 1..=1024;

/// The runtime's worker threads: `value` of [`WORKERS_ENV`] when set (an empty one counts as
/// unset), else one per core. A value that is not a whole number in [`WORKERS_RANGE`] is an
/// error naming the variable, its value and the range.
fn workers(value: Option<String>) -> Result<usize, String> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return Ok(std::thread::available_parallelism().map(usize::from).unwrap_or(2));
    };
    value.trim().parse::<usize>().ok().filter(|n| WORKERS_RANGE.contains(n)).ok_or_else(|| {
        format!(
            "environment variable {WORKERS_ENV}={value:?}: expected a whole number of runtime worker threads, {} to {}",
            WORKERS_RANGE.start(),
            WORKERS_RANGE.end()
        )
    })
}

/// The variable choosing what is logged (a `tracing` filter); `RUST_LOG` when it is unset.
const LOG_ENV: &str = "FERRY_LOG";

/// The log filter: [`LOG_ENV`], else `RUST_LOG`, else warnings and errors only. A filter that
/// does not parse is reported and the default used.
fn log_filter() -> EnvFilter {
    for var in [LOG_ENV, "RUST_LOG"] {
        if let Ok(value) = std::env::var(var)
            && !value.is_empty()
        {
            match EnvFilter::try_new(&value) {
                Ok(f) => return f,
                Err(e) => eprintln!("warning: {var}={value:?} is not a log filter ({e}); logging warnings only"),
            }
        }
    }
    EnvFilter::new("warn")
}

/// `e` and its causes as one line, each cause left out when the text before it already says it
/// (Ferry's errors often name their cause in their own message and keep it as the source too).
fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        // A cause's own message, without its `kind: ` prefix, may already be in the line.
        let bare = text.split_once(": ").map_or(text.as_str(), |(_, rest)| rest);
        if line.contains(&text) || (!bare.is_empty() && line.contains(bare)) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt().with_env_filter(log_filter()).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    // Runtime threads serve the target side and the engine; the TCP initiator's lanes run on
    // threads of their own.
    let workers = match workers(std::env::var(WORKERS_ENV).ok()) {
        Ok(n) => n,
        Err(message) => {
            eprintln!("error: {message}");
            // As clap answers other usage errors.
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            Command::Bench(args) => bench::run(args).await,
            Command::MetadataServer(args) => metadata_server::run(args).await,
            Command::Doctor(args) => doctor::run(args).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_help_header_names_every_subcommand() {
        use clap::CommandFactory;
        let about = Cli::command().render_help().to_string();
        let header = about.lines().next().unwrap_or_default().to_owned();
        for sub in Cli::command().get_subcommands() {
            assert!(header.contains(sub.get_name()), "{:?} is missing from the header {header:?}", sub.get_name());
        }
    }

    #[test]
    fn an_error_line_says_each_cause_once() {
        let inner = ferry::Error::invalid("segment name `x` is not host:port");
        let outer = ferry::Error::invalid(format!("looking up segment `x`: {inner}")).with_source(inner);
        let e = anyhow::Error::new(outer).context("opening the target");
        assert_eq!(
            error_line(&e),
            "opening the target: invalid_argument: looking up segment `x`: invalid_argument: segment name `x` is not host:port"
        );
        let io = std::io::Error::other("refused");
        let e = anyhow::Error::new(ferry::Error::unreachable("peer down").with_source(io));
        assert_eq!(error_line(&e), "peer_unreachable: peer down: refused", "a cause not said yet is kept");
    }

    #[test]
    fn the_metadata_server_listens_on_loopback_unless_told_otherwise() {
        let Command::MetadataServer(args) = Cli::parse_from(["ferry", "metadata-server"]).command else {
            panic!("parsed as another command")
        };
        assert_eq!(args.addr, "127.0.0.1:8080");
        let Command::MetadataServer(args) =
            Cli::parse_from(["ferry", "metadata-server", "--addr", "0.0.0.0:8080"]).command
        else {
            panic!("parsed as another command")
        };
        assert_eq!(args.addr, "0.0.0.0:8080");
    }
}
