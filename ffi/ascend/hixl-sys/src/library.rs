//! Finding and loading HIXL: which API, which files, which entry points.

use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::mem::ManuallyDrop;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use ferry_ascend_sys::{Attempt, HIXL_LIBRARY, LLM_DATADIST_LIBRARY, METADEF_LIBRARY, SearchPath};

use crate::error::{ApiFailure, HixlError, LoadError};
use crate::shim::{self, CxxError, Fns};
use crate::symbols::{self, ADXL, ASCEND_STRING, HIXL, Symbol, idx};
use crate::types::{FeatureType, Status};

/// The environment variable that picks the API: `hixl`, `adxl`, or `auto` (the default: `hixl`
/// when its library has every required entry point, else `adxl`).
pub const API_ENV: &str = "FERRY_HIXL_API";

/// Which of HIXL's two C++ APIs is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HixlApi {
    /// `hixl::Hixl` in `libcann_hixl.so` (CANN >= 8.5).
    Hixl,
    /// `adxl::AdxlEngine` in `libllm_datadist.so` (CANN 8.3 on; deprecated by HIXL, and what
    /// Mooncake's `ascend_direct` transport calls).
    Adxl,
}

impl HixlApi {
    /// The class: `hixl::Hixl` or `adxl::AdxlEngine`.
    pub fn class(self) -> &'static str {
        match self {
            HixlApi::Hixl => "hixl::Hixl",
            HixlApi::Adxl => "adxl::AdxlEngine",
        }
    }

    /// The library that exports it.
    pub fn library_file(self) -> &'static str {
        match self {
            HixlApi::Hixl => HIXL_LIBRARY,
            HixlApi::Adxl => LLM_DATADIST_LIBRARY,
        }
    }

    /// The engine entry points Ferry resolves for this API (required and optional), with
    /// their mangled names. `ge::AscendString`'s two are [`crate::ASCEND_STRING`].
    pub fn symbols(self) -> &'static [Symbol] {
        match self {
            HixlApi::Hixl => &HIXL,
            HixlApi::Adxl => &ADXL,
        }
    }

    pub(crate) fn call(self, i: usize) -> &'static str {
        self.symbols()[i].name
    }
}

impl fmt::Display for HixlApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.class())
    }
}

/// Which API to load ([`API_ENV`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ApiChoice {
    /// `hixl::Hixl` when usable, else `adxl::AdxlEngine`.
    #[default]
    Auto,
    /// Only `hixl::Hixl`.
    Hixl,
    /// Only `adxl::AdxlEngine`.
    Adxl,
}

impl ApiChoice {
    /// The choice of this process's environment ([`API_ENV`]; unset or empty is `Auto`).
    pub fn from_env() -> Result<Self, LoadError> {
        Self::parse(std::env::var(API_ENV).ok().as_deref())
    }

    /// Parses a value of [`API_ENV`] (case-insensitive; `None` or blank is `Auto`).
    pub fn parse(value: Option<&str>) -> Result<Self, LoadError> {
        let v = value.map(str::trim).unwrap_or("");
        match v.to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(ApiChoice::Auto),
            "hixl" => Ok(ApiChoice::Hixl),
            "adxl" => Ok(ApiChoice::Adxl),
            _ => Err(LoadError::BadChoice { value: v.to_owned() }),
        }
    }

    fn order(self) -> &'static [HixlApi] {
        match self {
            ApiChoice::Auto => &[HixlApi::Hixl, HixlApi::Adxl],
            ApiChoice::Hixl => &[HixlApi::Hixl],
            ApiChoice::Adxl => &[HixlApi::Adxl],
        }
    }
}

/// A loaded shared object. Kept loaded for the life of the process once a library uses it
/// (function pointers into it are stored); a candidate that is not used is closed again.
struct Object {
    path: String,
    lib: ManuallyDrop<libloading::os::unix::Library>,
}

impl Object {
    fn open(path: &str) -> Result<Self, String> {
        // SAFETY: loading a shared object runs its initialisers; the files opened here are the
        // HIXL/CANN libraries (or a stand-in with the same interface), whose initialisers are the
        // vendor's contract. RTLD_NOW makes an unresolved reference fail here rather than at a
        // later call; RTLD_GLOBAL gives the C++ libraries one shared view of their symbols
        // (typeinfo, `ge::AscendString`), as linking against them would.
        let lib = unsafe { libloading::os::unix::Library::open(Some(path), libc::RTLD_NOW | libc::RTLD_GLOBAL) }
            .map_err(|e| e.to_string())?;
        Ok(Self { path: path.to_owned(), lib: ManuallyDrop::new(lib) })
    }

