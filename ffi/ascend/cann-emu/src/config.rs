//! Process configuration read from the environment (once, at first use).
//!
//! ## `ASCEND_RT_VISIBLE_DEVICES`, as CANN documents and implements it
//!
//! The value lists *logical* device ids separated by commas (CANN environment reference:
//! "Device ID为昇腾AI处理器的逻辑ID"); the process sees only those devices, and its *user* ids
//! (what `aclrtSetDevice` and `aclrtGetDevice` take and return) are the indexes in that list.
//! The runtime's parser (`src/runtime/core/src/runtime.cc`) stops at the first character that
//! is not a digit or a comma, at an empty entry and at the first id not below the device count
//! (`=1, 2,3` reads `1`, `=1,3,8` on 8 devices reads `1,3`); a descending or repeated id makes
//! the whole variable an error ("must be configured in ascending order", "cannot be
//! duplicated"), as does a value with no valid id: `aclrtGetDeviceCount` then answers
//! `ACL_ERROR_RT_NO_DEVICE` (207004). Unset: every device is visible and user id == logical id.
//!
//! Logical ids are physical ids on bare metal only. A container that mounts a subset of the
//! cards numbers them 0, 1, … in its own order; `FERRY_CANN_EMU_MOUNTED=6,7` models one that
//! mounts physical cards 6 and 7 (logical 0 is physical 6). CANN's example: visible `1,2` →
//! user 0 → logical 1 → physical 6.

use std::net::IpAddr;
use std::sync::OnceLock;
use std::time::Duration;

/// Default number of emulated physical devices.
pub(crate) const DEFAULT_DEVICES: u32 = 8;
/// Upper bound for `FERRY_CANN_EMU_DEVICES` (a sanity cap).
const MAX_DEVICES: u32 = 1024;
/// HCCL's default `HCCL_CONNECT_TIMEOUT` (seconds).
const DEFAULT_CONNECT_TIMEOUT_S: u64 = 120;
/// HCCL's default `HCCL_EXEC_TIMEOUT` (seconds).
const DEFAULT_EXEC_TIMEOUT_S: u64 = 1800;

/// The emulator's configuration.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// Number of emulated physical devices (ids `0..physical_devices`).
    pub(crate) physical_devices: u32,
    /// Physical id of each logical id (index = logical id): the cards a container mounts
    /// (`FERRY_CANN_EMU_MOUNTED`), else every card (bare metal: logical = physical).
    pub(crate) mounted: Vec<u32>,
    /// Logical id of each user id (index = user id), from `ASCEND_RT_VISIBLE_DEVICES`.
    pub(crate) visible_logical: Vec<u32>,
    /// Physical id of each user id (index = user id).
    pub(crate) visible: Vec<u32>,
    /// What `aclrtGetSocName` answers (`FERRY_CANN_EMU_SOC`).
    pub(crate) soc_name: String,
    /// `HCCL_INTRA_ROCE_ENABLE=1`: ranks of one server talk over RoCE, not HCCS IPC.
    pub(crate) intra_roce: bool,
    /// `FERRY_CANN_EMU_SUPER_POD`: the Atlas A3 super pod id `aclrtGetDeviceInfo` answers.
    pub(crate) super_pod: i64,
    /// `FERRY_CANN_EMU_SUPER_DEVICE_BASE`: added to the physical id for the super-pod device id.
    pub(crate) super_device_base: i64,
    /// `HCCL_CONNECT_TIMEOUT`.
    pub(crate) connect_timeout: Duration,
    /// `HCCL_EXEC_TIMEOUT`.
    pub(crate) exec_timeout: Duration,
    /// `HCCL_IF_IP`, if set and valid.
    pub(crate) if_ip: Option<IpAddr>,
}

