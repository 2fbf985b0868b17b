//! Fault injection and call logging, configured by environment variables.
//!
//! - `FERRY_CANN_EMU_FAIL=<symbol>:<n>[:<code>][,...]`: the n-th call (1-based, counted per
//!   process and per symbol) of `symbol` fails. `n` may be `a-b` (inclusive range) or `*`
//!   (every call); the same symbol may appear several times. Without `:<code>` the failure
//!   uses a plausible code for the symbol ([`default_fail_code`]). Functions that return a
//!   pointer (`aclGetRecentErrMsg`, `aclrtGetSocName`, `HcclGetErrorString`) return NULL.
//! - `FERRY_CANN_EMU_DELAY_US=<symbol>:<us>[,...]`: each call of `symbol` is delayed; for the
//!   stream-ordered calls ([`ASYNC_SYMBOLS`]) the delay is added to the queued operation.
//! - `FERRY_CANN_EMU_NO_ONESIDED=1`: the one-sided HCCL calls answer `HCCL_E_NOT_SUPPORT`.
//! - `FERRY_CANN_EMU_LOG=1`: every call is logged to stderr.
//!
//! Malformed entries are reported on stderr and ignored.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::boundary::lock;
use crate::codes::*;

/// True for every C symbol the emulator knows (whether or not this build exports it).
fn is_known_symbol(symbol: &str) -> bool {
    crate::BASE_SYMBOLS.contains(&symbol)
        || crate::ONE_SIDED_SYMBOLS.contains(&symbol)
        || crate::hixl::HIXL_SYMBOLS.contains(&symbol)
}

/// Symbols whose work is queued on a stream: their delay applies to the queued operation.
pub(crate) const ASYNC_SYMBOLS: &[&str] = &["aclrtMemcpyAsync", "HcclSend", "HcclRecv", "HcclBatchGet", "HcclBatchPut"];

/// The code an injected failure of `symbol` returns when the rule names none.
pub(crate) fn default_fail_code(symbol: &str) -> i32 {
    match symbol {
        "aclInit" => ACL_ERROR_INVALID_FILE,
        "aclrtSetDevice" => ACL_ERROR_RT_DEV_SETUP_ERROR,
        "aclrtMalloc" | "aclrtMallocHost" => ACL_ERROR_RT_MEMORY_ALLOCATION,
        "aclrtCreateStream" | "aclrtCreateStreamWithConfig" => ACL_ERROR_RT_NO_STREAM_RESOURCE,
        "aclrtHostRegister" => ACL_ERROR_RT_DRV_INTERNAL_ERROR,
        "aclrtCreateContext" => ACL_ERROR_RT_RESOURCE_ALLOC_FAIL,
        "aclrtGetDevice" | "aclrtGetCurrentContext" => ACL_ERROR_RT_CONTEXT_NULL,
        "aclrtGetPhyDevIdByUserDevId" | "aclrtGetPhyDevIdByLogicDevId" => ACL_ERROR_RT_INVALID_DEVICEID,
        "aclrtSynchronizeStreamWithTimeout" => ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
        s if s.starts_with("acl") => ACL_ERROR_RT_INTERNAL_ERROR,
        s if s.starts_with("adxl.") || s.starts_with("hixl.") => HIXL_FAILED as i32,
        "HcclCommInitRootInfo" | "HcclCommInitClusterInfo" | "HcclCommInitClusterInfoMemConfig" => HCCL_E_TCP_CONNECT,
        "HcclCommPrepare" => HCCL_E_TIMEOUT,
        "HcclRegisterGlobalMem" => HCCL_E_MEMORY,
        "HcclSend" | "HcclRecv" => HCCL_E_TCP_TRANSFER,
        "HcclBatchGet" | "HcclBatchPut" => HCCL_E_ROCE_TRANSFER,
        _ => HCCL_E_INTERNAL,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FailRule {
    first: u64,
    last: u64,
    code: Option<i32>,
}

/// The parsed fault configuration plus per-symbol call counters.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    fail: HashMap<String, Vec<FailRule>>,
    delay: HashMap<String, Duration>,
    /// `FERRY_CANN_EMU_NO_ONESIDED=1`.
    pub(crate) no_onesided: bool,
    /// `FERRY_CANN_EMU_LOG=1`.
    pub(crate) log: bool,
    counters: Mutex<HashMap<String, u64>>,
}

fn warn(message: &str) {
    eprintln!("[ferry-cann-emu] warning: {message}");
}

fn check_symbol(var: &str, symbol: &str) -> bool {
    if is_known_symbol(symbol) {
        true
    } else {
        warn(&format!("{var}: unknown symbol {symbol:?} ignored"));
        false
    }
}

fn parse_fail(value: &str) -> HashMap<String, Vec<FailRule>> {
    let mut out: HashMap<String, Vec<FailRule>> = HashMap::new();
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let parts: Vec<&str> = entry.split(':').collect();
        let parsed = match parts.as_slice() {
            [symbol, spec] => parse_spec(spec).map(|(a, b)| (*symbol, a, b, None)),
            [symbol, spec, code] => match (parse_spec(spec), code.parse::<i32>()) {
                (Some((a, b)), Ok(c)) => Some((*symbol, a, b, Some(c))),
                _ => None,
            },
            _ => None,
        };
        match parsed {
            Some((symbol, first, last, code)) => {
                if check_symbol("FERRY_CANN_EMU_FAIL", symbol) {
                    out.entry(symbol.to_string()).or_default().push(FailRule { first, last, code });
                }
            }
            None => {
                warn(&format!("FERRY_CANN_EMU_FAIL: entry {entry:?} ignored (expected <symbol>:<n|a-b|*>[:<code>])"))
            }
        }
    }
    out
}