    /// The address of `name` in this object or its dependencies.
    fn sym(&self, name: &str) -> Option<*const c_void> {
        // SAFETY: only the address is read; nothing is called through it here.
        unsafe { self.lib.get::<*const c_void>(name.as_bytes()) }.ok().map(|s| *s).filter(|p| !p.is_null())
    }

    /// Closes a candidate that was not used.
    fn close(mut self) {
        // SAFETY: no address from this object was kept (it is closed only when the library that
        // would have used it was rejected), and `lib` is not used after being taken.
        drop(unsafe { ManuallyDrop::take(&mut self.lib) });
    }
}

/// HIXL, loaded: the API in use, where it came from, and its entry points.
///
/// Loaded once per process per file ([`HixlLibrary::load`]) and never unloaded; shared as an
/// `Arc`. Create engines with [`HixlEngine::new`](crate::HixlEngine::new).
pub struct HixlLibrary {
    api: HixlApi,
    path: String,
    string_path: String,
    pub(crate) fns: Fns,
    missing_optional: Vec<&'static str>,
    _objects: Vec<Object>,
}

// SAFETY: the struct holds addresses of functions in libraries that are never unloaded, paths,
// and library handles that are only kept (never used after loading). Calling through the
// addresses is what `HixlEngine` does, and its own `Send`/`Sync` argument covers that.
unsafe impl Send for HixlLibrary {}
// SAFETY: as above; nothing here is mutated after construction.
unsafe impl Sync for HixlLibrary {}

impl fmt::Debug for HixlLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HixlLibrary")
            .field("api", &self.api)
            .field("path", &self.path)
            .field("ascend_string", &self.string_path)
            .field("missing_optional", &self.missing_optional)
            .finish()
    }
}

/// `hixl::Hixl (/usr/local/Ascend/cann/lib64/libcann_hixl.so)`.
impl fmt::Display for HixlLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.api, self.path)
    }
}

type Cache = HashMap<(HixlApi, String), Arc<HixlLibrary>>;
static LOADED: OnceLock<Mutex<Cache>> = OnceLock::new();

impl HixlLibrary {
    /// Loads HIXL from `search`, with the API chosen by [`API_ENV`] (see [`ApiChoice`]).
    ///
    /// # Errors
    /// [`LoadError::BadChoice`] for an unknown [`API_ENV`] value; [`LoadError::NotFound`]
    /// naming, per API tried, every file looked for, where, and why it was not used.
    pub fn load(search: &SearchPath) -> Result<Arc<Self>, LoadError> {
        Self::load_with(search, ApiChoice::from_env()?)
    }

    /// Loads HIXL from `search` with an explicit API choice.
    ///
    /// For each allowed API in turn (`hixl::Hixl` first under [`ApiChoice::Auto`]), each
    /// candidate file of its library (`libcann_hixl.so` or `libllm_datadist.so`, in the order
    /// of [`SearchPath::candidates`]) is opened (`RTLD_NOW | RTLD_GLOBAL`) and must export
    /// every required engine entry point. `ge::AscendString` is taken from that library's own
    /// dependencies, else from `libmetadef.so` (its directory first, then the search path);
    /// `libmetadef.so` in the same directory is opened first, so the library's reference to
    /// it resolves to that copy. CANN's other dependencies (ACL, HCCL, ...) are found by the
    /// dynamic loader (CANN's `set_env.sh` sets `LD_LIBRARY_PATH`).
    ///
    /// The same file is loaded once per process: a later call that finds it returns the first
    /// call's library.
    pub fn load_with(search: &SearchPath, choice: ApiChoice) -> Result<Arc<Self>, LoadError> {
        let mut cache = LOADED.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|p| p.into_inner());
        let mut failures = Vec::new();
        for &api in choice.order() {
            match try_api(search, api, &mut cache) {
                Ok(lib) => return Ok(lib),
                Err(tried) => failures.push(ApiFailure { api, tried }),
            }
        }
        Err(LoadError::NotFound { choice, failures })
    }

    /// The API in use.
    pub fn api(&self) -> HixlApi {
        self.api
    }

    /// The file the API's library was loaded from (as opened: a path, or the bare file name when
    /// the dynamic loader found it).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The file `ge::AscendString` was resolved through.
    pub fn ascend_string_path(&self) -> &str {
        &self.string_path
    }

    /// The optional entry points this release does not export (for diagnostics).
    pub fn missing_optional(&self) -> &[&'static str] {
        &self.missing_optional
    }

    /// Whether `TransferAsync` and `GetTransferStatus` are both exported.
    pub fn has_async(&self) -> bool {
        !self.fns.transfer_async.is_null() && !self.fns.get_transfer_status.is_null()
    }

    /// Whether `GetCapability` is exported.
    pub fn has_capability_query(&self) -> bool {
        !self.fns.get_capability.is_null()
    }

    /// Whether the library supports `feature` (`GetCapability`, a static call that needs no
    /// engine): `None` when `GetCapability` is not exported. A call that fails counts as
    /// unsupported, as in Mooncake (`IsAdxlFeatureSupported`); [`Self::capability_value`] gives
    /// the failure.
    pub fn capability(&self, feature: FeatureType) -> Option<bool> {
        if !self.has_capability_query() {
            return None;
        }
        match self.capability_value(feature) {
            Ok(v) => Some(v == 1),
            Err(e) => {
                tracing::debug!(%feature, error = %e, "GetCapability failed; the feature counts as unsupported");
                Some(false)
            }
        }
    }

    /// `GetCapability(feature, value)`'s value (1 supported, 0 not).
    pub fn capability_value(&self, feature: FeatureType) -> Result<i32, HixlError> {
        let call = self.call(idx::GET_CAPABILITY);
        if !self.has_capability_query() {
            return Err(self.unsupported(call));
        }
        let mut value = 0i32;
        let mut err = CxxError::new();
        // SAFETY: `fns.get_capability` is the exported static `GetCapability(FeatureType,
        // int32_t&)`; `value` and `err` are valid out-pointers for the call.
        let status = unsafe { shim::ferry_hixl_get_capability(&self.fns, feature.0, &mut value, &mut err) };
        check(call, status, &err)?;
        Ok(value)
    }

    pub(crate) fn call(&self, i: usize) -> &'static str {
        self.api.call(i)
    }

    pub(crate) fn unsupported(&self, call: &'static str) -> HixlError {
        HixlError::Unsupported { call, library: self.path.clone() }
    }
}

