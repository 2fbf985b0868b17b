//! Loading `libascendcl.so` and `libhccl.so` (+ `libhcomm.so`) at run time and resolving their
//! symbols: required ones fail the load, optional ones become [`Capabilities`].

use std::collections::HashMap;
use std::ffi::{CStr, c_char};
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{ACL_ERROR_REPEAT_INITIALIZE, AscendError, Attempt, Result, acl_code_name, hccl_code_name};
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

pub(crate) struct AclFns {
    pub(crate) init: raw::AclInit,
    pub(crate) set_device: raw::AclrtSetDevice,
    pub(crate) get_device: raw::AclrtGetDevice,
    pub(crate) get_device_count: raw::AclrtGetDeviceCount,
    pub(crate) malloc: raw::AclrtMalloc,
    pub(crate) free: raw::AclrtFree,
    pub(crate) memcpy: raw::AclrtMemcpy,
    pub(crate) create_stream: raw::AclrtCreateStream,
    pub(crate) destroy_stream: raw::AclrtStreamOp,
    pub(crate) synchronize_stream: raw::AclrtStreamOp,
}

pub(crate) struct HcclFns {
    pub(crate) get_root_info: raw::HcclGetRootInfo,
    pub(crate) comm_init_root_info: raw::HcclCommInitRootInfo,
    pub(crate) comm_destroy: raw::HcclCommDestroy,
    pub(crate) send: raw::HcclSendRecv,
    pub(crate) recv: raw::HcclSendRecv,
}

pub(crate) struct OneSidedFns {
    pub(crate) register_global_mem: raw::HcclRegisterGlobalMem,
    pub(crate) deregister_global_mem: raw::HcclDeregisterGlobalMem,
    pub(crate) init_cluster_info_mem_config: raw::HcclCommInitClusterInfoMemConfig,
    pub(crate) bind_mem: raw::HcclCommMem,
    pub(crate) unbind_mem: raw::HcclCommMem,
    pub(crate) prepare: raw::HcclCommPrepare,
    pub(crate) batch_put: raw::HcclBatchOp,
    pub(crate) batch_get: raw::HcclBatchOp,
}

