//! Every command README.md and the docs show in a shell code block names things that exist and
//! options that are accepted, and the cheap ones run.
//!
//! The commands are the lines of the ```sh, ```bash and ```shell blocks (only the `$ ` lines of
//! ```console blocks and of blocks that show a prompt) of README.md, docs/*.md and the READMEs under ffi/, bench/ and scripts/.
//! Each is split as the shell splits it (leading `VAR=value` words dropped, `&&` chains and
//! `( … )` groups taken apart) and checked by what it runs:
//!
//! - `ferry SUB --flag …` (also `target/*/ferry` and `cargo run -p ferry-cli -- SUB …`): `ferry
//!   SUB --help` runs, and every flag the command uses is in that help;
//! - `cargo build|test|run|bench … -p PKG --example E --test T --bench B`: the package is a
//!   member of the workspace and has those targets; `cargo +nightly fuzz run T`: T is a fuzz
//!   target of fuzz/Cargo.toml;
//! - `scripts/X`: the script exists and is executable, every flag it is given is in its text,
//!   and `--help` runs where the docs show it;
//! - `python3 bench/X.py …`: the script exists and `--help` runs (the flags used are in it);
//!   `python -m ferry.alias CMD`: CMD is one of the module's commands;
//! - `pip install ./PATH`, `pytest PATH` and `cc … DIR/FILE.c -I DIR`: the paths exist.
//!
//! What needs an NPU, a cluster, a model or a network (vllm, sglang, Mooncake's own binaries,
//! apt-get, nm of a release build) is not run: those commands are listed, counted and left
//! alone; the test fails if the share it checks drops (a new kind of command needs a rule).
//! Running every command for real is what README's two commands and the CI script do for the
//! main paths; the Ascend ones run only on hardware (`scripts/ascend-smoke.sh`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("cli/ is under the root").to_path_buf()
}

/// The documents whose commands are checked.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut docs = vec![root.join("README.md")];
    let mut add_dir = |dir: &Path, recurse: bool| {
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else { continue };
            for entry in entries.flatten() {
                let path = entry.path();
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                if path.is_dir() {
                    if recurse && !name.starts_with('.') && name != "target" && name != "build" {
                        stack.push(path);
                    }
                } else if name.ends_with(".md") && (!recurse || name == "README.md") {
                    docs.push(path);
                }
            }
        }
    };
    add_dir(&root.join("docs"), false);
    for dir in ["ffi", "bench", "scripts"] {
        add_dir(&root.join(dir), true);
    }
    docs.sort();
    docs
}

/// One documented command: where it is and its words.
#[derive(Debug, Clone)]
struct Documented {
    at: String,
    words: Vec<String>,
}

/// The commands of the shell code blocks of `text` (`file` names them in messages).
fn commands(file: &str, text: &str) -> Vec<Documented> {
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate();
    while let Some((_, line)) = lines.next() {
        let Some(lang) = line.trim_start().strip_prefix("```") else { continue };
        let lang = lang.trim();
        let mut block: Vec<(usize, String)> = Vec::new();
        for (n, line) in lines.by_ref() {
            if line.trim_start().starts_with("```") {
                break;
            }
            block.push((n + 1, line.to_owned()));
        }
        if !matches!(lang, "sh" | "bash" | "shell" | "console") {
            continue;
        }
        // Join continued lines.
        let mut joined: Vec<(usize, String)> = Vec::new();
        let mut pending: Option<(usize, String)> = None;
        for (n, line) in block {
            let (start, mut text) = pending.take().unwrap_or((n, String::new()));
            text.push_str(line.trim());
            if let Some(stripped) = text.strip_suffix('\\') {
                pending = Some((start, format!("{stripped} ")));
            } else {
                joined.push((start, text));
            }
        }
        // A block whose commands have a `$ ` prompt shows their output too.
        let prompted = lang == "console" || joined.iter().any(|(_, l)| l.starts_with("$ "));
        for (n, line) in joined {
            let line = if prompted {
                match line.strip_prefix("$ ") {
                    Some(command) => command.to_owned(),
                    None => continue, // output
                }
            } else {
                line
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let line = without_comment(line);
            let words = shell_words::split(line)
                .unwrap_or_else(|e| panic!("{file}:{n}: `{line}` does not split as the shell splits it: {e}"));
            // Take `a && b` and `( … )` apart.
            for part in words.split(|w| w == "&&" || w == ";") {
                let mut part: Vec<String> =
                    part.iter().map(|w| w.trim_start_matches('(').trim_end_matches(')').to_owned()).collect();
                part.retain(|w| !w.is_empty());
                while part.first().is_some_and(|w| is_assignment(w)) {
                    part.remove(0);
                }
                if !part.is_empty() {
                    out.push(Documented { at: format!("{file}:{n}"), words: part });
                }
            }
        }
    }
    out
}

/// `line` without a trailing shell comment: from a `#` that starts a word outside quotes.
fn without_comment(line: &str) -> &str {
    let (mut single, mut double, mut previous) = (false, false, ' ');
    for (i, ch) in line.char_indices() {
        match ch {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && previous.is_whitespace() => return line[..i].trim_end(),
            _ => {}
        }
        previous = ch;
    }
    line
}

/// Whether `text` names `flag` as a whole word (`--dur` is not in `--duration`).
fn names_flag(text: &str, flag: &str) -> bool {
    text.match_indices(flag).any(|(at, _)| {
        !text[at + flag.len()..].chars().next().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    })
}

fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty() && name.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
    })
}

