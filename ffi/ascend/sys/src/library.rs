//! Loading `libascendcl.so` and `libhccl.so` (+ `libhcomm.so`) at run time and resolving their
//! symbols: required ones fail the load, optional ones become [`Capabilities`]. The resolved
//! functions are handed out as tables of raw function pointers ([`AclFns`], [`HcclFns`],
//! [`OneSidedFns`], [`OptionalFns`]); calling them is the caller's `unsafe` business.

use std::collections::HashMap;
use std::ffi::{CStr, c_char};
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use crate::codes::{ACL_ERROR_REPEAT_INITIALIZE, acl_code_name, hccl_code_name};
use crate::error::{Attempt, LoadError};
use crate::raw;
use crate::search::{ACL_LIBRARY, HCCL_LIBRARY, HCOMM_LIBRARY, SearchPath};

/// What the loaded CANN release offers beyond the required set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// The one-sided service (`HcclRegisterGlobalMem`, `HcclCommInitClusterInfoMemConfig`,
    /// bind/unbind, `HcclCommPrepare`, `HcclBatchGet`/`HcclBatchPut`, deregister): all present.
    pub one_sided: bool,
    /// `aclrtSynchronizeStreamWithTimeout` (else stream waits are unbounded).
    pub sync_with_timeout: bool,
    /// `aclrtStreamAbort`.
    pub stream_abort: bool,
    /// `aclrtGetPhyDevIdByUserDevId`.
    pub phy_id_by_user: bool,
    /// `aclrtGetPhyDevIdByLogicDevId`.
    pub phy_id_by_logic: bool,
    /// `aclrtPointerGetAttributes`.
    pub pointer_attributes: bool,
    /// `aclGetRecentErrMsg`.
    pub recent_error_text: bool,
    /// `HcclGetErrorString`.
    pub hccl_error_string: bool,
    /// `aclrtGetVersion`.
    pub version_query: bool,
}

/// The ACL functions every supported release exports (the load fails without one).
///
/// Each pointer stays valid for the life of the process (the libraries are never unloaded);
/// its type is the symbol's C declaration ([`raw`]).
#[non_exhaustive]
#[derive(Debug, Clone, Copy)]
pub struct AclFns {
    /// `aclInit`.
    pub init: raw::AclInit,
    /// `aclrtSetDevice`.
    pub set_device: raw::AclrtSetDevice,
    /// `aclrtGetDevice`.
    pub get_device: raw::AclrtGetDevice,
    /// `aclrtGetDeviceCount`.
    pub get_device_count: raw::AclrtGetDeviceCount,
    /// `aclrtMalloc`.
    pub malloc: raw::AclrtMalloc,
    /// `aclrtFree`.
    pub free: raw::AclrtFree,
    /// `aclrtMemcpy`.
    pub memcpy: raw::AclrtMemcpy,
    /// `aclrtCreateStream`.
    pub create_stream: raw::AclrtCreateStream,
    /// `aclrtDestroyStream`.
    pub destroy_stream: raw::AclrtStreamOp,
    /// `aclrtSynchronizeStream`.
    pub synchronize_stream: raw::AclrtStreamOp,
}

/// The HCCL functions every supported release exports: the two-sided service.
#[non_exhaustive]
#[derive(Debug, Clone, Copy)]
pub struct HcclFns {
    /// `HcclGetRootInfo`.
    pub get_root_info: raw::HcclGetRootInfo,
    /// `HcclCommInitRootInfo`.
    pub comm_init_root_info: raw::HcclCommInitRootInfo,
    /// `HcclCommDestroy`.
    pub comm_destroy: raw::HcclCommDestroy,
    /// `HcclSend`.
    pub send: raw::HcclSendRecv,
    /// `HcclRecv`.
    pub recv: raw::HcclSendRecv,
}

