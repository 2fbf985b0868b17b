//! The options that turn authentication on: `auth_secret_file` (`FERRY_AUTH_SECRET_FILE`), a file
//! holding the secret, or `auth_secret` (`FERRY_AUTH_SECRET`), the secret itself. Declared as
//! [`OptionSpec`]s (the `tcp` transport and the P2P handshake, which both use the secret, list
//! them among their options, so `ferry doctor` shows them) and read with [`load`].
//!
//! The secret is never shown: not in errors, logs, `Debug` output or `ferry doctor`.

use std::path::Path;
use std::sync::{Mutex, OnceLock};

use ferry_core::{Config, Environment, Error, FieldSource, OptionSpec, OptionValue, Result, Setting};

use crate::secret::{PeerSecret, SecretSource};

/// `auth_secret` (`FERRY_AUTH_SECRET`): the shared secret itself.
pub const SECRET: OptionSpec = OptionSpec {
    key: "auth_secret",
    env: Some("FERRY_AUTH_SECRET"),
    env_invalid: "",
    default: "none (authentication off)",
    doc: "the shared secret itself; prefer the file. Never logged or shown (`ferry doctor` shows its source and \
          length)",
};

/// `auth_secret_file` (`FERRY_AUTH_SECRET_FILE`): a file holding the shared secret.
pub const SECRET_FILE: OptionSpec = OptionSpec {
    key: "auth_secret_file",
    env: Some("FERRY_AUTH_SECRET_FILE"),
    env_invalid: "",
    default: "none (authentication off)",
    doc: "a file holding the cluster's shared secret (trailing whitespace ignored; at most 64 KiB); relative to the \
          config file. A file its group or others can access gets a warning",
};

/// Every option of peer authentication.
pub const OPTIONS: &[OptionSpec] = &[SECRET, SECRET_FILE];

/// The largest secret file read.
pub const MAX_SECRET_FILE: u64 = 64 * 1024;

/// The secret `config` and `env` configure, with any warnings about it, or `None` when
/// authentication is off. Nothing is logged ([`load`] logs).
#[derive(Debug)]
pub struct Loaded {
    /// The secret.
    pub secret: PeerSecret,
    /// What should be fixed, though it works (a secret file that group or others can read).
    pub warnings: Vec<String>,
}

/// Reads the secret `config` and `env` set, without logging.
///
/// Precedence as for every option ([`Config::option`]): the API, the variable, the field. Setting
/// both the secret and a secret file is refused: one of them would be ignored.
///
/// # Errors
/// [`ErrorKind::Config`](ferry_core::ErrorKind::Config), naming where the value came from and
/// never the secret: both options set; an `auth_secret` field that is not a string; a secret
/// file that cannot be read or is larger than [`MAX_SECRET_FILE`]; a secret shorter than
/// [`MIN_SECRET_LEN`](crate::MIN_SECRET_LEN) bytes.
pub fn read(config: &Config, env: &Environment) -> Result<Option<Loaded>> {
    // A field of the wrong type would be echoed by the generic reader: say so without it.
    let value = config
        .option::<String>(&SECRET, env)
        .map_err(|_| config.field_error(SECRET.key, "is not a string (the value is not shown)"))?;
    let file = config.option_path(&SECRET_FILE, env)?;
    match (value, file) {
        (None, None) => Ok(None),
        (Some(v), Some(f)) => Err(Error::config(format!(
            "peer authentication: both {} and {} are set; set only one (the file is preferred: a secret in a \
             variable or a config file is easier to leak)",
            v.describe(&SECRET),
            f.describe(&SECRET_FILE)
        ))),
        (Some(v), None) => {
            let secret = PeerSecret::new(v.value.as_bytes(), SecretSource::Value { set_by: v.source })?;
            Ok(Some(Loaded { secret, warnings: Vec::new() }))
        }
        (None, Some(f)) => read_file(&f.value, f.source).map(Some),
    }
}