/// Turns a shim call's outcome into a result: a caught exception first, then the status.
pub(crate) fn check(call: &'static str, status: u32, err: &CxxError) -> Result<(), HixlError> {
    if let Some(what) = err.take() {
        return Err(HixlError::Exception { call, what });
    }
    if status == Status::SUCCESS.0 { Ok(()) } else { Err(HixlError::Status { call, status: Status(status) }) }
}

/// Tries each candidate file of `api`'s library; returns the loaded library or every attempt.
fn try_api(search: &SearchPath, api: HixlApi, cache: &mut Cache) -> Result<Arc<HixlLibrary>, Vec<Attempt>> {
    let file = api.library_file();
    let mut tried = Vec::new();
    for (path, source) in search.candidates(file, None) {
        let shown = path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| file.to_owned());
        if let Some(lib) = cache.get(&(api, shown.clone())) {
            return Ok(lib.clone());
        }
        if let Some(p) = &path
            && !p.exists()
        {
            tried.push(Attempt { path: shown, source, reason: "no such file".into() });
            continue;
        }
        let dir = path.as_deref().and_then(Path::parent);
        let mut objects = Vec::new();
        // libmetadef.so of the same directory first, so the library's dependency on it
        // resolves to that copy (when it fails to load, the library's own load says why).
        if let Some(m) = dir.map(|d| d.join(METADEF_LIBRARY)).filter(|m| m.is_file())
            && let Ok(o) = Object::open(&m.display().to_string())
        {
            objects.push(o);
        }
        let obj = match Object::open(&shown) {
            Ok(o) => o,
            Err(e) => {
                tried.push(Attempt { path: shown, source, reason: format!("cannot be loaded: {e}") });
                objects.into_iter().for_each(Object::close);
                continue;
            }
        };
        let missing: Vec<&str> =
            api.symbols().iter().filter(|s| s.required && obj.sym(s.mangled).is_none()).map(|s| s.name).collect();
        if !missing.is_empty() {
            tried.push(Attempt {
                path: shown,
                source,
                reason: format!(
                    "loaded, but it lacks {} (not HIXL, or a release Ferry does not support)",
                    missing.join(", ")
                ),
            });
            obj.close();
            objects.into_iter().for_each(Object::close);
            continue;
        }
        let strings = match ascend_string(search, &obj, dir, file) {
            Ok(s) => s,
            Err(reason) => {
                tried.push(Attempt { path: shown, source, reason });
                obj.close();
                objects.into_iter().for_each(Object::close);
                continue;
            }
        };
        let (string_ctor, string_less, string_path, string_obj) = strings;
        let sym = |i: usize| obj.sym(api.symbols()[i].mangled).unwrap_or(std::ptr::null());
        let fns = Fns {
            string_ctor,
            string_less,
            engine_ctor: sym(idx::CTOR),
            engine_dtor: sym(idx::DTOR),
            initialize: sym(idx::INITIALIZE),
            finalize: sym(idx::FINALIZE),
            register_mem: sym(idx::REGISTER_MEM),
            deregister_mem: sym(idx::DEREGISTER_MEM),
            connect: sym(idx::CONNECT),
            disconnect: sym(idx::DISCONNECT),
            transfer_sync: sym(idx::TRANSFER_SYNC),
            transfer_async: sym(idx::TRANSFER_ASYNC),
            get_transfer_status: sym(idx::GET_TRANSFER_STATUS),
            get_capability: sym(idx::GET_CAPABILITY),
        };
        let missing_optional: Vec<&'static str> =
            api.symbols().iter().filter(|s| !s.required && obj.sym(s.mangled).is_none()).map(|s| s.name).collect();
        objects.push(obj);
        objects.extend(string_obj);
        let lib =
            Arc::new(HixlLibrary { api, path: shown.clone(), string_path, fns, missing_optional, _objects: objects });
        tracing::info!(api = %lib.api, path = %lib.path, ascend_string = %lib.string_path,
            missing_optional = ?lib.missing_optional, "HIXL loaded");
        cache.insert((api, shown), lib.clone());
        return Ok(lib);
    }
    Err(tried)
}

