//! The two commands of a fresh machine: `cargo xtask test` and `cargo xtask demo`. Each first
//! makes sure the machine has what it needs (Mesa's software Vulkan for burn's wgpu backend,
//! which records real graphs without a GPU), installing it where it can and saying in one line
//! what to run where it cannot.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Debian packages the CPU suite needs: lavapipe (Mesa's software Vulkan) and the Vulkan
/// loader for the wgpu backend; xz and python3 for xtask's own tests of the GPU bundle.
const TEST_PACKAGES: &[&str] = &["mesa-vulkan-drivers", "libvulkan1", "xz-utils", "python3"];
/// Debian packages the demo needs without an NVIDIA GPU.
const DEMO_PACKAGES: &[&str] = &["mesa-vulkan-drivers", "libvulkan1"];

mod split;

/// `cargo xtask suite-costs`: measures what each test of the CPU suite costs, for the split of
/// `cargo xtask test` (`split.rs`), and writes it to [`split::COSTS`].
pub fn suite_costs(root: &Path) -> Result<(), String> {
    ensure_packages(TEST_PACKAGES)?;
    split::measure(cargo, root)
}

/// The variable burn-graphed reads at process start for where cubecl's kernel cache lives.
const KERNEL_CACHE_VAR: &str = "BURN_GRAPHED_KERNEL_CACHE";

/// The suite's cubecl cache in the repository's `target/environment` (cubecl's own default
/// place, where `write_suite_picks` reads the suite's picks), not the user's cache directory
/// that burn-graphed defaults to: a run of the suite leaves nothing outside the repository.
/// A value the caller set is kept.
fn keep_kernel_cache_in_target(command: &mut Command, root: &Path) {
    if std::env::var_os(KERNEL_CACHE_VAR).is_none() {
        command.env(KERNEL_CACHE_VAR, root.join("target").join("environment"));
    }
}

/// `cargo xtask test [ARGS...]`: installs what the suite needs, then runs the README's test
/// command, `cargo test --workspace --locked [ARGS...]`, passing its output through, and ends
/// with the skipped tests and a last line `N passed, N failed, N skipped` ([`Tally`]). Without
/// arguments it builds first and runs half of the CPU suite's wgpu tests in a second process of
/// the suite's binary meanwhile (`split.rs`: one wgpu device compiles one kernel at a time);
/// their lines carry the prefix `[wgpu 2/2] `.
pub fn test(args: &[String], root: &Path) -> Result<(), String> {
    ensure_packages(TEST_PACKAGES)?;
    let split = if args.is_empty() {
        split::plan(cargo(), root)
    } else {
        None
    };
    let mut command = cargo();
    command.args(["test", "--workspace", "--locked"]).args(args);
    if let Some(split) = &split {
        command.args(["--", "--exact"]);
        for name in &split.tests {
            command.args(["--skip", name]);
        }
    }
    command.current_dir(root).stdout(Stdio::piped());
    keep_kernel_cache_in_target(&mut command, root);
    let mut children = vec![(
        "",
        command
            .spawn()
            .map_err(|e| format!("running the test suite: {e}"))?,
    )];
    if let Some(split) = &split {
        println!(
            "xtask: {} wgpu tests of {} in a second process ({})",
            split.tests.len(),
            split::SUITE,
            split.binary.display()
        );
        let mut second = Command::new(&split.binary);
        split::with_runtime_dir(&mut second);
        keep_kernel_cache_in_target(&mut second, root);
        second
            .arg("--exact")
            .args(&split.tests)
            .current_dir(root)
            .stdout(Stdio::piped());
        let child = second
            .spawn()
            .map_err(|e| format!("running {}: {e}", split.binary.display()))?;
        children.push(("[wgpu 2/2] ", child));
    }
    let state = Arc::new(Mutex::new((
        Tally::default(),
        children.iter().map(|_| Progress::new()).collect::<Vec<_>>(),
        false,
    )));
    // A line of progress whenever a process has printed nothing for a minute: a test binary
    // of long tests (the CPU suite on software Vulkan) otherwise reads as a hang.
    let labels: Vec<&'static str> = children.iter().map(|(label, _)| *label).collect();
    let heartbeat = {
        let state = Arc::clone(&state);
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(5));
                let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
                if state.2 {
                    return;
                }
                let now = Instant::now();
                for (progress, label) in state.1.iter_mut().zip(&labels) {
                    if let Some(line) = progress.beat(now) {
                        println!("{label}{line}");
                    }
                }
            }
        })
    };
    let mut readers = Vec::new();
    let mut waiting = Vec::new();
    for (index, (label, mut child)) in children.into_iter().enumerate() {
        let stdout = child.stdout.take();
        let state = Arc::clone(&state);
        readers.push(std::thread::spawn(move || -> Result<(), String> {
            let Some(stdout) = stdout else { return Ok(()) };
            let mut reader = BufReader::new(stdout);
            let mut bytes = Vec::new();
            while reader
                .read_until(b'\n', &mut bytes)
                .map_err(|e| e.to_string())?
                > 0
            {
                let line = String::from_utf8_lossy(&bytes);
                let line = line.trim_end_matches(['\n', '\r']);
                let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
                println!("{label}{line}");
                state.0.read(line);
                state.1[index].read(line, Instant::now());
                bytes.clear();
            }
            Ok(())
        }));
        waiting.push(child);
    }
    let mut failures = Vec::new();
    for mut child in waiting {
        let status = child
            .wait()
            .map_err(|e| format!("running the test suite: {e}"))?;
        if !status.success() {
            failures.push(status);
        }
    }
    for reader in readers {
        reader
            .join()
            .map_err(|_| "reading the test output panicked".to_string())??;
    }
    let mut tally = {
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        state.2 = true;
        std::mem::take(&mut state.0)
    };
    let _ = heartbeat.join();
    if let Some(status) = failures.first()
        && tally.failed == 0
    {
        // A build error, or a test binary that died before libtest could report.
        println!("xtask: cargo test failed before a test reported a failure ({status})");
        tally.failed = 1;
    }
    let tally = tally.finish();
    print!("{}", tally.report());
    if failures.is_empty() && tally.failed == 0 {
        Ok(())
    } else {
        Err(format!(
            "the test suite failed ({})",
            failures
                .first()
                .map_or_else(|| "a test failed".to_string(), ToString::to_string)
        ))
    }
}

