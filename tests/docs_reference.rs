//! The configuration reference cannot drift from the code: its field tables in
//! docs/configuration.md are generated from the code's documentation of each field, and every
//! `FERRY_*` environment variable named in a string literal of the shipped sources is
//! documented — the library's and binaries' in docs/configuration.md, the emulated CANN's in docs/ascend.md, the Python package's in
//! docs/python.md. (Options declared by transports are checked row by row in config_engine.rs.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Directories that hold no shipped source: build output, tests, benches, examples, the fuzz
/// workspace, virtual environments and other hidden directories.
fn skipped_dir(name: &str) -> bool {
    matches!(name, "target" | "tests" | "benches" | "examples" | "fuzz" | "bench" | "node_modules" | "__pycache__")
        || name.starts_with('.')
}

/// Every `.rs` and `.py` file under `dir` that is part of a crate's or package's sources.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if !skipped_dir(&name) {
                sources(&path, out);
            }
        } else if (name.ends_with(".rs") && name != "tests.rs" && name != "build.rs") || name.ends_with(".py") {
            let rel = path.strip_prefix(root()).unwrap();
            // Crate and package sources live under a `src` directory; setup.py builds the wheel.
            if rel.components().any(|c| c.as_os_str() == "src") || name == "setup.py" {
                out.push(path);
            }
        }
    }
}

/// The text of a Rust file before its unit-test module (`#[cfg(test)]` then `mod ...`).
fn without_unit_tests(text: &str) -> &str {
    let mut offset = 0;
    let mut lines = text.split_inclusive('\n').peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]" && lines.peek().is_some_and(|next| next.trim_start().starts_with("mod ")) {
            return &text[..offset];
        }
        offset += line.len();
    }
    text
}

/// The `"FERRY_..."` string literals of `text` (upper-case letters, digits and `_` after the
/// prefix, then the closing quote).
fn ferry_variables(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (at, _) in text.match_indices("\"FERRY_") {
        let rest = &text[at + 1..];
        let len =
            rest.find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')).unwrap_or(rest.len());
        if rest[len..].starts_with('"') && len > "FERRY_".len() {
            found.insert(rest[..len].to_owned());
        }
    }
    found
}

/// The document a variable found in `file` must appear in.
fn reference_for(file: &Path) -> &'static str {
    let rel = file.strip_prefix(root()).unwrap();
    if rel.starts_with("ffi/ascend/cann-emu") {
        "docs/ascend.md"
    } else if rel.starts_with("ffi/bindings/python") {
        "docs/python.md"
    } else {
        "docs/configuration.md"
    }
}

