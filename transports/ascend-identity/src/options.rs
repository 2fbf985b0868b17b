//! The Ascend side's config fields: `rank_table_path`, `hccn_conf_path`, `hccl_retries`,
//! `hccl_control_port`, `hccl_bind_address`, declared as [`OptionSpec`]s and read from the config's unknown fields
//! and the environment ([`Config::option`]), each with where its value came from.

use std::path::PathBuf;

use ferry_core::{Config, Environment, Error, FieldSource, OptionSpec, OptionValue, Result, Setting};

/// `rank_table_path` (`FERRY_RANK_TABLE`): the rank table the `rank_table` link reads.
pub const RANK_TABLE_PATH: OptionSpec = OptionSpec {
    key: "rank_table_path",
    env: Some("FERRY_RANK_TABLE"),
    env_invalid: "",
    default: "`$DISAGGREGATED_PREFILL_RANK_TABLE_PATH`",
    doc: "rank table: HCCL v1.0/v1.2 or vllm-ascend's prefill/decode form (see [Device \
          identity](#device-identity-the-resolver-chain)); relative to the config file (a path from the variable: \
          to the working directory)",
};

/// `hccn_conf_path` (`FERRY_HCCN_CONF`): the `hccn.conf` the `hccn_conf` link reads.
pub const HCCN_CONF_PATH: OptionSpec = OptionSpec {
    key: "hccn_conf_path",
    env: Some("FERRY_HCCN_CONF"),
    env_invalid: "",
    default: "`/etc/hccn.conf` (skipped when absent)",
    doc: "`hccn.conf` with `address_<phy>=<ip>` device IPs; relative to the config file. A configured file must \
          exist",
};

/// `hccl_retries` (`FERRY_HCCL_RETRIES`; Mooncake's [`RETRIES_ENV`] wins over both).
pub const HCCL_RETRIES: OptionSpec = OptionSpec {
    key: "hccl_retries",
    env: Some("FERRY_HCCL_RETRIES"),
    env_invalid: "not a whole number",
    default: "2",
    doc: "attempts after the first when an HCCL call fails (the communicator is rebuilt in between); at most 100. \
          Mooncake's `ASCEND_TRANSPORT_TRANSFER_MAX_RETRY_COUNT` wins over the field and the variable",
};

/// `hccl_control_port` (`FERRY_HCCL_CONTROL_PORT`); refused with `base_port`.
pub const HCCL_CONTROL_PORT: OptionSpec = OptionSpec {
    key: "hccl_control_port",
    env: Some("FERRY_HCCL_CONTROL_PORT"),
    env_invalid: "not a port number",
    default: "any free port",
    doc: "port of the transport's control channel (published as `rank_info.hostPort`). Refused with `base_port` \
          (every rank would bind it): leave it unset there",
};

/// `hccl_bind_address` (`FERRY_HCCL_BIND_ADDRESS`): the address the control channel listens on.
pub const HCCL_BIND_ADDRESS: OptionSpec = OptionSpec {
    key: "hccl_bind_address",
    env: Some("FERRY_HCCL_BIND_ADDRESS"),
    env_invalid: "not an IP address",
    default: "the published host IP (`rank_info.hostIp`) when it is an IP address, else every address",
    doc: "IP address the control channel listens on (`0.0.0.0` or `::`: every address). An address that cannot be \
          bound is an error",
};

/// `ascend_backend` (`FERRY_ASCEND_BACKEND`): which Ascend data path the transport uses.
pub const ASCEND_BACKEND: OptionSpec = OptionSpec {
    key: "ascend_backend",
    env: Some("FERRY_ASCEND_BACKEND"),
    env_invalid: "not one of auto, hixl, hccl",
    default: "from the protocol: `hixl`/`ascend_direct` → `hixl`, `hccl` → `hccl`, `ascend` → `auto`",
    doc: "`auto` (HIXL when it loads, and direct HCCL; each peer by what its descriptor publishes), `hixl` (HIXL \
          alone, as Mooncake's `ascend_direct`; no device IP needed), `hccl` (direct HCCL alone); see \
          docs/ascend.md, \"Two backends\"",
};