fn parse_spec(spec: &str) -> Option<(u64, u64)> {
    if spec == "*" {
        return Some((1, u64::MAX));
    }
    if let Some((a, b)) = spec.split_once('-') {
        let (a, b) = (a.parse::<u64>().ok()?, b.parse::<u64>().ok()?);
        return (a >= 1 && b >= a).then_some((a, b));
    }
    let n = spec.parse::<u64>().ok()?;
    (n >= 1).then_some((n, n))
}

fn parse_delay(value: &str) -> HashMap<String, Duration> {
    let mut out = HashMap::new();
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match entry.split_once(':').map(|(s, us)| (s, us.parse::<u64>())) {
            Some((symbol, Ok(us))) => {
                if check_symbol("FERRY_CANN_EMU_DELAY_US", symbol) {
                    out.insert(symbol.to_string(), Duration::from_micros(us));
                }
            }
            _ => warn(&format!("FERRY_CANN_EMU_DELAY_US: entry {entry:?} ignored (expected <symbol>:<microseconds>)")),
        }
    }
    out
}

fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| matches!(v.trim(), "1" | "true" | "yes" | "on"))
}

impl Faults {
    fn from_env() -> Faults {
        Faults {
            fail: std::env::var("FERRY_CANN_EMU_FAIL").map(|v| parse_fail(&v)).unwrap_or_default(),
            delay: std::env::var("FERRY_CANN_EMU_DELAY_US").map(|v| parse_delay(&v)).unwrap_or_default(),
            no_onesided: flag("FERRY_CANN_EMU_NO_ONESIDED"),
            log: flag("FERRY_CANN_EMU_LOG"),
            counters: Mutex::new(HashMap::new()),
        }
    }

    /// Counts a call of `symbol`; returns `(n, code)` when this call must fail.
    pub(crate) fn injected_failure(&self, symbol: &str) -> Option<(u64, i32)> {
        let rules = self.fail.get(symbol)?;
        let n = {
            let mut counters = lock(&self.counters);
            let counter = counters.entry(symbol.to_string()).or_insert(0);
            *counter += 1;
            *counter
        };
        let rule = rules.iter().find(|r| r.first <= n && n <= r.last)?;
        Some((n, rule.code.unwrap_or_else(|| default_fail_code(symbol))))
    }

    /// The configured delay of each call of `symbol`.
    pub(crate) fn delay(&self, symbol: &str) -> Option<Duration> {
        self.delay.get(symbol).copied()
    }
}

/// The process's fault configuration (read from the environment at first use).
pub(crate) fn faults() -> &'static Faults {
    static FAULTS: OnceLock<Faults> = OnceLock::new();
    FAULTS.get_or_init(Faults::from_env)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fail_rules_parse_counts_ranges_stars_and_codes() {
        let rules = parse_fail("aclrtMalloc:2, HcclBatchGet:1-3:21,HcclSend:*,bogus:1,aclrtFree:0,aclrtFree:x");
        assert_eq!(rules["aclrtMalloc"], vec![FailRule { first: 2, last: 2, code: None }]);
        assert_eq!(rules["HcclBatchGet"], vec![FailRule { first: 1, last: 3, code: Some(21) }]);
        assert_eq!(rules["HcclSend"], vec![FailRule { first: 1, last: u64::MAX, code: None }]);
        assert!(!rules.contains_key("bogus"));
        assert!(!rules.contains_key("aclrtFree"), "n is 1-based and must be a number");
    }

    #[test]
    fn the_nth_call_fails_and_the_others_do_not() {
        let faults = Faults { fail: parse_fail("aclrtMalloc:2,aclrtMalloc:4:99"), ..Faults::default() };
        let seen: Vec<_> = (0..5).map(|_| faults.injected_failure("aclrtMalloc")).collect();
        assert_eq!(seen, vec![None, Some((2, ACL_ERROR_RT_MEMORY_ALLOCATION)), None, Some((4, 99)), None]);
        assert_eq!(faults.injected_failure("aclrtFree"), None);
    }

    #[test]
    fn delays_parse_microseconds() {
        let delays = parse_delay("aclrtMemcpyAsync:1500,HcclSend:x,nope:3");
        assert_eq!(delays.get("aclrtMemcpyAsync"), Some(&Duration::from_micros(1500)));
        assert_eq!(delays.len(), 1);
    }

    #[test]
    fn default_codes_live_in_the_right_space() {
        assert_eq!(default_fail_code("aclrtMemcpy"), ACL_ERROR_RT_INTERNAL_ERROR);
        assert_eq!(default_fail_code("HcclCommDestroy"), HCCL_E_INTERNAL);
        assert_eq!(default_fail_code("HcclBatchGet"), HCCL_E_ROCE_TRANSFER);
    }
}
