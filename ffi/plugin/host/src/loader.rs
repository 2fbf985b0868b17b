//! Finding, opening and version-checking plugin libraries.

use std::collections::HashMap;
use std::ffi::{CStr, c_char};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use ferry_abi::{
    FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR, FERRY_PLUGIN_API_V1_0_SIZE, FERRY_PLUGIN_ENTRY_SYMBOL,
    FERRY_PLUGIN_FILE_PREFIX, FerryPluginApi, FerryPluginEntryFn,
};
use ferry_core::{Config, Error, ErrorKind, Result};

/// Environment variable naming plugin directories (`:`-separated), searched after the config's
/// `plugins` list.
pub const PLUGIN_DIR_ENV: &str = "FERRY_PLUGIN_DIR";

/// A plugin library that was opened, version-checked and validated. Never unloaded.
#[derive(Debug)]
pub struct LoadedPlugin {
    path: PathBuf,
    protocol: &'static str,
    api: FerryPluginApi,
    abi_minor: u32,
}

impl LoadedPlugin {
    /// The library's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The protocol it serves.
    pub fn protocol(&self) -> &'static str {
        self.protocol
    }

    /// Its function table (copied; fields past the plugin's `struct_size` are null: a 1.0
    /// plugin has no `set_completion_sink`).
    pub fn api(&self) -> &FerryPluginApi {
        &self.api
    }

    /// The ABI minor version it declared.
    pub fn abi_minor(&self) -> u32 {
        self.abi_minor
    }
}

/// True for protocol names that may become part of a file name: a peer's descriptor is
/// untrusted, and `../x` must not select a library outside the plugin directories.
pub fn is_plugin_protocol_name(protocol: &str) -> bool {
    !protocol.is_empty()
        && protocol.len() <= 64
        && protocol.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `libferry_transport_<protocol>.so`.
pub fn plugin_file_name(protocol: &str) -> String {
    format!("{FERRY_PLUGIN_FILE_PREFIX}{}.so", protocol.to_ascii_lowercase())
}

/// The places searched for plugins, in order: the config's `plugins` entries, then each
/// directory of `FERRY_PLUGIN_DIR`.
pub fn search_path(config: &Config) -> Vec<PathBuf> {
    let mut paths = config.plugin_paths();
    if let Ok(dirs) = std::env::var(PLUGIN_DIR_ENV) {
        paths.extend(dirs.split(':').filter(|d| !d.is_empty()).map(PathBuf::from));
    }
    paths
}

/// The library file for `protocol` in `paths` (a directory holding it, or the file itself).
pub fn find_plugin(protocol: &str, paths: &[PathBuf]) -> Option<PathBuf> {
    let file = plugin_file_name(protocol);
    paths.iter().find_map(|p| {
        if p.is_dir() {
            let candidate = p.join(&file);
            candidate.is_file().then_some(candidate)
        } else {
            (p.file_name().is_some_and(|n| n == file.as_str()) && p.is_file()).then(|| p.clone())
        }
    })
}

fn loaded() -> &'static Mutex<HashMap<String, Arc<LoadedPlugin>>> {
    static LOADED: OnceLock<Mutex<HashMap<String, Arc<LoadedPlugin>>>> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

/// The plugin already loaded for `protocol`, if any.
pub fn already_loaded(protocol: &str) -> Option<Arc<LoadedPlugin>> {
    loaded().lock().unwrap_or_else(|p| p.into_inner()).get(&protocol.to_ascii_lowercase()).cloned()
}

fn plugin_error(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Plugin, format!("plugin {}: {msg}", path.display()))
}

