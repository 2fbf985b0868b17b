//! `Initialize`: the local engine name and the options map, parsed as HIXL parses them.
//!
//! Sources (HIXL `hicann/hixl` at 9ed283b2): `src/hixl/engine/hixl_options.cc` (`HixlOptions::Parse`
//! l.212-228 and the parsers it calls), `src/hixl/engine/engine_factory.cc` l.38-77 (which engine),
//! `src/hixl/engine/comm_engine.cc` l.15-26 and `src/hixl/engine/hixl_engine.cc` l.31-69 (the keys
//! each engine accepts, the CS engine's buffer pool rule), `src/llm_datadist/adxl/adxl_inner_engine.cc`
//! l.204-248 (the legacy engine's `BufferPool`), `src/hixl/common/hixl_utils.cc` l.218-240
//! (`ParseListenInfo`).

use std::net::IpAddr;

use crate::codes::*;

/// Which HIXL engine `Initialize` selects (`engine_factory.cc` l.38-77).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `CommEngine`: the legacy HCCL comm-domain engine (at most 512 links).
    Legacy,
    /// `HixlEngine`: client/server mode (`LocalCommRes` `"version":"1.3"`, or a
    /// `GlobalResourceConfig` `comm_resource_config.protocol_desc`).
    ClientServer,
}

/// The options that decide the emulator's behaviour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Options {
    pub(crate) mode: Mode,
    /// `AutoConnect=1`: transfers connect on demand and a failed transfer drops the link.
    pub(crate) auto_connect: bool,
    /// The legacy engine's buffer pool `(buffer count, buffer MB)`; `None` = disabled (`"0:0"`).
    /// Parsed and validated only: the emulator never moves unregistered memory through it.
    pub(crate) buffer_pool: Option<(u64, u64)>,
}

const OPT_AUTO_CONNECT: &str = "AutoConnect";
const OPT_LOCAL_COMM_RES: [&str; 2] = ["LocalCommRes", "adxl.LocalCommRes"];
const OPT_BUFFER_POOL: [&str; 2] = ["BufferPool", "adxl.BufferPool"];
const OPT_TC: [&str; 2] = ["RdmaTrafficClass", "adxl.RdmaTrafficClass"];
const OPT_SL: [&str; 2] = ["RdmaServiceLevel", "adxl.RdmaServiceLevel"];
const OPT_FABRIC: &str = "EnableUseFabricMem";
const OPT_GLOBAL: &str = "GlobalResourceConfig";

/// Keys `CommEngine` accepts (`comm_engine.cc` l.15-21); anything else is `PARAM_INVALID` (l.24).
const LEGACY_KEYS: &[&str] = &[
    OPT_FABRIC,
    "RdmaTrafficClass",
    "adxl.RdmaTrafficClass",
    "RdmaServiceLevel",
    "adxl.RdmaServiceLevel",
    "LocalCommRes",
    "adxl.LocalCommRes",
    "BufferPool",
    "adxl.BufferPool",
    OPT_AUTO_CONNECT,
    OPT_GLOBAL,
];

/// Keys `HixlEngine` accepts (`hixl_engine.cc` l.31-37): no `EnableUseFabricMem`.
const CS_KEYS: &[&str] = &[
    "RdmaTrafficClass",
    "adxl.RdmaTrafficClass",
    "RdmaServiceLevel",
    "adxl.RdmaServiceLevel",
    "LocalCommRes",
    "adxl.LocalCommRes",
    "BufferPool",
    "adxl.BufferPool",
    OPT_AUTO_CONNECT,
    OPT_GLOBAL,
];

fn invalid(message: String) -> EmuError {
    hixl_err(HIXL_PARAM_INVALID, message)
}

/// HIXL's `ToNumber` for an unsigned value: decimal digits only, within `u64` (an inference:
/// `ToNumber` is not in the repository's public part; the emulator accepts what `std::stoull`
/// with a full-consumption check would).
fn to_u64(s: &str) -> Option<u64> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok()).flatten()
}

fn to_i64(s: &str) -> Option<i64> {
    let digits = s.strip_prefix('-').unwrap_or(s);
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok()).flatten()
}