/// Every option the Ascend side declares.
pub const OPTIONS: &[OptionSpec] =
    &[RANK_TABLE_PATH, HCCN_CONF_PATH, HCCL_RETRIES, HCCL_CONTROL_PORT, ASCEND_BACKEND, HCCL_BIND_ADDRESS];

/// Which data path(s) the Ascend transport runs ([`ASCEND_BACKEND`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AscendBackend {
    /// HIXL when it loads (published as `rank_info.endpoints`) and direct HCCL (published as
    /// Ferry's HCCL fields); each peer is reached by what its descriptor offers, HIXL first.
    /// Without HIXL, direct HCCL alone, saying why.
    Auto,
    /// HIXL only (as Mooncake's `ascend_direct`); the transport refuses to start without it.
    Hixl,
    /// Direct HCCL only (HIXL is not loaded).
    Hccl,
}

impl AscendBackend {
    /// The default for a configured protocol name: `hixl` and `ascend_direct` ask for HIXL,
    /// `hccl` for direct HCCL, anything else (`ascend`) for both.
    pub fn for_protocol(protocol: &str) -> Self {
        match protocol {
            "hixl" | "ascend_direct" => AscendBackend::Hixl,
            "hccl" => AscendBackend::Hccl,
            _ => AscendBackend::Auto,
        }
    }

    /// Its config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            AscendBackend::Auto => "auto",
            AscendBackend::Hixl => "hixl",
            AscendBackend::Hccl => "hccl",
        }
    }
}

impl std::str::FromStr for AscendBackend {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(AscendBackend::Auto),
            "hixl" | "ascend_direct" => Ok(AscendBackend::Hixl),
            "hccl" => Ok(AscendBackend::Hccl),
            other => Err(format!("{other:?} is not one of auto, hixl, hccl")),
        }
    }
}

impl std::fmt::Display for AscendBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Mooncake's variable for the Ascend transport's retry count; it wins over `hccl_retries` and
/// `FERRY_HCCL_RETRIES`, as in Mooncake.
pub const RETRIES_ENV: &str = "ASCEND_TRANSPORT_TRANSFER_MAX_RETRY_COUNT";

/// The Ascend side's options as one config and environment set them, each with its source
/// (`None`: not set, the default applies).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AscendOptions {
    /// [`RANK_TABLE_PATH`], relative paths from the file resolved against its directory.
    pub rank_table_path: Option<Setting<PathBuf>>,
    /// [`HCCN_CONF_PATH`], resolved the same way.
    pub hccn_conf_path: Option<Setting<PathBuf>>,
    /// [`HCCL_RETRIES`], or [`RETRIES_ENV`] when set.
    pub hccl_retries: Option<Setting<u32>>,
    /// [`HCCL_CONTROL_PORT`].
    pub hccl_control_port: Option<Setting<u16>>,
    /// [`HCCL_BIND_ADDRESS`].
    pub hccl_bind_address: Option<Setting<std::net::IpAddr>>,
    /// [`ASCEND_BACKEND`] (`None`: from the protocol, [`AscendBackend::for_protocol`]).
    pub ascend_backend: Option<Setting<AscendBackend>>,
}

impl AscendOptions {
    /// Reads and checks every option from `config` and `env`.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](ferry_core::ErrorKind::Config): a field of the wrong type (naming
    /// the file, the field and its position), a variable that does not parse (naming it and its
    /// value, a `hccl_bind_address` that is not an IP address among them), and a
    /// `hccl_control_port` set together with `base_port`, where every rank of the
    /// node shares the config and would bind the same port.
    pub fn from_config(config: &Config, env: &Environment) -> Result<Self> {
        Ok(Self {
            rank_table_path: Self::rank_table_path(config, env)?,
            hccn_conf_path: Self::hccn_conf_path(config, env)?,
            hccl_retries: Self::hccl_retries(config, env)?,
            hccl_control_port: Self::hccl_control_port(config, env)?,
            hccl_bind_address: config.option(&HCCL_BIND_ADDRESS, env)?,
            ascend_backend: config.option(&ASCEND_BACKEND, env)?,
        })
    }