/// How far the suite is, from libtest's lines (`running N tests`, then one `test NAME ...`
/// result per test), for [`beat`](Self::beat): a line of progress after a minute without
/// output, then one a minute while the silence lasts.
#[derive(Debug)]
struct Progress {
    started: Instant,
    /// When the suite last printed a line, and when the last progress line was printed.
    last_line: Instant,
    last_beat: Instant,
    /// Test binaries started, and the current one's tests: how many, how many finished.
    binaries: usize,
    total: usize,
    done: usize,
}

/// How long the suite may stay silent before a progress line, and between two of them.
const QUIET: Duration = Duration::from_secs(60);

impl Progress {
    fn new() -> Self {
        let now = Instant::now();
        Self {
            started: now,
            last_line: now,
            last_beat: now,
            binaries: 0,
            total: 0,
            done: 0,
        }
    }

    fn read(&mut self, line: &str, now: Instant) {
        self.last_line = now;
        if let Some(count) = line
            .strip_prefix("running ")
            .and_then(|rest| rest.strip_suffix(" tests").or(rest.strip_suffix(" test")))
            .and_then(|count| count.parse().ok())
        {
            self.binaries += 1;
            self.total = count;
            self.done = 0;
        } else if (line.starts_with("test ")
            && (line.ends_with(" ... ok")
                || line.ends_with(" ... FAILED")
                || line.contains(" ... ignored")))
            || line == "ok"
            || line == "FAILED"
        {
            self.done = (self.done + 1).min(self.total);
        }
    }

