//! Project automation: `cargo xtask <command>`.
//!
//! - `test [ARGS...]`: the test suite without a GPU, after installing what it needs
//!   (`local.rs`); what `.ci/run` runs.
//! - `demo [ARGS...]`: the demo, on CUDA where an NVIDIA GPU answers, otherwise on wgpu's
//!   software graphs.
//! - `suite-costs`: measure each CPU-suite test's time for `test`'s split into two processes
//!   (`xtask/suite-costs.txt`).
//! - `gpu-test [--run] [--long] [--filter F] [--jobs N]`: build the CUDA test suite (one
//!   release test binary), the demo and the train-step benchmark, and bundle them, compressed,
//!   with a runner script, the PyTorch reference script and a manifest into
//!   `target/gpu-bundle/`, a folder that runs on a GPU machine without a Rust toolchain.
//!   `--run` then runs the tests here (needs a local NVIDIA GPU), in N test processes at once
//!   with `--jobs N`.
//! - `bench [--run]`: the same bundle; `--run` runs the benchmark (Burn and PyTorch side by
//!   side) here.
//! - `bundle-dir`: print the bundle folder (for scripts).
//! - `launch --nproc N [...] -- PROGRAM [ARGS...]`: one process per rank of a data-parallel
//!   group, as `torchrun` starts them (`launch.rs`).
//!
//! Plain `std` only, so that `cargo xtask` costs seconds to build.

mod launch;
#[cfg(test)]
mod layers;
mod local;
#[cfg(test)]
mod vendor;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

const BUNDLE_DIR: &str = "target/gpu-bundle";
/// The features the bundle is built with (and its manifest names).
const GPU_FEATURES: &str = "cuda,host-profile,train";
/// What travels to a GPU machine must stay under this (the remote runner's limit).
const BUNDLE_LIMIT_BYTES: u64 = 64 * 1024 * 1024;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => local::test(&args[1..], &root()),
        Some("demo") => local::demo(&args[1..], &root()),
        Some("suite-costs") => local::suite_costs(&root()),
        Some("gpu-test") => gpu_test(&args[1..], "tests"),
        Some("bench") => gpu_test(&args[1..], "bench"),
        Some("launch") => launch::Launch::parse(&args[1..]).and_then(|l| launch::run(&l)),
        Some("bundle-dir") => {
            println!("{}", root().join(BUNDLE_DIR).display());
            Ok(())
        }
        _ => Err(format!(
            "usage: cargo xtask test [CARGO TEST ARGS...]\n       cargo xtask demo [WIDTH DEPTH BATCH STEPS]\n       cargo xtask suite-costs\n       cargo xtask gpu-test [--run] [--long] [--filter NAME] [--jobs N]\n       cargo xtask bench [--run]\n       cargo xtask bundle-dir\n       cargo xtask launch --nproc N [--nnodes M --node-rank K] [--master-addr A] [--master-port P] [--grace S] -- PROGRAM [ARGS...]\n(got {args:?})"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    // xtask lives one level below the workspace root. `cargo run` (the `xtask` alias) sets
    // CARGO_MANIFEST_DIR at run time; the compile-time value is a fallback only, since a
    // binary reused from a shared target directory may have been built in another checkout.
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    Path::new(&manifest_dir)
        .parent()
        .expect("xtask has a parent directory")
        .to_path_buf()
}

struct GpuTestOptions {
    run: bool,
    long: bool,
    filter: Option<String>,
    /// Test processes at once (`run.sh tests --jobs`), with `--run`.
    jobs: Option<u32>,
}

fn parse_gpu_test(args: &[String]) -> Result<GpuTestOptions, String> {
    let mut options = GpuTestOptions {
        run: false,
        long: false,
        filter: None,
        jobs: None,
    };
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--run" => options.run = true,
            "--long" => options.long = true,
            "--filter" => {
                options.filter = Some(
                    iter.next()
                        .ok_or("--filter needs a test name substring")?
                        .clone(),
                )
            }
            "--jobs" => {
                let value = iter
                    .next()
                    .ok_or("--jobs needs a number of test processes")?;
                match value.parse::<u32>() {
                    Ok(jobs) if jobs > 0 => options.jobs = Some(jobs),
                    _ => return Err(format!("--jobs takes a positive number, not `{value}`")),
                }
            }
            other => return Err(format!("gpu-test: unknown argument `{other}`")),
        }
    }
    Ok(options)
}

/// One artifact cargo built, as `--message-format=json` reports it.
struct Artifact {
    name: String,
    kind: &'static str,
    path: PathBuf,
}

/// Builds and bundles the GPU suite, the demo and the benchmark; with `--run`, runs the bundle
/// here in `mode` (`tests` or `bench`).
fn gpu_test(args: &[String], mode: &str) -> Result<(), String> {
    let options = parse_gpu_test(args)?;
    let root = root();
    let artifacts = cargo_build_gpu(&root)?;
    let bundle = root.join(BUNDLE_DIR);
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle).map_err(|e| format!("clearing {bundle:?}: {e}"))?;
    }
    std::fs::create_dir_all(&bundle).map_err(|e| format!("creating {bundle:?}: {e}"))?;

    let mut manifest = String::from("{\n  \"artifacts\": [\n");
    for (index, artifact) in artifacts.iter().enumerate() {
        let file = format!("{}-{}.xz", artifact.kind, artifact.name);
        let target = bundle.join(&file);
        compress(&artifact.path, &target)?;
        let size = std::fs::metadata(&target).map_err(|e| e.to_string())?.len();
        manifest.push_str(&format!(
            "    {{\"kind\": \"{}\", \"name\": \"{}\", \"file\": \"{}\", \"xz_bytes\": {}}}{}\n",
            artifact.kind,
            artifact.name,
            file,
            size,
            if index + 1 == artifacts.len() {
                ""
            } else {
                ","
            }
        ));
    }
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(&root)
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    // A bundle built from changes not yet committed says so: its logs and the GPU ledger name
    // this commit, and the commit alone would claim code it does not hold.
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .current_dir(&root)
        .output()
        .is_ok_and(|o| !o.stdout.is_empty());
    let commit = if dirty {
        format!("{commit}+dirty")
    } else {
        commit
    };
    manifest.push_str(&format!(
        "  ],\n  \"commit\": \"{commit}\",\n  \"profile\": \"release\",\n  \"features\": \"{GPU_FEATURES}\",\n  \"target\": \"x86_64-unknown-linux-gnu\"\n}}\n"
    ));
    write(&bundle.join("manifest.json"), &manifest)?;
    // Copied from the checkout, not the copy compiled into xtask: cargo decides whether to
    // rebuild xtask by file times, and a run.sh written with an old time (a copy that kept its
    // time) once left a stale runner in the bundle.
    std::fs::copy(root.join("xtask/src/run.sh"), bundle.join("run.sh"))
        .map_err(|e| format!("copying run.sh: {e}"))?;
    std::fs::copy(
        root.join("benches/torch_reference.py"),
        bundle.join("torch_reference.py"),
    )
    .map_err(|e| format!("copying the PyTorch reference script: {e}"))?;
    make_executable(&bundle.join("run.sh"))?;

    let total = dir_size(&bundle)?;
    println!(
        "xtask: bundle at {} ({:.1} MiB)",
        bundle.display(),
        total as f64 / (1024.0 * 1024.0)
    );
    if total > BUNDLE_LIMIT_BYTES {
        return Err(format!(
            "bundle is {total} bytes, over the {BUNDLE_LIMIT_BYTES}-byte limit of a remote run"
        ));
    }
    println!(
        "xtask: on a GPU machine without Rust, run `bash {BUNDLE_DIR}/run.sh` from the repository root"
    );

    if options.run {
        let mut command = Command::new("bash");
        command
            .arg(bundle.join("run.sh"))
            .arg(mode)
            .current_dir(&root);
        if options.long {
            command.env("BURN_GRAPHED_LONG", "1");
        }
        if let Some(filter) = &options.filter {
            command.env("BURN_GRAPHED_FILTER", filter);
        }
        if let Some(jobs) = options.jobs {
            command.env("BURN_GRAPHED_JOBS", jobs.to_string());
        }
        let status = command
            .status()
            .map_err(|e| format!("running run.sh: {e}"))?;
        if !status.success() {
            return Err(format!("GPU {mode} failed ({status})"));
        }
    }
    Ok(())
}