/// HCCL's one-sided service: present only when every one of these functions is.
#[non_exhaustive]
#[derive(Debug, Clone, Copy)]
pub struct OneSidedFns {
    /// `HcclRegisterGlobalMem`.
    pub register_global_mem: raw::HcclRegisterGlobalMem,
    /// `HcclDeregisterGlobalMem`.
    pub deregister_global_mem: raw::HcclDeregisterGlobalMem,
    /// `HcclCommInitClusterInfoMemConfig`.
    pub init_cluster_info_mem_config: raw::HcclCommInitClusterInfoMemConfig,
    /// `HcclCommBindMem`.
    pub bind_mem: raw::HcclCommMem,
    /// `HcclCommUnbindMem`.
    pub unbind_mem: raw::HcclCommMem,
    /// `HcclCommPrepare`.
    pub prepare: raw::HcclCommPrepare,
    /// `HcclBatchPut`.
    pub batch_put: raw::HcclBatchOp,
    /// `HcclBatchGet`.
    pub batch_get: raw::HcclBatchOp,
}

/// Functions some releases lack; `None` where the loaded one does.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, Default)]
pub struct OptionalFns {
    /// `aclrtSynchronizeStreamWithTimeout`.
    pub sync_with_timeout: Option<raw::AclrtSynchronizeStreamWithTimeout>,
    /// `aclrtStreamAbort`.
    pub stream_abort: Option<raw::AclrtStreamOp>,
    /// `aclrtGetPhyDevIdByUserDevId`.
    pub phy_by_user: Option<raw::AclrtGetPhyDevId>,
    /// `aclrtGetPhyDevIdByLogicDevId`.
    pub phy_by_logic: Option<raw::AclrtGetPhyDevId>,
    /// `aclrtPointerGetAttributes`.
    pub pointer_attributes: Option<raw::AclrtPointerGetAttributes>,
    /// `aclrtGetLogicDevIdByUserDevId`.
    pub logic_by_user: Option<raw::AclrtGetPhyDevId>,
    /// `aclrtMallocHost`.
    pub malloc_host: Option<raw::AclrtMallocHost>,
    /// `aclrtGetDeviceInfo`.
    pub device_info: Option<raw::AclrtGetDeviceInfo>,
    /// `aclrtGetCurrentContext`.
    pub current_context: Option<raw::AclrtGetCurrentContext>,
    /// `aclrtStreamQuery`.
    pub stream_query: Option<raw::AclrtStreamQuery>,
    /// `aclrtFreeHost`.
    pub free_host: Option<raw::AclrtFree>,
    /// `aclGetRecentErrMsg`.
    pub recent_err_msg: Option<raw::AclGetText>,
    /// `aclrtGetSocName`.
    pub soc_name: Option<raw::AclGetText>,
    /// `aclrtGetVersion`.
    pub version: Option<raw::AclrtGetVersion>,
    /// `HcclGetErrorString`.
    pub hccl_error_string: Option<raw::HcclGetErrorString>,
    /// `HcclGetRankId`.
    pub rank_id: Option<raw::HcclCommQuery>,
    /// `HcclGetRankSize`.
    pub rank_size: Option<raw::HcclCommQuery>,
    /// The one-sided service, when every one of its functions is exported.
    pub one_sided: Option<OneSidedFns>,
}

const REQUIRED_ACL: &[&str] = &[
    "aclInit",
    "aclrtSetDevice",
    "aclrtGetDevice",
    "aclrtGetDeviceCount",
    "aclrtMalloc",
    "aclrtFree",
    "aclrtMemcpy",
    "aclrtCreateStream",
    "aclrtDestroyStream",
    "aclrtSynchronizeStream",
];
const REQUIRED_HCCL: &[&str] = &["HcclGetRootInfo", "HcclCommInitRootInfo", "HcclCommDestroy", "HcclSend", "HcclRecv"];
const ONE_SIDED: &[&str] = &[
    "HcclRegisterGlobalMem",
    "HcclDeregisterGlobalMem",
    "HcclCommInitClusterInfoMemConfig",
    "HcclCommBindMem",
    "HcclCommUnbindMem",
    "HcclCommPrepare",
    "HcclBatchPut",
    "HcclBatchGet",
];
const OPTIONAL_ACL: &[&str] = &[
    "aclrtSynchronizeStreamWithTimeout",
    "aclrtStreamAbort",
    "aclrtGetPhyDevIdByUserDevId",
    "aclrtGetPhyDevIdByLogicDevId",
    "aclrtPointerGetAttributes",
    "aclrtGetLogicDevIdByUserDevId",
    "aclrtMallocHost",
    "aclrtFreeHost",
    "aclrtGetDeviceInfo",
    "aclGetRecentErrMsg",
    "aclrtGetSocName",
    "aclrtGetVersion",
];
const OPTIONAL_HCCL: &[&str] = &["HcclGetErrorString", "HcclGetRankId", "HcclGetRankSize"];

