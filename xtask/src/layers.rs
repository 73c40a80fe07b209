//! The library's three floors, checked (a test of this crate): the vocabulary imports only the
//! vocabulary, the engine (`cube/`) only itself and the vocabulary, and no `cfg(feature =
//! "cube")` gate stands outside the engine. ARCHITECTURE.md, "Three floors". Compiled for
//! tests only.

/// The vocabulary: modules that name no backend type.
const VOCABULARY: &[&str] = &[
    "callable",
    "config",
    "counter_rng",
    "error",
    "faults",
    "host_phases",
    "params",
    "ranks/mod",
    "ranks/process",
    "ranks/round",
    "ranks/wire",
    "shape_cache",
    "stats",
    "step_optim",
    "sync",
    "tensors",
];

/// The features: everything above the engine's front door.
const FEATURES: &[&str] = &[
    "data_parallel/mod",
    "data_parallel/params",
    "graphed/build",
    "graphed/group",
    "graphed/mod",
    "nn/attention",
    "nn/conv",
    "nn/embedding",
    "nn/encoder",
    "nn/linear",
    "nn/loss",
    "nn/mod",
    "nn/norm",
    "optim/mod",
    "optim/multi_adam",
    "rng",
    "route",
    "step/mod",
    "step/parallel",
    "step/record",
    "train",
];

/// The module each `crate::` path in `source`'s code names (doc comments and comments left
/// out), with the line it stands on: its first segment, or the first two as a file of a folder
/// (`optim::multi_adam` is `optim/multi_adam`, `optim` alone `optim/mod`) where the floors list
/// that file.
fn crate_imports(source: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (number, line) in source.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let after = &rest[at + "crate::".len()..];
            // A visibility (`pub(in crate::cube)`) names a scope, not an import.
            if rest[..at].ends_with("pub(in ") {
                rest = after;
                continue;
            }
            let path: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let mut segments = path.split("::").filter(|s| !s.is_empty());
            if let Some(first) = segments.next() {
                found.push((number + 1, module_of(first, segments.next())));
            }
            rest = after;
        }
    }
    found
}

