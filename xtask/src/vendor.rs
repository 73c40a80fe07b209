//! The upstream crates carried with a patch (`vendor/README.md`), checked (a test of this
//! crate): each copy is its crates.io release, fetched and verified by checksum, with the
//! committed patch applied, byte for byte, and nothing else. Compiled for tests only.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A carried crate: its name and version, the SHA-256 of its `.crate` on crates.io (as
/// `Cargo.lock` recorded it before the patch), where the copy lies and its patch.
struct Carried {
    name: &'static str,
    version: &'static str,
    sha256: &'static str,
    copy: &'static str,
    patch: &'static str,
}

const CARRIED: &[Carried] = &[
    Carried {
        name: "cubecl-cuda",
        version: "0.11.3",
        sha256: "dacd0c047f781b468d094705ef042f28d68944bf862c049f5cf0b7396f730bb5",
        copy: "vendor/cubecl-cuda",
        patch: "vendor/cubecl-cuda.patch",
    },
    Carried {
        name: "cubecl-common",
        version: "0.11.3",
        sha256: "0d0cf12d9bd1ba40cae471d3963f42c50c2c8df699b04ab83a7c2cbb8923800e",
        copy: "vendor/cubecl-common",
        patch: "vendor/cubecl-common.patch",
    },
    Carried {
        name: "burn-cubecl-fusion",
        version: "0.22.1",
        sha256: "cc9bd97d88c053b3c4d62159b21681f6d67018fe1b63d48317cc15e8b349925d",
        copy: "vendor/burn-cubecl-fusion",
        patch: "vendor/burn-cubecl-fusion.patch",
    },
    Carried {
        name: "burn-cubecl",
        version: "0.22.1",
        sha256: "8d00b95290d2a8de2529aea94c1106a96c7f433eb314da1bba133c068479e3ce",
        copy: "vendor/burn-cubecl",
        patch: "vendor/burn-cubecl.patch",
    },
    Carried {
        name: "burn-backend",
        version: "0.22.1",
        sha256: "4e50f934127d772ca3a687e7aa5f9fd671cc66dec253d383f4391b1a97031401",
        copy: "vendor/burn-backend",
        patch: "vendor/burn-backend.patch",
    },
];

fn run(command: &mut Command) -> Result<String, String> {
    let output = command
        .output()
        .map_err(|e| format!("{command:?} did not start: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{command:?} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The release's `.crate` file: cargo's download cache where it holds it, else fetched from
/// crates.io into `scratch`. Its checksum is checked either way.
fn release_archive(carried: &Carried, scratch: &Path) -> Result<PathBuf, String> {
    let file = format!("{}-{}.crate", carried.name, carried.version);
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .ok_or("neither CARGO_HOME nor HOME is set")?;
    let cached = std::fs::read_dir(cargo_home.join("registry/cache"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|index| index.path().join(&file))
        .find(|path| path.is_file());
    let archive = match cached {
        Some(path) => path,
        None => {
            let target = scratch.join(&file);
            let url = format!("https://static.crates.io/crates/{}/{file}", carried.name);
            run(Command::new("python3").args([
                "-c",
                "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])",
                &url,
                &target.to_string_lossy(),
            ]))?;
            target
        }
    };
    let sum = run(Command::new("sha256sum").arg(&archive))?;
    if sum.split_whitespace().next() != Some(carried.sha256) {
        return Err(format!(
            "{} has SHA-256 {sum}, not crates.io's {}",
            archive.display(),
            carried.sha256
        ));
    }
    Ok(archive)
}

/// Every file under `dir`, as paths relative to it, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next)
            .expect("readable directory")
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                found.push(path.strip_prefix(dir).expect("under dir").to_path_buf());
            }
        }
    }
    found.sort();
    found
}

/// The files in which `a` and `b` differ, or that only one of them has.
fn differences(a: &Path, b: &Path) -> Vec<String> {
    let (in_a, in_b) = (files(a), files(b));
    let mut differ = Vec::new();
    for path in in_a.iter().filter(|p| !in_b.contains(p)) {
        differ.push(format!("{} only in the release", path.display()));
    }
    for path in in_b.iter().filter(|p| !in_a.contains(p)) {
        differ.push(format!("{} only in the copy", path.display()));
    }
    for path in in_a.iter().filter(|p| in_b.contains(p)) {
        if std::fs::read(a.join(path)).ok() != std::fs::read(b.join(path)).ok() {
            differ.push(format!("{} differs", path.display()));
        }
    }
    differ
}

