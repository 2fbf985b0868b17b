//! Options declared outside the core: a transport (or a resolver link it brings) names the
//! config fields it reads with an [`OptionSpec`] — JSON key, environment variable, default and
//! its documentation — and reads their values with [`Config::option`] /
//! [`Config::option_path`], which also say where each value came from ([`Setting`]).
//!
//! The core does not know these fields: a config keeps them among its unknown fields
//! ([`Config::extra`]), so a file written for any build parses in every build, and the crate
//! that declares an option validates it when it reads it (its error names the file, the field
//! and its position, or the variable and its value, as the core's own fields' errors do).
//! `ferry doctor` lists as unknown only the fields no compiled-in crate declares
//! ([`Config::undeclared_fields`]).
//!
//! A transport lists its declarations with
//! [`TransportFactory::options`](crate::TransportFactory::options) and reads them for
//! display, each with its effective value and source, with
//! [`TransportFactory::read_options`](crate::TransportFactory::read_options); a
//! [`TransportRegistry`](crate::TransportRegistry) collects the declarations of every factory it
//! holds ([`TransportRegistry::options`](crate::TransportRegistry::options)).
//!
//! Precedence, highest first: a value set through the API ([`Config::set_option`]), the
//! option's environment variable (read when the option is read, from the [`Environment`] given;
//! an empty variable counts as unset), the config's field (`null` counts as unset), none.

use std::path::PathBuf;
use std::str::FromStr;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::config::{Config, FieldSource};
use crate::environment::Environment;
use crate::error::{Error, Result};

/// One option a crate outside the core declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionSpec {
    /// The config field (JSON key), e.g. `widget_retries`.
    pub key: &'static str,
    /// The environment variable overriding it, if any, e.g. `FERRY_WIDGET_RETRIES`.
    pub env: Option<&'static str>,
    /// What an invalid environment value is not, in the error naming it (`not a whole number`,
    /// `not a port number`); unused for text options, which any value satisfies.
    pub env_invalid: &'static str,
    /// The default, in words, for documentation and `ferry doctor` (`2`, `any free port`).
    pub default: &'static str,
    /// What the option means and which values it accepts: one cell (Markdown, no line break)
    /// of the configuration reference, whose tables are generated from these (docs/configuration.md).
    pub doc: &'static str,
}

/// An option's effective value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting<T> {
    /// The value.
    pub value: T,
    /// Where it came from (the file, inline JSON, an environment variable or the API).
    pub source: FieldSource,
}

impl<T> Setting<T> {
    /// Where `spec`'s value was set, for messages: `config field `x` in FILE`, `environment
    /// variable X`, ... (as [`Config::describe_source`] says it for the core's fields).
    pub fn describe(&self, spec: &OptionSpec) -> String {
        self.source.describe(spec.key)
    }

    /// The same setting with its value converted by `f` (its source kept).
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Setting<U> {
        Setting { value: f(self.value), source: self.source }
    }
}

/// One declared option's effective value, in words, as the crate that declares it reads it
/// ([`TransportFactory::read_options`](crate::TransportFactory::read_options)); `ferry doctor`
/// prints these.
#[derive(Debug)]
pub struct OptionValue {
    /// The option.
    pub spec: &'static OptionSpec,
    /// Its value and where it came from; `Ok(None)` when nothing sets it (the default,
    /// [`OptionSpec::default`], applies); an error when the value is not valid (the error the
    /// declaring crate reports when it starts).
    pub setting: Result<Option<Setting<String>>>,
}

impl OptionValue {
    /// `spec`'s value as read by a typed reader ([`Config::option`] and the declaring crate's
    /// checks), shown with `Display`.
    pub fn new<T: std::fmt::Display>(spec: &'static OptionSpec, read: Result<Option<Setting<T>>>) -> Self {
        Self { spec, setting: read.map(|s| s.map(|s| s.map(|v| v.to_string()))) }
    }

    /// `spec`'s value as set, unchecked ([`Config::option_text`]).
    pub fn as_set(spec: &'static OptionSpec, config: &Config, env: &Environment) -> Self {
        Self { spec, setting: Ok(config.option_text(spec, env)) }
    }
}