    /// The progress line due at `now`, if the suite has been quiet for [`QUIET`] since its
    /// last line and since the last progress line.
    fn beat(&mut self, now: Instant) -> Option<String> {
        let quiet = now.duration_since(self.last_line);
        // Before the first test binary cargo is building, and says so on its own.
        if self.binaries == 0 || quiet < QUIET || now.duration_since(self.last_beat) < QUIET {
            return None;
        }
        self.last_beat = now;
        let minutes = |d: Duration| format!("{}m{:02}s", d.as_secs() / 60, d.as_secs() % 60);
        Some(format!(
            "xtask: still running (test binary {}: {} of {} tests finished; {} since the last \
             line, {} in all)",
            self.binaries,
            self.done,
            self.total,
            minutes(quiet),
            minutes(now.duration_since(self.started))
        ))
    }
}

/// What `cargo test` reported, read line by line: libtest's summaries
/// (`test result: ok. 5 passed; 0 failed; 2 ignored; ...`), its lines of failed and ignored
/// tests, and the `skipped: TEST: REASON` lines of tests that could not run their checks on
/// this machine (`tests/scenarios/skip.rs`), which libtest counts as passed. A skip is never
/// a pass: such tests move from passed to skipped (unless they failed), beside the ignored.
#[derive(Debug, Default, PartialEq)]
struct Tally {
    passed: usize,
    failed: usize,
    /// Ignored tests, and after [`finish`](Self::finish) the skipped ones too.
    skipped: usize,
    /// `(test, reason)` of each ignored or skipped test, in the order reported.
    reasons: Vec<(String, String)>,
    /// Tests that printed a skip line, with the reason.
    skip_lines: Vec<(String, String)>,
    failed_tests: Vec<String>,
}

impl Tally {
    fn read(&mut self, line: &str) {
        if let Some(summary) = line.strip_prefix("test result: ") {
            let words: Vec<&str> = summary.split_whitespace().collect();
            for pair in words.windows(2) {
                let Ok(count) = pair[0].parse::<usize>() else {
                    continue;
                };
                match pair[1].trim_end_matches([';', ',']) {
                    "passed" => self.passed += count,
                    "failed" => self.failed += count,
                    "ignored" => self.skipped += count,
                    _ => {}
                }
            }
            return;
        }
        let mut line = line;
        if let Some(at) = line.find("skipped: ") {
            let rest = &line[at + "skipped: ".len()..];
            // A test's path: letters, digits, `_` and `::`, up to the first ": ".
            if let Some((name, reason)) = rest.split_once(": ")
                && !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
            {
                if !self.skip_lines.iter().any(|(test, _)| test == name) {
                    self.skip_lines.push((name.to_string(), reason.to_string()));
                }
                // What came before it on the line: libtest's "test NAME ... " when the test
                // runs without capture.
                line = &line[..at];
            }
        }
        if let Some((name, result)) = line
            .strip_prefix("test ")
            .and_then(|rest| rest.split_once(" ... "))
        {
            if result == "FAILED" {
                self.failed_tests.push(name.to_string());
            } else if let Some(reason) = result.strip_prefix("ignored") {
                let reason = reason.trim_start_matches(", ");
                let reason = if reason.is_empty() {
                    "ignored".to_string()
                } else {
                    format!("ignored: {reason}")
                };
                self.reasons.push((name.to_string(), reason));
            }
        }
    }

    /// Moves the tests that printed a skip line and did not fail from passed to skipped.
    fn finish(mut self) -> Self {
        for (name, reason) in std::mem::take(&mut self.skip_lines) {
            if self.failed_tests.contains(&name) {
                continue;
            }
            self.passed = self.passed.saturating_sub(1);
            self.skipped += 1;
            self.reasons.push((name, format!("skipped: {reason}")));
        }
        self
    }

    /// The skipped tests with their reasons, then the last line: `N passed, N failed, N skipped`.
    fn report(&self) -> String {
        let mut report = String::new();
        if !self.reasons.is_empty() {
            report.push_str("skipped tests (ignored, or unable to run their checks here):\n");
            for (name, reason) in &self.reasons {
                report.push_str(&format!("  {name}: {reason}\n"));
            }
        }
        report.push_str(&format!(
            "{} passed, {} failed, {} skipped\n",
            self.passed, self.failed, self.skipped
        ));
        report
    }
}