#[test]
fn every_ferry_variable_in_the_sources_is_documented() {
    let mut files = Vec::new();
    sources(&root(), &mut files);
    // variable -> (document, files naming it)
    let mut variables: BTreeMap<String, (&str, BTreeSet<String>)> = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let text = if file.extension().is_some_and(|e| e == "rs") { without_unit_tests(&text) } else { &text };
        for var in ferry_variables(text) {
            let rel = file.strip_prefix(root()).unwrap().display().to_string();
            variables.entry(var).or_insert_with(|| (reference_for(file), BTreeSet::new())).1.insert(rel);
        }
    }
    // The scan sees the variables of every layer, and nothing of the tests' own.
    for expected in ["FERRY_PROTOCOL", "FERRY_TCP_LANES", "FERRY_PLUGIN_DIR", "FERRY_WAIT_SPIN_US", "FERRY_CAPI_LIB"] {
        assert!(variables.contains_key(expected), "{expected} not found in the sources: {variables:?}");
    }
    assert!(variables.contains_key("FERRY_CANN_EMU_DEVICES"), "{variables:?}");
    for test_only in ["FERRY_TEST_REDIS", "FERRY_WIDGET_COUNT", "FERRY_TCP_FAULTS_CHILD"] {
        assert!(!variables.contains_key(test_only), "{test_only} is a test's variable");
    }
    let docs: BTreeMap<&str, String> =
        ["docs/configuration.md", "docs/ascend.md", "docs/python.md"].into_iter().map(|d| (d, read(d))).collect();
    let missing: Vec<String> = variables
        .iter()
        .filter(|(var, (doc, _))| !docs[doc].contains(&format!("`{var}`")) && !docs[doc].contains(&format!("`{var}=")))
        .map(|(var, (doc, files))| {
            format!(
                "{var} (read in {}) is not in {doc}",
                files.iter().map(String::as_str).collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    assert!(missing.is_empty(), "undocumented environment variables:\n{}", missing.join("\n"));
}

/// The tables of docs/configuration.md that are generated from the code, by name: the core's
/// fields ([`ferry::CORE_FIELDS`]) and the options each group of crates declares (their
/// [`ferry::OptionSpec`]s: key, variable, meaning, default).
fn generated_tables() -> Vec<(&'static str, String)> {
    use ferry::OptionSpec;
    let keys = |specs: &[&OptionSpec]| specs.iter().map(|s| s.key).collect::<BTreeSet<_>>();
    let transports = ferry::default_transports();
    let options_of = |name: &str| -> Vec<&'static OptionSpec> {
        transports.find(name).unwrap_or_else(|| panic!("no {name} transport")).options().iter().collect()
    };
    let tcp = options_of("tcp");
    let ascend = options_of("ascend");
    let p2p: Vec<&OptionSpec> = ferry::metadata_backends::p2p::OPTIONS.iter().collect();
    let http: Vec<&OptionSpec> = ferry::metadata_backends::http::OPTIONS.iter().collect();
    // Peer authentication's fields are the ones both the data transport and the handshake read.
    let shared: BTreeSet<&str> = keys(&tcp).intersection(&keys(&p2p)).copied().collect();
    let not_shared = |specs: Vec<&'static OptionSpec>| -> Vec<&'static OptionSpec> {
        specs.into_iter().filter(|s| !shared.contains(s.key)).collect()
    };
    let auth: Vec<&OptionSpec> = tcp.iter().copied().filter(|s| shared.contains(s.key)).collect();
    let groups = [
        ("tcp options", not_shared(tcp.clone())),
        ("ascend options", ascend.clone()),
        ("metadata options", not_shared(p2p.into_iter().chain(http).collect())),
        ("authentication options", auth),
    ];
    // Every option this build declares is in exactly one table.
    let mut grouped: Vec<&str> = groups.iter().flat_map(|(_, specs)| specs.iter().map(|s| s.key)).collect();
    grouped.sort_unstable();
    let mut declared: Vec<&str> = ferry::declared_options().iter().map(|s| s.key).collect();
    declared.sort_unstable();
    assert_eq!(grouped, declared, "every declared option belongs to one generated table");

    let mut core = String::from("| field | style | meaning | default |\n|---|---|---|---|\n");
    for row in ferry::CORE_FIELDS {
        let keys: Vec<String> = row.keys.iter().map(|k| format!("`{k}`")).collect();
        core += &format!("| {} | {} | {} | {} |\n", keys.join(", "), row.style, row.meaning, row.default);
    }
    let mut tables = vec![("core fields", core)];
    for (name, specs) in groups {
        let mut table = String::from("| field | variable | meaning | default |\n|---|---|---|---|\n");
        for spec in specs {
            let env = spec.env.map_or_else(|| "none".to_owned(), |v| format!("`{v}`"));
            table += &format!("| `{}` | {env} | {} | {} |\n", spec.key, spec.doc, spec.default);
        }
        tables.push((name, table));
    }
    tables
}

/// The configuration reference's field tables are generated from the code: each sits in
/// docs/configuration.md between `<!-- generated: NAME -->` and `<!-- end generated: NAME -->`
/// and must equal what the code says. `FERRY_BLESS=1 cargo test -p ferry --test docs_reference`
/// rewrites them after a change to a field's or an option's documentation.
#[test]
fn the_configuration_tables_are_generated_from_the_code() {
    let path = root().join("docs/configuration.md");
    let mut docs = read("docs/configuration.md");
    let bless = std::env::var_os("FERRY_BLESS").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    for (name, table) in generated_tables() {
        let begin = format!(
            "<!-- generated: {name} (from the code; FERRY_BLESS=1 cargo test -p ferry --test docs_reference) -->\n"
        );
        let end = format!("<!-- end generated: {name} -->\n");
        let at = docs.find(&begin).unwrap_or_else(|| panic!("docs/configuration.md has no line {begin:?}"));
        let from = at + begin.len();
        let to = from + docs[from..].find(&end).unwrap_or_else(|| panic!("docs/configuration.md has no line {end:?}"));
        if docs[from..to] != table {
            stale.push(name);
            docs.replace_range(from..to, &table);
        }
    }
    if bless {
        std::fs::write(&path, &docs).unwrap();
    } else {
        assert!(
            stale.is_empty(),
            "docs/configuration.md's tables {stale:?} differ from the code's documentation (ferry::CORE_FIELDS, \
             the OptionSpecs); run `FERRY_BLESS=1 cargo test -p ferry --test docs_reference` and commit the result"
        );
    }
}

#[test]
fn every_variable_that_overrides_a_core_field_names_it() {
    let docs = read("docs/configuration.md");
    for (var, field) in ferry::config::ENV_OVERRIDES {
        let row = docs.lines().find(|l| l.starts_with(&format!("| `{var}`")));
        let row = row.unwrap_or_else(|| panic!("docs/configuration.md has no row for {var}"));
        assert!(row.contains(&format!("`{field}`")), "the row of {var} names `{field}`: {row}");
    }
}
