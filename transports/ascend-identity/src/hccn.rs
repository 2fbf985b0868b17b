//! The `hccn_conf` link: a device's NIC IP from `/etc/hccn.conf`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use async_trait::async_trait;

use ferry_core::{Error, Identity, IdentityField, ResolveQuery, Result, SegmentResolver};

/// Where the driver's tool `hccn_tool` writes device network settings.
pub const DEFAULT_HCCN_CONF: &str = "/etc/hccn.conf";

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
/// `address_` line whose device is not a number or whose value is not an IP, and a device given
/// twice, are errors naming `file` and the line.
pub fn parse_hccn_conf(text: &str, file: &str) -> Result<BTreeMap<u32, HccnAddress>> {
    let mut out: BTreeMap<u32, HccnAddress> = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let Some((key, value)) = trimmed.split_once('=') else { continue };
        let key = key.trim();
        let Some(dev) = key.strip_prefix("address_") else { continue };
        let bad = |msg: String| Error::config(format!("{file} line {line}: {msg}"));
        if dev.is_empty() || !dev.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(format!("key {key:?} is not `address_<N>` with N a physical NPU id")));
        }
        let phy: u32 = dev.parse().map_err(|_| bad(format!("key {key:?}: device id is too large")))?;
        let ip = value.trim();
        if ip.parse::<IpAddr>().is_err() {
            return Err(bad(format!("{key} = {ip:?} is not an IP address; expected `{key}=<device IP>`")));
        }
        if let Some(first) = out.get(&phy) {
            return Err(bad(format!("{key} is given twice (first on line {})", first.line)));
        }
        out.insert(phy, HccnAddress { ip: ip.to_owned(), line });
    }
    Ok(out)
}

/// The `hccn_conf` link: the device IP of the physical NPU an earlier link resolved, from
/// `hccn.conf` (`address_<phy>=<ip>`).
///
/// Answers only for this process (the file describes this host), and only once the physical
/// device is known. A missing file at the default path answers nothing; a missing file at a
/// configured path (config `hccn_conf_path`, `FERRY_HCCN_CONF`) is an error, as is a file with
/// no line for the device (unless an earlier link already answered the device IP).
#[derive(Debug, Clone)]
pub struct HccnConfResolver {
    path: PathBuf,
    configured_by: Option<String>,
}

impl Default for HccnConfResolver {
    fn default() -> Self {
        Self { path: PathBuf::from(DEFAULT_HCCN_CONF), configured_by: None }
    }
}

impl HccnConfResolver {
    /// Reads `/etc/hccn.conf`, answering nothing when it does not exist.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads `path`, which `configured_by` (e.g. "config field `hccn_conf_path`") says must
    /// exist.
    pub fn at(path: impl Into<PathBuf>, configured_by: impl Into<String>) -> Self {
        Self { path: path.into(), configured_by: Some(configured_by.into()) }
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
                tracing::debug!(%file, "no hccn.conf: device IP not answered by hccn_conf");
                return Ok(Identity::default());
            }
            Err(e) => {
                let by = self.configured_by.as_deref().map(|b| format!(" (set by {b})")).unwrap_or_default();
                return Err(Error::config(format!("{file}{by} cannot be read: {e}")).with_source(e));
            }
        };
        let table = parse_hccn_conf(&text, &file)?;
        match table.get(&phy) {
            Some(a) => Ok(Identity { device_ip: Some(a.ip.clone()), ..Identity::default() }
                .with_detail(IdentityField::DeviceIp, format!("{file} line {} address_{phy}", a.line))),
            None if known.device_ip.is_some() => Ok(Identity::default()),
            None => {
                let listed: Vec<u32> = table.keys().copied().collect();
                Err(Error::config(format!(
                    "{file} has no `address_{phy}=<ip>` line for physical device {phy} (it lists devices {listed:?}); \
                     expected the device IP of every NPU this host uses"
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
    async fn missing_files() {
        let q = ResolveQuery::local(None, None);
        let default_missing = HccnConfResolver { path: "/nonexistent/hccn.conf".into(), configured_by: None };
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
            let text: String = map.iter().map(|(d, ip)| format!("address_{d}={ip}\nnetmask_{d}=255.255.255.0\n")).collect();
            let parsed = parse_hccn_conf(&text, "f").unwrap();
            let back: BTreeMap<u32, String> = parsed.into_iter().map(|(d, a)| (d, a.ip)).collect();
            let want: BTreeMap<u32, String> = map.into_iter().map(|(d, ip)| (d, ip.to_string())).collect();
            prop_assert_eq!(back, want);
        }
    }
}
