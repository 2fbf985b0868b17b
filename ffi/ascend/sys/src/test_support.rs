//! Helpers for tests that run against Ferry's emulated CANN (`ffi/ascend/cann-emu`), behind the
//! `test-support` feature: only tests use them.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Which emulator build to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Emulator {
    /// The default build, with the one-sided HCCL service.
    Current,
    /// The "older CANN" build, without the one-sided symbols.
    Legacy,
}

impl Emulator {
    /// The cargo command that builds this variant.
    pub fn build_command(self) -> &'static str {
        match self {
            Emulator::Current => "cargo build -p ferry-cann-emu",
            Emulator::Legacy => {
                "cargo build -p ferry-cann-emu --no-default-features --target-dir target/cann-emu-legacy"
            }
        }
    }
}

/// The cargo target directory the running executable was built in (`target/`), found from the
/// executable's path (`target/<profile>/deps/<test>` or `target/<profile>/examples/<bin>`).
pub fn target_dir() -> Option<(PathBuf, String)> {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        let exe = std::env::current_exe().ok()?;
        let profile = profile_of(&exe).unwrap_or_else(|| "debug".into());
        return Some((PathBuf::from(dir), profile));
    }
    let exe = std::env::current_exe().ok()?;
    let mut dir = exe.parent()?;
    if matches!(dir.file_name().and_then(|n| n.to_str()), Some("deps" | "examples")) {
        dir = dir.parent()?;
    }
    let profile = dir.file_name()?.to_str()?.to_owned();
    Some((dir.parent()?.to_path_buf(), profile))
}

fn profile_of(exe: &Path) -> Option<String> {
    let mut dir = exe.parent()?;
    if matches!(dir.file_name().and_then(|n| n.to_str()), Some("deps" | "examples")) {
        dir = dir.parent()?;
    }
    dir.file_name()?.to_str().map(str::to_owned)
}

/// The built emulator library of `variant`, or an error naming the cargo command that builds it.
pub fn emulator_library(variant: Emulator) -> Result<PathBuf, String> {
    let (target, profile) = target_dir().ok_or("cannot locate the cargo target directory")?;
    let path = match variant {
        Emulator::Current => target.join(&profile).join("libferry_cann_emu.so"),
        Emulator::Legacy => target.join("cann-emu-legacy").join("debug").join("libferry_cann_emu.so"),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "the emulated CANN library {} is missing: build it with `{}` (from the workspace root)",
            path.display(),
            variant.build_command()
        ))
    }
}

/// A temporary directory removed when dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates a fresh directory under the system temp dir.
    pub fn new(prefix: &str) -> std::io::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "{prefix}-{}-{nanos:x}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A directory holding `libascendcl.so` and `libhccl.so` as symlinks to the emulator of
/// `variant` (one object for both names, so ACL and HCCL share state), for
/// `FERRY_ASCEND_LIB_DIR`.
pub fn emulator_lib_dir(variant: Emulator) -> Result<TempDir, String> {
    link_dir(&emulator_library(variant)?, &[crate::search::ACL_LIBRARY, crate::search::HCCL_LIBRARY])
}

/// A fresh directory holding `names` as symlinks to `lib`.
fn link_dir(lib: &Path, names: &[&str]) -> Result<TempDir, String> {
    let dir = TempDir::new("ferry-cann-emu").map_err(|e| format!("cannot create a temp dir: {e}"))?;
    for name in names {
        std::os::unix::fs::symlink(lib, dir.path().join(name))
            .map_err(|e| format!("cannot link {name} to {}: {e}", lib.display()))?;
    }
    Ok(dir)
}

/// The file names the emulated HIXL answers to, besides ACL's and HCCL's: `libllm_datadist.so`
/// (`adxl::AdxlEngine`), `libcann_hixl.so` (`hixl::Hixl`) and `libmetadef.so`
/// (`ge::AscendString`).
pub const HIXL_LIBRARIES: [&str; 3] = ["libllm_datadist.so", "libcann_hixl.so", "libmetadef.so"];

/// Like [`emulator_lib_dir`], plus `libllm_datadist.so`, `libcann_hixl.so` and `libmetadef.so`
/// ([`HIXL_LIBRARIES`]) linked to the same emulator, so a process that loads HIXL (Ferry's HIXL
/// shim, Mooncake's `ascend_transport.so`) gets the emulated HIXL on the emulated devices
/// (glibc maps the one object once, so HIXL, ACL and HCCL share state). [`emulator_lib_dir`]
/// stays without them: tests of the fallback when HIXL is absent use it.
pub fn emulator_lib_dir_with_hixl(variant: Emulator) -> Result<TempDir, String> {
    link_dir(&emulator_library(variant)?, &WITH_HIXL)
}

const WITH_HIXL: [&str; 5] =
    [crate::search::ACL_LIBRARY, crate::search::HCCL_LIBRARY, HIXL_LIBRARIES[0], HIXL_LIBRARIES[1], HIXL_LIBRARIES[2]];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hixl_dir_adds_the_three_hixl_names_and_the_plain_one_does_not() {
        let src = TempDir::new("ferry-fake-emu").unwrap();
        let lib = src.path().join("libferry_cann_emu.so");
        std::fs::write(&lib, b"not really a library").unwrap();
        let plain = link_dir(&lib, &[crate::search::ACL_LIBRARY, crate::search::HCCL_LIBRARY]).unwrap();
        let with = link_dir(&lib, &WITH_HIXL).unwrap();
        for name in [crate::search::ACL_LIBRARY, crate::search::HCCL_LIBRARY] {
            assert!(plain.path().join(name).exists() && with.path().join(name).exists(), "{name}");
        }
        for name in HIXL_LIBRARIES {
            assert!(!plain.path().join(name).exists(), "{name} must stay absent from emulator_lib_dir");
            assert_eq!(std::fs::read_link(with.path().join(name)).unwrap(), lib, "{name}");
        }
    }
}