/// The `--flag` names of `words` (`--a=b` gives `--a`).
fn flags(words: &[String]) -> Vec<String> {
    words
        .iter()
        .take_while(|w| *w != "--")
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.split('=').next().unwrap().to_owned())
        .collect()
}

/// `cargo metadata` of the workspace: package name -> target (kind, name) pairs.
fn workspace_targets() -> BTreeMap<String, BTreeSet<(String, String)>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--no-deps", "--format-version", "1", "--offline"])
        .current_dir(root())
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut packages = BTreeMap::new();
    for p in meta["packages"].as_array().unwrap() {
        let mut targets = BTreeSet::new();
        for t in p["targets"].as_array().unwrap() {
            for kind in t["kind"].as_array().unwrap() {
                targets.insert((kind.as_str().unwrap().to_owned(), t["name"].as_str().unwrap().to_owned()));
            }
        }
        packages.insert(p["name"].as_str().unwrap().to_owned(), targets);
    }
    packages
}

struct Checker {
    root: PathBuf,
    ferry: PathBuf,
    packages: BTreeMap<String, BTreeSet<(String, String)>>,
    help: BTreeMap<Vec<String>, String>,
    problems: Vec<String>,
}

impl Checker {
    fn problem(&mut self, c: &Documented, msg: String) {
        self.problems.push(format!("{}: `{}`: {msg}", c.at, c.words.join(" ")));
    }

    /// The help text of `program args --help`, run once per distinct command.
    fn help_of(&mut self, program: &Path, args: &[&str]) -> Result<String, String> {
        let mut key = vec![program.display().to_string()];
        key.extend(args.iter().map(|s| s.to_string()));
        if let Some(text) = self.help.get(&key) {
            return Ok(text.clone());
        }
        let out = Command::new(program)
            .args(args)
            .arg("--help")
            .current_dir(&self.root)
            .output()
            .map_err(|e| format!("{} could not be run: {e}", program.display()))?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if !out.status.success() {
            return Err(format!("`{} {} --help` failed: {text}", program.display(), args.join(" ")));
        }
        self.help.insert(key, text.clone());
        Ok(text)
    }

    fn ferry(&mut self, c: &Documented, args: &[String]) {
        let Some(sub) = args.first().filter(|a| !a.starts_with('-')) else {
            if let Err(e) = self.help_of(&self.ferry.clone(), &[]) {
                self.problem(c, e);
            }
            return;
        };
        match self.help_of(&self.ferry.clone(), &[sub]) {
            Err(e) => self.problem(c, format!("no subcommand `{sub}`: {e}")),
            Ok(help) => {
                for flag in flags(&args[1..]) {
                    if !names_flag(&help, &flag) {
                        self.problem(c, format!("`ferry {sub}` has no flag {flag}"));
                    }
                }
            }
        }
    }