/// Parses `ASCEND_RT_VISIBLE_DEVICES` the way CANN documents it: returns the logical ids the
/// process sees, in user-id order (user id = index), given `physical` devices on the machine.
///
/// CANN's environment-variable reference: ids are separated by commas; "the value cannot
/// contain other characters or invalid device ids; if it does, only the ids before them are
/// read" (`1, 2,3` reads `[1]` because of the space; `1,3,8` on 8 devices reads `[1, 3]`), and
/// the ids must be strictly ascending: a descending or repeated id makes the *whole* variable an
/// error (`5,4` and `4,4` read `[]`; the runtime then reports no device). An empty value, or a
/// bad first entry, leaves no device. (When the variable is unset every device is visible; the emulator
/// has no container, so logical ids are physical ids.)
///
/// ```
/// use ferry_cann_emu::parse_visible_devices as parse;
/// assert_eq!(parse("4,5", 8), vec![4, 5]);
/// assert_eq!(parse("1, 2,3", 8), vec![1]);
/// assert_eq!(parse("1,3,8", 8), vec![1, 3]);
/// assert_eq!(parse("5,4", 8), Vec::<u32>::new());
/// assert_eq!(parse("", 8), Vec::<u32>::new());
/// ```
pub fn parse_visible_devices(value: &str, physical: u32) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for entry in value.split(',') {
        if entry.is_empty() || !entry.bytes().all(|b| b.is_ascii_digit()) {
            break;
        }
        let Ok(id) = entry.parse::<u32>() else { break };
        if id >= physical {
            break;
        }
        if out.last().is_some_and(|&last| id <= last) {
            // "it must be configured in ascending order" / "cannot be duplicated": the whole
            // variable is refused (runtime.cc, RT_ALL_ORDER_ERROR / RT_ALL_DUPLICATED_ERROR).
            return Vec::new();
        }
        out.push(id);
        if out.len() as u32 >= physical {
            break;
        }
    }
    out
}

/// What `aclrtGetSocName` answers by default (an Atlas A2 part).
pub(crate) const DEFAULT_SOC: &str = "Ascend910B3";

/// Parses `FERRY_CANN_EMU_MOUNTED`: the physical ids of the cards a container mounts, in the
/// order the container numbers them (its logical ids 0, 1, …). Each must be a physical id below
/// `physical` and appear once.
///
/// ```
/// use ferry_cann_emu::parse_mounted;
/// assert_eq!(parse_mounted("6,7", 8), Ok(vec![6, 7]));
/// assert!(parse_mounted("6,6", 8).is_err());
/// assert!(parse_mounted("8", 8).is_err());
/// ```
pub fn parse_mounted(value: &str, physical: u32) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for entry in value.split(',') {
        let id: u32 = entry.trim().parse().map_err(|_| format!("{entry:?} is not a physical device id"))?;
        if id >= physical {
            return Err(format!("physical device {id} does not exist ({physical} emulated)"));
        }
        if out.contains(&id) {
            return Err(format!("physical device {id} is listed twice"));
        }
        out.push(id);
    }
    Ok(out)
}

/// Whether a SoC name is an Atlas A3 part (`Ascend910_93xx`; HIXL `rank_table_generator.cc`
/// l.65-80 lists `Ascend910_9391/9381/9392/9382/9372/9362`).
pub(crate) fn is_a3(soc: &str) -> bool {
    soc.starts_with("Ascend910_93")
}

fn number_var(name: &str) -> i64 {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            warn(&format!("{name}={v:?} is not a whole number; using 0"));
            0
        }),
        Err(_) => 0,
    }
}

fn warn(message: &str) {
    eprintln!("[ferry-cann-emu] warning: {message}");
}

fn seconds_var(name: &str, default_s: u64) -> Duration {
    match std::env::var(name) {
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(s) if s > 0 => Duration::from_secs(s),
            _ => {
                warn(&format!("{name}={v:?} is not a positive number of seconds; using {default_s}"));
                Duration::from_secs(default_s)
            }
        },
        Err(_) => Duration::from_secs(default_s),
    }
}