/// Builds the GPU test binary and the demo in release mode with the `cuda` feature.
fn cargo_build_gpu(root: &Path) -> Result<Vec<Artifact>, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args([
            "build",
            "--release",
            "--no-default-features",
            "--features",
            GPU_FEATURES,
            "--test",
            "gpu",
            "--example",
            "train_mlp",
            "--bench",
            "train_step",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running cargo: {e}"))?;
    if !output.status.success() {
        return Err("cargo build of the GPU suite failed".into());
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut artifacts = Vec::new();
    for line in stdout.lines() {
        if !line.contains("\"reason\":\"compiler-artifact\"") {
            continue;
        }
        let Some(executable) = json_string(line, "executable") else {
            continue;
        };
        let kind = if line.contains("\"kind\":[\"test\"]") {
            "test"
        } else if line.contains("\"kind\":[\"example\"]") {
            "example"
        } else if line.contains("\"kind\":[\"bench\"]") {
            "bench"
        } else {
            continue;
        };
        let name = json_string(line, "name").unwrap_or_else(|| "unnamed".into());
        artifacts.push(Artifact {
            name,
            kind,
            path: PathBuf::from(executable),
        });
    }
    if !artifacts.iter().any(|a| a.kind == "test") {
        return Err("cargo reported no GPU test executable".into());
    }
    Ok(artifacts)
}

/// The value of the first `"key":"value"` pair in a line of cargo's JSON (cargo never puts
/// escaped quotes into the fields read here).
fn json_string(line: &str, key: &str) -> Option<String> {
    let pattern = format!("\"{key}\":\"");
    let start = line.find(&pattern)? + pattern.len();
    let end = line[start..].find('"')? + start;
    Some(line[start..end].to_string())
}

fn compress(source: &Path, target: &Path) -> Result<(), String> {
    let input = std::fs::File::open(source).map_err(|e| format!("opening {source:?}: {e}"))?;
    let out = std::fs::File::create(target).map_err(|e| format!("creating {target:?}: {e}"))?;
    let status = Command::new("xz")
        .args(["-6", "-T0", "-c"])
        .stdin(input)
        .stdout(out)
        .status()
        .map_err(|e| format!("running xz (install it: apt-get install xz-utils): {e}"))?;
    if !status.success() {
        return Err(format!("xz failed on {source:?}"));
    }
    Ok(())
}

fn write(path: &Path, contents: &str) -> Result<(), String> {
    std::fs::write(path, contents).map_err(|e| format!("writing {path:?}: {e}"))
}

#[cfg(unix)]
fn make_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod {path:?}: {e}"))
}

#[cfg(not(unix))]
fn make_executable(_path: &Path) -> Result<(), String> {
    Ok(())
}

fn dir_size(dir: &Path) -> Result<u64, String> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).map_err(|e| e.to_string())? {
        let entry = entry.map_err(|e| e.to_string())?;
        total += entry.metadata().map_err(|e| e.to_string())?.len();
    }
    Ok(total)
}

