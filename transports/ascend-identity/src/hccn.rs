//! The `hccn_conf` link: a device's NIC IP from `/etc/hccn.conf` (`address_<phy>`, then
//! `IPv6address_<phy>`), or from the driver's `hccn_tool` when that file does not exist — the
//! order of HIXL's `GetDeviceIp` (`src/hixl/common/hixl_utils.cc` l.112-171).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use async_trait::async_trait;

use ferry_core::{Error, Identity, IdentityField, ResolveQuery, Result, SegmentResolver};

/// Where the driver's tool `hccn_tool` writes device network settings.
pub const DEFAULT_HCCN_CONF: &str = "/etc/hccn.conf";
/// Where the driver installs `hccn_tool` (else it is looked for on `PATH`).
pub const DEFAULT_HCCN_TOOL: &str = "/usr/local/Ascend/driver/tools/hccn_tool";
/// Names the `hccn_tool` to run instead of the driver's (for tests and unusual installs).
pub const HCCN_TOOL_ENV: &str = "FERRY_HCCN_TOOL";
/// How long one `hccn_tool` query may take.
const HCCN_TOOL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// One `address_<phy>=<ip>` line of `hccn.conf`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HccnAddress {
    /// The IP as written (validated as an IPv4 or IPv6 address).
    pub ip: String,
    /// 1-based line number.
    pub line: usize,
}

/// Parses `hccn.conf` text: the `address_<phy>=<ip>` lines, by physical device. Other keys
/// (`netmask_0`, `gateway_0`, `netdetect_0`, ...), blank lines and `#` comments are ignored. An
/// `address_` line whose device is not a number or whose value is not an IP, a device given
/// twice, and two devices given the same IP (each NPU has a NIC of its own; two cards sharing
/// an address would reach each other's peers, and a transfer to either would wait for a
/// partner that never comes), are errors naming `file` and the lines.
pub fn parse_hccn_conf(text: &str, file: &str) -> Result<BTreeMap<u32, HccnAddress>> {
    parse_hccn_keys(text, file, "address_")
}

/// The `IPv6address_<phy>=<ip>` lines of `hccn.conf`, with the rules of [`parse_hccn_conf`].
pub fn parse_hccn_conf_v6(text: &str, file: &str) -> Result<BTreeMap<u32, HccnAddress>> {
    parse_hccn_keys(text, file, "IPv6address_")
}

fn parse_hccn_keys(text: &str, file: &str, prefix: &str) -> Result<BTreeMap<u32, HccnAddress>> {
    let mut out: BTreeMap<u32, HccnAddress> = BTreeMap::new();
    let mut by_ip: std::collections::HashMap<IpAddr, (u32, usize)> = std::collections::HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let Some((key, value)) = trimmed.split_once('=') else { continue };
        let key = key.trim();
        let Some(dev) = key.strip_prefix(prefix) else { continue };
        let bad = |msg: String| Error::config(format!("{file} line {line}: {msg}"));
        if dev.is_empty() || !dev.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(format!("key {key:?} is not `{prefix}<N>` with N a physical NPU id")));
        }
        let phy: u32 = dev.parse().map_err(|_| bad(format!("key {key:?}: device id is too large")))?;
        let ip = value.trim();
        let Ok(parsed) = ip.parse::<IpAddr>() else {
            return Err(bad(format!("{key} = {ip:?} is not an IP address; expected `{key}=<device IP>`")));
        };
        if let Some(first) = out.get(&phy) {
            return Err(bad(format!("{key} is given twice (first on line {})", first.line)));
        }
        if let Some((other, other_line)) = by_ip.insert(parsed, (phy, line)) {
            return Err(bad(format!(
                "{key} = {ip} is also the address of NPU {other} ({prefix}{other}, line {other_line}): every card \
                 needs a device IP of its own"
            )));
        }
        out.insert(phy, HccnAddress { ip: ip.to_owned(), line });
    }
    Ok(out)
}

/// The `hccn_conf` link: the device IP of the physical NPU an earlier link resolved, from
/// `hccn.conf` (`address_<phy>=<ip>`, then `IPv6address_<phy>=<ip>`), or, when the file does
/// not exist, from `hccn_tool -i <phy> -ip -g` (then `-ip -inet6 -g`), as HIXL finds it.
///
/// Answers only for this process (the file describes this host), and only once the physical
/// device is known. A missing file at the default path falls back to `hccn_tool` (the driver's,
/// else one on `PATH`, or the one `FERRY_HCCN_TOOL` names), and answers nothing when there is
/// none; a missing file at a configured path (config `hccn_conf_path`, `FERRY_HCCN_CONF`) is an
/// error, as is a file with no line for the device (unless an earlier link already answered the
/// device IP). Errors name all three sources.
#[derive(Debug, Clone)]
pub struct HccnConfResolver {
    path: PathBuf,
    configured_by: Option<String>,
    tool: Option<PathBuf>,
}

