//! The two commands of a fresh machine: `cargo xtask test` and `cargo xtask demo`. Each first
//! makes sure the machine has what it needs (Mesa's software Vulkan for burn's wgpu backend,
//! which records real graphs without a GPU), installing it where it can and saying in one line
//! what to run where it cannot.

use std::path::Path;
use std::process::Command;

/// Debian packages the CPU suite needs: lavapipe (Mesa's software Vulkan) and the Vulkan
/// loader for the wgpu backend; xz and python3 for xtask's own tests of the GPU bundle.
const TEST_PACKAGES: &[&str] = &["mesa-vulkan-drivers", "libvulkan1", "xz-utils", "python3"];
/// Debian packages the demo needs without an NVIDIA GPU.
const DEMO_PACKAGES: &[&str] = &["mesa-vulkan-drivers", "libvulkan1"];

/// `cargo xtask test [ARGS...]`: installs what the suite needs, then runs the README's test
/// command, `cargo test --workspace --locked [ARGS...]`.
pub fn test(args: &[String], root: &Path) -> Result<(), String> {
    ensure_packages(TEST_PACKAGES)?;
    let mut command = cargo();
    command
        .args(["test", "--workspace", "--locked"])
        .args(args)
        .current_dir(root);
    run(command, "the test suite")
}

/// `cargo xtask demo [ARGS...]`: the demo on CUDA where an NVIDIA GPU answers (a release
/// build: its timings are the point), otherwise on wgpu's software graphs (a debug build, the
/// one the tests share: on a CPU Vulkan the timings are not a GPU's anyway), after installing
/// Mesa's software Vulkan where it is missing. `ARGS` go to the demo.
pub fn demo(args: &[String], root: &Path) -> Result<(), String> {
    let mut command = cargo();
    command.args(["run", "--locked", "--example", "train_mlp"]);
    if nvidia_gpu() {
        println!("xtask: an NVIDIA GPU answers: the demo runs on CUDA");
        command.args(["--release", "--features", "cuda"]);
    } else {
        println!(
            "xtask: no NVIDIA GPU answers (nvidia-smi): the demo runs on wgpu's software graphs"
        );
        ensure_packages(DEMO_PACKAGES)?;
    }
    command.arg("--").args(args).current_dir(root);
    run(command, "the demo")
}

fn cargo() -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    // lavapipe warns on every device creation without a runtime directory.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        command.env("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
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