/// The runner that travels with the bundle (its tests; the bundle copies the checkout's file).
/// Needs bash and xz (or python3) only.
#[cfg(test)]
const RUN_SH: &str = include_str!("run.sh");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fields_of_cargo_artifact_lines() {
        let line = r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"gpu"},"executable":"/t/release/deps/gpu-1"}"#;
        assert_eq!(json_string(line, "name").as_deref(), Some("gpu"));
        assert_eq!(
            json_string(line, "executable").as_deref(),
            Some("/t/release/deps/gpu-1")
        );
        assert_eq!(json_string(line, "missing"), None);
    }

    #[test]
    fn parses_gpu_test_flags() {
        let args = ["--run", "--filter", "mlp", "--jobs", "2"].map(String::from);
        let options = parse_gpu_test(&args).expect("valid flags");
        assert!(options.run && !options.long);
        assert_eq!(options.filter.as_deref(), Some("mlp"));
        assert_eq!(options.jobs, Some(2));
        for bad in ["0", "two"] {
            assert!(parse_gpu_test(&["--jobs".to_string(), bad.to_string()]).is_err());
        }
        assert!(parse_gpu_test(&["--jobs".to_string()]).is_err());
        assert!(parse_gpu_test(&["--bogus".to_string()]).is_err());
        assert!(parse_gpu_test(&["--filter".to_string()]).is_err());
    }

    /// A bundle folder with the real `run.sh` and a fake test binary: a shell script that
    /// lists `names` (in the order given), prints its arguments and a libtest summary of 2
    /// passed tests, or, when one argument is `broken`, exits 3 without a summary, as a crashed
    /// binary would. Removed on drop. Needs bash and xz.
    struct FakeBundle {
        dir: PathBuf,
    }

    impl FakeBundle {
        fn new(tag: &str, names: &[&str]) -> Self {
            let dir =
                std::env::temp_dir().join(format!("xtask-run-sh-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            let list: String = names
                .iter()
                .map(|name| format!("{name}: test\\n"))
                .collect();
            let fake = dir.join("test-gpu");
            write(
                &fake,
                &format!(
                    "#!/bin/sh\n\
                     if [ \"$1\" = --list ]; then printf '{list}'; exit 0; fi\n\
                     echo \"ARGS: $*\"\n\
                     echo \"GPUS: ${{CUDA_VISIBLE_DEVICES:-all}}\"\n\
                     case \" $* \" in *' broken '*) exit 3 ;; esac\n\
                     echo 'test result: ok. 2 passed; 0 failed; 0 ignored'\n"
                ),
            )
            .expect("fake binary");
            compress(&fake);
            write(&dir.join("run.sh"), RUN_SH).expect("run.sh");
            Self { dir }
        }

        /// `run.sh tests ARGS`, with `OUT` set to `out` when given: the exit code and stdout.
        fn run(&self, args: &[&str], out: Option<&Path>) -> (Option<i32>, String) {
            let out = out.map(|out| ("OUT", out.to_str().expect("a UTF-8 path")));
            self.run_with(args, out.as_slice())
        }

        /// `run.sh tests ARGS` with the environment `env` added (no `OUT`, no GPUs otherwise
        /// named): the exit code and stdout.
        fn run_with(&self, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
            let mut command = Command::new("bash");
            command
                .arg(self.dir.join("run.sh"))
                .arg("tests")
                .args(args)
                .env("BURN_GRAPHED_REPO", &self.dir)
                .env("BURN_GRAPHED_HEARTBEAT", "600")
                .env_remove("BURN_GRAPHED_FILTER")
                .env_remove("BURN_GRAPHED_JOBS")
                .env_remove("OUT")
                .env_remove("CUDA_VISIBLE_DEVICES")
                .envs(env.iter().copied());
            let output = command.output().expect("bash");
            (
                output.status.code(),
                String::from_utf8_lossy(&output.stdout).into_owned(),
            )
        }

        /// Adds a fake benchmark binary that prints one JSON row naming its arguments, then,
        /// given `--slow`, sleeps for 30 s (a run that a time limit cuts off).
        fn with_bench(self) -> Self {
            let fake = self.dir.join("bench-train_step");
            write(
                &fake,
                "#!/bin/sh\n\
                 echo \"{\\\"args\\\": \\\"$*\\\"}\"\n\
                 case \" $* \" in *' --slow '*) sleep 30 ;; esac\n",
            )
            .expect("fake bench");
            compress(&fake);
            self
        }

        /// Fakes for `run.sh busy`: a benchmark binary that runs for half a second and prints a
        /// row naming its arguments, or nothing for the mode `unknown` (a mode the side does not
        /// know), and `bin/nvidia-smi`, which samples 97% at 1980 MHz every 100 ms. Returns the
        /// `bin` folder for `PATH`.
        fn with_busy_fakes(self) -> (Self, PathBuf) {
            let fake = self.dir.join("bench-train_step");
            write(
                &fake,
                "#!/bin/sh\n\
                 case \" $* \" in *' --modes unknown '*) exit 0 ;; esac\n\
                 sleep 0.5\n\
                 echo \"{\\\"args\\\": \\\"$*\\\", \\\"median_us\\\": 1.0}\"\n",
            )
            .expect("fake bench");
            compress(&fake);
            let bin = self.dir.join("bin");
            std::fs::create_dir_all(&bin).expect("bin");
            let smi = bin.join("nvidia-smi");
            write(
                &smi,
                "#!/bin/sh\n\
                 case \"$*\" in *-lms*) while :; do echo '97, 1980'; sleep 0.1; done ;; esac\n\
                 echo 'Fake GPU, 1.0'\n",
            )
            .expect("fake nvidia-smi");
            let chmod = Command::new("chmod").arg("+x").arg(&smi).status();
            assert!(chmod.is_ok_and(|status| status.success()), "chmod");
            (self, bin)
        }
    }

    /// `path.xz` beside `path`, as the bundle holds its binaries.
    fn compress(path: &Path) {
        let xz = Command::new("xz")
            .args(["-zkf"])
            .arg(path)
            .status()
            .expect("xz (the bundle needs it too)");
        assert!(xz.success(), "xz {}", path.display());
    }

    impl Drop for FakeBundle {
        fn drop(&mut self) {
            std::fs::remove_dir_all(&self.dir).ok();
        }
    }

    /// `run.sh nccl` links the NCCL library that `BURN_GRAPHED_NCCL` names (pip's and
    /// Debian's `libnccl.so.2`) as the `libnccl.so` that cudarc loads, and says so; a path that
    /// is not a file is an error that names it.
    #[test]
    fn run_sh_nccl_links_the_library_it_is_given() {
        let bundle = FakeBundle::new("nccl", &["a_test"]);
        let library = bundle.dir.join("libnccl.so.2");
        write(&library, "not a real library").expect("fake library");
        let run = |nccl: &Path| {
            let output = Command::new("bash")
                .arg(bundle.dir.join("run.sh"))
                .arg("nccl")
                .env("BURN_GRAPHED_REPO", &bundle.dir)
                .env("BURN_GRAPHED_NCCL", nccl)
                .output()
                .expect("bash");
            (
                output.status.code(),
                String::from_utf8_lossy(&output.stdout).into_owned(),
            )
        };
        let (code, stdout) = run(&library);
        assert_eq!(code, Some(0), "{stdout}");
        let linked = format!("-> {}", library.canonicalize().expect("path").display());
        assert!(stdout.contains(&linked), "{stdout}");
        let missing = bundle.dir.join("no-such-libnccl.so.2");
        let (code, stdout) = run(&missing);
        assert_eq!(code, Some(1), "{stdout}");
        assert!(stdout.contains("is not a file"), "{stdout}");
        assert!(stdout.contains("no-such-libnccl.so.2"), "{stdout}");
    }

    /// `run.sh tests --from NAME` hands the test binary NAME and the names after it (sorted, as
    /// libtest runs them), exactly; a NAME after every test is an error.
    #[test]
    fn run_sh_tests_from_runs_the_rest_in_order() {
        let bundle = FakeBundle::new("from", &["b_test", "a_test", "c_test"]);
        let (code, stdout) = bundle.run(&["--from", "b_test"], None);
        assert_eq!(code, Some(0), "{stdout}");
        assert!(
            stdout.contains("ARGS: --test-threads=1 --exact b_test c_test --nocapture"),
            "{stdout}"
        );
        assert!(stdout.contains("2 passed, 0 failed"), "{stdout}");
        assert_eq!(bundle.run(&["--from", "zzz"], None).0, Some(2));
    }

    /// `run.sh tests --jobs 2` runs two test processes, the sorted names dealt out in turn,
    /// each with a log of its own in `$OUT`, and sums their summaries.
    #[test]
    fn run_sh_tests_jobs_split_the_suite() {
        let bundle = FakeBundle::new("jobs", &["c_test", "a_test", "b_test"]);
        let out = bundle.dir.join("out");
        let (code, stdout) = bundle.run(&["--jobs", "2"], Some(&out));
        assert_eq!(code, Some(0), "{stdout}");
        assert!(
            stdout.contains("[1] ARGS: --test-threads=1 --exact a_test c_test --nocapture"),
            "{stdout}"
        );
        assert!(
            stdout.contains("[2] ARGS: --test-threads=1 --exact b_test --nocapture"),
            "{stdout}"
        );
        assert!(stdout.contains("4 passed, 0 failed"), "{stdout}");
        let log = |n: u32| {
            std::fs::read_to_string(out.join(format!("gpu-tests-{n}.log"))).expect("share's log")
        };
        assert!(log(1).contains("ARGS: --test-threads=1 --exact a_test c_test"));
        assert!(log(2).contains("ARGS: --test-threads=1 --exact b_test"));
        assert_eq!(bundle.run(&["--jobs", "0"], None).0, Some(2));
    }

    /// Names after `--jobs N` choose the tests (substrings) that the processes share: each
    /// chosen test runs once, in one process, and the others not at all.
    #[test]
    fn run_sh_tests_jobs_share_the_chosen_tests() {
        let bundle = FakeBundle::new("picks", &["a_test", "b_test", "c_test", "d_other"]);
        let (code, stdout) = bundle.run(&["--jobs", "2", "a_", "c_"], None);
        assert_eq!(code, Some(0), "{stdout}");
        assert!(
            stdout.contains("[1] ARGS: --test-threads=1 --exact a_test --nocapture"),
            "{stdout}"
        );
        assert!(
            stdout.contains("[2] ARGS: --test-threads=1 --exact c_test --nocapture"),
            "{stdout}"
        );
        assert!(
            !stdout.contains("b_test") && !stdout.contains("d_other"),
            "{stdout}"
        );
    }

    /// `run.sh tests --ledger LOG` runs nothing: the counts and the ledger are the log's, a
    /// test cut off in it "no result" (and failed in the counts), a hand-run reproduction whose
    /// watchdog printed `reproduced: WHAT` that line (counted apart, as skips are), a test it
    /// never started "not run".
    #[test]
    fn run_sh_tests_ledger_writes_the_logs_results_only() {
        let bundle = FakeBundle::new(
            "ledger",
            &["a_test", "b_test", "c_test", "d_test", "upstream_x"],
        );
        let log = bundle.dir.join("cut.log");
        write(
            &log,
            "[run.sh: bundle abc1234 on NVIDIA H100, 2026-11-28]\n\
             test a_test ... ok\n\
             test b_test ... FAILED\n\
             test c_test ... \n\n[run.sh: 600s]\n",
        )
        .expect("log");
        let reproduction = bundle.dir.join("upstream.log");
        write(
            &reproduction,
            "[run.sh: bundle abc1234 on 2 x NVIDIA H200, 2026-11-29]\n\
             test upstream_x ... \nreproduced: still waiting after 90 s\n",
        )
        .expect("log");
        let out = bundle.dir.join("out");
        let (code, stdout) = bundle.run(
            &[
                "--ledger",
                log.to_str().expect("utf-8 path"),
                reproduction.to_str().expect("utf-8 path"),
            ],
            Some(&out),
        );
        assert!(!stdout.contains("ARGS:"), "nothing may run: {stdout}");
        assert!(
            stdout.contains("(2 tests without a result in them)"),
            "{stdout}"
        );
        // A test cut off counts as failed beside the failed one; the reproduction apart.
        assert!(stdout.contains("1 passed, 2 failed, 1 skipped"), "{stdout}");
        assert_eq!(code, Some(1), "{stdout}");
        let ledger = std::fs::read_to_string(out.join("gpu-ledger.md")).expect("ledger in $OUT");
        for row in [
            "| `a_test` | passed | abc1234 | NVIDIA H100 | 2026-11-28 |",
            "| `b_test` | failed | abc1234 | NVIDIA H100 | 2026-11-28 |",
            "| `c_test` | no result | abc1234 | NVIDIA H100 | 2026-11-28 |",
            "| `d_test` | not run | - | - | - |",
            "| `upstream_x` | reproduced: still waiting after 90 s | abc1234 | 2 x NVIDIA H200 | \
             2026-11-29 |",
        ] {
            assert!(ledger.contains(row), "{row}\n{ledger}");
        }
        assert_eq!(bundle.run(&["--ledger"], None).0, Some(2));
    }

    /// On three GPUs, `run.sh tests --jobs 4` gives share j the GPUs rotated by j - 1: every
    /// share sees every GPU, and their first devices take the GPUs in turn.
    #[test]
    fn run_sh_tests_jobs_spread_over_the_gpus() {
        let bundle = FakeBundle::new("spread", &["a_test", "b_test", "c_test", "d_test"]);
        let (code, stdout) =
            bundle.run_with(&["--jobs", "4"], &[("CUDA_VISIBLE_DEVICES", "0,1,2")]);
        assert_eq!(code, Some(0), "{stdout}");
        for (share, gpus) in [(1, "0,1,2"), (2, "1,2,0"), (3, "2,0,1"), (4, "0,1,2")] {
            assert!(
                stdout.contains(&format!("[{share}] GPUS: {gpus}\n")),
                "{stdout}"
            );
        }
        let (code, stdout) = bundle.run_with(&["--jobs", "2"], &[("CUDA_VISIBLE_DEVICES", "3")]);
        assert_eq!(code, Some(0), "{stdout}");
        assert!(stdout.contains("[2] GPUS: 3\n"), "{stdout}");
    }

    /// A share whose binary dies without a summary fails the run, and the other share's
    /// passes still count.
    #[test]
    fn run_sh_tests_jobs_report_a_crashed_share() {
        let bundle = FakeBundle::new("crash", &["a_test", "broken", "c_test"]);
        let (code, stdout) = bundle.run(&["--jobs", "2"], None);
        assert_eq!(code, Some(1), "{stdout}");
        assert!(stdout.contains("2 passed, 1 failed"), "{stdout}");
    }

    /// `run.sh tests --rest LOG` runs the tests that the log shows no result for: a result
    /// on the test's own line or on a bare line after its output counts, a test cut off by
    /// the time limit does not; with none left nothing runs and the counts and the ledger are
    /// the logs'; without a log it is an error.
    #[test]
    fn run_sh_tests_rest_runs_what_a_log_did_not_finish() {
        let names = ["a_test", "b_test", "c_test", "d_test", "e_test"];
        let bundle = FakeBundle::new("rest", &names);
        let log = bundle.dir.join("cut.log");
        write(
            &log,
            "test a_test ... ok\n\
             test b_test ... some output\nmore output\nok\n\
             test d_test ... FAILED\n\
             test c_test ... \n\n[run.sh: 600s]\n",
        )
        .expect("log");
        let log = log.to_str().expect("utf-8 path");
        let (code, stdout) = bundle.run(&["--rest", log], None);
        assert_eq!(code, Some(0), "{stdout}");
        assert!(
            stdout.contains("ARGS: --test-threads=1 --exact c_test e_test --nocapture"),
            "{stdout}"
        );
        let all_done = bundle.dir.join("done.log");
        let lines: String = names.iter().map(|n| format!("test {n} ... ok\n")).collect();
        write(&all_done, &lines).expect("log");
        let all_done = all_done.to_str().expect("utf-8 path");
        let out = bundle.dir.join("ledger-only");
        let (code, stdout) = bundle.run(&["--rest", all_done], Some(&out));
        assert_eq!(code, Some(0), "{stdout}");
        assert!(!stdout.contains("ARGS:"), "nothing may run: {stdout}");
        assert!(stdout.contains("5 passed, 0 failed, 0 skipped"), "{stdout}");
        let ledger = std::fs::read_to_string(out.join("gpu-ledger.md")).expect("ledger in $OUT");
        assert!(ledger.contains("5 tests: 5 passed."), "{ledger}");
        assert_eq!(bundle.run(&["--rest"], None).0, Some(2));
    }

    /// A test that prints `skipped: NAME: REASON` (alone, or after libtest's `test NAME ... `
    /// without capture) counts as skipped, not passed, beside the ignored ones, and is listed
    /// with its reason; a failed test stays failed. The ledger in `$OUT` lists every test of
    /// the binary: this run's results at the manifest's commit, the rows of tests it did not
    /// run kept from `BURN_GRAPHED_LEDGER`, and the rest "not run".
    #[test]
    fn run_sh_tests_count_skips_apart_and_write_the_ledger() {
        let bundle = FakeBundle::new("skips", &[]);
        let fake = bundle.dir.join("test-gpu");
        write(
            &fake,
            "#!/bin/sh\n\
             if [ \"$1\" = --list ]; then printf 'a_two_gpus: test\\nb_f16: test\\nc_fails: test\\nd_kept: test\\ne_ignored: test\\nf_passes: test\\ng_new: test\\n'; exit 0; fi\n\
             echo 'test a_two_gpus ... skipped: a_two_gpus: needs 2 GPUs, this machine has 1'\n\
             echo ok\n\
             echo 'skipped: b_f16: the adapter has no f16'\n\
             echo 'test b_f16 ... ok'\n\
             echo 'skipped: c_fails: not really'\n\
             echo 'test c_fails ... FAILED'\n\
             echo 'test e_ignored ... ignored, run by hand'\n\
             echo 'test f_passes ... ok'\n\
             echo 'test result: FAILED. 3 passed; 1 failed; 1 ignored; 0 measured'\n\
             exit 101\n",
        )
        .expect("fake binary");
        compress(&fake);
        write(
            &bundle.dir.join("manifest.json"),
            "{\n  \"commit\": \"abc1234\",\n  \"profile\": \"release\"\n}\n",
        )
        .expect("manifest");
        let base = bundle.dir.join("base-ledger.md");
        write(
            &base,
            "| `d_kept` | passed | old1234 | NVIDIA H100 | 2026-01-01 |\n\
             | `f_passes` | failed | old1234 | NVIDIA H100 | 2026-01-01 |\n\
             | `z_gone` | passed | old1234 | NVIDIA H100 | 2026-01-01 |\n",
        )
        .expect("base ledger");
        let out = bundle.dir.join("out");
        let (code, stdout) = bundle.run_with(
            &[],
            &[
                ("OUT", out.to_str().expect("utf-8 path")),
                ("BURN_GRAPHED_LEDGER", base.to_str().expect("utf-8 path")),
            ],
        );
        assert_eq!(code, Some(1), "{stdout}");
        assert!(
            stdout.contains(
                "1 passed, 1 failed, 3 skipped\n\
                 skipped tests (ignored, or unable to run their checks here):\n\
                 \x20 a_two_gpus: skipped: needs 2 GPUs, this machine has 1\n\
                 \x20 b_f16: skipped: the adapter has no f16\n\
                 \x20 e_ignored: ignored: run by hand\n"
            ),
            "{stdout}"
        );
        let ledger = std::fs::read_to_string(out.join("gpu-ledger.md")).expect("ledger in $OUT");
        let rows: Vec<&str> = ledger.lines().filter(|l| l.starts_with("| `")).collect();
        let today = |row: &str| format!("{row} | abc1234 | unknown device |");
        assert_eq!(rows.len(), 7, "{ledger}");
        for (row, expected) in rows.iter().zip([
            today("| `a_two_gpus` | skipped: needs 2 GPUs, this machine has 1"),
            today("| `b_f16` | skipped: the adapter has no f16"),
            today("| `c_fails` | failed"),
            "| `d_kept` | passed | old1234 | NVIDIA H100 | 2026-01-01 |".to_string(),
            today("| `e_ignored` | ignored: run by hand"),
            today("| `f_passes` | passed"),
            "| `g_new` | not run | - | - | - |".to_string(),
        ]) {
            assert!(row.starts_with(&expected), "{row} / {expected}\n{ledger}");
        }
        assert!(
            ledger.contains("7 tests: 2 skipped, 1 failed, 2 passed, 1 ignored, 1 not run."),
            "{ledger}"
        );
    }

    /// `run.sh bench` writes its rows straight into `$OUT/bench.jsonl`, so that a run cut off
    /// by a time limit leaves the rows it finished; one file per call: a later call replaces an
    /// earlier one's.
    #[test]
    fn run_sh_bench_writes_rows_into_out_as_it_goes() {
        let bundle = FakeBundle::new("bench", &[]).with_bench();
        let out = bundle.dir.join("out");
        let bench = |limit_s: &str, args: &[&str]| {
            Command::new("timeout")
                .arg(limit_s)
                .arg("bash")
                .arg(bundle.dir.join("run.sh"))
                .arg("bench")
                .args(args)
                .env("BURN_GRAPHED_REPO", &bundle.dir)
                .env("BURN_GRAPHED_SIDES", "burn")
                .env("BURN_GRAPHED_DTYPES", "f32")
                .env_remove("BURN_GRAPHED_ROUNDS")
                .env("OUT", &out)
                .status()
                .expect("timeout and bash");
            std::fs::read_to_string(out.join("bench.jsonl")).expect("bench.jsonl in $OUT")
        };
        let cut = bench("3", &["--models", "mlp", "--slow"]);
        assert!(
            cut.contains(r#"{"args": "--dtype f32 --tf32 off --models mlp --slow"}"#),
            "{cut}"
        );
        let next = bench("60", &["--models", "cnn"]);
        assert!(
            next.contains("--models cnn") && !next.contains("--models mlp"),
            "{next}"
        );
    }

    /// `run.sh warm` starts one Burn process per (dtype, TF32 setting, model, group of modes),
    /// each running its group once with the settings `bench` would use, and logs each to
    /// `$OUT/warm/`.
    #[test]
    fn run_sh_warm_runs_a_process_per_model_and_group() {
        let bundle = FakeBundle::new("warm", &[]).with_bench();
        let out = bundle.dir.join("out");
        let output = Command::new("bash")
            .arg(bundle.dir.join("run.sh"))
            .args(["warm", "--models", "a,b", "--modes", "x,y+z"])
            .env("BURN_GRAPHED_REPO", &bundle.dir)
            .env("BURN_GRAPHED_CUBECL_ENV", bundle.dir.join("env"))
            .env("BURN_GRAPHED_DTYPES", "f32 bf16")
            .env("BURN_GRAPHED_TF32", "off on")
            .env("OUT", &out)
            .output()
            .expect("bash");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{stdout}");
        assert!(stdout.contains("run.sh warm: done after"), "{stdout}");
        let mut logs: Vec<String> = std::fs::read_dir(out.join("warm"))
            .expect("$OUT/warm")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        logs.sort();
        let mut expected = Vec::new();
        for (dtype, maths) in [("bf16", &["off"][..]), ("f32", &["off", "on"][..])] {
            for math in maths {
                for model in ["a", "b"] {
                    for group in ["x", "z"] {
                        expected.push(format!("{dtype}-tf32{math}-{model}-{group}.txt"));
                    }
                }
            }
        }
        expected.sort();
        assert_eq!(logs, expected, "{stdout}");
        let log = std::fs::read_to_string(out.join("warm/f32-tf32on-b-x.txt")).expect("a log");
        assert!(
            log.contains("--dtype f32 --tf32 on --models b --modes x,y --reps 1 --steps 2"),
            "{log}"
        );
    }

    /// `run.sh bench` writes the cubecl environment's `cubecl.toml`: the compilation cache
    /// always, autotune results kept only in memory under `BURN_GRAPHED_TUNE=fresh`, beside the
    /// autotune log's table when one is asked for; another value is an error that names it.
    #[test]
    fn run_sh_bench_tunes_afresh_when_asked() {
        let bundle = FakeBundle::new("tune", &[]).with_bench();
        let env = bundle.dir.join("env");
        let bench = |tune: Option<&str>, log: Option<&str>| {
            let mut command = Command::new("bash");
            command
                .arg(bundle.dir.join("run.sh"))
                .args(["bench", "--models", "mlp"])
                .env("BURN_GRAPHED_REPO", &bundle.dir)
                .env("BURN_GRAPHED_CUBECL_ENV", &env)
                .env("BURN_GRAPHED_SIDES", "burn")
                .env("BURN_GRAPHED_DTYPES", "f32")
                .env_remove("BURN_GRAPHED_ROUNDS")
                .env_remove("BURN_GRAPHED_TUNE")
                .env_remove("BURN_GRAPHED_AUTOTUNE_LOG")
                .env_remove("OUT")
                .current_dir(&bundle.dir);
            if let Some(tune) = tune {
                command.env("BURN_GRAPHED_TUNE", tune);
            }
            if let Some(log) = log {
                command.env("BURN_GRAPHED_AUTOTUNE_LOG", log);
            }
            let output = command.output().expect("bash");
            let toml = std::fs::read_to_string(env.join("cubecl.toml")).unwrap_or_default();
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            (output.status.code(), toml, stdout)
        };
        let (code, kept, stdout) = bench(None, None);
        assert_eq!(code, Some(0), "{stdout}");
        assert!(kept.contains("[compilation]\ncache = true"), "{kept}");
        assert!(!kept.contains("disable_cache"), "{kept}");
        let (code, fresh, stdout) = bench(Some("fresh"), Some("/tmp/tune.log"));
        assert_eq!(code, Some(0), "{stdout}");
        assert!(
            fresh.contains("[autotune]\ndisable_cache = true\n"),
            "{fresh}"
        );
        assert!(fresh.contains("[autotune.logger]"), "{fresh}");
        let (code, _, stdout) = bench(Some("always"), None);
        assert_eq!(code, Some(2), "{stdout}");
        assert!(stdout.contains("not 'always'"), "{stdout}");
    }

    /// `run.sh busy` samples each side's run of each mode in a window of its own (two modes of
    /// one side once shared one median), passes the other arguments on, says which mode a
    /// side does not know, and keeps rows and busy lines in `$OUT/busy.jsonl`; without
    /// `--modes` it is an error. Needs python3, as `busy` does.
    #[test]
    fn run_sh_busy_samples_each_mode_on_its_own() {
        let (bundle, bin) = FakeBundle::new("busy", &[]).with_busy_fakes();
        let out = bundle.dir.join("out");
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let busy = |args: &[&str]| {
            Command::new("bash")
                .arg(bundle.dir.join("run.sh"))
                .arg("busy")
                .args(args)
                .env("PATH", &path)
                .env("BURN_GRAPHED_REPO", &bundle.dir)
                .env("BURN_GRAPHED_SIDES", "burn")
                .env_remove("BURN_GRAPHED_DTYPES")
                .env("OUT", &out)
                .output()
                .expect("bash")
        };
        let run = busy(&["--models", "mlp", "--modes", "a,unknown,b", "--reps", "1"]);
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(run.status.success(), "{stdout}");
        let log = std::fs::read_to_string(out.join("busy.jsonl")).expect("busy.jsonl in $OUT");
        for mode in ["a", "b"] {
            let row = format!(
                r#"{{"args": "--dtype f32 --tf32 off --models mlp --reps 1 --modes {mode}""#
            );
            assert!(log.contains(&row), "{log}");
            let line = format!("# busy: burn {mode}: GPU utilization median 97% over");
            assert!(log.contains(&line), "{log}");
        }
        assert!(log.contains("# busy: burn unknown: no row"), "{log}");
        assert!(!log.contains("a,unknown,b"), "{log}");
        assert_eq!(busy(&["--models", "mlp"]).status.code(), Some(2));
    }

    /// report.py sets TF32 rows beside TF32 rows only: Burn's `--tf32 on` row against
    /// PyTorch's `--tf32` one, never a `--tf32 off` Burn row; a Burn row from before `--tf32`
    /// (no "tf32" key) stands in for Burn's TF32 row; a file with no TF32 row has no TF32
    /// columns.
    #[test]
    fn report_py_pairs_tf32_rows_with_tf32_rows() {
        let dir = std::env::temp_dir().join(format!("xtask-tf32-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let row = |framework: &str, mode: &str, tf32: Option<bool>, us: f64| {
            let tf32 = tf32.map_or_else(String::new, |t| format!(", \"tf32\": {t}"));
            timed_row(framework, mode, &tf32, us)
        };
        let table = |name: &str, rows: &[String]| {
            let file = dir.join(name);
            std::fs::write(&file, rows.concat()).expect("results file");
            report_py_table(&file, "whole_step")
        };
        let line = |table: &str| table.lines().nth(2).expect("a row").to_string();
        let both = table(
            "both.jsonl",
            &[
                row("burn", "whole_step", Some(false), 400.0),
                row("burn", "whole_step", Some(true), 300.0),
                row("torch", "whole_step_fused_adam", Some(false), 200.0),
                row("torch", "whole_step_fused_adam", Some(true), 100.0),
            ],
        );
        assert!(both.contains("burn / torch whole step, TF32"), "{both}");
        assert!(
            line(&both).ends_with("| 2.00 | 300 us (300-300) | 100 us (100-100) | 3.00 |"),
            "{both}"
        );
        let legacy = table(
            "legacy.jsonl",
            &[
                row("burn", "whole_step", None, 400.0),
                row("torch", "whole_step_fused_adam", Some(true), 100.0),
            ],
        );
        assert!(
            line(&legacy).ends_with("| as plain (autotune) | 100 us (100-100) | 4.00 |"),
            "{legacy}"
        );
        let plain = table(
            "plain.jsonl",
            &[
                row("burn", "whole_step", Some(false), 400.0),
                row("torch", "whole_step_fused_adam", Some(false), 200.0),
            ],
        );
        assert!(!plain.contains("TF32"), "{plain}");
        assert!(line(&plain).ends_with("| 2.00 |"), "{plain}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// report.py's TF32 table sets Burn's fused TF32 row beside PyTorch's TF32 row and, where
    /// PyTorch also ran with its transformer fast path off (the model's exact GELU), beside that
    /// one; a fast-path-off row without TF32 (a control) is never taken for it.
    #[test]
    fn report_py_tf32_table_sets_the_exact_gelu_beside_it() {
        let dir = std::env::temp_dir().join(format!("xtask-exact-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let on = ", \"tf32\": true";
        let rows = |exact: &str| {
            [
                timed_row("burn", "inference_graphed_fused_layers", on, 120.0),
                timed_row("torch", "inference_graphed", on, 100.0),
                timed_row("torch", "inference_graphed", exact, 150.0),
                timed_row(
                    "torch",
                    "inference_graphed",
                    ", \"tf32\": false, \"fastpath\": false",
                    300.0,
                ),
            ]
            .concat()
        };
        let file = dir.join("exact.jsonl");
        std::fs::write(&file, rows(", \"tf32\": true, \"fastpath\": false")).expect("results");
        let table = report_py_table(&file, "tf32");
        assert!(table.contains("| torch, TF32, fast path off |"), "{table}");
        let line = table.lines().nth(2).expect("a row");
        assert!(
            line.ends_with("| 1.20 | 150 us (150-150) | 0.80 |"),
            "{table}"
        );
        // Without a TF32 fast-path-off row: no such column, and the plain one is not taken.
        std::fs::write(&file, rows(on)).expect("results");
        let table = report_py_table(&file, "tf32");
        assert!(
            !table.contains("fast path off") && !table.contains("300 us"),
            "{table}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A checked timing row of model `m` in `f32`, as the bench prints it: `extra` adds fields
    /// after the dtype (", \"tf32\": true").
    fn timed_row(framework: &str, mode: &str, extra: &str, us: f64) -> String {
        format!(
            "{{\"framework\": \"{framework}\", \"model\": \"m\", \"dtype\": \"f32\"{extra}, \
             \"mode\": \"{mode}\", \"median_us\": {us}, \"p10_us\": {us}, \"p90_us\": {us}, \
             \"reserved_mib\": 1.0, \"check_passed\": true}}\n"
        )
    }

    /// The output of `python3 benches/SCRIPT ARGS...` (the run must succeed).
    fn bench_script(script: &str, args: &[&std::ffi::OsStr]) -> String {
        let out = Command::new("python3")
            .arg(root().join("benches").join(script))
            .args(args)
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `benches/report.py FILE --only TABLE`'s output (the run must succeed).
    fn report_py_table(file: &Path, table: &str) -> String {
        bench_script(
            "report.py",
            &[file.as_os_str(), "--only".as_ref(), table.as_ref()],
        )
    }

    /// A round whose value check failed leaves a failure row (`"error"`, no times, as the
    /// bench prints it) and no timing row: `benches/report.py` counts it against the key's
    /// rounds ("FAILED 1 of 2" in the check column, the passed round's times alone in the
    /// row) and lists it among the failed runs; a key whose every round failed has no timing
    /// row at all, only its failure.
    #[test]
    fn report_py_counts_failed_checks_against_the_rounds() {
        let dir = std::env::temp_dir().join(format!("xtask-failed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let timed = |model: &str, us: f64| {
            format!(
                "{{\"framework\": \"burn\", \"model\": \"{model}\", \"dtype\": \"f32\", \
                 \"tf32\": false, \"mode\": \"whole_step\", \"median_us\": {us}, \"p10_us\": {us}, \
                 \"p90_us\": {us}, \"reserved_mib\": 1.0, \"check_passed\": true}}\n"
            )
        };
        let failure = |model: &str| {
            format!(
                "{{\"framework\": \"burn\", \"model\": \"{model}\", \"dtype\": \"f32\", \
                 \"tf32\": false, \"mode\": \"whole_step\", \"check_passed\": false, \
                 \"error\": \"value check failed: parameter 3 off\"}}\n"
            )
        };
        let file = dir.join("rounds.jsonl");
        let rows = [timed("m", 400.0), failure("m"), failure("only_failed")];
        std::fs::write(&file, rows.concat()).expect("results file");
        let whole = report_py_table(&file, "whole_step");
        let row = whole
            .lines()
            .find(|line| line.starts_with("| m |"))
            .unwrap_or_else(|| panic!("a row for m: {whole}"));
        assert!(row.contains("| 400 us (400-400) |"), "{row}");
        assert!(row.contains("FAILED 1 of 2"), "{row}");
        assert!(!whole.contains("only_failed"), "{whole}");
        let failed = report_py_table(&file, "failed");
        assert_eq!(
            failed
                .matches("value check failed: parameter 3 off")
                .count(),
            2,
            "{failed}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The first-step table reads `benches/first_step.py`'s rows (three processes a Burn row):
    /// the cold time's split is cold - picks and picks - warm, with the kernels compiled only
    /// for tuning; a process whose check failed shows as FAILED; a row whose split does not
    /// hold (its picks process tuned) shows none; PyTorch's first step sits beside it.
    #[test]
    fn report_py_first_step_table_splits_and_counts_checks() {
        let dir = std::env::temp_dir().join(format!("xtask-first-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let burn = |mode: &str, valid: bool, warm_check: bool| {
            format!(
                "{{\"framework\": \"burn\", \"model\": \"m\", \"dtype\": \"f32\", \
                 \"tf32\": false, \"mode\": \"{mode}\", \"median_us\": 9000000, \
                 \"single\": true, \"split_valid\": {valid}, \"cold_median_us\": 9000000, \
                 \"picks_median_us\": 5000000, \"warm_median_us\": 300000, \
                 \"cold_kernels_compiled\": 40, \"picks_kernels_compiled\": 30, \
                 \"cold_keys_tuned\": 3, \"cold_check_passed\": true, \
                 \"picks_check_passed\": true, \"warm_check_passed\": {warm_check}}}\n"
            )
        };
        let torch = "{\"framework\": \"torch\", \"model\": \"m\", \"dtype\": \"f32\", \
                     \"mode\": \"first_step\", \"median_us\": 4200000, \"single\": true}\n";
        // At another autotune effort: a row of its own, next to cubecl's default's.
        let minimal = burn("first_step", true, true)
            .replace(
                "\"single\": true",
                "\"single\": true, \"autotune_level\": \"minimal\"",
            )
            .replace("\"cold_median_us\": 9000000", "\"cold_median_us\": 7000000");
        // Stopped past `--process-timeout`: a lower bound, neither a time nor a failure.
        let stopped = "{\"framework\": \"burn\", \"model\": \"m\", \"dtype\": \"f32\", \
                       \"mode\": \"first_step_eager_fused_layers\", \"single\": true, \
                       \"autotune_level\": \"full\", \"stopped_after_s\": 240, \
                       \"error\": \"cold process stopped after 240 s\"}\n";
        // With TF32 products on both sides (`first_step.py --tf32 on`): rows of their own, the
        // Burn row beside PyTorch's TF32 row, neither replacing the plain `f32` rows.
        let tf32 = burn("first_step", true, true)
            .replace("\"tf32\": false", "\"tf32\": true")
            .replace(
                "\"cold_median_us\": 9000000",
                "\"cold_median_us\": 30000000",
            );
        let torch_tf32 = torch
            .replace("\"median_us\": 4200000", "\"median_us\": 3100000")
            .replace("\"single\": true", "\"single\": true, \"tf32\": true");
        let file = dir.join("first.jsonl");
        let rows = [
            burn("first_step", true, true),
            burn("first_step_fused_layers", false, false),
            minimal,
            stopped.to_string(),
            torch.to_string(),
            tf32,
            torch_tf32,
        ];
        std::fs::write(&file, rows.concat()).expect("results file");
        let table = report_py_table(&file, "first_step");
        let line = |layers: &str| {
            table
                .lines()
                .find(|line| line.starts_with(&format!("| m | f32 | {layers} |")))
                .unwrap_or_else(|| panic!("a {layers} line: {table}"))
                .to_string()
        };
        let plain = line("burn-nn");
        assert!(plain.contains("| 9.0 s / 0.30 s |"), "{plain}");
        assert!(plain.contains("| 4.0 s + 4.7 s + 0.30 s |"), "{plain}");
        assert!(plain.contains("| 3 / 40 (10 for tuning only) |"), "{plain}");
        assert!(plain.contains("| passed 3/3 |"), "{plain}");
        assert!(plain.contains("| n/a / n/a / 4.2 s |"), "{plain}");
        let fused = line("fused");
        assert!(fused.contains("FAILED 1 of 3"), "{fused}");
        assert!(fused.contains("n/a (the picks process tuned"), "{fused}");
        assert!(!fused.contains("4.0 s + 4.7 s"), "{fused}");
        let quick = line("burn-nn, autotune `minimal`");
        assert!(quick.contains("| 7.0 s / 0.30 s |"), "{quick}");
        let rounded = line("burn-nn, TF32");
        assert!(rounded.contains("| 30.0 s / 0.30 s |"), "{rounded}");
        assert!(rounded.contains("| n/a / n/a / 3.1 s |"), "{rounded}");
        assert!(
            !plain.contains("30.0 s") && !plain.contains("3.1 s"),
            "{plain}"
        );
        let bound = line("fused, autotune `full`");
        assert!(bound.contains("| > 240 s (stopped) / n/a |"), "{bound}");
        assert!(bound.contains("| - |"), "{bound}");
        // Nor among the failed runs: no table of them at all.
        let all = bench_script("report.py", &[file.as_os_str()]);
        assert!(!all.contains("stopped after 240 s"), "{all}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `benches/first_step.py --process-timeout` stops a Burn process that runs past it, its
    /// whole process group (the bench that run.sh started, and what the bench started), and
    /// leaves a lower-bound row with what cubecl's logs say the process had done by then; the
    /// first-step table shows it, with the time of the first step the process printed before
    /// its check, and cubecl's logs are kept. A stand-in run.sh writes two compilation lines
    /// and one autotune decision (and one line of each kind that must not count), notes the
    /// TF32 setting it was given (`--tf32 on`), prints its first-step line, starts a
    /// grandchild, and sleeps.
    #[test]
    fn first_step_py_stops_a_process_and_counts_what_it_did() {
        let dir = std::env::temp_dir().join(format!("xtask-stopped-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let grandchild = dir.join("grandchild.pid");
        let run_sh = dir.join("run.sh");
        std::fs::write(
            &run_sh,
            format!(
                "printf '[Compiling kernel] a\\n[Compiling kernel] b\\nnot a kernel\\n' >> \"$BURN_GRAPHED_COMPILE_LOG\"\n\
                 printf 'Fastest result k\\nslower result k\\n' >> \"$BURN_GRAPHED_AUTOTUNE_LOG\"\n\
                 echo \"$BURN_GRAPHED_TF32\" > {}\n\
                 echo '# mlp 8x256 b32 first_step: first step 1.50 s (make 0.00, setup 1.45, step 0.05)'\n\
                 sleep 60 & echo $! > {}\n\
                 wait\n",
                dir.join("tf32.txt").display(),
                grandchild.display()
            ),
        )
        .expect("stand-in run.sh");
        let out = dir.join("out");
        let started = std::time::Instant::now();
        let mut args: Vec<std::ffi::OsString> =
            "--models mlp --dtypes f32 --modes first_step --sides burn --process-timeout 2 --tf32 on"
                .split(' ')
                .map(Into::into)
                .collect();
        args.extend(["--run-sh".into(), run_sh.clone().into(), "--out".into()]);
        args.push(out.clone().into());
        bench_script(
            "first_step.py",
            &args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>(),
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
        let rows = std::fs::read_to_string(out.join("first_step.jsonl")).expect("results");
        let row = rows
            .lines()
            .find(|line| line.starts_with('{'))
            .unwrap_or_else(|| panic!("a row: {rows}"));
        for field in [
            "\"model\": \"mlp 8x256 b32\"",
            "\"stopped_after_s\": 2.0",
            "\"stopped_process\": \"cold\"",
            "\"kernels_compiled_so_far\": 2",
            "\"keys_tuned_so_far\": 1",
            "\"first_step_s_before_stop\": 1.5",
            "\"tf32\": true",
        ] {
            assert!(row.contains(field), "{field} in {row}");
        }
        // `--tf32 on` reached run.sh as its one TF32 setting.
        let tf32 = std::fs::read_to_string(dir.join("tf32.txt")).expect("the stand-in's tf32");
        assert_eq!(tf32.trim(), "on");
        // The grandchild went with its process group: gone, or a zombie its new parent has
        // not reaped yet (Linux's /proc: state `Z`).
        let pid = std::fs::read_to_string(&grandchild).expect("the grandchild's pid");
        let running = || {
            std::fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
                .ok()
                .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| rest.to_string()))
                .is_some_and(|rest| !rest.starts_with('Z'))
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while running() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert!(
            !running(),
            "the grandchild {} outlived its group",
            pid.trim()
        );
        // cubecl's logs of the stopped process are kept beside its own.
        let kept = out.join("first_step_logs/mlp-f32-first_step-tf32-cold.compile.log");
        let kept = std::fs::read_to_string(&kept).unwrap_or_else(|e| panic!("{kept:?}: {e}"));
        assert!(kept.contains("[Compiling kernel] b"), "{kept}");
        let table = report_py_table(&out.join("first_step.jsonl"), "first_step");
        assert!(
            table.contains(
                "| > 2 s (stopped; its first step ended at 1.5 s, unchecked; 2 kernels compiled, \
                 1 key tuned) / n/a |"
            ),
            "{table}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `benches/ncu_summary.py --rows` sums a profile's launches per step by kernel family (Burn's
    /// prefixed kernels, burn-cubecl's and PyTorch's library names), labels the row with the
    /// profiled process's bench row (its value check included), and refuses a profile capped
    /// below the graph's kernel nodes; `benches/report.py`'s families table prints the row.
    #[test]
    fn ncu_summary_sums_families_and_report_py_prints_them() {
        let dir = std::env::temp_dir().join(format!("xtask-families-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let launch = |id: usize, name: &str, ns: &str| {
            format!(
                "\"{id}\",\"1\",\"bench\",\"h\",\"{name}\",\"1\",\"14\",\"(256, 1, 1)\",\
                 \"(32, 1, 1)\",\"0\",\"9.0\",\"m\",\"gpu__time_duration.sum\",\"ns\",\"{ns}\"\n"
            )
        };
        let step = [
            ("attention_forward_tc_kernel_f_bf16_0a", "10,000"),
            ("nvjet_sm90_tst_64x48_64x15_2x4_h_bz_bias_NNT", "4,000"),
            (
                "void at::vectorized_elementwise_kernel<4, at::FillFunctor<float>>(int)",
                "1,000",
            ),
            ("norm_forward_kernel_f_bf16_0b", "2,000"),
            ("mystery_kernel", "500"),
        ];
        let profile = |nodes: usize, steps: usize| {
            let mut text = String::from(
                "==PROF== Connected\n{\"framework\": \"burn\", \"model\": \"m\", \
                 \"dtype\": \"bf16\", \"mode\": \"whole_step_fused_layers\", \
                 \"median_us\": 1.0, \"check_passed\": true, ",
            );
            text += &format!("\"graph_kernel_nodes\": {nodes}}}\n");
            text += "\"ID\",\"Process ID\",\"Process Name\",\"Host Name\",\"Kernel Name\",\
                     \"Context\",\"Stream\",\"Block Size\",\"Grid Size\",\"Device\",\"CC\",\
                     \"Section Name\",\"Metric Name\",\"Metric Unit\",\"Metric Value\"\n";
            for s in 0..steps {
                for (i, (name, ns)) in step.iter().enumerate() {
                    text += &launch(s * step.len() + i, name, ns);
                }
            }
            text
        };
        let summary = |file: &Path, steps: &str| {
            Command::new("python3")
                .arg(root().join("benches/ncu_summary.py"))
                .args(["--steps", steps, "--rows"])
                .arg(file)
                .output()
                .expect("python3")
        };
        let good = dir.join("good.ncu.csv");
        std::fs::write(&good, profile(5, 2)).expect("profile");
        let out = summary(&good, "2");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let row = String::from_utf8_lossy(&out.stdout).into_owned();
        for part in [
            "\"attention\": {\"us\": 10.0, \"launches\": 1.0}",
            "\"matmuls\": {\"us\": 4.0",
            "\"copies\": {\"us\": 1.0",
            "\"norms\": {\"us\": 2.0",
            "\"other\": {\"us\": 0.5",
            "\"device_us_per_step\": 17.5",
            "\"check_passed\": true",
            "\"other_kernels\": [\"mystery_kernel\"]",
        ] {
            assert!(row.contains(part), "{part} in {row}");
        }
        let results = dir.join("families.jsonl");
        std::fs::write(&results, &row).expect("results");
        let table = report_py_table(&results, "families");
        let line = table
            .lines()
            .find(|l| l.starts_with("| m | bf16 | whole step | Burn, fused layers |"))
            .unwrap_or_else(|| panic!("a row: {table}"));
        assert!(line.contains("| 4 (1) | 10 (1) | 2 (1) |"), "{line}");
        assert!(line.contains("| 18 | 5 (5) | passed 1/1 |"), "{line}");
        // A profile capped below a step's graph nodes (2 steps of a 7-node graph in 10
        // launches) is refused, and so is a graph profiled whole.
        let capped = dir.join("capped.ncu.csv");
        std::fs::write(&capped, profile(7, 2)).expect("profile");
        assert!(!summary(&capped, "2").status.success());
        let whole = dir.join("whole.ncu.csv");
        std::fs::write(&whole, profile(5, 2).replace("mystery_kernel", "graph")).expect("profile");
        assert!(!summary(&whole, "2").status.success());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `benches/report.py` reads every committed results file into its tables, and keeps the
    /// plot that BENCHMARKS.md's commands ask of it (`--plot`): a refactor once dropped the
    /// plot function and nothing but a `--plot` run noticed. Draws the plot where matplotlib
    /// is installed; elsewhere checks that the function is there. Needs python3 (`.ci/run`
    /// installs it).
    #[test]
    fn report_py_reads_every_results_file_and_plots() {
        let root = root();
        let report = root.join("benches/report.py");
        let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("benches/results"))
            .expect("benches/results")
            .map(|entry| entry.expect("results entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "jsonl"))
            .collect();
        files.sort();
        assert!(!files.is_empty(), "no results files under benches/results");
        let python = |args: &[&std::ffi::OsStr]| {
            Command::new("python3")
                .args(args)
                .output()
                .expect("python3 (.ci/run installs it)")
        };
        for file in &files {
            let out = python(&[report.as_os_str(), file.as_os_str()]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "report.py {}: {}",
                file.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            // Each file has some table (report.py prints only the tables its rows fill).
            assert!(
                stdout.contains("| model | dtype |"),
                "report.py {}: no table in {stdout}",
                file.display()
            );
        }
        let has_matplotlib = python(&["-c".as_ref(), "import matplotlib".as_ref()])
            .status
            .success();
        if has_matplotlib {
            let png = std::env::temp_dir().join(format!("xtask-plot-{}.png", std::process::id()));
            let out = python(&[
                report.as_os_str(),
                files[0].as_os_str(),
                "--plot".as_ref(),
                png.as_os_str(),
            ]);
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let size = std::fs::metadata(&png).expect("the plot's file").len();
            assert!(size > 1000, "a {size}-byte plot");
            std::fs::remove_file(&png).ok();
        } else {
            let benches = root.join("benches");
            let out = python(&[
                "-c".as_ref(),
                "import sys; sys.path.insert(0, sys.argv[1]); import report; assert callable(report.plot)"
                    .as_ref(),
                benches.as_os_str(),
            ]);
            assert!(
                out.status.success(),
                "report.py has no plot function: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// Every table in README.md and BENCHMARKS.md is what `benches/report.py` prints for the
    /// results files its block names (`<!-- report.py NAME FILES -->` ... `<!-- end
    /// report.py -->`): no figure of a table is edited by hand. Each doc holds such blocks, and
    /// a cell changed by hand is caught (the same check on a tampered copy fails).
    #[test]
    fn docs_tables_are_report_py_output() {
        let root = root();
        let report = root.join("benches/report.py");
        let check = |docs: &[PathBuf]| {
            Command::new("python3")
                .arg(&report)
                .arg("--docs")
                .args(docs)
                .output()
                .expect("python3 (.ci/run installs it)")
        };
        let docs = [root.join("README.md"), root.join("BENCHMARKS.md")];
        for doc in &docs {
            let text = std::fs::read_to_string(doc).expect("the doc");
            assert!(
                text.contains("<!-- report.py "),
                "{} has no generated table",
                doc.display()
            );
        }
        let out = check(&docs);
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // The control: one cell of README's first generated table changed by hand.
        let readme = std::fs::read_to_string(&docs[0]).expect("README.md");
        let start = readme.find("<!-- report.py ").expect("a block");
        let row = start + readme[start..].find("\n| ").expect("a table row") + 1;
        let row = row + readme[row..].find("\n| ").expect("a second row") + 1;
        let cell = row + readme[row..].find(" us").expect("a time cell");
        let mut tampered = readme.clone();
        tampered.replace_range(cell..cell, "0");
        let copy = std::env::temp_dir().join(format!("xtask-docs-{}.md", std::process::id()));
        std::fs::write(&copy, tampered).expect("a temporary copy");
        let out = check(std::slice::from_ref(&copy));
        std::fs::remove_file(&copy).ok();
        assert!(
            !out.status.success(),
            "a hand-edited cell passed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}