#[test]
fn carried_crates_are_their_release_plus_the_listed_patch() {
    let root = crate::root();
    for carried in CARRIED {
        let scratch = std::env::temp_dir().join(format!(
            "xtask-vendor-{}-{}",
            carried.name,
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).expect("scratch directory");
        let archive = release_archive(carried, &scratch).unwrap_or_else(|e| panic!("{e}"));
        run(Command::new("tar")
            .arg("xzf")
            .arg(&archive)
            .arg("-C")
            .arg(&scratch))
        .unwrap_or_else(|e| panic!("{e}"));
        let release = scratch.join(format!("{}-{}", carried.name, carried.version));
        let copy = root.join(carried.copy);
        // Negative control: the release and the copy differ, exactly where the patch says.
        let before = differences(&release, &copy);
        assert!(
            !before.is_empty(),
            "{} is the release itself: drop the patch",
            carried.copy
        );
        run(Command::new("git")
            .args(["apply", "-p1", "--whitespace=nowarn"])
            .arg(root.join(carried.patch))
            .current_dir(&release))
        .unwrap_or_else(|e| panic!("{} does not apply to the release: {e}", carried.patch));
        let after = differences(&release, &copy);
        assert!(
            after.is_empty(),
            "{} is not {} {} with {} applied: {after:?}",
            carried.copy,
            carried.name,
            carried.version,
            carried.patch
        );
        let _ = std::fs::remove_dir_all(&scratch);
    }
}

/// The workspace's `[patch.crates-io]` entries as (crate, path) pairs, read line by line (each
/// entry is one `name = { path = "..." }` line).
fn patch_entries(manifest: &str) -> Vec<(String, String)> {
    let mut inside = false;
    let mut entries = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == "[patch.crates-io]";
            continue;
        }
        if !inside || line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (name, rest) = line
            .split_once('=')
            .expect("an entry is `name = { path = .. }`");
        let path = rest
            .split_once("path = \"")
            .and_then(|(_, after)| after.split_once('"'))
            .map(|(path, _)| path.to_string())
            .unwrap_or_else(|| panic!("a [patch.crates-io] entry without a path: {line}"));
        entries.push((name.trim().to_string(), path));
    }
    entries
}

/// A user's workspace copies the `[patch.crates-io]` section (README: cargo applies patches only
/// from the root workspace), each entry as `{ git = URL }`: cargo then finds the crate in this
/// repository by its package name. So every entry is a folder of this repository whose package
/// has the entry's name, and the README says to copy the section.
#[test]
fn patch_entries_resolve_by_name_for_a_git_dependency() {
    let root = crate::root();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    let entries = patch_entries(&manifest);
    for carried in CARRIED {
        assert!(
            entries
                .iter()
                .any(|(name, path)| name == carried.name && path == carried.copy),
            "{} at {} is in [patch.crates-io]: {entries:?}",
            carried.name,
            carried.copy
        );
    }
    let package_name = |path: &str| {
        let package = std::fs::read_to_string(root.join(path).join("Cargo.toml"))
            .unwrap_or_else(|e| panic!("{path}/Cargo.toml: {e}"));
        package
            .lines()
            .skip_while(|line| line.trim() != "[package]")
            .find_map(|line| line.trim().strip_prefix("name = "))
            .map(|name| name.trim_matches('"').to_string())
    };
    for (name, path) in &entries {
        assert_eq!(
            package_name(path).as_deref(),
            Some(name.as_str()),
            "the package at {path}"
        );
    }
    // Negative control: an entry whose key is not its package's name reads as such.
    let wrong =
        patch_entries("[patch.crates-io]\nnot-cubecl = { path = \"vendor/cubecl-cuda\" }\n");
    assert_eq!(wrong.len(), 1);
    assert_ne!(
        package_name(&wrong[0].1).as_deref(),
        Some(wrong[0].0.as_str())
    );
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    assert!(
        readme.contains("`[patch.crates-io]`"),
        "README tells a user to copy the section"
    );
}