impl Config {
    /// The value of `spec`, parsed as `T`: from the API, else `spec.env` in `env`, else the
    /// config's field (see the [module docs](crate::options) for the precedence). `Ok(None)`
    /// when none of them sets it.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config): a field of the wrong type names the
    /// file, the field and its position and says what was expected (serde's words, as for the
    /// core's fields); a variable that does not parse names the variable and its value, then
    /// `spec.env_invalid`.
    pub fn option<T: DeserializeOwned + FromStr>(
        &self,
        spec: &OptionSpec,
        env: &Environment,
    ) -> Result<Option<Setting<T>>> {
        let api = self.source_of(spec.key) == Some(&FieldSource::Api);
        if !api && let Some((var, value)) = spec.env.and_then(|v| env.get_nonempty(v).map(|value| (v, value))) {
            let parsed = value
                .parse::<T>()
                .map_err(|_| Error::config(format!("environment variable {var}={value:?}: {}", spec.env_invalid)))?;
            return Ok(Some(Setting { value: parsed, source: FieldSource::Env(var) }));
        }
        match self.extra.get(spec.key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let value = serde_json::from_value::<T>(v.clone())
                    .map_err(|e| self.field_error(spec.key, &crate::json_fields::strip_position(&e.to_string())))?;
                let source = match self.source_of(spec.key) {
                    Some(s) => s.clone(),
                    None => self.origin_source(),
                };
                Ok(Some(Setting { value, source }))
            }
        }
    }

    /// `spec`'s value as set, in words, with the precedence of [`option`](Self::option) but
    /// without parsing it: the variable's text, else the field's (a string as written, another
    /// JSON value as JSON). For display; the declaring crate checks the value when it reads it.
    pub fn option_text(&self, spec: &OptionSpec, env: &Environment) -> Option<Setting<String>> {
        let api = self.source_of(spec.key) == Some(&FieldSource::Api);
        if !api && let Some((var, value)) = spec.env.and_then(|v| env.get_nonempty(v).map(|value| (v, value))) {
            return Some(Setting { value, source: FieldSource::Env(var) });
        }
        let value = match self.extra.get(spec.key)? {
            Value::Null => return None,
            Value::String(s) => s.clone(),
            v => v.to_string(),
        };
        let source = self.source_of(spec.key).cloned().unwrap_or_else(|| self.origin_source());
        Some(Setting { value, source })
    }

    /// A path option ([`option`](Self::option) as a string; empty counts as unset): a relative
    /// path from the config file is taken relative to the file's directory, one from the
    /// environment or the API as written.
    pub fn option_path(&self, spec: &OptionSpec, env: &Environment) -> Result<Option<Setting<PathBuf>>> {
        let Some(s) = self.option::<String>(spec, env)? else { return Ok(None) };
        if s.value.is_empty() {
            return Ok(None);
        }
        let value = self.relative_to(&s.value, Some(&s.source));
        Ok(Some(Setting { value, source: s.source }))
    }

    /// Sets `spec`'s field through the API: it then wins over the environment variable.
    pub fn set_option(&mut self, spec: &OptionSpec, value: impl Into<Value>) {
        self.extra.insert(spec.key.to_owned(), value.into());
        self.set_source(spec.key, FieldSource::Api);
    }

    /// A config error about `spec`'s value from `source`: naming the variable when it came
    /// from the environment, else the file, the field and its position
    /// ([`field_error`](Self::field_error)).
    pub fn option_error(&self, spec: &OptionSpec, source: &FieldSource, msg: &str) -> Error {
        match source {
            FieldSource::Env(var) => {
                Error::config(format!("field `{}` (from environment variable {var}): {msg}", spec.key))
            }
            _ => self.field_error(spec.key, msg),
        }
    }

    /// The [`unknown_fields`](Self::unknown_fields) that none of `declared` names: the fields
    /// nothing in this build reads.
    pub fn undeclared_fields<'s>(&self, declared: impl IntoIterator<Item = &'s OptionSpec>) -> Vec<&str> {
        let keys: Vec<&str> = declared.into_iter().map(|d| d.key).collect();
        self.unknown_fields().into_iter().filter(|f| !keys.contains(f)).collect()
    }

    /// The [`undeclared_fields`](Self::undeclared_fields), each with the nearest field that
    /// would be read (the core's or one of `declared`), when one is near enough to be a likely
    /// misspelling (see [`UnknownField::suggestion`]). Engines log each as a warning when they
    /// are built; `ferry doctor` prints them (and `--strict` refuses them).
    pub fn unknown_field_warnings<'s>(&self, declared: impl IntoIterator<Item = &'s OptionSpec>) -> Vec<UnknownField> {
        let declared: Vec<&'static str> = declared.into_iter().map(|d| d.key).collect();
        let known: Vec<&'static str> =
            crate::json_fields::serde_fields::<Config>().iter().copied().chain(declared.iter().copied()).collect();
        self.undeclared_fields(std::iter::empty())
            .into_iter()
            .filter(|f| !declared.contains(f))
            .map(|key| UnknownField {
                key: key.to_owned(),
                suggestion: nearest(key, &known),
                origin: self.path().map(|p| p.display().to_string()),
            })
            .collect()
    }
}

