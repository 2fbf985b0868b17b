//! [`AclQueries`]: the process-wide ACL calls on a loaded [`Library`] that need no device bound
//! to the calling thread: initialising ACL, counting devices and mapping their ids, the SoC and
//! the release.

use std::ffi::CStr;

use ferry_ascend_sys::{ACL_ERROR_CONTEXT_NULL, Library, raw};

use crate::error::{AscendError, Checks, Result};

/// Process-wide ACL calls on a loaded [`Library`]. Every call that needs ACL initialises it
/// first (`aclInit`, once per process).
pub trait AclQueries {
    /// Calls `aclInit(NULL)` once per process (a repeated initialisation counts as success,
    /// since the application may have initialised ACL itself).
    fn ensure_initialized(&self) -> Result<()>;

    /// Devices visible to this process (`aclrtGetDeviceCount`: after `ASCEND_RT_VISIBLE_DEVICES`).
    fn device_count(&self) -> Result<u32>;

    /// The physical id of user device `user_id`, and the function that answered:
    /// `aclrtGetPhyDevIdByUserDevId`, else `aclrtGetPhyDevIdByLogicDevId` (whose argument is
    /// really the user id). [`AscendError::Unavailable`] when this release has neither; a
    /// runtime error (an invalid id) is returned as is, never papered over.
    fn physical_device(&self, user_id: u32) -> Result<(u32, &'static str)>;

    /// The logical id (the `ASCEND_RT_VISIBLE_DEVICES` entry) of user device `user_id`
    /// (`aclrtGetLogicDevIdByUserDevId`), `None` when this release lacks the call.
    fn logical_device(&self, user_id: u32) -> Result<Option<u32>>;

    /// Whether this is an Atlas A3 part (`aclrtGetSocName` answers `Ascend910_93xx`, the SoCs
    /// HIXL builds v1.2 rank tables for: `rank_table_generator.cc` l.65-80).
    fn is_atlas_a3(&self) -> bool;

    /// User device `user_id`'s Atlas A3 super-pod device id and super pod id
    /// (`aclrtGetDeviceInfo` with `ACL_DEV_ATTR_SUPER_POD_DEVICE_ID`, `ACL_DEV_ATTR_SUPER_POD_ID`,
    /// as HIXL's v1.2 rank-table generator reads them). `None` when the release lacks the call.
    fn super_pod_ids(&self, user_id: u32) -> Result<Option<(i64, i64)>>;

    /// The calling thread's current device as a user id (`aclrtGetDevice`): what vLLM and
    /// torch_npu set before they create a transfer engine. `None` when the thread has none.
    fn current_device(&self) -> Result<Option<u32>>;

    /// `aclrtGetVersion`, when available.
    fn version(&self) -> Option<(i32, i32, i32)>;

    /// `aclrtGetSocName`, when available and answered.
    fn soc_name(&self) -> Option<String>;
}

impl AclQueries for Library {
    fn ensure_initialized(&self) -> Result<()> {
        self.init()
    }

    fn device_count(&self) -> Result<u32> {
        self.ensure_initialized()?;
        let mut n = 0u32;
        // SAFETY: `n` is a valid out-pointer for the call's duration.
        let code = unsafe { (self.acl().get_device_count)(&mut n) };
        self.acl_check("aclrtGetDeviceCount", code)?;
        Ok(n)
    }

    fn physical_device(&self, user_id: u32) -> Result<(u32, &'static str)> {
        self.ensure_initialized()?;
        let id = i32::try_from(user_id).map_err(|_| AscendError::InvalidArgument(format!("device id {user_id}")))?;
        let opt = self.optional();
        for (f, name) in
            [(opt.phy_by_user, "aclrtGetPhyDevIdByUserDevId"), (opt.phy_by_logic, "aclrtGetPhyDevIdByLogicDevId")]
        {
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

    fn logical_device(&self, user_id: u32) -> Result<Option<u32>> {
        self.ensure_initialized()?;
        let Some(f) = self.optional().logic_by_user else { return Ok(None) };
        let id = i32::try_from(user_id).map_err(|_| AscendError::InvalidArgument(format!("device id {user_id}")))?;
        let mut logic = -1i32;
        // SAFETY: `logic` is a valid out-pointer for the call's duration.
        let code = unsafe { f(id, &mut logic) };
        self.acl_check("aclrtGetLogicDevIdByUserDevId", code)?;
        Ok(u32::try_from(logic).ok())
    }

    fn is_atlas_a3(&self) -> bool {
        self.soc_name().is_some_and(|s| s.starts_with("Ascend910_93"))
    }

    fn super_pod_ids(&self, user_id: u32) -> Result<Option<(i64, i64)>> {
        self.ensure_initialized()?;
        let Some(f) = self.optional().device_info else { return Ok(None) };
        let read = |attr: i32| {
            let mut v = 0i64;
            // SAFETY: `v` is a valid out-pointer for the call's duration.
            let code = unsafe { f(user_id, attr, &mut v) };
            self.acl_check("aclrtGetDeviceInfo", code).map(|()| v)
        };
        Ok(Some((read(raw::dev_attr::SUPER_POD_DEVICE_ID)?, read(raw::dev_attr::SUPER_POD_ID)?)))
    }

    fn current_device(&self) -> Result<Option<u32>> {
        self.ensure_initialized()?;
        let mut id = -1i32;
        // SAFETY: `id` is a valid out-pointer for the call's duration.
        let code = unsafe { (self.acl().get_device)(&mut id) };
        if code == ACL_ERROR_CONTEXT_NULL {
            return Ok(None);
        }
        self.acl_check("aclrtGetDevice", code)?;
        Ok(u32::try_from(id).ok())
    }

    fn version(&self) -> Option<(i32, i32, i32)> {
        let f = self.optional().version?;
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: three valid out-pointers.
        let code = unsafe { f(&mut a, &mut b, &mut c) };
        (code == 0).then_some((a, b, c))
    }

    fn soc_name(&self) -> Option<String> {
        let f = self.optional().soc_name?;
        // SAFETY: no arguments; the result is NULL or a NUL-terminated string owned by ACL.
        let p = unsafe { f() };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-NULL and NUL-terminated (above), valid until the next ACL call on this
        // thread; the bytes are copied at once.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}