/// A loaded shared object: kept loaded for the life of the process (never `dlclose`d, since
/// function pointers taken from it are stored everywhere).
struct Object {
    path: String,
    lib: ManuallyDrop<libloading::Library>,
}

impl Object {
    fn open(path: &str) -> Result<Self, String> {
        // SAFETY: loading a shared object runs its initialisers; the libraries named here are
        // CANN's (or a stand-in with the same C surface), whose initialisers are the vendor's
        // contract. RTLD_NOW makes unresolved references fail here, not at a later call.
        let lib = unsafe { libloading::os::unix::Library::open(Some(path), libc::RTLD_NOW | libc::RTLD_LOCAL) }
            .map_err(|e| e.to_string())?;
        Ok(Self { path: path.to_owned(), lib: ManuallyDrop::new(lib.into()) })
    }

    fn has(&self, name: &str) -> bool {
        // SAFETY: only the address is looked up; nothing is called through it.
        unsafe { self.lib.get::<*const ()>(name.as_bytes()) }.is_ok()
    }

    /// The symbol `name` as a `T`.
    ///
    /// # Safety
    /// `T` must be the function-pointer type of the symbol's C declaration.
    unsafe fn get<T: Copy>(&self, name: &str) -> Option<T> {
        // SAFETY: the caller guarantees `T` matches the symbol's declaration; the library stays
        // loaded forever, so the pointer never dangles.
        unsafe { self.lib.get::<T>(name.as_bytes()) }.ok().map(|s| *s)
    }
}

/// Which file each library was loaded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedPaths {
    /// `libascendcl.so` as loaded.
    pub acl: String,
    /// `libhccl.so` as loaded.
    pub hccl: String,
    /// `libhcomm.so`, when some symbol came from it.
    pub hcomm: Option<String>,
}

/// The loaded ACL and HCCL libraries: the required functions, the optional ones found, and
/// what they add up to ([`Capabilities`]).
///
/// Loaded once per process per library file ([`Library::load`]) and never unloaded. Shared as
/// an `Arc`; every method may be called from any thread, but ACL device state is per thread:
/// calls that need a device belong on a thread bound to it (`ferry-ascend-runtime`'s `Device`
/// and `DeviceThread`).
pub struct Library {
    paths: LoadedPaths,
    acl: AclFns,
    hccl: HcclFns,
    opt: OptionalFns,
    caps: Capabilities,
    missing_optional: Vec<&'static str>,
    initialized: OnceLock<Result<(), i32>>,
    _objects: Vec<Object>,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library").field("paths", &self.paths).field("capabilities", &self.caps).finish()
    }
}

static LOADED: OnceLock<Mutex<HashMap<String, Arc<Library>>>> = OnceLock::new();

impl Library {
    /// Loads ACL and HCCL from this process's search path ([`SearchPath::from_env`]), or returns
    /// the already loaded copy.
    pub fn load() -> Result<Arc<Library>, LoadError> {
        Self::load_from(&SearchPath::from_env())
    }

