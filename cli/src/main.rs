//! The `ferry` command line: `ferry demo` runs a verified block-level KV transfer between two
//! engines on the embedded default; `ferry doctor` validates a config and explains what Ferry
//! resolved from it.

mod bench;
mod demo;
mod doctor;
mod metadata_server;
mod stats;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// Ferry: KV-cache transfer engine for disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about, long_about = None)]
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

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")))
        .with_writer(std::io::stderr)
        .init();
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
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