    /// Each option's effective value, checked as [`from_config`](Self::from_config) checks it
    /// (for `ferry doctor`); `hccl_retries` from Mooncake's [`RETRIES_ENV`] when set.
    pub fn values(config: &Config, env: &Environment) -> Vec<OptionValue> {
        let path = |r: Result<Option<Setting<PathBuf>>>| r.map(|s| s.map(|s| s.map(|p| p.display().to_string())));
        vec![
            OptionValue::new(&RANK_TABLE_PATH, path(Self::rank_table_path(config, env))),
            OptionValue::new(&HCCN_CONF_PATH, path(Self::hccn_conf_path(config, env))),
            OptionValue::new(&HCCL_RETRIES, Self::hccl_retries(config, env)),
            OptionValue::new(&HCCL_CONTROL_PORT, Self::hccl_control_port(config, env)),
            OptionValue::new(&ASCEND_BACKEND, config.option::<AscendBackend>(&ASCEND_BACKEND, env)),
            OptionValue::new(&HCCL_BIND_ADDRESS, config.option::<std::net::IpAddr>(&HCCL_BIND_ADDRESS, env)),
        ]
    }

    /// The backend asked for: [`ASCEND_BACKEND`] when set, else the protocol's default.
    pub fn backend(&self, protocol: &str) -> AscendBackend {
        self.ascend_backend.as_ref().map_or_else(|| AscendBackend::for_protocol(protocol), |s| s.value)
    }

    /// [`RANK_TABLE_PATH`] alone.
    pub fn rank_table_path(config: &Config, env: &Environment) -> Result<Option<Setting<PathBuf>>> {
        config.option_path(&RANK_TABLE_PATH, env)
    }

    /// [`HCCN_CONF_PATH`] alone.
    pub fn hccn_conf_path(config: &Config, env: &Environment) -> Result<Option<Setting<PathBuf>>> {
        config.option_path(&HCCN_CONF_PATH, env)
    }

    /// [`HCCL_RETRIES`] alone, with Mooncake's [`RETRIES_ENV`] first.
    pub fn hccl_retries(config: &Config, env: &Environment) -> Result<Option<Setting<u32>>> {
        if let Some(v) = env.get(RETRIES_ENV).filter(|v| !v.trim().is_empty()) {
            let value = v.trim().parse().map_err(|_| {
                Error::config(format!("environment variable {RETRIES_ENV}={v:?} is not a valid number"))
            })?;
            return Ok(Some(Setting { value, source: FieldSource::Env(RETRIES_ENV) }));
        }
        config.option(&HCCL_RETRIES, env)
    }