fn read_file(path: &Path, set_by: FieldSource) -> Result<Loaded> {
    let source = SecretSource::File { path: path.to_owned(), set_by };
    let unreadable = |e: std::io::Error| {
        Error::config(format!("peer authentication: cannot read the secret {source}: {e}")).with_source(e)
    };
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    if !meta.is_file() || meta.len() > MAX_SECRET_FILE {
        return Err(Error::config(format!(
            "peer authentication: the secret {source} is not a regular file of at most {MAX_SECRET_FILE} bytes"
        )));
    }
    let bytes = std::fs::read(path).map_err(unreadable)?;
    let mut warnings = Vec::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            warnings.push(format!(
                "the peer authentication secret {source} is accessible to its group or to others (mode {mode:03o}); \
                 make it readable by its owner only (chmod 600)"
            ));
        }
    }
    let secret = PeerSecret::new(bytes.trim_ascii_end(), source)?;
    Ok(Loaded { secret, warnings })
}

/// Reads the secret as [`read`] does, for a crate that is about to use it: each warning is
/// logged once per process (the `tcp` transport and the P2P handshake both load it), the secret
/// never.
///
/// # Errors
/// As [`read`].
pub fn load(config: &Config, env: &Environment) -> Result<Option<PeerSecret>> {
    let Some(loaded) = read(config, env)? else { return Ok(None) };
    static WARNED: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    let mut warned = WARNED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    for w in loaded.warnings {
        if !warned.contains(&w) {
            tracing::warn!("{w}");
            warned.push(w);
        }
    }
    Ok(Some(loaded.secret))
}

/// Each option's value for `ferry doctor`: `auth_secret` as `(set, N bytes, hidden)`, never its
/// text; `auth_secret_file` as its path. An invalid setting carries the error [`read`] gives.
pub fn values(config: &Config, env: &Environment) -> Vec<OptionValue> {
    let checked = read(config, env);
    let secret = config
        .option::<String>(&SECRET, env)
        .map(|s| s.map(|s| Setting { value: format!("(set, {} bytes, hidden)", s.value.len()), source: s.source }))
        .map_err(|_| config.field_error(SECRET.key, "is not a string (the value is not shown)"));
    let file = config
        .option_path(&SECRET_FILE, env)
        .map(|f| f.map(|f| Setting { value: f.value.display().to_string(), source: f.source }));
    // The error of the whole (both set, a short secret, an unreadable file) goes with the option
    // that caused it.
    let (secret, file) = match (&checked, secret, file) {
        (Err(e), Ok(Some(_)), Ok(None)) => (Err(e.duplicate()), Ok(None)),
        (Err(e), s, Ok(Some(_))) => (s, Err(e.duplicate())),
        (_, s, f) => (s, f),
    };
    vec![OptionValue { spec: &SECRET, setting: secret }, OptionValue { spec: &SECRET_FILE, setting: file }]
}