impl Default for HccnConfResolver {
    fn default() -> Self {
        Self { path: PathBuf::from(DEFAULT_HCCN_CONF), configured_by: None, tool: None }
    }
}

/// The `hccn_tool` to ask: `FERRY_HCCN_TOOL`, else the driver's, else `hccn_tool` on `PATH`.
pub fn find_hccn_tool(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    if let Some(t) = env(HCCN_TOOL_ENV).filter(|t| !t.is_empty()) {
        return Some(PathBuf::from(t));
    }
    let driver = PathBuf::from(DEFAULT_HCCN_TOOL);
    if driver.is_file() {
        return Some(driver);
    }
    let path = env("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("hccn_tool")).find(|p| p.is_file())
}

/// The device IP `hccn_tool` reports for physical device `phy` (`ipaddr:<ip>` in its output):
/// IPv4 first, then IPv6. `Ok(None)` when it reports none.
fn ask_hccn_tool(tool: &std::path::Path, phy: u32) -> std::result::Result<Option<(String, String)>, String> {
    for query in [&["-ip", "-g"][..], &["-ip", "-inet6", "-g"][..]] {
        let mut cmd = std::process::Command::new(tool);
        cmd.arg("-i").arg(phy.to_string()).args(query);
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let shown = format!("{} -i {phy} {}", tool.display(), query.join(" "));
        let mut child = cmd.spawn().map_err(|e| format!("`{shown}` cannot run: {e}"))?;
        let deadline = std::time::Instant::now() + HCCN_TOOL_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("`{shown}` did not answer within {HCCN_TOOL_TIMEOUT:?}"));
                }
                Err(e) => return Err(format!("`{shown}`: {e}")),
            }
        }
        let out = child.wait_with_output().map_err(|e| format!("`{shown}`: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        if let Some(ip) = text.lines().find_map(|l| l.trim().strip_prefix("ipaddr:")).map(str::trim)
            && !ip.is_empty()
        {
            if ip.parse::<IpAddr>().is_err() {
                return Err(format!("`{shown}` answered `ipaddr:{ip}`, which is not an IP address"));
            }
            return Ok(Some((ip.to_owned(), shown)));
        }
    }
    Ok(None)
}

impl HccnConfResolver {
    /// Reads `/etc/hccn.conf`, answering nothing when it does not exist.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads `path`, which `configured_by` (e.g. "config field `hccn_conf_path`") says must
    /// exist.
    pub fn at(path: impl Into<PathBuf>, configured_by: impl Into<String>) -> Self {
        Self { path: path.into(), configured_by: Some(configured_by.into()), tool: None }
    }

    /// Asks `tool` (see [`find_hccn_tool`]) when the default `hccn.conf` does not exist.
    pub fn with_tool(mut self, tool: Option<PathBuf>) -> Self {
        self.tool = tool;
        self
    }

    /// The file read.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

#[async_trait]
impl SegmentResolver for HccnConfResolver {
    fn name(&self) -> &str {
        "hccn_conf"
    }

