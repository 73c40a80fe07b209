//! The CPU suite in two processes. Its wgpu tests spend their time compiling kernels on
//! lavapipe, and a process has one wgpu device whose server thread compiles every kernel of every
//! test in turn: with libtest's two threads on two cores the suite kept one core busy (a CPU
//! time of 106% of the wall time). `cargo xtask test` therefore builds first, then runs a share
//! of the suite's wgpu tests in a second process of the suite's binary while `cargo test` runs
//! everything else; each process compiles the kernels its tests meet. The share is chosen by
//! the tests' measured costs ([`COSTS`], written by `cargo xtask suite-costs`), so that both
//! processes end at about the same time.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The source of the suite whose wgpu tests are split.
pub(super) const SUITE: &str = "tests/cpu.rs";

/// The measured costs the split reads: a line per test of [`SUITE`], `SECONDS NAME`, and one
/// for everything else `cargo test` runs ([`REST`]); `#` starts a comment.
pub(super) const COSTS: &str = "xtask/suite-costs.txt";

/// The name of the line of [`COSTS`] that holds the wall time of everything `cargo test` runs
/// besides the suite's tests: the other test binaries and the doctests.
const REST: &str = "(the other test binaries and the doctests)";

/// What the second process runs: the suite's binary and the tests it takes (exact names), which
/// `cargo test` skips.
#[derive(Debug, PartialEq)]
pub(super) struct Split {
    pub(super) binary: PathBuf,
    pub(super) tests: Vec<String>,
}

/// Builds every test binary (`cargo test --workspace --locked --no-run`, its progress passed
/// through) and plans the split: `None` where the build fails (the single `cargo test` then
/// reports it) or the suite has fewer than two families of wgpu tests.
pub(super) fn plan(cargo: Command, root: &Path) -> Option<Split> {
    let binary = build(cargo, root)?;
    let names = list(&binary, root)?;
    let costs = std::fs::read_to_string(root.join(COSTS))
        .map(|text| Costs::parse(&text))
        .unwrap_or_default();
    let tests = second_share(&names, &costs);
    (!tests.is_empty()).then_some(Split { binary, tests })
}

/// `cargo xtask suite-costs`: builds, runs the suite's binary alone with libtest's report of
/// each test's time (its lines passed through), then everything else `cargo test` runs with
/// the suite's tests skipped, timed as a whole, and writes [`COSTS`]. `cargo` makes a fresh
/// `cargo` command.
///
/// # Errors
///
/// The build, a test or the file's writing failed (nothing is written then).
pub(super) fn measure(cargo: impl Fn() -> Command, root: &Path) -> Result<(), String> {
    let binary = build(cargo(), root).ok_or("the test build failed")?;
    let names = list(&binary, root).ok_or("the suite's binary did not list its tests")?;
    let mut suite = Command::new(&binary);
    with_runtime_dir(&mut suite);
    // libtest's `--report-time` is unstable: the binary accepts it when told it may.
    let mut child = suite
        .env("RUSTC_BOOTSTRAP", "1")
        .args(["-Zunstable-options", "--report-time"])
        .current_dir(root)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running {}: {e}", binary.display()))?;
    let mut costs = Costs::default();
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines() {
            let line = line.map_err(|e| e.to_string())?;
            println!("{line}");
            if let Some((name, seconds)) = reported_time(&line) {
                costs.tests.insert(name, seconds);
            }
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("the suite failed ({status}): no costs written"));
    }
    let start = Instant::now();
    let mut rest = cargo();
    rest.args(["test", "--workspace", "--locked", "--", "--exact"]);
    for name in &names {
        rest.args(["--skip", name]);
    }
    let status = rest
        .current_dir(root)
        .status()
        .map_err(|e| format!("running cargo test: {e}"))?;
    if !status.success() {
        return Err(format!("cargo test failed ({status}): no costs written"));
    }
    costs.rest = start.elapsed().as_secs_f64();
    let path = root.join(COSTS);
    std::fs::write(&path, costs.render()).map_err(|e| format!("{}: {e}", path.display()))?;
    println!(
        "xtask: {} tests' costs and the rest's ({:.0} s) written to {COSTS}",
        costs.tests.len(),
        costs.rest
    );
    Ok(())
}

