//! The persistent kernel cache, every case in processes of its own: cubecl reads its
//! configuration once per process, and burn-graphed gives it before `main`. Each child runs
//! this binary's ignored `kernel_cache_child` in a fresh folder of its own (no cubecl
//! configuration file above it) with its own user cache directory (`XDG_CACHE_HOME`), and
//! reports what it saw on its standard output. Compilations are counted from cubecl's own
//! compilation log (`CUBECL_DEBUG_LOG`), which names every kernel it compiles and none it
//! loads from the cache: a count, not a timing.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn_graphed::{GraphedConfig, GraphedError, KERNEL_CACHE_VAR};

/// Set in a child: what it does.
const ROLE: &str = "BURN_GRAPHED_KERNEL_CACHE_ROLE";

/// Every file under `dir`, recursively, with its size.
fn files_under(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            match entry.metadata() {
                Ok(meta) if meta.is_dir() => pending.push(path),
                Ok(meta) => files.push((path, meta.len())),
                Err(_) => {}
            }
        }
    }
    files
}

fn bytes_under(dir: &Path) -> u64 {
    files_under(dir).iter().map(|(_, len)| len).sum()
}

/// A folder of this test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "burn-graphed-kernel-cache-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("work")).expect("a temporary folder");
        // The children run in a Cargo project, as a user's program does under `cargo run`.
        std::fs::write(dir.join("work").join("Cargo.toml"), "").expect("an empty manifest");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a child saw.
#[derive(Debug)]
struct Seen {
    /// `kernel_cache_location()` after its operations (`None`: the cache is off).
    location: Option<String>,
    /// Kernels cubecl compiled in the child (not loaded from a cache).
    compiled: usize,
    /// Warnings the child's logger received.
    warnings: Vec<String>,
    /// `enable_kernel_cache(None)` after the first operation.
    enable_after: String,
    /// All it printed.
    stdout: String,
}

/// Runs the child `role` in `scratch/work`, with `scratch/<xdg>` as its user cache directory
/// and `cache` as [`KERNEL_CACHE_VAR`] (`None`: unset).
fn child(scratch: &Scratch, role: &str, xdg: &Path, cache: Option<&str>, run: usize) -> Seen {
    let log = scratch.0.join(format!("compilations-{role}-{run}.log"));
    let mut command = Command::new(std::env::current_exe().expect("this test binary"));
    command
        .args(["--exact", "kernel_cache_child", "--ignored", "--nocapture"])
        .current_dir(scratch.0.join("work"))
        .env(ROLE, role)
        .env("XDG_CACHE_HOME", xdg)
        .env_remove(KERNEL_CACHE_VAR);
    // The log turns cubecl's profiling log on too, whose profiling a capture cannot record:
    // the capturing child goes without it (and counts nothing).
    if role != "capture" {
        command.env("CUBECL_DEBUG_LOG", &log);
    }
    if let Some(cache) = cache {
        command.env(KERNEL_CACHE_VAR, cache);
    }
    let out = command.output().expect("a child process");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child {role} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |name: &str| {
        stdout
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .unwrap_or_else(|| panic!("no `{name}` in {stdout}"))
            .to_string()
    };
    let compilations = std::fs::read_to_string(&log).unwrap_or_default();
    Seen {
        location: Some(field("location: ")).filter(|location| location != "off"),
        compiled: compiled_kernels(&compilations),
        warnings: stdout
            .lines()
            .filter_map(|line| line.strip_prefix("warning: "))
            .map(str::to_string)
            .collect(),
        enable_after: field("enable after: "),
        stdout,
    }
}

/// The kernels cubecl's compilation log names as compiled.
fn compiled_kernels(log: &str) -> usize {
    log.lines()
        .filter(|line| *line == "[START_KERNEL_COMPILATION]")
        .count()
}

/// The linear layer and loss the capturing roles graph.
fn linear_loss(model: &Linear, x: Tensor<2>) -> Tensor<1> {
    model.forward(x).sum()
}