#[derive(Default)]
pub(crate) struct OptionalFns {
    pub(crate) sync_with_timeout: Option<raw::AclrtSynchronizeStreamWithTimeout>,
    pub(crate) stream_abort: Option<raw::AclrtStreamOp>,
    pub(crate) phy_by_user: Option<raw::AclrtGetPhyDevId>,
    pub(crate) phy_by_logic: Option<raw::AclrtGetPhyDevId>,
    pub(crate) pointer_attributes: Option<raw::AclrtPointerGetAttributes>,
    pub(crate) logic_by_user: Option<raw::AclrtGetPhyDevId>,
    pub(crate) malloc_host: Option<raw::AclrtMallocHost>,
    pub(crate) device_info: Option<raw::AclrtGetDeviceInfo>,
    pub(crate) free_host: Option<raw::AclrtFree>,
    pub(crate) recent_err_msg: Option<raw::AclGetText>,
    pub(crate) soc_name: Option<raw::AclGetText>,
    pub(crate) version: Option<raw::AclrtGetVersion>,
    pub(crate) hccl_error_string: Option<raw::HcclGetErrorString>,
    pub(crate) rank_id: Option<raw::HcclCommQuery>,
    pub(crate) rank_size: Option<raw::HcclCommQuery>,
    pub(crate) one_sided: Option<OneSidedFns>,
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
    fn open(path: &str) -> std::result::Result<Self, String> {
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
/// use a [`Device`](crate::Device) (or a [`DeviceThread`](crate::DeviceThread)) for calls
/// that need a device.
pub struct Library {
    paths: LoadedPaths,
    pub(crate) acl: AclFns,
    pub(crate) hccl: HcclFns,
    pub(crate) opt: OptionalFns,
    caps: Capabilities,
    missing_optional: Vec<&'static str>,
    initialized: OnceLock<std::result::Result<(), (i32, String)>>,
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
    pub fn load() -> Result<Arc<Library>> {
        Self::load_from(&SearchPath::from_env())
    }

    /// Loads ACL and HCCL from `search`. The same files are loaded once per process: a second
    /// call that finds the same `libascendcl.so` returns the first call's library.
    ///
    /// # Errors
    /// [`AscendError::NotFound`] naming every path tried and why each failed (absent file, not a
    /// loadable object, a loadable object without the ACL symbols), and
    /// [`AscendError::MissingSymbol`] for an HCCL without a required function.
    pub fn load_from(search: &SearchPath) -> Result<Arc<Library>> {
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

    fn resolve(acl: Object, hccl: Object, hcomm: Option<Object>) -> Result<Self> {
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
                    .ok_or(AscendError::MissingSymbol { symbol: $name, searched: acl.path.clone() })?
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
                    .ok_or_else(|| AscendError::MissingSymbol { symbol: $name, searched: searched.clone() })?
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

    /// Calls `aclInit(NULL)` once per process (a repeated initialisation, 100002, counts as
    /// success, since the application may have initialised ACL itself).
    pub fn ensure_initialized(&self) -> Result<()> {
        let r = self.initialized.get_or_init(|| {
            // SAFETY: aclInit takes an optional config path; NULL means none.
            let code = unsafe { (self.acl.init)(std::ptr::null()) };
            if code == 0 || code == ACL_ERROR_REPEAT_INITIALIZE { Ok(()) } else { Err((code, self.acl_text(code))) }
        });
        r.clone().map_err(|(code, message)| AscendError::Acl { call: "aclInit", code, message })
    }

    /// Devices visible to this process (`aclrtGetDeviceCount`: after `ASCEND_RT_VISIBLE_DEVICES`).
    pub fn device_count(&self) -> Result<u32> {
        self.ensure_initialized()?;
        let mut n = 0u32;
        // SAFETY: `n` is a valid out-pointer for the call's duration.
        let code = unsafe { (self.acl.get_device_count)(&mut n) };
        self.acl_check("aclrtGetDeviceCount", code)?;
        Ok(n)
    }

    /// The physical id of user device `user_id`, and the function that answered:
    /// `aclrtGetPhyDevIdByUserDevId`, else `aclrtGetPhyDevIdByLogicDevId` (whose argument is
    /// really the user id). [`AscendError::Unavailable`] when this release has neither; a
    /// runtime error (an invalid id) is returned as is, never papered over.
    pub fn physical_device(&self, user_id: u32) -> Result<(u32, &'static str)> {
        self.ensure_initialized()?;
        let id = i32::try_from(user_id).map_err(|_| AscendError::InvalidArgument(format!("device id {user_id}")))?;
        for (f, name) in [
            (self.opt.phy_by_user, "aclrtGetPhyDevIdByUserDevId"),
            (self.opt.phy_by_logic, "aclrtGetPhyDevIdByLogicDevId"),
        ] {
            let Some(f) = f else { continue };
            let mut phy = -1i32;
            // SAFETY: `phy` is a valid out-pointer for the call's duration.
            let code = unsafe { f(id, &mut phy) };
            self.acl_check(name, code)?;
            return u32::try_from(phy).map(|p| (p, name)).map_err(|_| AscendError::Acl {
                call: name,
                code: 0,
                message: format!("answered a negative physical id {phy} for user device {user_id}"),
            });
        }
        Err(AscendError::Unavailable {
            symbol: "aclrtGetPhyDevIdByUserDevId",
            purpose: "mapping a user device id to its physical id",
        })
    }

    /// The logical id (the `ASCEND_RT_VISIBLE_DEVICES` entry) of user device `user_id`
    /// (`aclrtGetLogicDevIdByUserDevId`), `None` when this release lacks the call.
    pub fn logical_device(&self, user_id: u32) -> Result<Option<u32>> {
        self.ensure_initialized()?;
        let Some(f) = self.opt.logic_by_user else { return Ok(None) };
        let id = i32::try_from(user_id).map_err(|_| AscendError::InvalidArgument(format!("device id {user_id}")))?;
        let mut logic = -1i32;
        // SAFETY: `logic` is a valid out-pointer for the call's duration.
        let code = unsafe { f(id, &mut logic) };
        self.acl_check("aclrtGetLogicDevIdByUserDevId", code)?;
        Ok(u32::try_from(logic).ok())
    }

    /// Whether this is an Atlas A3 part (`aclrtGetSocName` answers `Ascend910_93xx`, the SoCs
    /// HIXL builds v1.2 rank tables for: `rank_table_generator.cc` l.65-80).
    pub fn is_atlas_a3(&self) -> bool {
        self.soc_name().is_some_and(|s| s.starts_with("Ascend910_93"))
    }

    /// User device `user_id`'s Atlas A3 super-pod device id and super pod id
    /// (`aclrtGetDeviceInfo` with `ACL_DEV_ATTR_SUPER_POD_DEVICE_ID`, `ACL_DEV_ATTR_SUPER_POD_ID`,
    /// as HIXL's v1.2 rank-table generator reads them). `None` when the release lacks the call.
    pub fn super_pod_ids(&self, user_id: u32) -> Result<Option<(i64, i64)>> {
        self.ensure_initialized()?;
        let Some(f) = self.opt.device_info else { return Ok(None) };
        let read = |attr: i32| {
            let mut v = 0i64;
            // SAFETY: `v` is a valid out-pointer for the call's duration.
            let code = unsafe { f(user_id, attr, &mut v) };
            self.acl_check("aclrtGetDeviceInfo", code).map(|()| v)
        };
        Ok(Some((read(raw::dev_attr::SUPER_POD_DEVICE_ID)?, read(raw::dev_attr::SUPER_POD_ID)?)))
    }

    /// The calling thread's current device as a user id (`aclrtGetDevice`): what vLLM and
    /// torch_npu set before they create a transfer engine. `None` when the thread has none.
    pub fn current_device(&self) -> Result<Option<u32>> {
        self.ensure_initialized()?;
        let mut id = -1i32;
        // SAFETY: `id` is a valid out-pointer for the call's duration.
        let code = unsafe { (self.acl.get_device)(&mut id) };
        if code == crate::error::ACL_ERROR_CONTEXT_NULL {
            return Ok(None);
        }
        self.acl_check("aclrtGetDevice", code)?;
        Ok(u32::try_from(id).ok())
    }

    /// `aclrtGetVersion`, when available.
    pub fn version(&self) -> Option<(i32, i32, i32)> {
        let f = self.opt.version?;
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: three valid out-pointers.
        let code = unsafe { f(&mut a, &mut b, &mut c) };
        (code == 0).then_some((a, b, c))
    }

    /// `aclrtGetSocName`, when available and answered.
    pub fn soc_name(&self) -> Option<String> {
        let f = self.opt.soc_name?;
        // SAFETY: no arguments; the result is NULL or a NUL-terminated string owned by ACL.
        let p = unsafe { f() };
        // SAFETY: as above; copied at once.
        text(p)
    }

    /// The text of ACL error `code`: `aclGetRecentErrMsg` (this thread's last error), else a
    /// description of the code.
    pub fn acl_text(&self, code: i32) -> String {
        let recent = self.opt.recent_err_msg.and_then(|f| {
            // SAFETY: no arguments; the result is NULL or a NUL-terminated string owned by ACL.
            text(unsafe { f() })
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
            text(unsafe { f(code) })
        });
        match s {
            Some(t) if !t.trim().is_empty() => t.trim().to_owned(),
            _ => hccl_code_name(code).to_owned(),
        }
    }

    pub(crate) fn acl_check(&self, call: &'static str, code: i32) -> Result<()> {
        if code == 0 { Ok(()) } else { Err(AscendError::Acl { call, code, message: self.acl_text(code) }) }
    }

    pub(crate) fn hccl_check(&self, call: &'static str, code: i32) -> Result<()> {
        if code == 0 { Ok(()) } else { Err(AscendError::Hccl { call, code, message: self.hccl_text(code) }) }
    }

    pub(crate) fn one_sided(&self, call: &'static str) -> Result<&OneSidedFns> {
        self.opt
            .one_sided
            .as_ref()
            .ok_or(AscendError::Unavailable { symbol: call, purpose: "the one-sided HCCL service" })
    }
}

/// Copies a C string owned by the runtime (NULL → `None`).
fn text(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the runtime returns NUL-terminated strings that stay valid at least until the
    // next call on this thread; the bytes are copied at once.
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
) -> Result<(Object, Option<PathBuf>)> {
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
    Err(AscendError::NotFound { library: file, tried })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{Emulator, TempDir, emulator_lib_dir};
    use crate::{Device, DeviceThread};

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
        let AscendError::NotFound { library, tried } = &err else { panic!("{err}") };
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
        let AscendError::NotFound { tried, .. } = &err else { panic!("{err}") };
        assert_eq!(tried.len(), 1);
        assert!(tried[0].reason.contains("lacks aclInit"), "{err}");
        assert!(tried[0].reason.contains("not the ACL runtime"), "{err}");

        let text = TempDir::new("ferry-text-cann").unwrap();
        std::fs::write(text.path().join("libascendcl.so"), "this is not a shared object\n").unwrap();
        let err = Library::load_from(&SearchPath::only(text.path())).unwrap_err();
        let AscendError::NotFound { tried, .. } = &err else { panic!("{err}") };
        assert!(tried[0].reason.starts_with("cannot be loaded"), "{err}");
        assert!(tried[0].path.ends_with("libascendcl.so"));
    }

    #[test]
    fn the_emulator_loads_with_every_capability_and_runs_on_a_device_thread() {
        let dir = emulator_lib_dir(Emulator::Current).unwrap_or_else(|e| panic!("{e}"));
        let lib = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        assert!(lib.capabilities().one_sided, "{:?}", lib.capabilities());
        assert!(lib.capabilities().sync_with_timeout);
        assert!(lib.paths().acl.ends_with("libascendcl.so"));
        let again = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        assert!(Arc::ptr_eq(&lib, &again), "loaded once per process");
        assert!(lib.device_count().unwrap() >= 2);
        assert_eq!(lib.physical_device(1).unwrap().0, 1, "outside a container user id = physical id");
        let err = lib.physical_device(4096).unwrap_err();
        assert_eq!(err.code(), Some(crate::ACL_ERROR_INVALID_DEVICE), "{err}");
        let err = Device::bind(&lib, 4096).unwrap_err();
        assert_eq!(err.call(), Some("aclrtSetDevice"));

        let worker = DeviceThread::spawn(&lib, 1, "test-dev1", |dev| dev.create_stream()).unwrap();
        let got = worker
            .call(|dev, stream| {
                assert_eq!(dev.current().unwrap(), 1, "the thread is bound to user device 1");
                let buf = dev.alloc(4096).unwrap();
                buf.write(100, b"ferry").unwrap();
                stream.synchronize(Some(std::time::Duration::from_secs(5))).unwrap();
                // The emulator has aclrtStreamAbort: draining aborts (an idle stream here).
                assert!(dev.library().capabilities().stream_abort);
                assert!(stream.abort(), "the abort succeeded");
                assert!(matches!(stream.drain(), crate::Drained::Aborted));
                stream.synchronize(Some(std::time::Duration::from_secs(5))).unwrap();
                let mut out = [0u8; 5];
                buf.read(100, &mut out).unwrap();
                assert!(buf.write(4095, b"xy").is_err(), "writes past the end are refused");
                out
            })
            .unwrap();
        assert_eq!(&got, b"ferry");
        assert!(worker.stop(std::time::Duration::from_secs(5)));
        assert!(worker.submit(|_, _| {}).is_err(), "a stopped thread takes no jobs");
    }

    #[test]
    fn the_legacy_emulator_has_no_one_sided_service() {
        let dir = emulator_lib_dir(Emulator::Legacy).unwrap_or_else(|e| panic!("{e}"));
        let lib = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        assert!(!lib.capabilities().one_sided);
        assert!(lib.missing_optional().contains(&"HcclBatchGet"));
        let Err(err) = lib.one_sided("HcclBatchGet") else { panic!("one-sided calls are present") };
        assert!(err.is_not_supported(), "{err}");
    }
}