/// The listed module a path of `first` then `second` names.
fn module_of(first: &str, second: Option<&str>) -> String {
    let listed = |module: &str| VOCABULARY.contains(&module) || FEATURES.contains(&module);
    if let Some(second) = second {
        let file = format!("{first}/{second}");
        if listed(&file) {
            return file;
        }
    }
    let folder = format!("{first}/mod");
    if listed(&folder) {
        folder
    } else {
        first.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("readable source folder") {
            let path = entry.expect("readable entry").path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn reads_crate_paths_outside_comments() {
        let source = "use crate::error::GraphedError;\n/// [`x`](crate::graphed::Graphed)\nlet a = crate::sync::lock(&m); // crate::rng\nuse crate::optim::multi_adam::M;\nuse crate::optim::FusedAdam;\npub(in crate::cube) fn f() {}\n";
        let names: Vec<_> = crate_imports(source).into_iter().map(|(_, n)| n).collect();
        assert_eq!(names, ["error", "sync", "optim/multi_adam", "optim/mod"]);
    }

    /// Every `crate::` path of the library names a module of an allowed floor, and the engine
    /// is the only place that asks for the `cube` feature.
    #[test]
    fn library_floors_import_downward() {
        let src = crate::root().join("crates/burn-graphed/src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        let mut wrong = Vec::new();
        for file in &files {
            let relative = file.strip_prefix(&src).expect("under src");
            let source = std::fs::read_to_string(file).expect("readable source");
            let in_engine = relative.starts_with("cube");
            let module = relative
                .with_extension("")
                .to_string_lossy()
                .replace('\\', "/");
            let vocabulary = VOCABULARY.contains(&module.as_str());
            assert!(
                in_engine || vocabulary || FEATURES.contains(&module.as_str()) || module == "lib",
                "{module} is on no floor: add it to VOCABULARY or FEATURES"
            );
            for (line, name) in crate_imports(&source) {
                // The vocabulary and the engine use only the vocabulary through `crate::`
                // (the engine reaches its own modules through `super::`). Features may use the
                // engine and each other, never the crate root's re-exports (the root imports
                // every module).
                let allowed = if vocabulary || in_engine {
                    VOCABULARY.contains(&name.as_str())
                } else {
                    name.chars().next().is_some_and(char::is_lowercase)
                };
                if !allowed {
                    wrong.push(format!("{module}.rs:{line} uses crate::{name}"));
                }
            }
            if !in_engine && source.contains("cfg(feature = \"cube\")") {
                wrong.push(format!("{module}.rs gates code on the `cube` feature"));
            }
        }
        assert!(files.len() > 20, "found the library's sources");
        assert!(
            wrong.is_empty(),
            "imports against the floors:\n{}",
            wrong.join("\n")
        );
    }

    /// Whether ARCHITECTURE.md's `text` names the source file `relative` (a path under `src/`):
    /// as `` `relative` ``, or, for a file in a folder, on a line that names the folder
    /// (`` `nn/` ``) and the file (`` `norm.rs` ``; a folder's `mod.rs` by the folder alone).
    fn names_file(text: &str, relative: &str) -> bool {
        if text.contains(&format!("`{relative}`")) {
            return true;
        }
        let Some((folder, file)) = relative.rsplit_once('/') else {
            return false;
        };
        text.lines().any(|line| {
            line.contains(&format!("`{folder}/`"))
                && (file == "mod.rs" || line.contains(&format!("`{file}`")))
        })
    }

    /// ARCHITECTURE.md's code map names every source file of the library, so that it stays
    /// true to the tree (a file added without its row fails here).
    #[test]
    fn architecture_names_every_source_file() {
        let src = crate::root().join("crates/burn-graphed/src");
        let text = std::fs::read_to_string(crate::root().join("ARCHITECTURE.md"))
            .expect("ARCHITECTURE.md");
        let mut files = Vec::new();
        sources(&src, &mut files);
        let missing: Vec<String> = files
            .iter()
            .map(|file| {
                file.strip_prefix(&src)
                    .expect("under src")
                    .to_string_lossy()
                    .replace('\\', "/")
            })
            .filter(|relative| relative != "lib.rs" && !names_file(&text, relative))
            .collect();
        assert!(
            missing.is_empty(),
            "ARCHITECTURE.md's code map does not name: {missing:?}"
        );
        // The control: a file that is not in the map is found missing.
        assert!(!names_file(&text, "cube/not_a_module.rs"));
        assert!(!names_file(&text, "nn/not_a_module.rs"));
    }

    /// Lines a library file may hold before its module doc must say why it is longer.
    const LONG_FILE: usize = 600;

    /// Whether `source`'s module doc (its leading `//!` lines) gives a reason for its length.
    fn says_why_long(source: &str) -> bool {
        source
            .lines()
            .take_while(|line| line.starts_with("//!") || line.trim().is_empty())
            .any(|line| line.contains("Over 600 lines"))
    }

    /// The house rule: no file of the library over about 600 lines without a reason at its top
    /// ("Over 600 lines: ..." in its module doc).
    #[test]
    fn long_files_say_why() {
        let src = crate::root().join("crates/burn-graphed/src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        let silent: Vec<String> = files
            .iter()
            .filter_map(|file| {
                let source = std::fs::read_to_string(file).expect("readable source");
                let long = source.lines().count() > LONG_FILE;
                (long && !says_why_long(&source)).then(|| {
                    let relative = file.strip_prefix(&src).expect("under src");
                    format!("{} ({} lines)", relative.display(), source.lines().count())
                })
            })
            .collect();
        assert!(
            silent.is_empty(),
            "files over {LONG_FILE} lines without a reason at their top: {silent:?}"
        );
        // The control: a reason below the module doc is not at the top.
        assert!(says_why_long(
            "//! A module.\n//!\n//! Over 600 lines: why.\n\nuse x;\n"
        ));
        assert!(!says_why_long(
            "//! A module.\n\nuse x;\n// Over 600 lines: too late.\n"
        ));
    }
}
