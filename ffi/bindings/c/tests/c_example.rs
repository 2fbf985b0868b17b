//! Compiles `examples/transfer.c` with the system C compiler against `ffi/include` and the
//! `libferry_c.so` cargo built beside this test, runs it, and checks what it reports.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The directory holding the `libferry_c.so` of this build. The test runs from
/// `target/<profile>/deps/`; cargo builds the library's cdylib in the same rustc invocation as
/// the rlib this test links, into that `deps/` directory. (`cargo test` does not copy it up to
/// `target/<profile>/`, as `cargo build` does, so the copy there may be stale: `deps/` first.)
fn library_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let deps = exe.parent().context("test executable has no directory")?;
    let profile = deps.parent().context("deps directory has no parent")?;
    for dir in [deps, profile] {
        if dir.join("libferry_c.so").is_file() {
            return Ok(dir.to_owned());
        }
    }
    bail!("libferry_c.so is in neither {} nor {}", profile.display(), deps.display())
}

fn run_with_deadline(mut cmd: Command, deadline: Duration) -> anyhow::Result<std::process::Output> {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let start = Instant::now();
    loop {
        if child.try_wait()?.is_some() {
            return Ok(child.wait_with_output()?);
        }
        if start.elapsed() > deadline {
            child.kill()?;
            let out = child.wait_with_output()?;
            bail!(
                "{cmd:?} did not finish in {deadline:?}; stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_c_example_compiles_runs_and_verifies_its_transfers() -> anyhow::Result<()> {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let include = crate_dir.join("../../include");
    let source = crate_dir.join("examples/transfer.c");
    let lib_dir = library_dir()?;
    let work = std::env::temp_dir().join(format!("ferry-capi-c-example-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let exe = work.join("transfer");

    let mut cc = Command::new("cc");
    cc.args(["-std=c99", "-Wall", "-Werror", "-I"])
        .arg(&include)
        .arg(&source)
        .arg("-L")
        .arg(&lib_dir)
        .arg("-lferry_c")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(&exe);
    let built = cc.output().context("running cc")?;
    if !built.status.success() {
        bail!("cc failed ({}):\n{}", built.status, String::from_utf8_lossy(&built.stderr));
    }

    let mut run = Command::new(&exe);
    // The example's config must not be overridden by the caller's environment.
    for var in ["FERRY_LOCAL_HOSTNAME", "FERRY_METADATA_SERVER", "FERRY_PROTOCOL", "MC_METADATA_CLUSTER_ID"] {
        run.env_remove(var);
    }
    let out = run_with_deadline(run, Duration::from_secs(120))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&work);
    assert!(out.status.success(), "example failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);

    let version = format!("ferry {}", env!("CARGO_PKG_VERSION"));
    for expected in [
        version.as_str(),
        "engines: prefill 127.0.0.1:",
        "registered 4096 bytes on each engine",
        "wrote 2048 bytes decode -> prefill",
        "read 2048 bytes prefill -> decode: verified",
        "moved KV blocks 1,2,5 -> 4,5,0 in 2 requests: verified",
        "\"kv ready: request 42\"",
        "out-of-bounds read refused (-4): out_of_bounds: request 0: remote range",
        "double free refused (-2): not_found: batch handle",
        "engines destroyed; all checks passed",
    ] {
        assert!(stdout.contains(expected), "missing {expected:?} in:\n{stdout}");
    }
    // The notification names its sender, decode's segment.
    let decode = stdout
        .lines()
        .find_map(|l| l.split(", decode ").nth(1))
        .context("no decode segment name printed")?
        .trim()
        .to_owned();
    assert!(stdout.contains(&format!("notification from {decode}: ")), "{stdout}");
    Ok(())
}