/// A config field that nothing in this build reads (see [`Config::unknown_field_warnings`]).
/// Its `Display` is the warning: the field, the file, the suggestion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownField {
    /// The field as written.
    pub key: String,
    /// The known field (the core's or a declared option) nearest to it by edit distance, when
    /// the distance is small for its length: at most 1 for keys of up to 7 characters, 2 up to
    /// 11, else 3.
    pub suggestion: Option<&'static str>,
    /// The config file it is in, if any.
    pub origin: Option<String>,
}

impl std::fmt::Display for UnknownField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown config field `{}`", self.key)?;
        if let Some(file) = &self.origin {
            write!(f, " in {file}")?;
        }
        match self.suggestion {
            Some(s) => write!(f, ": did you mean `{s}`? It is kept, and nothing reads it"),
            None => f.write_str(": kept, and nothing in this build reads it"),
        }
    }
}

/// The entry of `known` nearest to `key` by edit distance (Levenshtein, ignoring case), if it is
/// near enough (see [`UnknownField::suggestion`]); the first of equals.
fn nearest(key: &str, known: &[&'static str]) -> Option<&'static str> {
    let lower = key.to_ascii_lowercase();
    let limit = match key.chars().count() {
        0..=7 => 1,
        8..=11 => 2,
        _ => 3,
    };
    known
        .iter()
        .map(|k| (strsim::levenshtein(&lower, k), *k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const COUNT: OptionSpec = OptionSpec {
        key: "widget_count",
        env: Some("FERRY_WIDGET_COUNT"),
        env_invalid: "not a whole number",
        default: "2",
        doc: "widgets",
    };
    const FILE: OptionSpec = OptionSpec {
        key: "widget_file",
        env: Some("FERRY_WIDGET_FILE"),
        env_invalid: "",
        default: "none",
        doc: "file",
    };

    fn env(pairs: &[(&str, &str)]) -> Environment {
        Environment::from_pairs(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    #[test]
    fn file_env_and_api_in_that_order_of_strength() {
        let text = "{\n  \"protocol\": \"tcp\",\n  \"widget_count\": 7,\n  \"widget_file\": \"w.json\"\n}";
        let mut c = Config::from_json_str(text, Some(Path::new("/etc/ferry/m.json"))).unwrap();
        let s = c.option::<u32>(&COUNT, &env(&[])).unwrap().unwrap();
        assert_eq!((s.value, &s.source), (7, &FieldSource::File("/etc/ferry/m.json".into())));
        assert_eq!(s.describe(&COUNT), "config field `widget_count` in /etc/ferry/m.json");
        let p = c.option_path(&FILE, &env(&[])).unwrap().unwrap();
        assert_eq!(p.value, PathBuf::from("/etc/ferry/w.json"), "relative to the file");
        let p = c.option_path(&FILE, &env(&[("FERRY_WIDGET_FILE", "x.json")])).unwrap().unwrap();
        assert_eq!((p.value, p.source), (PathBuf::from("x.json"), FieldSource::Env("FERRY_WIDGET_FILE")));
        let s = c.option::<u32>(&COUNT, &env(&[("FERRY_WIDGET_COUNT", "9")])).unwrap().unwrap();
        assert_eq!((s.value, s.describe(&COUNT).as_str()), (9, "environment variable FERRY_WIDGET_COUNT"));
        let s = c.option::<u32>(&COUNT, &env(&[("FERRY_WIDGET_COUNT", "")])).unwrap().unwrap();
        assert_eq!(s.value, 7, "an empty variable is unset");
        c.set_option(&COUNT, 3);
        let s = c.option::<u32>(&COUNT, &env(&[("FERRY_WIDGET_COUNT", "9")])).unwrap().unwrap();
        assert_eq!((s.value, s.source), (3, FieldSource::Api), "the API wins");
        assert_eq!(c.undeclared_fields([&COUNT]), vec!["widget_file"]);
        assert!(c.undeclared_fields(&[COUNT, FILE]).is_empty());
        let t = c.option_text(&FILE, &env(&[])).unwrap();
        assert_eq!((t.value.as_str(), t.source), ("w.json", FieldSource::File("/etc/ferry/m.json".into())));
        let t = c.option_text(&COUNT, &env(&[("FERRY_WIDGET_COUNT", "many")])).unwrap();
        assert_eq!((t.value.as_str(), t.source), ("3", FieldSource::Api), "the API's, as JSON");
        let fresh = Config::from_json_str(text, None).unwrap();
        let t = fresh.option_text(&COUNT, &env(&[("FERRY_WIDGET_COUNT", "many")])).unwrap();
        assert_eq!((t.value.as_str(), t.source), ("many", FieldSource::Env("FERRY_WIDGET_COUNT")), "unchecked");
        let t = fresh.option_text(&COUNT, &env(&[])).unwrap();
        assert_eq!((t.value.as_str(), t.source), ("7", FieldSource::Inline));
        let none = Config::from_json_str(r#"{"widget_count": null, "widget_file": ""}"#, None).unwrap();
        assert_eq!(none.option_text(&COUNT, &env(&[])), None);
        assert_eq!(none.option::<u32>(&COUNT, &env(&[])).unwrap(), None);
        assert_eq!(none.option_path(&FILE, &env(&[])).unwrap(), None);
    }

    #[test]
    fn unknown_fields_get_the_nearest_known_one_as_a_suggestion() {
        let text = r#"{"metadata_sever": "P2PHANDSHAKE", "widget_cuont": 2, "Protocol": "tcp", "rdma_devices": "x",
                       "widget_count": 1}"#;
        let c = Config::from_json_str(text, Some(Path::new("/etc/m.json"))).unwrap();
        let w = c.unknown_field_warnings([&COUNT]);
        let by_key: Vec<(&str, Option<&str>)> = w.iter().map(|u| (u.key.as_str(), u.suggestion)).collect();
        assert_eq!(
            by_key,
            [
                ("Protocol", Some("protocol")),
                ("metadata_sever", Some("metadata_server")),
                ("rdma_devices", None),
                ("widget_cuont", Some("widget_count")),
            ],
            "a declared option is neither unknown nor missed as a suggestion"
        );
        assert_eq!(
            w[1].to_string(),
            "unknown config field `metadata_sever` in /etc/m.json: did you mean `metadata_server`? It is kept, and \
             nothing reads it"
        );
        assert_eq!(
            w[2].to_string(),
            "unknown config field `rdma_devices` in /etc/m.json: kept, and nothing in this build reads it"
        );
        assert!(
            Config::from_json_str(r#"{"protocol": "tcp", "widget_count": 1}"#, None)
                .unwrap()
                .unknown_field_warnings([&COUNT])
                .is_empty()
        );
    }

    #[test]
    fn errors_name_the_field_and_position_or_the_variable() {
        let text = "{\n  \"protocol\": \"tcp\",\n  \"widget_count\": \"many\"\n}";
        let c = Config::from_json_str(text, Some(Path::new("/m.json"))).unwrap();
        let e = c.option::<u32>(&COUNT, &env(&[])).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        assert_eq!(
            e.message(),
            "config /m.json: field `widget_count` at line 3 column 3: invalid type: string \"many\", expected u32"
        );
        let e = c.option::<u32>(&COUNT, &env(&[("FERRY_WIDGET_COUNT", "x")])).unwrap_err();
        assert_eq!(e.message(), "environment variable FERRY_WIDGET_COUNT=\"x\": not a whole number");
        let e = c.option_error(&COUNT, &FieldSource::Env("FERRY_WIDGET_COUNT"), "is wrong");
        assert_eq!(e.message(), "field `widget_count` (from environment variable FERRY_WIDGET_COUNT): is wrong");
        let e = c.option_error(&COUNT, &FieldSource::File("/m.json".into()), "is wrong");
        assert_eq!(e.message(), "config /m.json: field `widget_count` at line 3 column 3: is wrong");
    }
}
