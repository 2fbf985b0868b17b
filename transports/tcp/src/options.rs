//! The `tcp` transport's config fields: `tcp_lanes`, `tcp_data_port`, `tcp_io_threads`,
//! `tcp_bind_address`, `tcp_max_connections_per_ip`, `tcp_max_connections` and
//! `tcp_local_congestion`, declared as [`OptionSpec`]s and read from the config's unknown fields and the environment
//! ([`Config::option`]), each with where its value came from, and checked here: a value out of
//! range is an error naming the field (or the variable) and the accepted range, never clamped.
//!
//! The transport also reads peer authentication's `auth_secret` and `auth_secret_file`
//! (declared by `ferry-peer-auth`, listed here among its options: see the crate-level docs of
//! `auth`).

use std::net::IpAddr;

use ferry_core::{Config, Environment, OptionSpec, OptionValue, Result, Setting};

/// `tcp_lanes` (`FERRY_TCP_LANES`): persistent connections per peer.
pub const LANES: OptionSpec = OptionSpec {
    key: "tcp_lanes",
    env: Some("FERRY_TCP_LANES"),
    env_invalid: "not a whole number",
    default: "4; to a peer on this host, one per two cores (1 to 4)",
    doc: "persistent connections per peer, 1 to 64 (a peer on this host shares its cores: each connection to it \
          keeps two busy)",
};

/// `tcp_data_port` (`FERRY_TCP_DATA_PORT`): the port the target listens on; refused with
/// `base_port`.
pub const DATA_PORT: OptionSpec = OptionSpec {
    key: "tcp_data_port",
    env: Some("FERRY_TCP_DATA_PORT"),
    env_invalid: "not a port number",
    default: "any free port",
    doc: "data port the target listens on (0: any free port), published as the descriptor's `tcp_data_port`. A \
          fixed port is refused with `base_port` (every rank would bind it): leave it unset there",
};

/// `tcp_io_threads` (`FERRY_TCP_IO_THREADS`): threads running the initiator's lanes.
pub const IO_THREADS: OptionSpec = OptionSpec {
    key: "tcp_io_threads",
    env: Some("FERRY_TCP_IO_THREADS"),
    env_invalid: "not a whole number",
    default: "one per lane, at most one per core",
    doc: "threads running the initiator's lanes, 1 to 64",
};

/// `tcp_bind_address` (`FERRY_TCP_BIND_ADDRESS`): the address the data port listens on.
pub const BIND_ADDRESS: OptionSpec = OptionSpec {
    key: "tcp_bind_address",
    env: Some("FERRY_TCP_BIND_ADDRESS"),
    env_invalid: "not an IP address",
    default: "the host published as `tcp_data_host` (the segment name's) when it is an IP address, else every \
              address",
    doc: "IP address the data port listens on (`0.0.0.0` or `::`: every address). An address that cannot be bound \
          is an error",
};

/// `tcp_max_connections_per_ip` (`FERRY_TCP_MAX_CONNECTIONS_PER_IP`): connections the target
/// keeps per remote IP address before it closes the idlest of them for a new one.
pub const MAX_CONNECTIONS_PER_IP: OptionSpec = OptionSpec {
    key: "tcp_max_connections_per_ip",
    env: Some("FERRY_TCP_MAX_CONNECTIONS_PER_IP"),
    env_invalid: "not a whole number",
    default: "64",
    doc: "connections the target keeps per remote IP address; a new one beyond it closes the idlest of them (never \
          one in the middle of a request; see docs/transports.md), 1 to 65536",
};

/// `tcp_max_connections` (`FERRY_TCP_MAX_CONNECTIONS`): connections the target serves in all
/// before it closes the idlest of them, from any address, for a new one.
pub const MAX_CONNECTIONS: OptionSpec = OptionSpec {
    key: "tcp_max_connections",
    env: Some("FERRY_TCP_MAX_CONNECTIONS"),
    env_invalid: "not a whole number",
    default: "4096",
    doc: "connections the target serves in all; a new one beyond it closes the idlest of all, from any address \
          (never one in the middle of a request), 16 to 1048576",
};