/// `cargo xtask demo [ARGS...]`: the demo on CUDA where an NVIDIA GPU answers (a release
/// build: its timings are the point), otherwise on wgpu's software graphs (a debug build, the
/// one the tests share: on a CPU Vulkan the timings are not a GPU's anyway), after installing
/// Mesa's software Vulkan where it is missing. `ARGS` go to the demo.
pub fn demo(args: &[String], root: &Path) -> Result<(), String> {
    if nvidia_gpu() {
        println!("xtask: an NVIDIA GPU answers: the demo runs on CUDA");
        let mut command = cargo();
        command.args([
            "run",
            "--locked",
            "--example",
            DEMO,
            "--release",
            "--features",
            "cuda",
        ]);
        command.arg("--").args(args).current_dir(root);
        return run(command, "the demo");
    }
    println!("xtask: no NVIDIA GPU answers (nvidia-smi): the demo runs on wgpu's software graphs");
    ensure_packages(DEMO_PACKAGES)?;
    let binary = build_demo_as_tests(root)?;
    let mut command = Command::new(binary);
    split::with_runtime_dir(&mut command);
    command
        .env(
            "BURN_GRAPHED_DEMO_WHY",
            "no NVIDIA GPU answers (nvidia-smi)",
        )
        .args(args)
        .current_dir(root);
    run(command, "the demo")
}

/// The demo's example, `examples/train_mlp.rs`.
const DEMO: &str = "train_mlp";

/// Builds the demo as the test command builds (the dev profile, `--workspace`) and returns its
/// executable. `--workspace` resolves the features `cargo test --workspace` resolves, so the
/// demo reuses every crate the tests built; `cargo run --example` alone resolves the root
/// package's features and rebuilds burn's and cubecl's crates (42 of them, 11.7 minutes on two
/// cores after the test command).
fn build_demo_as_tests(root: &Path) -> Result<PathBuf, String> {
    let built = cargo()
        .args(["build", "--workspace", "--locked", "--example", DEMO])
        .arg("--message-format=json-render-diagnostics")
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running cargo build: {e}"))?;
    if !built.status.success() {
        return Err(format!("building the demo failed ({})", built.status));
    }
    let source = root.join("examples").join(format!("{DEMO}.rs"));
    split::executable_of(&String::from_utf8_lossy(&built.stdout), &source).ok_or_else(|| {
        format!(
            "cargo reported no executable built from {}",
            source.display()
        )
    })
}

fn cargo() -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    split::with_runtime_dir(&mut command);
    command
}