/// Whether `spec` is an option whose value must never be shown (`auth_secret`).
pub fn is_secret(spec: &OptionSpec) -> bool {
    spec.key == SECRET.key
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use ferry_core::ErrorKind;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Environment {
        Environment::from_pairs(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    fn temp_file(name: &str, contents: &[u8], mode: u32) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ferry-peer-auth-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(contents).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        path
    }

    #[test]
    fn off_unless_set_and_every_source_is_named() {
        assert!(read(&Config::default(), &env(&[])).unwrap().is_none());
        let c = Config::from_json_str(r#"{"auth_secret": "a shared secret of the cluster"}"#, None).unwrap();
        let s = read(&c, &env(&[])).unwrap().unwrap().secret;
        assert_eq!(s.source().to_string(), "config field `auth_secret`");
        let s = read(&Config::default(), &env(&[("FERRY_AUTH_SECRET", "0123456789abcdef")])).unwrap().unwrap();
        assert_eq!(s.secret.source().to_string(), "environment variable FERRY_AUTH_SECRET");

        let path = temp_file("named", b"0123456789abcdef0123456789abcdef\n", 0o600);
        let loaded = read(&Config::default(), &env(&[("FERRY_AUTH_SECRET_FILE", path.to_str().unwrap())])).unwrap();
        let loaded = loaded.unwrap();
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        assert_eq!(loaded.secret.len(), 32, "the trailing newline is not part of the secret");
        assert_eq!(
            loaded.secret.source().to_string(),
            format!("file {} (named by environment variable FERRY_AUTH_SECRET_FILE)", path.display())
        );
    }

    #[test]
    fn a_file_and_a_value_prove_the_same_secret() {
        use crate::proof::{Role, prove};
        let path = temp_file("same", b"0123456789abcdef0123456789abcdef\r\n", 0o600);
        let text = format!(r#"{{"auth_secret_file": "{}"}}"#, path.display());
        let from_file = read(&Config::from_json_str(&text, None).unwrap(), &env(&[])).unwrap().unwrap().secret;
        let from_env = read(&Config::default(), &env(&[("FERRY_AUTH_SECRET", "0123456789abcdef0123456789abcdef")]))
            .unwrap()
            .unwrap()
            .secret;
        let n = [5u8; 32];
        assert_eq!(prove(&from_file, Role::Initiator, b"x", &n, &n), prove(&from_env, Role::Initiator, b"x", &n, &n));
    }

    #[test]
    fn bad_settings_are_refused_without_showing_the_secret() {
        let short = "short-secret";
        for (config, vars) in [
            (format!(r#"{{"auth_secret": "{short}"}}"#), vec![]),
            ("{}".to_owned(), vec![("FERRY_AUTH_SECRET", short)]),
        ] {
            let e = read(&Config::from_json_str(&config, None).unwrap(), &env(&vars)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config);
            assert!(e.message().contains("is 12 bytes; at least 16 are required"), "{e}");
            assert!(!e.message().contains(short), "{e}");
        }
        let e = read(&Config::from_json_str(r#"{"auth_secret": 12345678901234567890}"#, None).unwrap(), &env(&[]))
            .unwrap_err();
        assert!(e.message().contains("field `auth_secret`") && e.message().contains("is not a string"), "{e}");
        assert!(!e.message().contains("1234567890"), "{e}");

        let path = temp_file("both", b"0123456789abcdef", 0o600);
        let c = Config::from_json_str(r#"{"auth_secret": "0123456789abcdef0123"}"#, None).unwrap();
        let e = read(&c, &env(&[("FERRY_AUTH_SECRET_FILE", path.to_str().unwrap())])).unwrap_err();
        assert!(e.message().contains("both config field `auth_secret` and environment variable"), "{e}");
        assert!(!e.message().contains("0123456789abcdef"), "{e}");

        let e = read(&Config::default(), &env(&[("FERRY_AUTH_SECRET_FILE", "/nonexistent/ferry-secret")])).unwrap_err();
        assert!(e.message().contains("cannot read the secret file /nonexistent/ferry-secret"), "{e}");
        let short_file = temp_file("short", b"tiny\n", 0o600);
        let e =
            read(&Config::default(), &env(&[("FERRY_AUTH_SECRET_FILE", short_file.to_str().unwrap())])).unwrap_err();
        assert!(e.message().contains("is 4 bytes"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn a_file_others_can_read_gets_a_warning() {
        let path = temp_file("open", b"0123456789abcdef0123456789abcdef", 0o644);
        let loaded =
            read(&Config::default(), &env(&[("FERRY_AUTH_SECRET_FILE", path.to_str().unwrap())])).unwrap().unwrap();
        assert_eq!(loaded.warnings.len(), 1);
        assert!(
            loaded.warnings[0].contains("mode 644") && loaded.warnings[0].contains("chmod 600"),
            "{:?}",
            loaded.warnings
        );
    }

    #[test]
    fn values_never_show_the_secret() {
        let c = Config::from_json_str(r#"{"auth_secret": "0123456789abcdef-very-secret"}"#, None).unwrap();
        let v = values(&c, &env(&[]));
        assert_eq!(v.len(), 2);
        assert!(is_secret(v[0].spec) && !is_secret(v[1].spec));
        let shown = v[0].setting.as_ref().unwrap().as_ref().unwrap();
        assert_eq!(shown.value, "(set, 28 bytes, hidden)");
        assert!(v[1].setting.as_ref().unwrap().is_none());
        let c = Config::from_json_str(r#"{"auth_secret": "too-short"}"#, None).unwrap();
        let v = values(&c, &env(&[]));
        let e = v[0].setting.as_ref().unwrap_err();
        assert!(e.message().contains("is 9 bytes") && !e.message().contains("too-short"), "{e}");
    }
}