    /// Loads ACL and HCCL from `search`. The same files are loaded once per process: a second
    /// call that finds the same `libascendcl.so` returns the first call's library.
    ///
    /// # Errors
    /// [`LoadError::NotFound`] naming every path tried and why each failed (absent file, not a
    /// loadable object, a loadable object without the ACL symbols), and
    /// [`LoadError::MissingSymbol`] for an HCCL without a required function.
    pub fn load_from(search: &SearchPath) -> Result<Arc<Library>, LoadError> {
        let cache = LOADED.get_or_init(|| Mutex::new(HashMap::new()));
        let (acl_obj, acl_dir) = find(search, ACL_LIBRARY, None, REQUIRED_ACL, "not the ACL runtime")?;
        let mut map = cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(lib) = map.get(&acl_obj.path) {
            return Ok(lib.clone());
        }
        let hccl_obj = find(search, HCCL_LIBRARY, acl_dir.as_deref(), &[], "")?.0;
        // libhcomm.so is consulted only when libhccl.so lacks something.
        let all_hccl = REQUIRED_HCCL.iter().chain(ONE_SIDED).chain(OPTIONAL_HCCL);
        let hcomm_obj = if all_hccl.clone().all(|s| hccl_obj.has(s)) {
            None
        } else {
            find(search, HCOMM_LIBRARY, acl_dir.as_deref(), &[], "").ok().map(|(o, _)| o)
        };
        let lib = Arc::new(Self::resolve(acl_obj, hccl_obj, hcomm_obj)?);
        tracing::info!(acl = %lib.paths.acl, hccl = %lib.paths.hccl, hcomm = ?lib.paths.hcomm, capabilities = ?lib.caps, "CANN libraries loaded");
        map.insert(lib.paths.acl.clone(), lib.clone());
        Ok(lib)
    }