fn load() -> Config {
    let physical_devices = match std::env::var("FERRY_CANN_EMU_DEVICES") {
        Ok(v) => match v.trim().parse::<u32>() {
            Ok(n) if n <= MAX_DEVICES => n,
            _ => {
                warn(&format!(
                    "FERRY_CANN_EMU_DEVICES={v:?} is not a device count (0..={MAX_DEVICES}); using {DEFAULT_DEVICES}"
                ));
                DEFAULT_DEVICES
            }
        },
        Err(_) => DEFAULT_DEVICES,
    };
    let mounted = match std::env::var("FERRY_CANN_EMU_MOUNTED") {
        Ok(v) => match parse_mounted(&v, physical_devices) {
            Ok(m) => m,
            Err(why) => {
                warn(&format!("FERRY_CANN_EMU_MOUNTED={v:?}: {why}; treating the machine as bare metal"));
                (0..physical_devices).collect()
            }
        },
        Err(_) => (0..physical_devices).collect(),
    };
    // The variable lists logical ids, checked against the number of cards the process can see
    // (the mounted ones) (runtime `runtime.cc` `GetVisibleDevices`; docs/ascend.md rule 4).
    let logical_count = mounted.len() as u32;
    let visible_logical = match std::env::var("ASCEND_RT_VISIBLE_DEVICES") {
        Ok(v) => parse_visible_devices(&v, logical_count),
        Err(_) => (0..logical_count).collect(),
    };
    let visible = visible_logical.iter().map(|&l| mounted[l as usize]).collect();
    let soc_name = match std::env::var("FERRY_CANN_EMU_SOC") {
        Ok(v) if !v.is_empty() && v.len() < 64 && v.bytes().all(|b| b.is_ascii_graphic()) => v,
        Ok(v) => {
            warn(&format!("FERRY_CANN_EMU_SOC={v:?} is not a SoC name; using {DEFAULT_SOC}"));
            DEFAULT_SOC.to_owned()
        }
        Err(_) => DEFAULT_SOC.to_owned(),
    };
    let if_ip = match std::env::var("HCCL_IF_IP") {
        Ok(v) => match v.trim().parse::<IpAddr>() {
            Ok(ip) => Some(ip),
            Err(_) => {
                warn(&format!("HCCL_IF_IP={v:?} is not an IP address; using 127.0.0.1"));
                None
            }
        },
        Err(_) => None,
    };
    Config {
        physical_devices,
        mounted,
        visible_logical,
        visible,
        soc_name,
        intra_roce: std::env::var("HCCL_INTRA_ROCE_ENABLE").is_ok_and(|v| v.trim() == "1"),
        super_pod: number_var("FERRY_CANN_EMU_SUPER_POD"),
        super_device_base: number_var("FERRY_CANN_EMU_SUPER_DEVICE_BASE"),
        connect_timeout: seconds_var("HCCL_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT_S),
        exec_timeout: seconds_var("HCCL_EXEC_TIMEOUT", DEFAULT_EXEC_TIMEOUT_S),
        if_ip,
    }
}

/// The process configuration (read from the environment at first use).
pub(crate) fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(load)
}

#[cfg(test)]
mod tests {
    use super::parse_visible_devices as parse;

    #[test]
    fn ids_are_read_in_order() {
        assert_eq!(parse("4,5", 8), vec![4, 5]);
        assert_eq!(parse("1,2,3", 8), vec![1, 2, 3]);
        assert_eq!(parse("7", 8), vec![7]);
        assert_eq!(parse("012", 16), vec![12]);
    }

    #[test]
    fn parsing_stops_at_the_first_bad_entry() {
        assert_eq!(parse("1, 2,3", 8), vec![1], "a space is another character");
        assert_eq!(parse("1,3,8", 8), vec![1, 3], "8 is out of range on 8 devices");
        assert_eq!(parse("5,4", 8), Vec::<u32>::new(), "descending: the whole variable is refused");
        assert_eq!(parse("4,4,5", 8), Vec::<u32>::new(), "repeated: the whole variable is refused");
        assert_eq!(parse("2,x,3", 8), vec![2]);
        assert_eq!(parse("2,3,", 8), vec![2, 3], "trailing comma");
        assert_eq!(parse("-1", 8), Vec::<u32>::new());
        assert_eq!(parse("+1", 8), Vec::<u32>::new());
        assert_eq!(parse(" 1", 8), Vec::<u32>::new());
        assert_eq!(parse("99999999999999999999", 8), Vec::<u32>::new());
    }

    #[test]
    fn empty_means_no_device() {
        assert_eq!(parse("", 8), Vec::<u32>::new());
        assert_eq!(parse(",1", 8), Vec::<u32>::new());
        assert_eq!(parse("0", 0), Vec::<u32>::new());
    }
}