    fn cargo(&mut self, c: &Documented) {
        let w = &c.words;
        let mut i = 1;
        if w.get(i).is_some_and(|a| a.starts_with('+')) {
            i += 1;
        }
        let sub = w.get(i).cloned().unwrap_or_default();
        match sub.as_str() {
            "fuzz" => {
                let fuzz = std::fs::read_to_string(self.root.join("fuzz/Cargo.toml")).unwrap();
                // `fuzz run [--flag value…] TARGET [CORPUS…] [-- libFuzzer flags]`: the word after `run`'s flags.
                let words: Vec<&String> = w[i + 2..].iter().take_while(|a| *a != "--").collect();
                let mut j = 0;
                while words.get(j).is_some_and(|a| a.starts_with("--")) {
                    j += if words[j] == "--sanitizer" { 2 } else { 1 };
                }
                let target = words.get(j);
                if let Some(target) = target
                    && !fuzz.contains(&format!("name = \"{target}\""))
                {
                    self.problem(c, format!("no fuzz target {target} in fuzz/Cargo.toml"));
                }
            }
            "install" => {} // a tool from crates.io
            "build" | "test" | "run" | "bench" | "nextest" => {
                let args: Vec<&String> = w[i + 1..].iter().take_while(|a| *a != "--").collect();
                let value = |flag: &str| -> Vec<String> {
                    args.windows(2).filter(|p| p[0] == flag).map(|p| p[1].clone()).collect()
                };
                let packages = value("-p");
                let package = packages.first().cloned().unwrap_or_else(|| "ferry".to_owned());
                for p in &packages {
                    if !self.packages.contains_key(p) {
                        self.problem(c, format!("no workspace package {p}"));
                    }
                }
                for (flag, kind) in [("--example", "example"), ("--test", "test"), ("--bench", "bench")] {
                    for name in value(flag) {
                        let has = self.packages.get(&package).is_some_and(|t| t.contains(&(kind.into(), name.clone())));
                        if !has {
                            self.problem(c, format!("package {package} has no {kind} {name}"));
                        }
                    }
                }
                if sub == "run"
                    && package == "ferry-cli"
                    && let Some(dash) = w.iter().position(|a| a == "--")
                {
                    let rest = w[dash + 1..].to_vec();
                    self.ferry(c, &rest);
                }
            }
            other => self.problem(c, format!("no rule for `cargo {other}`")),
        }
    }

