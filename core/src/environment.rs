//! [`Environment`]: how Ferry reads environment variables (the process environment, or an
//! injected map for tests and embedding), so that nothing has to mutate the process
//! environment. Config overrides, declared options and resolvers all read through one.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// How resolvers read environment variables: the process environment, or an injected map
/// (tests, embedding), so nothing has to mutate the process environment.
#[derive(Clone)]
pub struct Environment {
    get: Arc<EnvFn>,
}

type EnvFn = dyn Fn(&str) -> Option<String> + Send + Sync;

impl fmt::Debug for Environment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Environment")
    }
}

impl Default for Environment {
    fn default() -> Self {
        Self::process()
    }
}

impl Environment {
    /// The process environment. A value that is not UTF-8 is read lossily (so it is reported
    /// as malformed rather than treated as unset).
    pub fn process() -> Self {
        Self::from_fn(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()))
    }

    /// An environment answering through `get`.
    pub fn from_fn(get: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> Self {
        Self { get: Arc::new(get) }
    }

    /// An environment holding exactly `pairs`.
    pub fn from_pairs<K: Into<String>, V: Into<String>>(pairs: impl IntoIterator<Item = (K, V)>) -> Self {
        let map: HashMap<String, String> = pairs.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
        Self::from_fn(move |k| map.get(k).cloned())
    }

    /// An environment with no variables.
    pub fn empty() -> Self {
        Self::from_fn(|_| None)
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<String> {
        (self.get)(key)
    }

    /// The value of `key`, if set and not empty.
    pub fn get_nonempty(&self, key: &str) -> Option<String> {
        self.get(key).filter(|v| !v.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_from_pairs_and_empty() {
        let env = Environment::from_pairs([("A", "1"), ("B", "")]);
        assert_eq!(env.get("A").as_deref(), Some("1"));
        assert_eq!(env.get("B").as_deref(), Some(""));
        assert_eq!(env.get_nonempty("B"), None);
        assert_eq!(Environment::empty().get("A"), None);
    }
}