type Strings = (*const c_void, *const c_void, String, Option<Object>);

/// `ge::AscendString`'s constructor and `operator<`: from `api_obj`'s own scope (its
/// dependencies), else from `libmetadef.so` (the API library's directory first, then the search
/// path). Returns the addresses, the file they came from, and the extra object to keep.
fn ascend_string(search: &SearchPath, api_obj: &Object, dir: Option<&Path>, file: &str) -> Result<Strings, String> {
    let [ctor, less] = &symbols::ASCEND_STRING;
    if let (Some(c), Some(l)) = (api_obj.sym(ctor.mangled), api_obj.sym(less.mangled)) {
        return Ok((c, l, api_obj.path.clone(), None));
    }
    let mut candidates: Vec<(Option<std::path::PathBuf>, String)> = Vec::new();
    if let Some(d) = dir {
        candidates.push((Some(d.join(METADEF_LIBRARY)), format!("directory of {file}")));
    }
    for c in search.candidates(METADEF_LIBRARY, None) {
        if !candidates.iter().any(|(p, _)| *p == c.0) {
            candidates.push(c);
        }
    }
    let mut tried = Vec::new();
    for (path, source) in candidates {
        let shown = path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| METADEF_LIBRARY.to_owned());
        if let Some(p) = &path
            && !p.exists()
        {
            tried.push(format!("{shown} ({source}): no such file"));
            continue;
        }
        match Object::open(&shown) {
            Err(e) => tried.push(format!("{shown} ({source}): cannot be loaded: {e}")),
            Ok(o) => match (o.sym(ctor.mangled), o.sym(less.mangled)) {
                (Some(c), Some(l)) => return Ok((c, l, o.path.clone(), Some(o))),
                _ => {
                    tried.push(format!("{shown} ({source}): loaded, but it lacks ge::AscendString"));
                    o.close();
                }
            },
        }
    }
    Err(format!(
        "loaded, but {} and {} are neither in it nor in {METADEF_LIBRARY} (tried {})",
        ASCEND_STRING[0].signature,
        ASCEND_STRING[1].signature,
        tried.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_choice_parses_the_documented_values_only() {
        assert_eq!(ApiChoice::parse(None).unwrap(), ApiChoice::Auto);
        assert_eq!(ApiChoice::parse(Some(" ")).unwrap(), ApiChoice::Auto);
        assert_eq!(ApiChoice::parse(Some("auto")).unwrap(), ApiChoice::Auto);
        assert_eq!(ApiChoice::parse(Some("HIXL")).unwrap(), ApiChoice::Hixl);
        assert_eq!(ApiChoice::parse(Some("adxl")).unwrap(), ApiChoice::Adxl);
        let e = ApiChoice::parse(Some("llm")).unwrap_err();
        assert_eq!(e.to_string(), "FERRY_HIXL_API=\"llm\" is not one of hixl, adxl, auto");
    }

    #[test]
    fn apis_name_their_class_and_library() {
        assert_eq!(HixlApi::Hixl.to_string(), "hixl::Hixl");
        assert_eq!(HixlApi::Adxl.to_string(), "adxl::AdxlEngine");
        assert_eq!(HixlApi::Hixl.library_file(), "libcann_hixl.so");
        assert_eq!(HixlApi::Adxl.library_file(), "libllm_datadist.so");
        assert_eq!(HixlApi::Adxl.call(idx::CONNECT), "adxl::AdxlEngine::Connect");
    }
}