    /// [`HCCL_CONTROL_PORT`] alone, refused with `base_port`.
    pub fn hccl_control_port(config: &Config, env: &Environment) -> Result<Option<Setting<u16>>> {
        let port = config.option::<u16>(&HCCL_CONTROL_PORT, env)?;
        if let Some(p) = &port
            && config.base_port.is_some()
        {
            return Err(config.option_error(
                &HCCL_CONTROL_PORT,
                &p.source,
                "is one fixed port, but with base_port every rank of a node shares this config, so every rank \
                 would bind the same port; leave it unset: the ascend transport then listens on any free port and \
                 publishes it in rank_info.hostPort",
            ));
        }
        Ok(port)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Environment {
        Environment::from_pairs(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    #[test]
    fn the_control_channel_bind_address() {
        let env_of =
            |pairs: &[(&str, &str)]| Environment::from_pairs(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let c = Config::from_json_str(r#"{"hccl_bind_address": "10.0.0.5"}"#, None).unwrap();
        let o = AscendOptions::from_config(&c, &env_of(&[])).unwrap();
        assert_eq!(o.hccl_bind_address.map(|s| s.value), Some("10.0.0.5".parse().unwrap()));
        let o = AscendOptions::from_config(&c, &env_of(&[("FERRY_HCCL_BIND_ADDRESS", "0.0.0.0")])).unwrap();
        assert!(o.hccl_bind_address.is_some_and(|s| s.value.is_unspecified()));
        let e = AscendOptions::from_config(&Config::default(), &env_of(&[("FERRY_HCCL_BIND_ADDRESS", "eth0")]));
        assert_eq!(
            e.unwrap_err().message(),
            "environment variable FERRY_HCCL_BIND_ADDRESS=\"eth0\": not an IP address"
        );
    }

    #[test]
    fn fields_env_and_sources() {
        let text = r#"{
  "prefill_url": "10.0.0.5",
  "protocol": "ascend",
  "rank_table_path": "ranktable.json",
  "hccn_conf_path": "/etc/hccn.conf",
  "hccl_retries": 5,
  "hccl_control_port": 18000
}"#;
        let c = Config::from_json_str(text, Some(Path::new("/etc/ferry/mooncake.json"))).unwrap();
        assert!(c.undeclared_fields(OPTIONS).is_empty(), "{:?}", c.unknown_fields());
        let o = AscendOptions::from_config(&c, &env(&[])).unwrap();
        let file = FieldSource::File("/etc/ferry/mooncake.json".into());
        assert_eq!(
            o.rank_table_path,
            Some(Setting { value: PathBuf::from("/etc/ferry/ranktable.json"), source: file.clone() })
        );
        assert_eq!(o.hccn_conf_path.as_ref().unwrap().value, PathBuf::from("/etc/hccn.conf"));
        assert_eq!(o.hccl_retries, Some(Setting { value: 5, source: file.clone() }));
        assert_eq!(o.hccl_control_port, Some(Setting { value: 18000, source: file }));
        assert_eq!(
            o.rank_table_path.as_ref().unwrap().describe(&RANK_TABLE_PATH),
            "config field `rank_table_path` in /etc/ferry/mooncake.json"
        );

        let e = env(&[
            ("FERRY_RANK_TABLE", "rt.json"),
            ("FERRY_HCCN_CONF", "/x/hccn.conf"),
            ("FERRY_HCCL_RETRIES", "7"),
            ("FERRY_HCCL_CONTROL_PORT", "18001"),
        ]);
        let o = AscendOptions::from_config(&c, &e).unwrap();
        let rt = o.rank_table_path.unwrap();
        assert_eq!(rt.value, PathBuf::from("rt.json"), "env paths are not relative to the file");
        assert_eq!(rt.describe(&RANK_TABLE_PATH), "environment variable FERRY_RANK_TABLE");
        assert_eq!(o.hccn_conf_path.unwrap().value, PathBuf::from("/x/hccn.conf"));
        assert_eq!(o.hccl_retries, Some(Setting { value: 7, source: FieldSource::Env("FERRY_HCCL_RETRIES") }));
        assert_eq!(o.hccl_control_port.unwrap().value, 18001);
        // Mooncake's variable wins over both.
        let m = env(&[("FERRY_HCCL_RETRIES", "7"), (RETRIES_ENV, " 3 ")]);
        assert_eq!(AscendOptions::hccl_retries(&c, &m).unwrap().unwrap().value, 3);
        let none = AscendOptions::from_config(&Config::default(), &env(&[])).unwrap();
        assert_eq!(none, AscendOptions::default());
    }

    #[test]
    fn bad_values_name_the_field_or_the_variable() {
        let text = "{\n  \"protocol\": \"ascend\",\n  \"hccl_retries\": \"two\"\n}";
        let c = Config::from_json_str(text, Some(Path::new("/m.json"))).unwrap();
        let e = AscendOptions::from_config(&c, &env(&[])).unwrap_err();
        assert_eq!(
            e.message(),
            "config /m.json: field `hccl_retries` at line 3 column 3: invalid type: string \"two\", expected u32"
        );
        let c = Config::default();
        for (var, value, msg) in [
            ("FERRY_HCCL_RETRIES", "x", "environment variable FERRY_HCCL_RETRIES=\"x\": not a whole number"),
            (
                "FERRY_HCCL_CONTROL_PORT",
                "70000",
                "environment variable FERRY_HCCL_CONTROL_PORT=\"70000\": not a port number",
            ),
            (
                RETRIES_ENV,
                "many",
                "environment variable ASCEND_TRANSPORT_TRANSFER_MAX_RETRY_COUNT=\"many\" is not a valid number",
            ),
        ] {
            let e = AscendOptions::from_config(&c, &env(&[(var, value)])).unwrap_err();
            assert_eq!(e.kind(), ferry_core::ErrorKind::Config);
            assert_eq!(e.message(), msg);
        }
        let e = Config::from_json_str(r#"{"rank_table_path": 5}"#, None).unwrap();
        let m = AscendOptions::from_config(&e, &env(&[])).unwrap_err().message().to_owned();
        assert!(m.contains("field `rank_table_path`") && m.contains("expected a string"), "{m}");
    }

    #[test]
    fn a_fixed_control_port_is_refused_with_base_port() {
        let text = r#"{"local_hostname": "10.0.0.5", "base_port": 17000, "hccl_control_port": 18000}"#;
        let c = Config::from_json_str(text, Some(Path::new("/m.json"))).unwrap();
        let e = AscendOptions::from_config(&c, &env(&[])).unwrap_err();
        let m = e.message();
        assert!(
            m.contains("/m.json")
                && m.contains("field `hccl_control_port` at line 1")
                && m.contains("every rank would bind the same port")
                && m.contains("leave it unset")
                && m.contains("any free port"),
            "{m}"
        );
        let c = Config::from_json_str(r#"{"local_hostname": "10.0.0.5", "base_port": 17000}"#, None).unwrap();
        let e = AscendOptions::from_config(&c, &env(&[("FERRY_HCCL_CONTROL_PORT", "18000")])).unwrap_err();
        assert!(
            e.message().contains("field `hccl_control_port` (from environment variable FERRY_HCCL_CONTROL_PORT)")
                && e.message().contains("leave it unset"),
            "{e}"
        );
        // Without base_port a fixed control port is fine (one rank per config).
        let solo = Config::from_json_str(r#"{"local_hostname": "10.0.0.5:17000", "hccl_control_port": 18000}"#, None);
        let o = AscendOptions::from_config(&solo.unwrap(), &env(&[])).unwrap();
        assert_eq!(o.hccl_control_port.unwrap().value, 18000);
    }

    #[test]
    fn the_backend_follows_the_protocol_unless_set() {
        let cfg = Config::from_json_str(r#"{"protocol":"ascend"}"#, None).unwrap();
        let o = AscendOptions::from_config(&cfg, &env(&[])).unwrap();
        assert_eq!(o.backend("ascend"), AscendBackend::Auto);
        assert_eq!(o.backend("hccl"), AscendBackend::Hccl);
        assert_eq!(o.backend("hixl"), AscendBackend::Hixl);
        assert_eq!(o.backend("ascend_direct"), AscendBackend::Hixl);
        let o = AscendOptions::from_config(&cfg, &env(&[("FERRY_ASCEND_BACKEND", "hccl")])).unwrap();
        assert_eq!(o.backend("hixl"), AscendBackend::Hccl);
        let cfg = Config::from_json_str(r#"{"protocol":"ascend","ascend_backend":"hixl"}"#, None).unwrap();
        assert_eq!(AscendOptions::from_config(&cfg, &env(&[])).unwrap().backend("ascend"), AscendBackend::Hixl);
        let e = AscendOptions::from_config(&cfg, &env(&[("FERRY_ASCEND_BACKEND", "rdma")])).unwrap_err();
        assert!(e.to_string().contains("FERRY_ASCEND_BACKEND"), "{e}");
        let cfg = Config::from_json_str(r#"{"protocol":"ascend","ascend_backend":"fast"}"#, None).unwrap();
        let e = AscendOptions::from_config(&cfg, &env(&[])).unwrap_err();
        assert!(e.to_string().contains("ascend_backend"), "{e}");
    }

    #[test]
    fn values_show_each_option_as_the_transport_reads_it() {
        let text = r#"{"protocol": "ascend", "rank_table_path": "rt.json", "ascend_backend": "fast"}"#;
        let c = Config::from_json_str(text, Some(Path::new("/etc/ferry/m.json"))).unwrap();
        let values = AscendOptions::values(&c, &env(&[("FERRY_HCCL_RETRIES", "7"), (RETRIES_ENV, "3")]));
        let keys: Vec<&str> = values.iter().map(|v| v.spec.key).collect();
        assert_eq!(keys, OPTIONS.iter().map(|o| o.key).collect::<Vec<_>>());
        let shown = |i: usize| values[i].setting.as_ref().unwrap().clone().map(|s| (s.value, s.source));
        assert_eq!(shown(0), Some(("/etc/ferry/rt.json".into(), FieldSource::File("/etc/ferry/m.json".into()))));
        assert_eq!(shown(1), None);
        assert_eq!(shown(2), Some(("3".into(), FieldSource::Env(RETRIES_ENV))), "Mooncake's variable wins");
        assert!(values[4].setting.as_ref().unwrap_err().message().contains("ascend_backend"));
    }
}