/// The child's work: a few elementwise kernels and a reduction, with known results; in the
/// role `capture`, also a graphed callable's capture (which must work); in the role
/// `profiled` (run with cubecl's profiling log on), a capture that must be refused with an
/// error saying why, after which the device still computes.
fn work(role: &str) {
    let device = Device::wgpu(Default::default());
    let sum = (Tensor::<1>::ones([4], &device) * 2.0)
        .sum()
        .into_scalar::<f32>();
    assert_eq!(sum, 8.0);
    let exp = Tensor::<1>::ones([4], &device)
        .exp()
        .sum()
        .into_scalar::<f32>();
    assert!((exp - 4.0 * std::f32::consts::E).abs() < 1e-5, "{exp}");
    if role != "capture" && role != "profiled" {
        return;
    }
    let device = device.autodiff();
    let model: Linear = LinearConfig::new(4, 2).init(&device);
    let sample = Tensor::<2>::ones([3, 4], &device);
    let eager_loss = linear_loss(&model, sample.clone()).into_scalar::<f32>();
    let graphed = burn_graphed::Graphed::new(
        model.clone(),
        linear_loss,
        sample.clone(),
        &GraphedConfig::new(),
    );
    if role == "profiled" {
        println!("capture: {:?}", graphed.map(|_| ()));
        let again = linear_loss(&model, sample).into_scalar::<f32>();
        assert_eq!(again, eager_loss, "the device computes after the refusal");
        return;
    }
    let graphed = graphed.expect("a capture without a kernel cache");
    let graphed_loss = graphed
        .forward(sample)
        .expect("a replay")
        .into_scalar::<f32>();
    assert_eq!(
        graphed_loss, eager_loss,
        "the replay computes what eager burn does"
    );
}

/// A logger that prints every warning on the standard output, where the parent reads it.
struct Warnings;

impl log::Log for Warnings {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Warn
    }
    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            println!("warning: {}", record.args());
        }
    }
    fn flush(&self) {}
}

static WARNINGS: Warnings = Warnings;

/// The child process of the tests below, which run it.
#[test]
#[ignore = "the child process of this binary's tests, which run it"]
fn kernel_cache_child() {
    let Some(role) = std::env::var_os(ROLE) else {
        panic!("run by this binary's tests, with {ROLE} set");
    };
    let _ = log::set_logger(&WARNINGS);
    log::set_max_level(log::LevelFilter::Warn);
    work(role.to_str().unwrap_or_default());
    let location = burn_graphed::kernel_cache_location();
    println!(
        "location: {}",
        location.map_or("off".into(), |file| file.display().to_string())
    );
    println!(
        "enable after: {:?}",
        burn_graphed::enable_kernel_cache(None)
    );
}

#[test]
fn the_kernel_cache_is_on_by_default_and_serves_the_next_process() {
    let scratch = Scratch::new("default");
    let xdg = scratch.0.join("xdg");
    let first = child(&scratch, "compute", &xdg, None, 1);
    let second = child(&scratch, "compute", &xdg, None, 2);
    println!("first process: {first:?}\nsecond process: {second:?}");
    let location = first.location.clone().expect("the cache is on by default");
    assert!(
        Path::new(&location).starts_with(xdg.join("cubecl")),
        "not under the user cache directory {}: {location}",
        xdg.display()
    );
    assert!(
        bytes_under(&xdg.join("cubecl")) > 0,
        "nothing written under {}",
        xdg.display()
    );
    assert_eq!(
        bytes_under(&scratch.0.join("work").join("target")),
        0,
        "written into the project's target/ (cubecl's default without burn-graphed)"
    );
    assert_eq!(
        first.enable_after, "Ok(())",
        "on already: enabling again changes nothing"
    );
    // The control: the log sees a compilation where one happens.
    assert!(first.compiled > 0, "{first:?}");
    // What the cache serves on every backend: the autotune picks, whose candidates the first
    // process compiled and timed. (wgpu's WGSL kernels themselves are not stored by cubecl,
    // CUDA's are: the GPU suite's `kernel_cache_serves_compiled_kernels` expects none then.)
    assert!(
        second.compiled < first.compiled,
        "the second process compiled what the first had cached: {first:?} then {second:?}"
    );
    assert_eq!(second.location, first.location);
}