    fn resolve(acl: Object, hccl: Object, hcomm: Option<Object>) -> Result<Self, LoadError> {
        let hccl_objs: Vec<&Object> = std::iter::once(&hccl).chain(hcomm.as_ref()).collect();
        let mut used_hcomm = false;
        let searched = hccl_objs.iter().map(|o| o.path.as_str()).collect::<Vec<_>>().join(", ");
        // Finds an HCCL symbol in libhccl.so, then libhcomm.so.
        let mut hccl_sym = |name: &'static str| -> Option<*const ()> {
            for (i, o) in hccl_objs.iter().enumerate() {
                // SAFETY: a data-pointer lookup; the pointer is transmuted to the declared
                // function type by the typed lookups below.
                if let Some(p) = unsafe { o.get::<*const ()>(name) } {
                    used_hcomm |= i > 0;
                    return Some(p);
                }
            }
            None
        };
        macro_rules! acl_req {
            ($name:literal) => {
                // SAFETY: the type is the symbol's declaration in the reference headers.
                unsafe { acl.get($name) }
                    .ok_or(LoadError::MissingSymbol { symbol: $name, searched: acl.path.clone() })?
            };
        }
        macro_rules! acl_opt {
            ($name:literal) => {
                // SAFETY: the type is the symbol's declaration in the reference headers.
                unsafe { acl.get($name) }
            };
        }
        macro_rules! hccl_any {
            ($name:literal, $ty:ty) => {
                hccl_sym($name).map(|p| {
                    // SAFETY: `p` is the address of the exported function `$name`, whose C
                    // declaration is `$ty`; function and data pointers have the same size here.
                    unsafe { std::mem::transmute::<*const (), $ty>(p) }
                })
            };
        }
        macro_rules! hccl_req {
            ($name:literal, $ty:ty) => {
                hccl_any!($name, $ty)
                    .ok_or_else(|| LoadError::MissingSymbol { symbol: $name, searched: searched.clone() })?
            };
        }
        let acl_fns = AclFns {
            init: acl_req!("aclInit"),
            set_device: acl_req!("aclrtSetDevice"),
            get_device: acl_req!("aclrtGetDevice"),
            get_device_count: acl_req!("aclrtGetDeviceCount"),
            malloc: acl_req!("aclrtMalloc"),
            free: acl_req!("aclrtFree"),
            memcpy: acl_req!("aclrtMemcpy"),
            create_stream: acl_req!("aclrtCreateStream"),
            destroy_stream: acl_req!("aclrtDestroyStream"),
            synchronize_stream: acl_req!("aclrtSynchronizeStream"),
        };
        let hccl_fns = HcclFns {
            get_root_info: hccl_req!("HcclGetRootInfo", raw::HcclGetRootInfo),
            comm_init_root_info: hccl_req!("HcclCommInitRootInfo", raw::HcclCommInitRootInfo),
            comm_destroy: hccl_req!("HcclCommDestroy", raw::HcclCommDestroy),
            send: hccl_req!("HcclSend", raw::HcclSendRecv),
            recv: hccl_req!("HcclRecv", raw::HcclSendRecv),
        };
        let one_sided = (|| {
            Some(OneSidedFns {
                register_global_mem: hccl_any!("HcclRegisterGlobalMem", raw::HcclRegisterGlobalMem)?,
                deregister_global_mem: hccl_any!("HcclDeregisterGlobalMem", raw::HcclDeregisterGlobalMem)?,
                init_cluster_info_mem_config: hccl_any!(
                    "HcclCommInitClusterInfoMemConfig",
                    raw::HcclCommInitClusterInfoMemConfig
                )?,
                bind_mem: hccl_any!("HcclCommBindMem", raw::HcclCommMem)?,
                unbind_mem: hccl_any!("HcclCommUnbindMem", raw::HcclCommMem)?,
                prepare: hccl_any!("HcclCommPrepare", raw::HcclCommPrepare)?,
                batch_put: hccl_any!("HcclBatchPut", raw::HcclBatchOp)?,
                batch_get: hccl_any!("HcclBatchGet", raw::HcclBatchOp)?,
            })
        })();
        let opt = OptionalFns {
            sync_with_timeout: acl_opt!("aclrtSynchronizeStreamWithTimeout"),
            stream_abort: acl_opt!("aclrtStreamAbort"),
            phy_by_user: acl_opt!("aclrtGetPhyDevIdByUserDevId"),
            phy_by_logic: acl_opt!("aclrtGetPhyDevIdByLogicDevId"),
            pointer_attributes: acl_opt!("aclrtPointerGetAttributes"),
            logic_by_user: acl_opt!("aclrtGetLogicDevIdByUserDevId"),
            malloc_host: acl_opt!("aclrtMallocHost"),
            device_info: acl_opt!("aclrtGetDeviceInfo"),
            current_context: acl_opt!("aclrtGetCurrentContext"),
            stream_query: acl_opt!("aclrtStreamQuery"),
            free_host: acl_opt!("aclrtFreeHost"),
            recent_err_msg: acl_opt!("aclGetRecentErrMsg"),
            soc_name: acl_opt!("aclrtGetSocName"),
            version: acl_opt!("aclrtGetVersion"),
            hccl_error_string: hccl_any!("HcclGetErrorString", raw::HcclGetErrorString),
            rank_id: hccl_any!("HcclGetRankId", raw::HcclCommQuery),
            rank_size: hccl_any!("HcclGetRankSize", raw::HcclCommQuery),
            one_sided,
        };
        let caps = Capabilities {
            one_sided: opt.one_sided.is_some(),
            sync_with_timeout: opt.sync_with_timeout.is_some(),
            stream_abort: opt.stream_abort.is_some(),
            phy_id_by_user: opt.phy_by_user.is_some(),
            phy_id_by_logic: opt.phy_by_logic.is_some(),
            pointer_attributes: opt.pointer_attributes.is_some(),
            recent_error_text: opt.recent_err_msg.is_some(),
            hccl_error_string: opt.hccl_error_string.is_some(),
            version_query: opt.version.is_some(),
        };
        let missing_optional: Vec<&'static str> = OPTIONAL_ACL
            .iter()
            .filter(|s| !acl.has(s))
            .chain(ONE_SIDED.iter().chain(OPTIONAL_HCCL).filter(|s| !hccl_objs.iter().any(|o| o.has(s))))
            .copied()
            .collect();
        let paths = LoadedPaths {
            acl: acl.path.clone(),
            hccl: hccl.path.clone(),
            hcomm: if used_hcomm { hcomm.as_ref().map(|o| o.path.clone()) } else { None },
        };
        let mut objects = vec![acl, hccl];
        objects.extend(hcomm);
        Ok(Self {
            paths,
            acl: acl_fns,
            hccl: hccl_fns,
            opt,
            caps,
            missing_optional,
            initialized: OnceLock::new(),
            _objects: objects,
        })
    }

    /// Which files were loaded.
    pub fn paths(&self) -> &LoadedPaths {
        &self.paths
    }

    /// What this CANN release offers beyond the required set.
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// Optional symbols this CANN release does not export (for diagnostics).
    pub fn missing_optional(&self) -> &[&'static str] {
        &self.missing_optional
    }

    /// The required ACL functions.
    pub fn acl(&self) -> &AclFns {
        &self.acl
    }

    /// The required HCCL functions.
    pub fn hccl(&self) -> &HcclFns {
        &self.hccl
    }

    /// The optional functions this release exports.
    pub fn optional(&self) -> &OptionalFns {
        &self.opt
    }

    /// Calls `aclInit(NULL)` once per process and returns the `aclError` of a failure (every
    /// later call returns the same). A repeated initialisation (100002) counts as success,
    /// since the application may have initialised ACL itself.
    pub fn initialize(&self) -> Result<(), i32> {
        *self.initialized.get_or_init(|| {
            // SAFETY: aclInit takes an optional config path; NULL means none.
            let code = unsafe { (self.acl.init)(std::ptr::null()) };
            if code == 0 || code == ACL_ERROR_REPEAT_INITIALIZE { Ok(()) } else { Err(code) }
        })
    }

    /// The text of ACL error `code`: `aclGetRecentErrMsg` (this thread's last error), else a
    /// description of the code.
    pub fn acl_text(&self, code: i32) -> String {
        let recent = self.opt.recent_err_msg.and_then(|f| {
            // SAFETY: no arguments; the result is NULL or a NUL-terminated string owned by ACL,
            // copied before anything else runs on this thread.
            unsafe { text(f()) }
        });
        match recent {
            Some(t) if !t.trim().is_empty() => t.trim().to_owned(),
            _ => acl_code_name(code).to_owned(),
        }
    }

    /// The text of HCCL error `code`: `HcclGetErrorString`, else the code's name.
    pub fn hccl_text(&self, code: i32) -> String {
        let s = self.opt.hccl_error_string.and_then(|f| {
            // SAFETY: takes the code by value; returns NULL or a static NUL-terminated string.
            unsafe { text(f(code)) }
        });
        match s {
            Some(t) if !t.trim().is_empty() => t.trim().to_owned(),
            _ => hccl_code_name(code).to_owned(),
        }
    }
}