/// Opens the library at `path`, which must serve `protocol`, or returns the one already loaded
/// for that protocol. Loads with `RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE` and never unloads.
///
/// Errors ([`ErrorKind::Plugin`], naming the file): the library cannot be opened (not a shared
/// library, missing dependencies), has no entry symbol, refuses the host's ABI, declares another
/// ABI major, a table smaller than ABI 1.0's, a missing required function, or another protocol.
pub fn load_plugin(path: &Path, protocol: &str) -> Result<Arc<LoadedPlugin>> {
    let key = protocol.to_ascii_lowercase();
    let mut table = loaded().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = table.get(&key) {
        return Ok(p.clone());
    }
    let path = path.canonicalize().map_err(|e| plugin_error(path, format!("cannot be resolved: {e}")))?;
    let flags = libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE;
    // SAFETY: opening a library runs its initialisers. The file was named by the operator (the
    // config's `plugins` list or FERRY_PLUGIN_DIR): loading it is the point of the call, and it
    // is trusted as much as the program itself.
    let lib = unsafe { libloading::os::unix::Library::open(Some(&path), flags) }
        .map_err(|e| plugin_error(&path, format!("cannot be loaded: {e}")))?;
    let symbol = format!("{FERRY_PLUGIN_ENTRY_SYMBOL}\0");
    // SAFETY: the symbol, if present, is the plugin entry point whose type the ABI fixes.
    let entry = unsafe { lib.get::<FerryPluginEntryFn>(symbol.as_bytes()) }.map_err(|e| {
        plugin_error(&path, format!("is not a Ferry transport plugin: no `{FERRY_PLUGIN_ENTRY_SYMBOL}` symbol ({e})"))
    })?;
    // SAFETY: calling the entry point with the host's version, as the ABI prescribes.
    let api_ptr = unsafe { entry(FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR) };
    if api_ptr.is_null() {
        return Err(plugin_error(
            &path,
            format!(
                "refused host ABI {FERRY_PLUGIN_ABI_MAJOR}.{FERRY_PLUGIN_ABI_MINOR} (its entry point returned null)"
            ),
        ));
    }
    // SAFETY: a non-null table starts with `struct_size: u64, abi_major: u32, abi_minor: u32` in
    // every ABI version; those 16 bytes are read before anything else.
    let (size, major, minor) = unsafe {
        let base = api_ptr.cast::<u8>();
        (
            std::ptr::read_unaligned(base.cast::<u64>()),
            std::ptr::read_unaligned(base.add(8).cast::<u32>()),
            std::ptr::read_unaligned(base.add(12).cast::<u32>()),
        )
    };
    if major != FERRY_PLUGIN_ABI_MAJOR {
        return Err(plugin_error(
            &path,
            format!(
                "speaks plugin ABI {major}.{minor}; this host speaks {FERRY_PLUGIN_ABI_MAJOR}.x (majors must match)"
            ),
        ));
    }
    if size < FERRY_PLUGIN_API_V1_0_SIZE {
        return Err(plugin_error(
            &path,
            format!(
                "declares a function table of {size} bytes, smaller than ABI {major}.0's {FERRY_PLUGIN_API_V1_0_SIZE}: built against a broken or foreign header"
            ),
        ));
    }
    let api = read_table(api_ptr, size);
    let missing: Vec<&str> = [
        ("create", api.create.is_none()),
        ("destroy", api.destroy.is_none()),
        ("open_target", api.open_target.is_none()),
        ("close_target", api.close_target.is_none()),
        ("submit", api.submit.is_none()),
        ("poll", api.poll.is_none()),
        ("cancel", api.cancel.is_none()),
        ("free_batch", api.free_batch.is_none()),
    ]
    .into_iter()
    .filter_map(|(name, absent)| absent.then_some(name))
    .collect();
    if !missing.is_empty() {
        return Err(plugin_error(&path, format!("lacks required functions: {}", missing.join(", "))));
    }
    if api.protocol.is_null() {
        return Err(plugin_error(&path, "declares no protocol name"));
    }
    // SAFETY: the ABI makes `protocol` a NUL-terminated static string.
    let declared = unsafe { CStr::from_ptr(api.protocol as *const c_char) };
    let declared = declared.to_str().map_err(|_| plugin_error(&path, "its protocol name is not UTF-8"))?;
    if !declared.eq_ignore_ascii_case(protocol) {
        return Err(plugin_error(&path, format!("serves protocol {declared:?}, but its file name says {protocol:?}")));
    }
    // Never unloaded: RTLD_NODELETE keeps the code mapped, and forgetting the handle keeps the
    // reference count, so function pointers stay valid for the life of the process.
    std::mem::forget(lib);
    let plugin = Arc::new(LoadedPlugin {
        path,
        protocol: Box::leak(declared.to_owned().into_boxed_str()),
        api,
        abi_minor: minor,
    });
    tracing::info!(protocol = plugin.protocol, path = %plugin.path.display(), abi = %format!("{major}.{minor}"), "transport plugin loaded");
    table.insert(key, plugin.clone());
    Ok(plugin)
}

/// Copies the plugin's table: the first `min(size, size_of::<FerryPluginApi>())` bytes, the
/// rest null. A 1.0 plugin's table ends before the fields later minors appended; a newer
/// plugin's may go on past the ones this host knows.
fn read_table(api_ptr: *const FerryPluginApi, size: u64) -> FerryPluginApi {
    let known = std::mem::size_of::<FerryPluginApi>();
    let len = usize::try_from(size).map_or(known, |s| s.min(known));
    let mut api = std::mem::MaybeUninit::<FerryPluginApi>::zeroed();
    // SAFETY: the plugin declared a table of `size` readable bytes (its `struct_size`), and
    // `len <= size`; the destination is a local of `known >= len` bytes, not overlapping it.
    unsafe { std::ptr::copy_nonoverlapping(api_ptr.cast::<u8>(), api.as_mut_ptr().cast::<u8>(), len) };
    // SAFETY: every field of `FerryPluginApi` is an integer, a raw pointer or an `Option` of a
    // function pointer, for which all-zero bytes (the fields not copied) and any bytes the
    // plugin wrote are valid values.
    unsafe { api.assume_init() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_names_that_could_escape_the_directory_are_refused() {
        for bad in ["", "../x", "a/b", "x.so", "a b", "é", &"x".repeat(65)] {
            assert!(!is_plugin_protocol_name(bad), "{bad:?}");
        }
        for good in ["example", "my-rdma_2", "CMemcpy"] {
            assert!(is_plugin_protocol_name(good), "{good:?}");
        }
        assert_eq!(plugin_file_name("CMemcpy"), "libferry_transport_cmemcpy.so");
    }

    #[test]
    fn find_plugin_accepts_directories_and_exact_files() {
        let dir = std::env::temp_dir().join(format!("ferry-find-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("libferry_transport_demo.so");
        std::fs::write(&file, b"not a library").unwrap();
        let missing = dir.join("nowhere");
        assert_eq!(find_plugin("demo", &[missing.clone(), dir.clone()]), Some(file.clone()));
        assert_eq!(find_plugin("demo", std::slice::from_ref(&file)), Some(file.clone()));
        assert_eq!(find_plugin("other", &[dir.clone(), file.clone()]), None);
        let e = load_plugin(&file, "demo").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Plugin);
        assert!(e.message().contains("cannot be loaded") && e.message().contains("libferry_transport_demo.so"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