/// The first of `keys` present (HIXL prefers the unprefixed key, `hixl_options.cc` l.248-250).
fn find<'a>(pairs: &'a [(String, String)], keys: &[&str]) -> Option<&'a str> {
    keys.iter().find_map(|k| pairs.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str()))
}

/// Parses the options as `HixlOptions::Parse` then `EngineFactory::CreateEngine` then the
/// selected engine's `Initialize` do. Every refusal is `PARAM_INVALID`, as in HIXL
/// (`CreateEngine` returns null on a parse error and `HIXL_CHECK_NOTNULL` turns that into
/// `PARAM_INVALID`, `hixl_impl.cc` l.88-90, `hixl_checker.h` l.86-93).
pub(crate) fn parse(pairs: &[(String, String)]) -> EmuResult<Options> {
    // RDMA traffic class: 0..=255, a multiple of 4; service level 0..=7 (`hixl_options.cc`
    // l.246-296). The `HCCL_RDMA_TC`/`HCCL_RDMA_SL` fallbacks are not read by the emulator.
    if let Some(tc) = find(pairs, &OPT_TC).filter(|v| !v.is_empty()) {
        match to_i64(tc) {
            Some(v) if (0..=255).contains(&v) && v % 4 == 0 => {}
            _ => return Err(invalid(format!("RdmaTrafficClass {tc:?} must be 0-255 and a multiple of 4"))),
        }
    }
    if let Some(sl) = find(pairs, &OPT_SL).filter(|v| !v.is_empty()) {
        match to_i64(sl) {
            Some(v) if (0..=7).contains(&v) => {}
            _ => return Err(invalid(format!("RdmaServiceLevel {sl:?} must be in [0, 7]"))),
        }
    }
    let local_comm_res = find(pairs, &OPT_LOCAL_COMM_RES);
    // EnableUseFabricMem: empty is ignored, else 0 or 1 (`hixl_options.cc` l.309-321).
    let mut fabric = false;
    if let Some(v) = pairs.iter().find(|(k, _)| k == OPT_FABRIC).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty()) {
        match to_u64(v) {
            Some(0) => {}
            Some(1) => fabric = true,
            _ => return Err(invalid(format!("{OPT_FABRIC} {v:?} is invalid, should be zero or one"))),
        }
    }
    // AutoConnect: present ⇒ non-empty, a number, 0 or 1 (`hixl_options.cc` l.323-340).
    let mut auto_connect = false;
    if let Some(v) = pairs.iter().find(|(k, _)| k == OPT_AUTO_CONNECT).map(|(_, v)| v.as_str()) {
        if v.is_empty() {
            return Err(invalid(format!("{OPT_AUTO_CONNECT} value is empty, should be zero or one")));
        }
        match to_u64(v) {
            Some(0) => {}
            Some(1) => auto_connect = true,
            _ => return Err(invalid(format!("{OPT_AUTO_CONNECT} {v:?} is invalid, should be zero or one"))),
        }
    }
    // GlobalResourceConfig: a JSON object (`hixl_options.cc` l.342-357);
    // `comm_resource_config.protocol_desc` selects the CS engine (`engine_factory.cc` l.24-31, 66-69).
    let mut protocol_desc = false;
    if let Some(v) = pairs.iter().find(|(k, _)| k == OPT_GLOBAL).map(|(_, v)| v.as_str()) {
        let json: serde_json::Value =
            serde_json::from_str(v).map_err(|e| invalid(format!("Failed to parse GlobalResourceConfig json: {e}")))?;
        let obj = json.as_object().ok_or_else(|| invalid("GlobalResourceConfig must be a JSON object".into()))?;
        protocol_desc = match obj.get("comm_resource_config.protocol_desc") {
            None => false,
            Some(serde_json::Value::String(s)) => !s.is_empty(),
            Some(serde_json::Value::Array(a)) => {
                if !a.iter().all(|x| x.is_string()) {
                    return Err(invalid("comm_resource_config.protocol_desc must be a string or strings".into()));
                }
                !a.is_empty()
            }
            Some(_) => return Err(invalid("comm_resource_config.protocol_desc must be a string or strings".into())),
        };
    }
    // Which engine (`engine_factory.cc` l.47-77).
    if fabric {
        // FabricMemEngine is not modelled (an emulator choice, documented in docs/ascend.md).
        return Err(hixl_err(
            HIXL_UNSUPPORTED,
            "EnableUseFabricMem=1 selects HIXL's FabricMemEngine, which the emulator does not model",
        ));
    }
    let mode = match local_comm_res.filter(|v| !v.is_empty()) {
        Some(lcr) => {
            let json: serde_json::Value =
                serde_json::from_str(lcr).map_err(|e| invalid(format!("Invalid LocalCommRes json: {e}")))?;
            if json.get("version").and_then(|v| v.as_str()) == Some("1.3") { Mode::ClientServer } else { Mode::Legacy }
        }
        None if protocol_desc => Mode::ClientServer,
        None => Mode::Legacy,
    };
    // The selected engine's accepted keys (`comm_engine.cc` l.24, `hixl_engine.cc` l.60).
    let accepted = if mode == Mode::Legacy { LEGACY_KEYS } else { CS_KEYS };
    if let Some((k, _)) = pairs.iter().find(|(k, _)| !accepted.contains(&k.as_str())) {
        return Err(invalid(format!("Unsupported option '{k}' for this engine")));
    }
    let pool = find(pairs, &OPT_BUFFER_POOL);
    let buffer_pool = match mode {
        // The CS engine accepts only "0:0" (`hixl_engine.cc` l.62-69).
        Mode::ClientServer => {
            if let Some(p) = pool
                && p != "0:0"
            {
                return Err(invalid(format!("BufferPool {p:?}: the hixl engine only supports \"0:0\"")));
            }
            None
        }
        Mode::Legacy => parse_buffer_pool(pool)?,
    };
    Ok(Options { mode, auto_connect, buffer_pool })
}