/// `tcp_local_congestion` (`FERRY_TCP_LOCAL_CONGESTION`): the TCP congestion control of a
/// connection whose two ends are on this host.
pub const LOCAL_CONGESTION: OptionSpec = OptionSpec {
    key: "tcp_local_congestion",
    env: Some("FERRY_TCP_LOCAL_CONGESTION"),
    env_invalid: "not a congestion control name",
    default: "reno",
    doc: "TCP congestion control of a connection whose two ends are on this host (it goes over loopback, where there \
          is no network to share): a name the kernel lets this process choose (`reno` always; the others listed in \
          `net.ipv4.tcp_allowed_congestion_control`), or `system` for the host's default. A pacing one such as BBR \
          arms a timer per burst, which costs a loopback connection more than half its throughput on a virtual \
          machine (docs/performance.md). Connections to other hosts keep the host's default",
};

/// Every option the `tcp` transport declares: its own and peer authentication's.
pub const OPTIONS: &[OptionSpec] = &[
    LANES,
    DATA_PORT,
    IO_THREADS,
    BIND_ADDRESS,
    MAX_CONNECTIONS_PER_IP,
    MAX_CONNECTIONS,
    LOCAL_CONGESTION,
    ferry_peer_auth::options::SECRET,
    ferry_peer_auth::options::SECRET_FILE,
];

/// Default [`MAX_CONNECTIONS_PER_IP`].
pub const DEFAULT_MAX_CONNECTIONS_PER_IP: u32 = 64;

/// The accepted [`MAX_CONNECTIONS_PER_IP`].
pub const CONNECTIONS_PER_IP_RANGE: std::ops::RangeInclusive<u32> = 1..=65_536;

/// Default [`MAX_CONNECTIONS`].
pub const DEFAULT_MAX_CONNECTIONS: u32 = 4096;

/// The accepted [`MAX_CONNECTIONS`].
pub const CONNECTIONS_RANGE: std::ops::RangeInclusive<u32> = 16..=1_048_576;

/// Default connections per peer.
pub const DEFAULT_LANES: u32 = 4;

/// The accepted number of lanes and of I/O threads.
pub const LANES_RANGE: std::ops::RangeInclusive<u32> = 1..=64;

/// What [`LOCAL_CONGESTION`] asks for: `system` (the host's default), or an algorithm's name.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub struct LocalCongestion(Option<String>);

impl LocalCongestion {
    /// The host's default, as for connections to other hosts.
    pub const SYSTEM: LocalCongestion = LocalCongestion(None);

    /// Reno, the default: every Linux kernel has it, lets any process choose it, and it paces
    /// nothing.
    pub fn reno() -> Self {
        LocalCongestion(Some("reno".to_owned()))
    }

    /// The algorithm's name to ask the kernel for (`None`: the host's default).
    pub fn name(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

impl Default for LocalCongestion {
    fn default() -> Self {
        Self::reno()
    }
}

impl std::str::FromStr for LocalCongestion {
    type Err = String;

    /// `system`, or an algorithm's name: 1 to 15 ASCII letters, digits, `_` or `-` (Linux's
    /// `TCP_CA_NAME_MAX` is 16 with the terminating zero).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("system") {
            return Ok(Self::SYSTEM);
        }
        if s.is_empty() || s.len() > 15 || !s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            return Err(format!(
                "{s:?} is not a congestion control name (1 to 15 letters, digits, `_` or `-`) nor `system`"
            ));
        }
        Ok(LocalCongestion(Some(s.to_owned())))
    }
}

impl TryFrom<String> for LocalCongestion {
    type Error = String;

    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

impl std::fmt::Display for LocalCongestion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name().unwrap_or("system"))
    }
}