    fn script(&mut self, c: &Documented, path: &Path) {
        let full = self.root.join(path);
        let Ok(text) = std::fs::read_to_string(&full) else {
            return self.problem(c, format!("{} does not exist", path.display()));
        };
        let executable =
            std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&full).unwrap().permissions()) & 0o111;
        if executable == 0 {
            self.problem(c, format!("{} is not executable", path.display()));
        }
        for flag in flags(&c.words[1..]) {
            if !names_flag(&text, &flag) {
                self.problem(c, format!("{} knows no {flag}", path.display()));
            }
        }
        // `--help` of a script is cheap by contract; scripts/test.sh takes no flags and runs
        // the whole suite, so only the ones the docs show with flags are asked.
        if c.words.iter().any(|w| w == "--help")
            && let Err(e) = self.help_of(&full, &[])
        {
            self.problem(c, e);
        }
    }

    fn python(&mut self, c: &Documented) {
        let w = &c.words;
        if w.get(1).is_some_and(|a| a == "-m") {
            match w.get(2).map(String::as_str) {
                Some("ferry.alias") => {
                    let module =
                        std::fs::read_to_string(self.root.join("ffi/bindings/python/src/ferry/alias.py")).unwrap();
                    let cmd = w.get(3).cloned().unwrap_or_default();
                    if !module.contains(&format!("\"{cmd}\"")) {
                        self.problem(c, format!("ferry.alias has no command {cmd:?}"));
                    }
                }
                Some("venv") => {}
                _ => {} // a module of another project (sglang, …)
            }
            return;
        }
        let Some(script) = w.get(1).filter(|a| a.ends_with(".py")) else { return };
        let path = self.root.join(script);
        if !path.exists() {
            return self.problem(c, format!("{script} does not exist"));
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for flag in flags(&w[2..]) {
            if !text.contains(&format!("\"{flag}\"")) {
                self.problem(c, format!("{script} has no option {flag}"));
            }
        }
        match Command::new("python3").arg(&path).arg("--help").current_dir(&self.root).output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => {
                self.problem(c, format!("`python3 {script} --help` failed: {}", String::from_utf8_lossy(&out.stderr)))
            }
            Err(e) => self.problem(c, format!("python3 could not be run: {e}")),
        }
    }

    fn paths(&mut self, c: &Documented) {
        let w = c.words.clone();
        let check = |this: &mut Self, p: &str| {
            if !this.root.join(p).exists() {
                this.problem(c, format!("{p} does not exist"));
            }
        };
        match w[0].as_str() {
            "pytest" => {
                for p in w.iter().skip(1).filter(|a| !a.starts_with('-')) {
                    check(self, p);
                }
            }
            "pip" => {
                for p in w.iter().skip(1).filter(|a| a.starts_with("./")) {
                    check(self, p);
                }
            }
            "cc" => {
                for (i, a) in w.iter().enumerate() {
                    // The repository's sources (`app.c` stands for the reader's own).
                    if a.ends_with(".c") && a.contains('/') {
                        check(self, a);
                    }
                    if a == "-I"
                        && let Some(dir) = w.get(i + 1)
                    {
                        check(self, dir);
                    }
                }
            }
            _ => {}
        }
    }

    /// Checks `c`; `false` when no rule applies (the command is left alone).
    fn check(&mut self, c: &Documented) -> bool {
        let program = c.words[0].clone();
        let name = Path::new(&program).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        match () {
            _ if program == "ferry" || (name == "ferry" && program.contains("target/")) => {
                let args = c.words[1..].to_vec();
                self.ferry(c, &args);
            }
            _ if program == "cargo" => self.cargo(c),
            _ if program.starts_with("scripts/") => self.script(c, Path::new(&program)),
            _ if program == "python" || program == "python3" || name == "python" => self.python(c),
            _ if program == "cc" || name == "pip" || name == "pytest" => {
                let mut c = c.clone();
                c.words[0] = if program == "cc" { "cc".into() } else { name };
                self.paths(&c);
            }
            _ => return false,
        }
        true
    }
}

#[test]
fn every_documented_command_names_what_exists_and_its_cheap_ones_run() {
    let root = root();
    let mut all = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        let rel = doc.strip_prefix(&root).unwrap().display().to_string();
        all.extend(commands(&rel, &text));
    }
    let mut checker = Checker {
        root: root.clone(),
        ferry: PathBuf::from(env!("CARGO_BIN_EXE_ferry")),
        packages: workspace_targets(),
        help: BTreeMap::new(),
        problems: Vec::new(),
    };
    let mut left_alone = Vec::new();
    let mut checked = 0;
    for c in &all {
        if checker.check(c) {
            checked += 1;
        } else {
            left_alone.push(format!("{}: {}", c.at, c.words.join(" ")));
        }
    }
    println!("{checked} documented commands checked; left alone ({}):\n{}", left_alone.len(), left_alone.join("\n"));
    assert!(all.len() >= 60, "the docs' commands were found: {}", all.len());
    assert!(
        checked * 10 >= all.len() * 8,
        "at least 80% of the documented commands are checked ({checked} of {}); left alone:\n{}",
        all.len(),
        left_alone.join("\n")
    );
    assert!(checker.problems.is_empty(), "documented commands that would fail:\n{}", checker.problems.join("\n"));
}

#[test]
fn commands_are_found_as_the_shell_reads_them() {
    let text = "```sh\nFOO=1 ferry bench --mode=target \\\n  --duration=5   # a comment\n(cd x && cargo build -p a) # x\n```\n\
                ```console\n$ nm -D lib.so\n0000 T symbol\n```\n```json\n{\"a\": 1}\n```\n";
    let found: Vec<String> = commands("t.md", text).iter().map(|c| format!("{} {}", c.at, c.words.join(" "))).collect();
    assert_eq!(
        found,
        [
            "t.md:2 ferry bench --mode=target --duration=5",
            "t.md:4 cd x",
            "t.md:4 cargo build -p a",
            "t.md:7 nm -D lib.so"
        ]
    );
}