/// The legacy engine's `BufferPool` (`adxl_inner_engine.cc` l.216-248): absent or empty → the
/// default 4 buffers of 8 MB; `"0:0"` → disabled; else `N:MB` with both numbers > 0.
fn parse_buffer_pool(pool: Option<&str>) -> EmuResult<Option<(u64, u64)>> {
    let p = match pool {
        None | Some("") => return Ok(Some((4, 8))),
        Some("0:0") => return Ok(None),
        Some(p) => p,
    };
    let parts: Vec<&str> = p.split(':').collect();
    let [n, size] = parts.as_slice() else {
        return Err(invalid(format!("Option BufferPool is invalid: {p}, expect ${{BUFFER_NUM}}:${{BUFFER_SIZE}}")));
    };
    let n =
        to_u64(n).filter(|&n| n > 0).ok_or_else(|| invalid(format!("Buffer num of BufferPool {p:?} is invalid")))?;
    let size = to_u64(size)
        .filter(|&s| s > 0)
        .ok_or_else(|| invalid(format!("Buffer size of BufferPool {p:?} is invalid")))?;
    n.checked_mul(size)
        .and_then(|t| t.checked_mul(1 << 20))
        .ok_or_else(|| invalid(format!("Buffer pool config {p:?} is invalid (overflow)")))?;
    Ok(Some((n, size)))
}