fn run(mut command: Command, what: &str) -> Result<(), String> {
    let status = command
        .status()
        .map_err(|e| format!("running {what}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

/// Whether `nvidia-smi -L` lists a GPU.
fn nvidia_gpu() -> bool {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|out| {
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("GPU")
        })
}

/// Installs the Debian packages of `packages` that are missing (as root, or through
/// passwordless sudo); where that cannot be done, fails with the one command to run.
pub fn ensure_packages(packages: &[&str]) -> Result<(), String> {
    if Command::new("dpkg-query")
        .arg("--version")
        .output()
        .is_err()
    {
        // Not Debian: say what is needed, and go on (the suite says what it lacks).
        println!(
            "xtask: not a Debian system; the CPU suite needs Mesa's software Vulkan (lavapipe) \
             and the Vulkan loader from your distribution"
        );
        return Ok(());
    }
    let missing = missing_packages(packages);
    if missing.is_empty() {
        return Ok(());
    }
    let list = missing.join(" ");
    let sudo = if is_root() {
        None
    } else if Command::new("sudo")
        .args(["-n", "true"])
        .status()
        .is_ok_and(|s| s.success())
    {
        Some("sudo")
    } else {
        return Err(format!(
            "missing Debian packages: {list}. Run: sudo apt-get install -y {list}"
        ));
    };
    println!("xtask: installing {list}");
    let apt = |args: &[&str]| {
        let mut command = match sudo {
            Some(sudo) => {
                let mut command = Command::new(sudo);
                command.arg("apt-get");
                command
            }
            None => Command::new("apt-get"),
        };
        command
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    let mut install = vec!["install", "-y", "-qq", "--no-install-recommends"];
    install.extend(missing.iter().map(String::as_str));
    if apt(&["update", "-qq"]) && apt(&install) && missing_packages(packages).is_empty() {
        Ok(())
    } else {
        Err(format!(
            "installing {list} failed. Run: sudo apt-get update && sudo apt-get install -y {list}"
        ))
    }
}

fn missing_packages(packages: &[&str]) -> Vec<String> {
    packages
        .iter()
        .filter(|package| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", package])
                .output()
                .is_ok_and(|out| {
                    String::from_utf8_lossy(&out.stdout).contains("install ok installed")
                })
        })
        .map(|package| package.to_string())
        .collect()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

#[cfg(test)]
mod tests {
    use super::{Progress, QUIET, Tally};
    use std::time::Duration;

    /// Silence for a minute in a test binary gives one progress line naming the binary and its
    /// finished tests, then none until another minute passes; a line of output resets the
    /// silence; none while cargo builds.
    #[test]
    fn progress_speaks_after_a_quiet_minute() {
        let mut progress = Progress::new();
        let t0 = progress.started;
        // Cargo building: it speaks for itself.
        assert_eq!(progress.beat(t0 + 2 * QUIET), None);
        for line in [
            "running 3 tests",
            "test a ... ok",
            "test b ... ignored, why",
            "test c ... skipped: c: why",
        ] {
            progress.read(line, t0 + QUIET + Duration::from_secs(1));
        }
        let t1 = t0 + QUIET + Duration::from_secs(1);
        assert_eq!(progress.beat(t1 + QUIET / 2), None);
        let line = progress
            .beat(t1 + QUIET)
            .expect("a minute after the last line");
        assert_eq!(
            line,
            "xtask: still running (test binary 1: 2 of 3 tests finished; 1m00s since the last \
             line, 2m01s in all)"
        );
        assert_eq!(progress.beat(t1 + QUIET + QUIET / 2), None);
        progress.read("ok", t1 + 2 * QUIET);
        assert_eq!(progress.done, 3);
        progress.read("running 1 test", t1 + 2 * QUIET);
        assert_eq!(
            (progress.binaries, progress.total, progress.done),
            (2, 1, 0)
        );
    }

    fn tally(output: &str) -> Tally {
        let mut tally = Tally::default();
        for line in output.lines() {
            tally.read(line);
        }
        tally.finish()
    }

    /// A test that printed `skipped: TEST: REASON` counts as skipped, not passed, whether its
    /// line stands alone (captured output) or follows libtest's `test NAME ... ` (without
    /// capture); ignored tests count as skipped with their reasons; summaries of several
    /// binaries add up; a failed test that printed a skip line stays failed.
    #[test]
    fn skip_lines_and_ignored_tests_count_as_skipped() {
        let tally = tally(
            "running 4 tests\n\
             skipped: gpu_two: needs 2 GPUs, this machine has 1\n\
             test gpu_two ... ok\n\
             test flex_suite::faults ... ignored, Flex cannot capture: faults\n\
             test plain ... ignored\n\
             test other ... ok\n\
             test result: ok. 2 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out\n\
             test f16 ... skipped: f16: the adapter has no f16 (Err: x)\n\
             ok\n\
             skipped: broke: why\n\
             test broke ... FAILED\n\
             test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured\n",
        );
        assert_eq!((tally.passed, tally.failed, tally.skipped), (1, 1, 4));
        assert_eq!(
            tally.report(),
            "skipped tests (ignored, or unable to run their checks here):\n\
             \x20 flex_suite::faults: ignored: Flex cannot capture: faults\n\
             \x20 plain: ignored\n\
             \x20 gpu_two: skipped: needs 2 GPUs, this machine has 1\n\
             \x20 f16: skipped: the adapter has no f16 (Err: x)\n\
             1 passed, 1 failed, 4 skipped\n"
        );
    }

    /// Lines that only mention skipping are not skip lines.
    #[test]
    fn other_lines_are_not_skips() {
        let tally = tally(
            "reproduced: one rank's collective skipped, the other still waiting\n\
             # skipped: bench mode needs 2 GPUs\n\
             test result: ok. 3 passed; 0 failed; 0 ignored\n",
        );
        assert_eq!((tally.passed, tally.failed, tally.skipped), (3, 0, 0));
    }
}