/// Sets `XDG_RUNTIME_DIR` for a process that runs tests where it is unset (lavapipe warns on
/// every device creation without a runtime directory).
pub(super) fn with_runtime_dir(command: &mut Command) {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        command.env("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
}

/// Builds every test binary and returns the suite's executable.
fn build(mut cargo: Command, root: &Path) -> Option<PathBuf> {
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
    executable_of(&String::from_utf8_lossy(&built.stdout), &root.join(SUITE))
}

/// The names of the suite's tests (`--list`).
fn list(binary: &Path, root: &Path) -> Option<Vec<String>> {
    let listed = Command::new(binary)
        .args(["--list", "--format", "terse"])
        .current_dir(root)
        .output()
        .ok()?;
    listed.status.success().then(|| {
        String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter_map(|line| line.strip_suffix(": test"))
            .map(str::to_string)
            .collect()
    })
}

/// `(name, seconds)` of a libtest line with `--report-time`: `test NAME ... ok <1.234s>`, or 0
/// for an ignored test (`test NAME ... ignored[, REASON]`), which neither process runs.
fn reported_time(line: &str) -> Option<(String, f64)> {
    let rest = line.strip_prefix("test ")?;
    let (name, outcome) = rest.split_once(" ... ")?;
    let seconds = if outcome.starts_with("ignored") {
        0.0
    } else {
        outcome
            .strip_prefix("ok <")?
            .strip_suffix("s>")?
            .parse()
            .ok()?
    };
    Some((name.to_string(), seconds))
}

/// The seconds each test of the suite took, and everything else (see [`COSTS`]).
#[derive(Debug, Default, PartialEq)]
struct Costs {
    tests: HashMap<String, f64>,
    rest: f64,
}

impl Costs {
    fn parse(text: &str) -> Self {
        let mut costs = Self::default();
        for line in text.lines().map(str::trim) {
            if line.starts_with('#') {
                continue;
            }
            let Some((seconds, name)) = line.split_once(' ') else {
                continue;
            };
            let Ok(seconds) = seconds.parse::<f64>() else {
                continue;
            };
            if name == REST {
                costs.rest = seconds;
            } else {
                costs.tests.insert(name.to_string(), seconds);
            }
        }
        costs
    }

    /// The file: a header, the rest, then the tests from the costliest.
    fn render(&self) -> String {
        let mut tests: Vec<(&String, &f64)> = self.tests.iter().collect();
        tests.sort_by(|a, b| b.1.total_cmp(a.1).then(a.0.cmp(b.0)));
        let mut text = format!(
            "# Seconds each test of {SUITE} took (its binary alone, libtest's threads), and the\n\
             # wall time of everything else `cargo test` runs: written by `cargo xtask suite-costs`.\n\
             # `cargo xtask test` splits the suite's wgpu tests between two processes by them;\n\
             # a test missing here counts as the median. Regenerate after adding slow tests.\n\
             {:.1} {REST}\n",
            self.rest
        );
        for (name, seconds) in tests {
            text.push_str(&format!("{seconds:.1} {name}\n"));
        }
        text
    }
}

/// The executable of the target built from `source` in cargo's JSON messages (one object a line:
/// the artifact whose target's `src_path` is `source` has its `executable`).
pub(super) fn executable_of(messages: &str, source: &Path) -> Option<PathBuf> {
    let source = format!("\"src_path\":{}", json_string(&source.to_string_lossy()));
    messages
        .lines()
        .filter(|line| line.contains("\"reason\":\"compiler-artifact\"") && line.contains(&source))
        .find_map(|line| {
            let rest = &line[line.find("\"executable\":\"")? + "\"executable\":\"".len()..];
            let path = unescape(&rest[..closing_quote(rest)?]);
            Some(PathBuf::from(path))
        })
}

/// What a second of the rest's measured wall time costs the first process, in the tests' cost
/// units. Calibrated on a fresh run (`c09861e`, two cores, the rest counted twice then): the
/// second process, wgpu tests alone, took 0.69 s of wall time per cost second (913 s for 1331);
/// the first ended at about 640 s, of which its tests' 797 cost seconds account for 547, so its
/// 267 s of rest took about 93 s (136 cost seconds): about half its measured wall time, the
/// rest's binaries and doctests running beside the suite's tests.
const REST_WEIGHT: f64 = 0.5;

/// The second process's share of the wgpu tests, by whole families (a family being a wgpu
/// test's name up to its last `_`: `wgpu_suite::linear_matches_exact_f32` and `_f16` are one),
/// so that tests meeting the same kernels stay in one process. The first process starts with
/// everything else: the suite's other tests, and the rest weighed by [`REST_WEIGHT`]. The
/// families, costliest first, each go to the process with less so far. A test `costs` lacks
/// counts as the median of those it has (1 s without any). At least two families, or nothing.
fn second_share(names: &[String], costs: &Costs) -> Vec<String> {
    let mut known: Vec<f64> = names
        .iter()
        .filter_map(|name| costs.tests.get(name).copied())
        .collect();
    known.sort_by(f64::total_cmp);
    let typical = known.get(known.len() / 2).copied().unwrap_or(1.0);
    let cost = |name: &str| costs.tests.get(name).copied().unwrap_or(typical);
    let family = |name: &str| {
        name.rsplit_once('_')
            .map_or(name, |(stem, _)| stem)
            .to_string()
    };
    let mut families: Vec<(String, f64)> = Vec::new();
    let mut first = REST_WEIGHT * costs.rest;
    for name in names {
        if !name.starts_with("wgpu") {
            first += cost(name);
            continue;
        }
        let stem = family(name);
        match families.iter_mut().find(|(f, _)| *f == stem) {
            Some((_, total)) => *total += cost(name),
            None => families.push((stem, cost(name))),
        }
    }
    if families.len() < 2 {
        return Vec::new();
    }
    // Stable: equal costs keep the suite's order.
    families.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut second = 0.0;
    let mut taken: Vec<String> = Vec::new();
    for (stem, total) in families {
        if second < first {
            second += total;
            taken.push(stem);
        } else {
            first += total;
        }
    }
    names
        .iter()
        .filter(|name| name.starts_with("wgpu") && taken.contains(&family(name)))
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
        let suite = Path::new("/w/main").join(SUITE);
        let messages = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"x","src_path":"/w/main/src/lib.rs"},"executable":null}
{"reason":"compiler-artifact","target":{"kind":["test"],"name":"memory","src_path":"/w/main/tests/memory.rs"},"executable":"/t/debug/deps/memory-1"}
{"reason":"compiler-artifact","target":{"kind":["test"],"name":"cpu","src_path":"/w/main/tests/cpu.rs"},"executable":"/t/debug/deps/cpu-2"}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            executable_of(messages, &suite),
            Some(PathBuf::from("/t/debug/deps/cpu-2"))
        );
        assert_eq!(executable_of("", &suite), None);
    }

    fn names() -> Vec<String> {
        [
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
        .to_vec()
    }

    #[test]
    fn the_families_are_shared_by_cost() {
        let costs = Costs::parse(
            "# a comment\n\
             10.0 (the other test binaries and the doctests)\n\
             30.0 flex_suite::linear_matches_exact_f32\n\
             200.0 wgpu_suite::attention_matches_exact_f16\n\
             150.0 wgpu_suite::attention_matches_exact_f32\n\
             40.0 wgpu_suite::backward_twice_matches_eager\n\
             90.0 wgpu_suite::linear_matches_exact_f16\n\
             110.0 wgpu_suite::linear_matches_exact_f32\n\
             5.0 wgpu_records_graphs\n\
             not a line\n",
        );
        assert_eq!(costs.rest, 10.0);
        assert_eq!(costs.tests.len(), 7);
        // The first process starts at 10 / 2 + 30 + the median (90) for the test the file
        // lacks = 125. Attention (350) goes second; linear (200) first (325); backward (40)
        // first (365) as the second has 350; records (5) second (355).
        assert_eq!(
            second_share(&names(), &costs),
            [
                "wgpu_suite::attention_matches_exact_f16",
                "wgpu_suite::attention_matches_exact_f32",
                "wgpu_records_graphs"
            ]
        );
        // The file the measurement writes reads back the same.
        assert_eq!(Costs::parse(&costs.render()), costs);
    }

    #[test]
    fn without_costs_the_families_alternate_by_count() {
        // Every test 1 s: the first process starts at 2 (its two tests). Attention (2) goes
        // second; linear (2) first, the second having as much (4); backward (1) and records
        // (1) second (3, then 4).
        let shared = second_share(&names(), &Costs::default());
        assert_eq!(
            shared,
            [
                "wgpu_suite::attention_matches_exact_f16",
                "wgpu_suite::attention_matches_exact_f32",
                "wgpu_suite::backward_twice_matches_eager",
                "wgpu_records_graphs"
            ]
        );
        assert!(
            second_share(&names()[..4], &Costs::default()).is_empty(),
            "one family only"
        );
    }

    #[test]
    fn libtests_reported_times_are_read() {
        assert_eq!(
            reported_time("test wgpu_suite::a_b ... ok <12.345s>"),
            Some(("wgpu_suite::a_b".to_string(), 12.345))
        );
        assert_eq!(reported_time("test wgpu_suite::a_b ... ok"), None);
        assert_eq!(
            reported_time("test flex_suite::c ... ignored, Flex cannot capture"),
            Some(("flex_suite::c".to_string(), 0.0))
        );
        assert_eq!(reported_time("test x ... FAILED <1.0s>"), None);
    }

    #[test]
    fn json_strings_round_trip() {
        let path = r#"C:\a "b"\c"#;
        let literal = json_string(path);
        let inner = &literal[1..];
        assert_eq!(unescape(&inner[..closing_quote(inner).unwrap()]), path);
    }
}