/// An engine name: `ip`, `ip:port`, `[ipv6]` or `[ipv6]:port` (`hixl_utils.cc` l.218-240).
/// The port is an `int32`; absent = 0 (no server).
pub(crate) fn parse_engine_name(name: &str) -> EmuResult<(IpAddr, i64)> {
    let (ip, port) = match (name.find('['), name.find(']')) {
        (Some(l), Some(r)) if l < r => {
            let port = name[r..].find(':').map(|c| &name[r + c + 1..]);
            (&name[l + 1..r], port)
        }
        _ => {
            let parts: Vec<&str> = name.split(':').collect();
            match parts.as_slice() {
                [ip] => (*ip, None),
                [ip, port] => (*ip, Some(*port)),
                _ => {
                    return Err(invalid(format!(
                        "listen info is invalid: {name}, expect ${{ip}}:${{port}}, ${{ip}}, [${{ipv6}}]:${{port}}"
                    )));
                }
            }
        }
    };
    let ip: IpAddr = ip.parse().map_err(|_| invalid(format!("IP is invalid: {ip}, listen info = {name}")))?;
    let port = match port {
        None => 0,
        Some(p) => to_i64(p)
            .filter(|p| i32::try_from(*p).is_ok())
            .ok_or_else(|| invalid(format!("Port:{p} is invalid (engine name {name})")))?,
    };
    Ok((ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(pairs: &[(&str, &str)]) -> EmuResult<Options> {
        let v: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        parse(&v)
    }

    #[test]
    fn auto_connect_is_zero_or_one() {
        assert!(o(&[("AutoConnect", "1")]).unwrap().auto_connect);
        assert!(!o(&[("AutoConnect", "0")]).unwrap().auto_connect);
        assert!(!o(&[]).unwrap().auto_connect);
        for bad in ["", "2", "yes", "-1", " 1"] {
            assert_eq!(o(&[("AutoConnect", bad)]).unwrap_err().code as u32, HIXL_PARAM_INVALID, "{bad:?}");
        }
    }

    #[test]
    fn local_comm_res_version_1_3_selects_client_server_mode() {
        assert_eq!(o(&[("adxl.LocalCommRes", r#"{"version":"1.3"}"#)]).unwrap().mode, Mode::ClientServer);
        assert_eq!(o(&[("LocalCommRes", r#"{"version":"1.2"}"#)]).unwrap().mode, Mode::Legacy);
        assert_eq!(o(&[("LocalCommRes", "{")]).unwrap_err().code as u32, HIXL_PARAM_INVALID);
        assert_eq!(
            o(&[("GlobalResourceConfig", r#"{"comm_resource_config.protocol_desc":"roce"}"#)]).unwrap().mode,
            Mode::ClientServer
        );
        assert_eq!(o(&[("GlobalResourceConfig", "[]")]).unwrap_err().code as u32, HIXL_PARAM_INVALID);
    }

    #[test]
    fn buffer_pools_and_unknown_keys() {
        assert_eq!(o(&[]).unwrap().buffer_pool, Some((4, 8)));
        assert_eq!(o(&[("adxl.BufferPool", "0:0")]).unwrap().buffer_pool, None);
        assert_eq!(o(&[("BufferPool", "2:16")]).unwrap().buffer_pool, Some((2, 16)));
        for bad in ["4", "0:8", "4:0", "a:b", "1:2:3"] {
            assert_eq!(o(&[("BufferPool", bad)]).unwrap_err().code as u32, HIXL_PARAM_INVALID, "{bad:?}");
        }
        let cs = r#"{"version":"1.3"}"#;
        assert_eq!(o(&[("LocalCommRes", cs), ("BufferPool", "4:8")]).unwrap_err().code as u32, HIXL_PARAM_INVALID);
        assert!(o(&[("LocalCommRes", cs), ("BufferPool", "0:0")]).is_ok());
        assert_eq!(o(&[("Bogus", "1")]).unwrap_err().code as u32, HIXL_PARAM_INVALID);
        assert_eq!(
            o(&[("LocalCommRes", cs), ("EnableUseFabricMem", "0")]).unwrap_err().code as u32,
            HIXL_PARAM_INVALID
        );
        assert_eq!(o(&[("EnableUseFabricMem", "1")]).unwrap_err().code as u32, HIXL_UNSUPPORTED);
        assert_eq!(o(&[("RdmaTrafficClass", "5")]).unwrap_err().code as u32, HIXL_PARAM_INVALID);
        assert!(o(&[("adxl.RdmaTrafficClass", "132"), ("adxl.RdmaServiceLevel", "4")]).is_ok());
    }

    #[test]
    fn engine_names() {
        assert_eq!(parse_engine_name("10.0.0.1").unwrap(), ("10.0.0.1".parse().unwrap(), 0));
        assert_eq!(parse_engine_name("10.0.0.1:20001").unwrap(), ("10.0.0.1".parse().unwrap(), 20001));
        assert_eq!(parse_engine_name("[::1]:7").unwrap(), ("::1".parse().unwrap(), 7));
        assert_eq!(parse_engine_name("[::1]").unwrap(), ("::1".parse().unwrap(), 0));
        assert_eq!(parse_engine_name("1.2.3.4:-1").unwrap().1, -1);
        for bad in ["", "host:1", "1.2.3.4:x", "::1", "1.2.3.4:99999999999"] {
            assert_eq!(parse_engine_name(bad).unwrap_err().code as u32, HIXL_PARAM_INVALID, "{bad:?}");
        }
    }
}