    async fn resolve(&self, query: &ResolveQuery, known: &Identity) -> Result<Identity> {
        let Some(phy) = known.physical_device.filter(|_| query.is_local()) else { return Ok(Identity::default()) };
        let file = self.path.display().to_string();
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.configured_by.is_none() => {
                let Some(tool) = self.tool.clone() else {
                    tracing::debug!(%file, "no hccn.conf and no hccn_tool: device IP not answered by hccn_conf");
                    return Ok(Identity::default());
                };
                let asked = tokio::task::spawn_blocking(move || ask_hccn_tool(&tool, phy))
                    .await
                    .map_err(|e| Error::config(format!("asking hccn_tool: {e}")))?;
                return match asked {
                    Ok(Some((ip, shown))) => Ok(Identity { device_ip: Some(ip), ..Identity::default() }
                        .with_detail(IdentityField::DeviceIp, format!("{file} does not exist; `{shown}`"))),
                    Ok(None) if known.device_ip.is_some() => Ok(Identity::default()),
                    Ok(None) => Err(Error::config(format!(
                        "no device IP for physical device {phy}: {file} does not exist and hccn_tool reports no \
                         `ipaddr:` for it (-ip -g, -ip -inet6 -g); set it with `hccn_tool -i {phy} -ip -s address <ip> \
                         netmask <mask>`, or give `address_{phy}=<ip>` (or `IPv6address_{phy}=<ip>`) in an hccn.conf"
                    ))),
                    Err(why) if known.device_ip.is_some() => {
                        tracing::debug!(why, "hccn_tool failed; the device IP is known already");
                        Ok(Identity::default())
                    }
                    Err(why) => Err(Error::config(format!("no device IP for physical device {phy}: {why}"))),
                };
            }
            Err(e) => {
                let by = self.configured_by.as_deref().map(|b| format!(" (set by {b})")).unwrap_or_default();
                return Err(Error::config(format!("{file}{by} cannot be read: {e}")).with_source(e));
            }
        };
        let table = parse_hccn_conf(&text, &file)?;
        let v6 = parse_hccn_conf_v6(&text, &file)?;
        let found = table.get(&phy).map(|a| ("address", a)).or_else(|| v6.get(&phy).map(|a| ("IPv6address", a)));
        match found {
            Some((key, a)) => Ok(Identity { device_ip: Some(a.ip.clone()), ..Identity::default() }
                .with_detail(IdentityField::DeviceIp, format!("{file} line {} {key}_{phy}", a.line))),
            None if known.device_ip.is_some() => Ok(Identity::default()),
            None => {
                let listed: Vec<u32> = table.keys().chain(v6.keys()).copied().collect();
                Err(Error::config(format!(
                    "{file} has no `address_{phy}=<ip>` or `IPv6address_{phy}=<ip>` line for physical device {phy} \
                     (it lists devices {listed:?}; hccn_tool is asked only when the file does not exist); expected \
                     the device IP of every NPU this host uses"
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CONF: &str = "# written by hccn_tool\naddress_0=29.10.1.1\nnetmask_0=255.255.255.0\n\naddress_5 = 29.10.1.6\nnetdetect_5=29.10.1.254\n";

    fn tmp(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferry-hccn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn known(phy: u32) -> Identity {
        Identity { physical_device: Some(phy), ..Identity::default() }
    }

    #[test]
    fn parses_address_lines() {
        let t = parse_hccn_conf(CONF, "/etc/hccn.conf").unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[&0], HccnAddress { ip: "29.10.1.1".into(), line: 2 });
        assert_eq!(t[&5], HccnAddress { ip: "29.10.1.6".into(), line: 5 });
    }

    #[test]
    fn malformed_lines_name_file_and_line() {
        for (text, needle) in [
            ("address_x=1.2.3.4", "line 1: key \"address_x\" is not `address_<N>`"),
            ("\naddress_=1.2.3.4", "line 2: key \"address_\""),
            ("address_1=not-an-ip", "line 1: address_1 = \"not-an-ip\" is not an IP address"),
            ("address_1=1.2.3.4\naddress_1=1.2.3.5", "line 2: address_1 is given twice (first on line 1)"),
            (
                "address_0=10.0.0.1\naddress_1=10.0.0.1",
                "line 2: address_1 = 10.0.0.1 is also the address of NPU 0 (address_0, line 1)",
            ),
            ("address_99999999999=1.2.3.4", "too large"),
        ] {
            let e = parse_hccn_conf(text, "/h.conf").unwrap_err();
            assert!(e.message().starts_with("/h.conf ") && e.message().contains(needle), "{text:?}: {e}");
        }
    }

    #[tokio::test]
    async fn answers_the_known_devices_ip() {
        let p = tmp("ok.conf", CONF);
        let r = HccnConfResolver::at(&p, "test");
        let q = ResolveQuery::local(None, None);
        let id = r.resolve(&q, &known(5)).await.unwrap();
        assert_eq!(id.device_ip.as_deref(), Some("29.10.1.6"));
        assert!(id.details[&IdentityField::DeviceIp].ends_with("line 5 address_5"), "{:?}", id.details);
        // Nothing to look up without a physical device, and peers are not answered.
        assert!(r.resolve(&q, &Identity::default()).await.unwrap().is_empty());
        assert!(r.resolve(&ResolveQuery::peer("h:1", None, None), &known(5)).await.unwrap().is_empty());
        // A device with no line: an error naming the file and the device...
        let e = r.resolve(&q, &known(3)).await.unwrap_err();
        assert!(e.message().contains(&p.display().to_string()) && e.message().contains("physical device 3"), "{e}");
        assert!(e.message().contains("[0, 5]"), "{e}");
        // ...unless an earlier link already knows the device IP.
        let k = Identity { device_ip: Some("1.1.1.1".into()), ..known(3) };
        assert!(r.resolve(&q, &k).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn ipv6_lines_answer_after_ipv4_ones() {
        let p = tmp("v6.conf", "IPv6address_2=fd00::2\naddress_3=29.0.0.3\nIPv6address_3=fd00::3\n");
        let r = HccnConfResolver::at(&p, "test");
        let q = ResolveQuery::local(None, None);
        let id = r.resolve(&q, &known(2)).await.unwrap();
        assert_eq!(id.device_ip.as_deref(), Some("fd00::2"));
        assert!(id.details[&IdentityField::DeviceIp].ends_with("line 1 IPv6address_2"), "{:?}", id.details);
        assert_eq!(r.resolve(&q, &known(3)).await.unwrap().device_ip.as_deref(), Some("29.0.0.3"), "IPv4 first");
        let e = r.resolve(&q, &known(4)).await.unwrap_err();
        assert!(e.message().contains("`address_4=<ip>` or `IPv6address_4=<ip>`"), "{e}");
        assert!(e.message().contains("hccn_tool is asked only when the file does not exist"), "{e}");
        assert!(parse_hccn_conf_v6("IPv6address_1=x", "f").is_err());
    }

    /// A stand-in `hccn_tool` printing what the driver's prints for `-i <phy> -ip -g`.
    fn fake_tool(name: &str, script: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = tmp(name, &format!("#!/bin/sh\n{script}\n"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    #[tokio::test]
    async fn without_hccn_conf_hccn_tool_is_asked() {
        let q = ResolveQuery::local(None, None);
        let missing = |tool: Option<PathBuf>| HccnConfResolver {
            path: "/nonexistent/hccn.conf".into(),
            configured_by: None,
            tool,
        };
        let v4 = fake_tool(
            "hccn_tool_v4",
            r#"[ "$1 $2 $3 $4" = "-i 6 -ip -g" ] && printf 'ipaddr:29.1.1.7\nnetmask:255.255.255.0\n'; exit 0"#,
        );
        let id = missing(Some(v4.clone())).resolve(&q, &known(6)).await.unwrap();
        assert_eq!(id.device_ip.as_deref(), Some("29.1.1.7"));
        assert!(id.details[&IdentityField::DeviceIp].contains("-i 6 -ip -g"), "{:?}", id.details);
        let v6 = fake_tool("hccn_tool_v6", r#"[ "$3 $4" = "-ip -inet6" ] && echo 'ipaddr:fd00::7'; exit 0"#);
        assert_eq!(missing(Some(v6)).resolve(&q, &known(6)).await.unwrap().device_ip.as_deref(), Some("fd00::7"));
        // Nothing reported: an error naming all three sources.
        let e = missing(Some(v4)).resolve(&q, &known(2)).await.unwrap_err();
        let m = e.message();
        assert!(m.contains("does not exist") && m.contains("hccn_tool") && m.contains("IPv6address_2"), "{m}");
        let bad = fake_tool("hccn_tool_bad", "echo 'ipaddr:not-an-ip'");
        let e = missing(Some(bad)).resolve(&q, &known(2)).await.unwrap_err();
        assert!(e.message().contains("not an IP address"), "{e}");
        // A tool named by FERRY_HCCN_TOOL wins; none on PATH means none.
        let named = find_hccn_tool(|k| (k == HCCN_TOOL_ENV).then(|| "/x/hccn_tool".to_owned()));
        assert_eq!(named, Some(PathBuf::from("/x/hccn_tool")));
        if !PathBuf::from(DEFAULT_HCCN_TOOL).is_file() {
            assert_eq!(find_hccn_tool(|k| (k == "PATH").then(|| "/nonexistent".to_owned())), None);
        }
    }

    #[tokio::test]
    async fn missing_files() {
        let q = ResolveQuery::local(None, None);
        let default_missing =
            HccnConfResolver { path: "/nonexistent/hccn.conf".into(), configured_by: None, tool: None };
        assert!(default_missing.resolve(&q, &known(0)).await.unwrap().is_empty());
        let configured = HccnConfResolver::at("/nonexistent/hccn.conf", "FERRY_HCCN_CONF");
        let e = configured.resolve(&q, &known(0)).await.unwrap_err();
        assert!(e.message().contains("/nonexistent/hccn.conf (set by FERRY_HCCN_CONF) cannot be read"), "{e}");
    }

    proptest! {
        #[test]
        fn never_panics(text in "(address_[0-9x]{0,3}[ =]{1,2}[0-9a-f.:]{0,12}\n|#.*\n|[a-z_0-9]{0,8}=.*\n){0,8}") {
            let _ = parse_hccn_conf(&text, "f");
        }

        #[test]
        fn round_trips(map in proptest::collection::btree_map(0u32..64, any::<std::net::Ipv4Addr>(), 0..16)) {
            // Every card has an address of its own (a shared one is an error, tested above).
            let distinct: std::collections::HashSet<_> = map.values().collect();
            prop_assume!(distinct.len() == map.len());
            let text: String = map.iter().map(|(d, ip)| format!("address_{d}={ip}\nnetmask_{d}=255.255.255.0\n")).collect();
            let parsed = parse_hccn_conf(&text, "f").unwrap();
            let back: BTreeMap<u32, String> = parsed.into_iter().map(|(d, a)| (d, a.ip)).collect();
            let want: BTreeMap<u32, String> = map.into_iter().map(|(d, ip)| (d, ip.to_string())).collect();
            prop_assert_eq!(back, want);
        }
    }
}