#[test]
fn kernel_cache_off_leaves_cubecl_as_it_is_and_cannot_be_turned_on_late() {
    let scratch = Scratch::new("off");
    let xdg = scratch.0.join("xdg");
    let seen = child(&scratch, "compute", &xdg, Some("off"), 1);
    println!("{seen:?}");
    assert_eq!(seen.location, None);
    assert!(seen.compiled > 0, "{seen:?}");
    assert_eq!(
        seen.enable_after,
        format!("{:?}", Err::<(), _>(GraphedError::KernelCacheTooLate))
    );
    // cubecl's own default: its autotune picks in the project's target/, nothing per user.
    // (Mesa keeps its own shader cache there: `xdg/mesa_shader_cache`.)
    assert_eq!(
        bytes_under(&xdg.join("cubecl")),
        0,
        "written to the user cache directory"
    );
    assert!(bytes_under(&scratch.0.join("work").join("target").join("environment")) > 0);
}

#[test]
fn kernel_cache_in_a_named_directory() {
    let scratch = Scratch::new("named");
    let dir = scratch.0.join("named");
    let xdg = scratch.0.join("xdg");
    let dir_text = dir.display().to_string();
    let first = child(&scratch, "compute", &xdg, Some(&dir_text), 1);
    let second = child(&scratch, "compute", &xdg, Some(&dir_text), 2);
    println!("first process: {first:?}\nsecond process: {second:?}");
    let location = first.location.clone().expect("on");
    assert!(Path::new(&location).starts_with(&dir), "{location}");
    assert_eq!(
        bytes_under(&xdg.join("cubecl")),
        0,
        "written to the user cache directory too: {:?}",
        files_under(&xdg.join("cubecl"))
    );
    assert!(first.compiled > second.compiled, "{first:?} {second:?}");
}

#[test]
fn kernel_cache_that_cannot_be_written_warns_and_the_capture_works() {
    let scratch = Scratch::new("unwritable");
    // A user cache directory under a regular file: no process can make it, root included.
    let file = scratch.0.join("a-file");
    std::fs::write(&file, b"not a folder").expect("a file");
    let xdg: PathBuf = file.join("xdg");
    let seen = child(&scratch, "capture", &xdg, None, 1);
    println!("{seen:?}");
    assert_eq!(seen.location, None, "the cache stays off");
    let warned: Vec<&String> = seen
        .warnings
        .iter()
        .filter(|line| line.contains("kernel cache is off") && line.contains(KERNEL_CACHE_VAR))
        .collect();
    assert_eq!(
        warned.len(),
        1,
        "one warning naming the way out: {:?}",
        seen.warnings
    );
    assert!(
        warned[0].contains(&xdg.join("cubecl").display().to_string()),
        "the warning names the directory: {warned:?}"
    );
}

#[test]
fn kernel_cache_configuration_file_is_kept() {
    let scratch = Scratch::new("file");
    std::fs::write(
        scratch.0.join("work").join("cubecl.toml"),
        "[compilation]\ncache = false\n",
    )
    .expect("a cubecl.toml");
    let xdg = scratch.0.join("xdg");
    let seen = child(&scratch, "compute", &xdg, None, 1);
    println!("{seen:?}");
    assert_eq!(seen.location, None, "the file turned the cache off");
}

#[test]
fn a_capture_under_cubecls_profiling_log_is_refused_with_the_reason() {
    let scratch = Scratch::new("profiled");
    let xdg = scratch.0.join("xdg");
    // `child` turns the log on (`CUBECL_DEBUG_LOG`) for every role but `capture`.
    let out = child(&scratch, "profiled", &xdg, None, 1).stdout;
    let capture = out
        .lines()
        .find_map(|line| line.strip_prefix("capture: "))
        .unwrap_or_else(|| panic!("no capture line in {out}"));
    assert!(
        capture.starts_with("Err(Capture {") && capture.contains("CUBECL_DEBUG_LOG"),
        "the capture was not refused with the reason: {capture}"
    );
}