/// The `tcp` transport's options as one config and environment set them, each checked and with
/// its source (`None`: not set, the default applies).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TcpOptions {
    /// [`LANES`], within [`LANES_RANGE`].
    pub lanes: Option<Setting<u32>>,
    /// [`DATA_PORT`] (0: any free port); never a fixed port together with `base_port`.
    pub data_port: Option<Setting<u16>>,
    /// [`IO_THREADS`], within [`LANES_RANGE`].
    pub io_threads: Option<Setting<u32>>,
    /// [`BIND_ADDRESS`].
    pub bind_address: Option<Setting<IpAddr>>,
    /// [`MAX_CONNECTIONS_PER_IP`], within [`CONNECTIONS_PER_IP_RANGE`].
    pub max_connections_per_ip: Option<Setting<u32>>,
    /// [`MAX_CONNECTIONS`], within [`CONNECTIONS_RANGE`].
    pub max_connections: Option<Setting<u32>>,
    /// [`LOCAL_CONGESTION`].
    pub local_congestion: Option<Setting<LocalCongestion>>,
}

impl TcpOptions {
    /// Reads and checks every option from `config` and `env`.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](ferry_core::ErrorKind::Config): a field of the wrong type (naming
    /// the file, the field and its position), a variable that does not parse (naming it and its
    /// value), a number of lanes or threads outside 1 to 64, a bind address that is not an IP
    /// address, a connection limit per address outside 1 to 65536 or in all outside 16 to 1048576, and a fixed data port together with
    /// `base_port`, where every rank of the node shares the config and would bind the same port.
    pub fn from_config(config: &Config, env: &Environment) -> Result<Self> {
        Ok(Self {
            lanes: Self::lanes(config, env)?,
            data_port: Self::data_port(config, env)?,
            io_threads: Self::io_threads(config, env)?,
            bind_address: config.option::<IpAddr>(&BIND_ADDRESS, env)?,
            max_connections_per_ip: Self::max_connections_per_ip(config, env)?,
            max_connections: Self::max_connections(config, env)?,
            local_congestion: config.option::<LocalCongestion>(&LOCAL_CONGESTION, env)?,
        })
    }

    /// The congestion control of connections within this host: [`LOCAL_CONGESTION`], else
    /// reno.
    pub fn local_congestion(&self) -> LocalCongestion {
        self.local_congestion.as_ref().map_or_else(LocalCongestion::reno, |s| s.value.clone())
    }

    /// Connections per remote IP address: [`MAX_CONNECTIONS_PER_IP`], else
    /// [`DEFAULT_MAX_CONNECTIONS_PER_IP`].
    pub fn connections_per_ip(&self) -> u32 {
        self.max_connections_per_ip.as_ref().map_or(DEFAULT_MAX_CONNECTIONS_PER_IP, |s| s.value)
    }

    /// Connections in all: [`MAX_CONNECTIONS`], else [`DEFAULT_MAX_CONNECTIONS`].
    pub fn connections(&self) -> u32 {
        self.max_connections.as_ref().map_or(DEFAULT_MAX_CONNECTIONS, |s| s.value)
    }

    /// [`MAX_CONNECTIONS`] alone, checked.
    pub fn max_connections(config: &Config, env: &Environment) -> Result<Option<Setting<u32>>> {
        match config.option::<u32>(&MAX_CONNECTIONS, env)? {
            Some(s) if !CONNECTIONS_RANGE.contains(&s.value) => Err(config.option_error(
                &MAX_CONNECTIONS,
                &s.source,
                &format!(
                    "is {}; expected {} to {} connections",
                    s.value,
                    CONNECTIONS_RANGE.start(),
                    CONNECTIONS_RANGE.end()
                ),
            )),
            s => Ok(s),
        }
    }

