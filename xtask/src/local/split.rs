//! The CPU suite in two processes. Its wgpu tests spend their time compiling kernels on
//! lavapipe, and a process has one wgpu device whose server thread compiles every kernel of every
//! test in turn: with libtest's two threads on two cores the suite kept one core busy (a CPU
//! time of 106% of the wall time). `cargo xtask test` therefore builds first, then runs half of
//! the suite's wgpu tests in a second process of the suite's binary while `cargo test` runs
//! everything else, the first half included; each process compiles the kernels its tests meet.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The source of the suite whose wgpu tests are split.
pub(super) const SUITE: &str = "tests/cpu.rs";

/// What the second process runs: the suite's binary and the tests it takes (exact names), which
/// `cargo test` skips.
#[derive(Debug, PartialEq)]
pub(super) struct Split {
    pub(super) binary: PathBuf,
    pub(super) tests: Vec<String>,
}

/// Builds every test binary (`cargo test --workspace --locked --no-run`, its progress passed
/// through) and plans the split: `None` where the build fails (the single `cargo test` then
/// reports it) or the suite has fewer than two wgpu tests.
pub(super) fn plan(mut cargo: Command, root: &Path) -> Option<Split> {
    let built = cargo
        .args([
            "test",
            "--workspace",
            "--locked",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .ok()?;
    if !built.status.success() {
        return None;
    }
    let binary = suite_binary(&String::from_utf8_lossy(&built.stdout), root)?;
    let listed = Command::new(&binary)
        .args(["--list", "--format", "terse"])
        .current_dir(root)
        .output()
        .ok()?;
    if !listed.status.success() {
        return None;
    }
    let names: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|line| line.strip_suffix(": test"))
        .map(str::to_string)
        .collect();
    let tests = second_half(&names);
    (!tests.is_empty()).then_some(Split { binary, tests })
}

/// The executable of [`SUITE`] in cargo's JSON messages (one object a line: the artifact whose
/// target's `src_path` is the suite's source has its `executable`).
fn suite_binary(messages: &str, root: &Path) -> Option<PathBuf> {
    let source = format!(
        "\"src_path\":{}",
        json_string(&root.join(SUITE).to_string_lossy())
    );
    messages
        .lines()
        .filter(|line| line.contains("\"reason\":\"compiler-artifact\"") && line.contains(&source))
        .find_map(|line| {
            let rest = &line[line.find("\"executable\":\"")? + "\"executable\":\"".len()..];
            let path = unescape(&rest[..closing_quote(rest)?]);
            Some(PathBuf::from(path))
        })
}

/// The second process's share of the wgpu tests: the tests of every second family, a family
/// being a wgpu test's name up to its last `_` (`wgpu_suite::linear_matches_exact_f32` and
/// `_f16` are one family), so that tests meeting the same kernels stay in one process. At least
/// two families, or nothing.
fn second_half(names: &[String]) -> Vec<String> {
    let wgpu: Vec<&String> = names
        .iter()
        .filter(|name| name.starts_with("wgpu"))
        .collect();
    let family = |name: &str| {
        name.rsplit_once('_')
            .map_or(name, |(stem, _)| stem)
            .to_string()
    };
    let mut families: Vec<String> = Vec::new();
    for name in &wgpu {
        let name = family(name);
        if !families.contains(&name) {
            families.push(name);
        }
    }
    if families.len() < 2 {
        return Vec::new();
    }
    let second: Vec<&String> = families.iter().skip(1).step_by(2).collect();
    wgpu.into_iter()
        .filter(|name| second.contains(&&family(name)))
        .cloned()
        .collect()
}

/// `text` as a JSON string literal (quotes and backslashes escaped), as cargo writes paths.
fn json_string(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The index of the first unescaped `"` in `text`.
fn closing_quote(text: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        match c {
            '\\' if !escaped => escaped = true,
            '"' if !escaped => return Some(i),
            _ => escaped = false,
        }
    }
    None
}

/// A JSON string's content with `\\` and `\"` unescaped (all a path needs).
fn unescape(text: &str) -> String {
    text.replace("\\\"", "\"").replace("\\\\", "\\")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suite_binary_is_found_in_cargos_messages() {
        let root = Path::new("/w/main");
        let messages = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"x","src_path":"/w/main/src/lib.rs"},"executable":null}
{"reason":"compiler-artifact","target":{"kind":["test"],"name":"memory","src_path":"/w/main/tests/memory.rs"},"executable":"/t/debug/deps/memory-1"}
{"reason":"compiler-artifact","target":{"kind":["test"],"name":"cpu","src_path":"/w/main/tests/cpu.rs"},"executable":"/t/debug/deps/cpu-2"}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            suite_binary(messages, root),
            Some(PathBuf::from("/t/debug/deps/cpu-2"))
        );
        assert_eq!(suite_binary("", root), None);
    }

    #[test]
    fn every_second_family_of_wgpu_tests_goes_to_the_second_process() {
        let names: Vec<String> = [
            "flex_suite::linear_matches_exact_f32",
            "input_on_another_device_is_refused",
            "wgpu_suite::attention_matches_exact_f16",
            "wgpu_suite::attention_matches_exact_f32",
            "wgpu_suite::backward_twice_matches_eager",
            "wgpu_suite::linear_matches_exact_f16",
            "wgpu_suite::linear_matches_exact_f32",
            "wgpu_records_graphs",
        ]
        .map(String::from)
        .to_vec();
        // Families in order: attention_matches_exact, backward_twice_matches,
        // linear_matches_exact, wgpu_records; the second and the fourth go.
        assert_eq!(
            second_half(&names),
            [
                "wgpu_suite::backward_twice_matches_eager",
                "wgpu_records_graphs"
            ]
        );
        assert!(second_half(&names[..3]).is_empty(), "one family only");
    }

    #[test]
    fn json_strings_round_trip() {
        let path = r#"C:\a "b"\c"#;
        let literal = json_string(path);
        let inner = &literal[1..];
        assert_eq!(unescape(&inner[..closing_quote(inner).unwrap()]), path);
    }
}
