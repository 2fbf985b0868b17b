//! Where the CANN libraries are looked for, in order (see [`SearchPath::from_env_with`]).

use std::path::{Path, PathBuf};

/// The ACL runtime library.
pub const ACL_LIBRARY: &str = "libascendcl.so";
/// The HCCL library.
pub const HCCL_LIBRARY: &str = "libhccl.so";
/// Newer CANN releases keep the communicator functions here (`libhccl.so` links it).
pub const HCOMM_LIBRARY: &str = "libhcomm.so";
/// HIXL's deprecated `adxl::AdxlEngine` (CANN 8.3 on) lives here.
pub const LLM_DATADIST_LIBRARY: &str = "libllm_datadist.so";
/// HIXL's `hixl::Hixl` (CANN >= 8.5).
pub const HIXL_LIBRARY: &str = "libcann_hixl.so";
/// `ge::AscendString`, the string type of HIXL's C++ API.
pub const METADEF_LIBRARY: &str = "libmetadef.so";
/// Ferry's override: a directory (or `:`-separated directories) holding the libraries.
pub const LIB_DIR_ENV: &str = "FERRY_ASCEND_LIB_DIR";
/// Install root of CANN <= 8.3.
pub const CANN_TOOLKIT_LIB_DIR: &str = "/usr/local/Ascend/ascend-toolkit/latest/lib64";
/// Install root of CANN >= 8.5.
pub const CANN_LIB_DIR: &str = "/usr/local/Ascend/cann/lib64";

/// One place to look: a directory, or the dynamic loader's own search (`LD_LIBRARY_PATH`, the
/// loader cache) when `dir` is `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchDir {
    /// The directory, or `None` for the dynamic loader's search.
    pub dir: Option<PathBuf>,
    /// Where this entry came from, shown in errors.
    pub source: String,
}

/// The ordered list of places the libraries are looked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchPath {
    dirs: Vec<SearchDir>,
}

impl SearchPath {
    /// The search path of this process's environment.
    pub fn from_env() -> Self {
        Self::from_env_with(|k| std::env::var(k).ok())
    }

    /// The search path for an environment given as a lookup function:
    ///
    /// 1. each directory in `FERRY_ASCEND_LIB_DIR` (`:`-separated);
    /// 2. `$ASCEND_HOME_PATH/lib64`, then `$ASCEND_TOOLKIT_HOME/lib64`;
    /// 3. the CANN <= 8.3 root `/usr/local/Ascend/ascend-toolkit/latest/lib64`;
    /// 4. the CANN >= 8.5 root `/usr/local/Ascend/cann/lib64`;
    /// 5. the dynamic loader's own search (the bare file name).
    ///
    /// Empty variables count as unset; a directory listed twice is kept once (first place).
    pub fn from_env_with(env: impl Fn(&str) -> Option<String>) -> Self {
        let mut dirs = Vec::new();
        if let Some(list) = env(LIB_DIR_ENV) {
            for d in list.split(':').map(str::trim).filter(|d| !d.is_empty()) {
                dirs.push(SearchDir { dir: Some(PathBuf::from(d)), source: LIB_DIR_ENV.to_owned() });
            }
        }
        for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
            if let Some(root) = env(var).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty()) {
                dirs.push(SearchDir { dir: Some(Path::new(&root).join("lib64")), source: format!("{var}/lib64") });
            }
        }
        dirs.push(SearchDir { dir: Some(CANN_TOOLKIT_LIB_DIR.into()), source: "CANN <= 8.3 install root".into() });
        dirs.push(SearchDir { dir: Some(CANN_LIB_DIR.into()), source: "CANN >= 8.5 install root".into() });
        dirs.push(SearchDir { dir: None, source: "dynamic loader search path".into() });
        let mut unique: Vec<SearchDir> = Vec::with_capacity(dirs.len());
        for d in dirs {
            if !unique.iter().any(|u| u.dir == d.dir) {
                unique.push(d);
            }
        }
        Self { dirs: unique }
    }

    /// Only `dir`, nothing else (for embedders that ship their own CANN copy, and for tests).
    pub fn only(dir: impl Into<PathBuf>) -> Self {
        Self { dirs: vec![SearchDir { dir: Some(dir.into()), source: "explicit directory".into() }] }
    }

    /// The places, in order.
    pub fn dirs(&self) -> &[SearchDir] {
        &self.dirs
    }

    /// The paths to try for `file`, in order, each with its source: `prefer` (the directory an
    /// earlier library came from) first when given, then the search path.
    pub fn candidates(&self, file: &str, prefer: Option<&Path>) -> Vec<(Option<PathBuf>, String)> {
        let mut out: Vec<(Option<PathBuf>, String)> = Vec::new();
        if let Some(p) = prefer {
            out.push((Some(p.join(file)), format!("directory of {ACL_LIBRARY}")));
        }
        for d in &self.dirs {
            let path = d.dir.as_ref().map(|dir| dir.join(file));
            if !out.iter().any(|(p, _)| *p == path) {
                out.push((path, d.source.clone()));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_order_is_override_then_env_roots_then_install_roots_then_loader() {
        let p = SearchPath::from_env_with(env(&[
            ("FERRY_ASCEND_LIB_DIR", "/opt/a:/opt/b"),
            ("ASCEND_HOME_PATH", "/home/cann"),
            ("ASCEND_TOOLKIT_HOME", "/tk"),
        ]));
        let dirs: Vec<Option<String>> =
            p.dirs().iter().map(|d| d.dir.as_ref().map(|x| x.display().to_string())).collect();
        assert_eq!(
            dirs,
            vec![
                Some("/opt/a".into()),
                Some("/opt/b".into()),
                Some("/home/cann/lib64".into()),
                Some("/tk/lib64".into()),
                Some(CANN_TOOLKIT_LIB_DIR.into()),
                Some(CANN_LIB_DIR.into()),
                None,
            ]
        );
        assert_eq!(p.dirs()[0].source, "FERRY_ASCEND_LIB_DIR");
        assert_eq!(p.dirs()[2].source, "ASCEND_HOME_PATH/lib64");
    }

    #[test]
    fn empty_variables_are_unset_and_duplicates_are_kept_once() {
        let p = SearchPath::from_env_with(env(&[
            ("FERRY_ASCEND_LIB_DIR", ""),
            ("ASCEND_HOME_PATH", "/usr/local/Ascend/ascend-toolkit/latest"),
            ("ASCEND_TOOLKIT_HOME", "  "),
        ]));
        assert_eq!(p.dirs().len(), 3, "{p:?}");
        assert_eq!(p.dirs()[0].dir.as_deref(), Some(Path::new(CANN_TOOLKIT_LIB_DIR)));
        assert_eq!(p.dirs()[0].source, "ASCEND_HOME_PATH/lib64", "the first place wins");
        let none = SearchPath::from_env_with(env(&[]));
        assert_eq!(none.dirs().len(), 3);
        assert_eq!(none.dirs()[2].dir, None);
    }

    #[test]
    fn candidates_put_the_preferred_directory_first_once() {
        let p = SearchPath::from_env_with(env(&[("FERRY_ASCEND_LIB_DIR", "/x")]));
        let c = p.candidates(HCCL_LIBRARY, Some(Path::new("/x")));
        assert_eq!(c[0].0.as_deref(), Some(Path::new("/x/libhccl.so")));
        assert_eq!(c.iter().filter(|(p, _)| p.as_deref() == Some(Path::new("/x/libhccl.so"))).count(), 1);
        assert_eq!(c.last().unwrap().0, None);
    }
}