    /// [`MAX_CONNECTIONS_PER_IP`] alone, checked.
    pub fn max_connections_per_ip(config: &Config, env: &Environment) -> Result<Option<Setting<u32>>> {
        let setting = config.option::<u32>(&MAX_CONNECTIONS_PER_IP, env)?;
        match setting {
            Some(s) if !CONNECTIONS_PER_IP_RANGE.contains(&s.value) => Err(config.option_error(
                &MAX_CONNECTIONS_PER_IP,
                &s.source,
                &format!(
                    "is {}; expected {} to {} connections",
                    s.value,
                    CONNECTIONS_PER_IP_RANGE.start(),
                    CONNECTIONS_PER_IP_RANGE.end()
                ),
            )),
            s => Ok(s),
        }
    }

    /// Connections per peer: [`LANES`], else [`DEFAULT_LANES`].
    pub fn lane_count(&self) -> u32 {
        self.lanes.as_ref().map_or(DEFAULT_LANES, |s| s.value)
    }

    /// Connections to a peer on this host (a loopback address or this engine's own): [`LANES`]
    /// when set, else one per two cores, from 1 to [`DEFAULT_LANES`]. Each such connection keeps
    /// two of this host's cores busy, its sender's and its receiver's; more lanes than that add
    /// only context switches (on the 2-core VM, batch-64 64 KiB reads at one thread went from
    /// 79k to 95k per second with one lane instead of four; docs/performance.md).
    pub fn local_lane_count(&self) -> u32 {
        self.lanes.as_ref().map_or_else(
            || {
                let cores = std::thread::available_parallelism().map_or(2, usize::from);
                u32::try_from(cores / 2).unwrap_or(u32::MAX).clamp(1, DEFAULT_LANES)
            },
            |s| s.value,
        )
    }

    /// The port to listen on: [`DATA_PORT`], else 0 (any free port).
    pub fn port(&self) -> u16 {
        self.data_port.as_ref().map_or(0, |s| s.value)
    }

    /// I/O threads for `lanes` lanes: [`IO_THREADS`], else one per lane, at most one per core.
    pub fn io_thread_count(&self, lanes: u32) -> u32 {
        self.io_threads.as_ref().map_or_else(
            || {
                let cores = std::thread::available_parallelism().map_or(2, usize::from);
                lanes.min(u32::try_from(cores).unwrap_or(u32::MAX)).max(1)
            },
            |s| s.value,
        )
    }

    /// [`LANES`] alone, checked.
    pub fn lanes(config: &Config, env: &Environment) -> Result<Option<Setting<u32>>> {
        in_range(config, &LANES, config.option::<u32>(&LANES, env)?, "connections per peer")
    }

    /// [`IO_THREADS`] alone, checked.
    pub fn io_threads(config: &Config, env: &Environment) -> Result<Option<Setting<u32>>> {
        in_range(config, &IO_THREADS, config.option::<u32>(&IO_THREADS, env)?, "threads")
    }

    /// [`DATA_PORT`] alone; a fixed port is refused with `base_port`.
    pub fn data_port(config: &Config, env: &Environment) -> Result<Option<Setting<u16>>> {
        let port = config.option::<u16>(&DATA_PORT, env)?;
        if let Some(p) = &port
            && p.value != 0
            && config.base_port.is_some()
        {
            return Err(config.option_error(
                &DATA_PORT,
                &p.source,
                "is one fixed port, but with base_port every rank of a node shares this config, so every rank \
                 would bind the same port; leave it unset: the tcp transport then listens on any free port and \
                 publishes it in the descriptor's tcp_data_port",
            ));
        }
        Ok(port)
    }

    /// Each option's effective value, checked (for `ferry doctor`); the secret is never shown
    /// ([`ferry_peer_auth::options::values`]).
    pub fn values(config: &Config, env: &Environment) -> Vec<OptionValue> {
        let mut values = vec![
            OptionValue::new(&LANES, Self::lanes(config, env)),
            OptionValue::new(&DATA_PORT, Self::data_port(config, env)),
            OptionValue::new(&IO_THREADS, Self::io_threads(config, env)),
            OptionValue::new(&BIND_ADDRESS, config.option::<IpAddr>(&BIND_ADDRESS, env)),
            OptionValue::new(&MAX_CONNECTIONS_PER_IP, Self::max_connections_per_ip(config, env)),
            OptionValue::new(&MAX_CONNECTIONS, Self::max_connections(config, env)),
            OptionValue::new(&LOCAL_CONGESTION, config.option::<LocalCongestion>(&LOCAL_CONGESTION, env)),
        ];
        values.extend(ferry_peer_auth::options::values(config, env));
        values
    }
}

