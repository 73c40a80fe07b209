//! `export_tuned` and `import_tuned` between two processes, as between two machines: each
//! process gets a cache of its own (`enable_kernel_cache` moves it before the first tensor
//! operation).
//! The first tunes a matrix product and exports; the second imports into its empty cache and
//! computes the same product without tuning. Whether a process tuned is read from cubecl's
//! records of its tunings, not from a timing.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::prelude::*;
use burn_cubecl::cubecl::environment;
use burn_graphed::GraphedError;

/// Set in the second process: the bundle to import.
const IMPORT: &str = "BURN_GRAPHED_TUNED_IMPORT";

/// cubecl's records of the tunings this process's cache saw (one per tuned key).
fn tunings() -> u64 {
    environment::namespaces()
        .into_iter()
        .filter(|summary| summary.namespace.ends_with("records/v1/autotune"))
        .map(|summary| summary.entries)
        .sum()
}

/// A fresh folder, made the working directory, and this process's kernel cache moved into it
/// (`enable_kernel_cache` with the cache on from process start, as by default).
fn enter_fresh_project(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("a temporary folder");
    std::env::set_current_dir(dir).expect("into the temporary folder");
    burn_graphed::enable_kernel_cache(Some(dir.join("cache"))).expect("the cache is on");
}

/// A product whose shape cubecl's autotune tunes (the rows are multiples of the columns'
/// ramp, so the sums are exact in `f32` and the result is known).
fn product(device: &Device) {
    let lhs = Tensor::<1, Int>::arange(0..48 * 40, device)
        .float()
        .reshape([48, 40])
        .div_scalar(1024.0);
    let rhs = Tensor::<2>::ones([40, 24], device);
    let out = lhs
        .matmul(rhs)
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32");
    for (index, value) in out.iter().enumerate() {
        let row = (index / 24) as f32;
        let expected = (0..40).map(|k| row * 40.0 + k as f32).sum::<f32>() / 1024.0;
        assert_eq!(*value, expected, "element {index}");
    }
}

fn work_dir() -> PathBuf {
    std::env::temp_dir().join(format!("burn-graphed-tuned-{}", std::process::id()))
}

#[test]
fn tuned_picks_travel_to_a_fresh_cache() {
    let work = work_dir();
    enter_fresh_project(&work.join("tuner"));
    let device = Device::wgpu(Default::default());
    let before = tunings();
    product(&device);
    let tuned = tunings() - before;
    // The control: the records see a tuning where one happens.
    assert!(tuned > 0, "no tuning recorded for a first product: {tuned}");
    let bundle = work.join("picks.bundle");
    let exported = burn_graphed::export_tuned(&bundle).expect("export");
    println!("exported: {exported:?}");
    assert!(exported.entries > 0, "{exported:?}");
    assert!(
        exported.namespaces.iter().any(|n| n.contains("autotune/")),
        "{exported:?}"
    );
    assert!(
        exported
            .namespaces
            .iter()
            .all(|n| !n.starts_with("records")),
        "cubecl's records are not shipped: {exported:?}"
    );
    let child = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "--exact",
            "imported_picks_are_not_tuned_again",
            "--ignored",
            "--nocapture",
        ])
        .env(IMPORT, &bundle)
        .output()
        .expect("the importing process");
    let stdout = String::from_utf8_lossy(&child.stdout);
    println!("importing process: {stdout}");
    let _ = std::fs::remove_dir_all(&work);
    assert!(
        child.status.success() && stdout.contains("1 passed"),
        "the importing process failed: {stdout}\n{}",
        String::from_utf8_lossy(&child.stderr)
    );
}

/// The second process of [`tuned_picks_travel_to_a_fresh_cache`], which runs it.
#[test]
#[ignore = "the importing process of tuned_picks_travel_to_a_fresh_cache, which runs it"]
fn imported_picks_are_not_tuned_again() {
    let bundle = PathBuf::from(std::env::var_os(IMPORT).expect("run by the exporting test"));
    enter_fresh_project(&bundle.with_file_name("importer"));
    let missing = bundle.with_file_name("no-such.bundle");
    match burn_graphed::import_tuned(&missing) {
        Err(GraphedError::TunedBundle { argument, path, .. }) => {
            assert_eq!(argument, "path");
            assert_eq!(path, missing.display().to_string());
        }
        other => panic!("expected TunedBundle naming `path`, got {other:?}"),
    }
    let imported = burn_graphed::import_tuned(&bundle).expect("import");
    println!("imported: {imported:?}");
    assert!(imported.imported > 0, "{imported:?}");
    assert_eq!(
        (imported.skipped, imported.failed),
        (0, 0),
        "a fresh cache takes every entry: {imported:?}"
    );
    let device = Device::wgpu(Default::default());
    let before = tunings();
    product(&device);
    assert_eq!(tunings(), before, "the imported picks were tuned again");
}

/// Writes the kernel picks of the cubecl cache in `target/environment` (where `cargo xtask
/// test` keeps the CPU suite's) to the bundle that the CPU suite imports before its first wgpu
/// operation (`tests/scenarios/picks.rs`). A maintainer's command, for when the suite's shapes
/// changed (the suite then tunes the new ones, which costs time and nothing else):
/// `BURN_GRAPHED_KERNEL_CACHE=$PWD/target/environment cargo test --test tuned_bundle --
/// --ignored --exact write_suite_picks`.
#[test]
#[ignore = "a maintainer's command: writes the CPU suite's kernel picks from target/environment"]
fn write_suite_picks() {
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lavapipe-picks.bundle");
    let written = burn_graphed::export_tuned(&out).expect("export");
    println!("{}: {written:?}", out.display());
    assert!(
        written.entries > 0,
        "nothing to write: run the CPU suite first"
    );
}