/// Copies a C string owned by the runtime (NULL → `None`).
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid during this call.
unsafe fn text(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-NULL, and the caller vouches for the string; the bytes are copied at once.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Tries each candidate for `file`; the first that loads and exports every symbol of
/// `required` wins. Returns the object and its directory.
fn find(
    search: &SearchPath,
    file: &'static str,
    prefer: Option<&Path>,
    required: &[&str],
    wrong_kind: &str,
) -> Result<(Object, Option<PathBuf>), LoadError> {
    let mut tried = Vec::new();
    for (path, source) in search.candidates(file, prefer) {
        let shown = path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| file.to_owned());
        if let Some(p) = &path
            && !p.exists()
        {
            tried.push(Attempt { path: shown, source, reason: "no such file".into() });
            continue;
        }
        match Object::open(&shown) {
            Err(e) => tried.push(Attempt { path: shown, source, reason: format!("cannot be loaded: {e}") }),
            Ok(obj) => {
                let missing: Vec<&str> = required.iter().copied().filter(|s| !obj.has(s)).collect();
                if missing.is_empty() {
                    let dir = path.as_ref().and_then(|p| p.parent().map(Path::to_path_buf));
                    return Ok((obj, dir));
                }
                tried.push(Attempt {
                    path: shown,
                    source,
                    reason: format!(
                        "loaded, but it lacks {} ({wrong_kind}, or a CANN release Ferry does not support)",
                        missing.join(", ")
                    ),
                });
            }
        }
    }
    Err(LoadError::NotFound { library: file, tried })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{Emulator, TempDir, emulator_lib_dir};

    fn libc_path() -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.contains("/libc.so") || p.contains("/libc-"))
            .expect("this test process maps libc")
            .to_owned()
    }

    #[test]
    fn nothing_found_lists_every_path_tried_with_its_reason() {
        let empty = TempDir::new("ferry-no-cann").unwrap();
        let home = TempDir::new("ferry-no-cann-home").unwrap();
        let (e1, e2) = (empty.path().display().to_string(), home.path().display().to_string());
        let search = SearchPath::from_env_with(|k| match k {
            "FERRY_ASCEND_LIB_DIR" => Some(e1.clone()),
            "ASCEND_HOME_PATH" => Some(e2.clone()),
            _ => None,
        });
        let err = Library::load_from(&search).unwrap_err();
        let LoadError::NotFound { library, tried } = &err else { panic!("{err}") };
        assert_eq!(*library, "libascendcl.so");
        let paths: Vec<&str> = tried.iter().map(|a| a.path.as_str()).collect();
        assert_eq!(
            paths,
            vec![
                format!("{e1}/libascendcl.so").as_str(),
                format!("{e2}/lib64/libascendcl.so").as_str(),
                "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so",
                "/usr/local/Ascend/cann/lib64/libascendcl.so",
                "libascendcl.so",
            ],
            "{err}"
        );
        assert_eq!(tried[0].reason, "no such file");
        assert!(tried[4].reason.starts_with("cannot be loaded"), "{}", tried[4].reason);
        let text = err.to_string();
        for a in tried {
            assert!(text.contains(&a.path), "{text}");
        }
        assert!(text.contains("FERRY_ASCEND_LIB_DIR"), "{text}");
    }

    #[test]
    fn a_library_of_the_wrong_kind_is_named_as_such() {
        let dir = TempDir::new("ferry-wrong-cann").unwrap();
        std::os::unix::fs::symlink(libc_path(), dir.path().join("libascendcl.so")).unwrap();
        let err = Library::load_from(&SearchPath::only(dir.path())).unwrap_err();
        let LoadError::NotFound { tried, .. } = &err else { panic!("{err}") };
        assert_eq!(tried.len(), 1);
        assert!(tried[0].reason.contains("lacks aclInit"), "{err}");
        assert!(tried[0].reason.contains("not the ACL runtime"), "{err}");

        let text = TempDir::new("ferry-text-cann").unwrap();
        std::fs::write(text.path().join("libascendcl.so"), "this is not a shared object\n").unwrap();
        let err = Library::load_from(&SearchPath::only(text.path())).unwrap_err();
        let LoadError::NotFound { tried, .. } = &err else { panic!("{err}") };
        assert!(tried[0].reason.starts_with("cannot be loaded"), "{err}");
        assert!(tried[0].path.ends_with("libascendcl.so"));
    }

    #[test]
    fn the_emulator_loads_once_with_every_capability() {
        let dir = emulator_lib_dir(Emulator::Current).unwrap_or_else(|e| panic!("{e}"));
        let lib = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        assert!(lib.capabilities().one_sided, "{:?}", lib.capabilities());
        assert!(lib.optional().one_sided.is_some());
        assert!(lib.capabilities().sync_with_timeout);
        assert!(lib.capabilities().stream_abort);
        assert!(lib.paths().acl.ends_with("libascendcl.so"));
        let again = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        assert!(Arc::ptr_eq(&lib, &again), "loaded once per process");
        assert_eq!(lib.initialize(), Ok(()));
        assert_eq!(lib.initialize(), Ok(()), "a second call is answered from the first");
    }

    #[test]
    fn the_legacy_emulator_has_no_one_sided_service() {
        let dir = emulator_lib_dir(Emulator::Legacy).unwrap_or_else(|e| panic!("{e}"));
        let lib = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        assert!(!lib.capabilities().one_sided);
        assert!(lib.optional().one_sided.is_none());
        assert!(lib.missing_optional().contains(&"HcclBatchGet"));
    }

    #[test]
    fn error_texts_fall_back_to_the_code_names() {
        let dir = emulator_lib_dir(Emulator::Current).unwrap_or_else(|e| panic!("{e}"));
        let lib = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        // Nothing failed on this thread, so ACL has no recent text: the code's description.
        assert_eq!(lib.acl_text(crate::ACL_ERROR_INVALID_DEVICE), "invalid device id");
        assert!(!lib.hccl_text(crate::HCCL_E_TIMEOUT).is_empty());
    }
}