/// `setting`, refused outside [`LANES_RANGE`] with an error naming the field or the variable.
fn in_range(
    config: &Config,
    spec: &OptionSpec,
    setting: Option<Setting<u32>>,
    what: &str,
) -> Result<Option<Setting<u32>>> {
    match setting {
        Some(s) if !LANES_RANGE.contains(&s.value) => Err(config.option_error(
            spec,
            &s.source,
            &format!("is {}; expected {} to {} {what}", s.value, LANES_RANGE.start(), LANES_RANGE.end()),
        )),
        s => Ok(s),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use ferry_core::FieldSource;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Environment {
        Environment::from_pairs(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    #[test]
    fn fields_env_and_sources() {
        let text = r#"{"protocol": "tcp", "tcp_lanes": 8, "tcp_data_port": 18000, "tcp_io_threads": 2}"#;
        let c = Config::from_json_str(text, Some(Path::new("/etc/ferry/mooncake.json"))).unwrap();
        assert!(c.undeclared_fields(OPTIONS).is_empty(), "{:?}", c.unknown_fields());
        let o = TcpOptions::from_config(&c, &env(&[])).unwrap();
        let file = FieldSource::File("/etc/ferry/mooncake.json".into());
        assert_eq!(o.lanes, Some(Setting { value: 8, source: file.clone() }));
        assert_eq!((o.lane_count(), o.port(), o.io_thread_count(8)), (8, 18000, 2));
        assert_eq!(
            o.data_port.unwrap().describe(&DATA_PORT),
            "config field `tcp_data_port` in /etc/ferry/mooncake.json"
        );

        let e = env(&[("FERRY_TCP_LANES", "16"), ("FERRY_TCP_DATA_PORT", "0"), ("FERRY_TCP_IO_THREADS", "3")]);
        let o = TcpOptions::from_config(&c, &e).unwrap();
        assert_eq!(o.lanes, Some(Setting { value: 16, source: FieldSource::Env("FERRY_TCP_LANES") }));
        assert_eq!((o.port(), o.io_thread_count(16)), (0, 3));

        let none = TcpOptions::from_config(&Config::default(), &env(&[])).unwrap();
        assert_eq!(none, TcpOptions::default());
        assert_eq!((none.lane_count(), none.port()), (DEFAULT_LANES, 0));
        assert!((1..=DEFAULT_LANES).contains(&none.io_thread_count(DEFAULT_LANES)));
        assert_eq!(none.io_thread_count(1), 1);
    }

    #[test]
    fn out_of_range_values_are_refused_naming_the_field_or_the_variable() {
        for (text, needle) in [
            (
                "{\n  \"tcp_lanes\": 0\n}",
                "field `tcp_lanes` at line 2 column 3: is 0; expected 1 to 64 connections per peer",
            ),
            ("{\n  \"tcp_lanes\": 65\n}", "field `tcp_lanes` at line 2 column 3: is 65; expected 1 to 64"),
            (
                "{\n  \"tcp_io_threads\": 100\n}",
                "field `tcp_io_threads` at line 2 column 3: is 100; expected 1 to 64 threads",
            ),
            (
                "{\n  \"tcp_lanes\": -1\n}",
                "field `tcp_lanes` at line 2 column 3: invalid value: integer `-1`, expected u32",
            ),
            (
                "{\n  \"tcp_data_port\": 70000\n}",
                "field `tcp_data_port` at line 2 column 3: invalid value: integer `70000`",
            ),
        ] {
            let c = Config::from_json_str(text, Some(Path::new("/m.json"))).unwrap();
            let e = TcpOptions::from_config(&c, &env(&[])).unwrap_err();
            assert_eq!(e.kind(), ferry_core::ErrorKind::Config);
            assert!(e.message().starts_with("config /m.json: ") && e.message().contains(needle), "{e}");
        }
        for (var, value, msg) in [
            (
                "FERRY_TCP_LANES",
                "100",
                "field `tcp_lanes` (from environment variable FERRY_TCP_LANES): is 100; expected 1 to 64 connections \
                 per peer",
            ),
            ("FERRY_TCP_LANES", "four", "environment variable FERRY_TCP_LANES=\"four\": not a whole number"),
            ("FERRY_TCP_DATA_PORT", "70000", "environment variable FERRY_TCP_DATA_PORT=\"70000\": not a port number"),
            (
                "FERRY_TCP_IO_THREADS",
                "0",
                "field `tcp_io_threads` (from environment variable FERRY_TCP_IO_THREADS): is 0; expected 1 to 64 threads",
            ),
        ] {
            let e = TcpOptions::from_config(&Config::default(), &env(&[(var, value)])).unwrap_err();
            assert_eq!(e.kind(), ferry_core::ErrorKind::Config);
            assert_eq!(e.message(), msg);
        }
    }

    #[test]
    fn a_fixed_data_port_is_refused_with_base_port() {
        let store = r#"{"local_hostname": "10.0.0.5", "base_port": 17000}"#;
        let c = Config::from_json_str(store, None).unwrap();
        let e = TcpOptions::from_config(&c, &env(&[("FERRY_TCP_DATA_PORT", "18000")])).unwrap_err();
        assert!(
            e.message().contains("field `tcp_data_port` (from environment variable FERRY_TCP_DATA_PORT)")
                && e.message().contains("every rank would bind the same port; leave it unset"),
            "{e}"
        );
        let text = r#"{"local_hostname": "10.0.0.5", "base_port": 17000, "tcp_data_port": 18000}"#;
        let c = Config::from_json_str(text, Some(Path::new("/m.json"))).unwrap();
        let e = TcpOptions::from_config(&c, &env(&[])).unwrap_err();
        assert!(e.message().contains("/m.json") && e.message().contains("field `tcp_data_port` at line 1"), "{e}");
        // Any free port is fine with base_port, and a fixed one without it (one rank per config).
        assert_eq!(TcpOptions::from_config(&c, &env(&[("FERRY_TCP_DATA_PORT", "0")])).unwrap().port(), 0);
        let solo = Config::from_json_str(r#"{"local_hostname": "10.0.0.5:17000", "tcp_data_port": 18000}"#, None);
        assert_eq!(TcpOptions::from_config(&solo.unwrap(), &env(&[])).unwrap().port(), 18000);
    }

    #[test]
    fn bind_address_and_connections_per_ip() {
        let c = Config::from_json_str(r#"{"tcp_bind_address": "0.0.0.0", "tcp_max_connections_per_ip": 8}"#, None);
        let o = TcpOptions::from_config(&c.unwrap(), &env(&[])).unwrap();
        assert_eq!(o.bind_address.as_ref().map(|s| s.value), Some("0.0.0.0".parse().unwrap()));
        assert_eq!(o.connections_per_ip(), 8);
        let o = TcpOptions::from_config(&Config::default(), &env(&[("FERRY_TCP_BIND_ADDRESS", "::1")])).unwrap();
        assert_eq!(o.bind_address.as_ref().map(|s| s.value), Some("::1".parse().unwrap()));
        assert_eq!(o.connections_per_ip(), DEFAULT_MAX_CONNECTIONS_PER_IP);
        let e = TcpOptions::from_config(&Config::default(), &env(&[("FERRY_TCP_BIND_ADDRESS", "eth0")])).unwrap_err();
        assert_eq!(e.message(), "environment variable FERRY_TCP_BIND_ADDRESS=\"eth0\": not an IP address");
        let c = Config::from_json_str("{\n  \"tcp_max_connections_per_ip\": 0\n}", None).unwrap();
        let e = TcpOptions::from_config(&c, &env(&[])).unwrap_err();
        assert!(
            e.message().contains("field `tcp_max_connections_per_ip` at line 2 column 3: is 0; expected 1 to 65536"),
            "{e}"
        );
    }

    #[test]
    fn values_show_each_option_checked() {
        let c = Config::from_json_str(r#"{"tcp_lanes": 0, "tcp_io_threads": 2}"#, None).unwrap();
        let values = TcpOptions::values(&c, &env(&[("FERRY_TCP_DATA_PORT", "18000")]));
        let keys: Vec<&str> = values.iter().map(|v| v.spec.key).collect();
        assert_eq!(
            keys,
            [
                "tcp_lanes",
                "tcp_data_port",
                "tcp_io_threads",
                "tcp_bind_address",
                "tcp_max_connections_per_ip",
                "tcp_max_connections",
                "tcp_local_congestion",
                "auth_secret",
                "auth_secret_file"
            ]
        );
        assert!(values[0].setting.as_ref().unwrap_err().message().contains("is 0; expected 1 to 64"));
        let port = values[1].setting.as_ref().unwrap().as_ref().unwrap();
        assert_eq!((port.value.as_str(), &port.source), ("18000", &FieldSource::Env("FERRY_TCP_DATA_PORT")));
        assert_eq!(values[2].setting.as_ref().unwrap().as_ref().unwrap().value, "2");
    }

    #[test]
    fn local_congestion_is_reno_unless_set_and_refuses_what_is_no_name() {
        assert_eq!(
            TcpOptions::from_config(&Config::default(), &env(&[])).unwrap().local_congestion().name(),
            Some("reno")
        );
        let o = TcpOptions::from_config(&Config::default(), &env(&[("FERRY_TCP_LOCAL_CONGESTION", "system")])).unwrap();
        assert_eq!(
            (o.local_congestion(), o.local_congestion().to_string()),
            (LocalCongestion::SYSTEM, "system".into())
        );
        let c = Config::from_json_str(r#"{"tcp_local_congestion": "cubic"}"#, None).unwrap();
        assert_eq!(TcpOptions::from_config(&c, &env(&[])).unwrap().local_congestion().name(), Some("cubic"));
        for bad in ["bbr cubic", "a_name_of_16_chr", "reno;"] {
            let e = TcpOptions::from_config(&Config::default(), &env(&[("FERRY_TCP_LOCAL_CONGESTION", bad)]));
            let e = e.unwrap_err();
            assert_eq!(
                e.message(),
                format!("environment variable FERRY_TCP_LOCAL_CONGESTION={bad:?}: not a congestion control name"),
            );
        }
        let c = Config::from_json_str("{\n  \"tcp_local_congestion\": \"\"\n}", None).unwrap();
        let e = TcpOptions::from_config(&c, &env(&[])).unwrap_err();
        assert!(
            e.message().contains("field `tcp_local_congestion` at line 2") && e.message().contains("not a congestion"),
            "{e}"
        );
    }

    #[test]
    fn lanes_to_a_peer_on_this_host_are_one_per_two_cores_unless_set() {
        let cores = std::thread::available_parallelism().map_or(2, usize::from) as u32;
        let o = TcpOptions::from_config(&Config::default(), &env(&[])).unwrap();
        assert_eq!(o.local_lane_count(), (cores / 2).clamp(1, DEFAULT_LANES));
        assert_eq!(o.lane_count(), DEFAULT_LANES);
        let o = TcpOptions::from_config(&Config::default(), &env(&[("FERRY_TCP_LANES", "8")])).unwrap();
        assert_eq!((o.lane_count(), o.local_lane_count()), (8, 8), "a set count holds for every peer");
    }
}
