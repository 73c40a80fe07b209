//! The CPU suite's kernel picks: cubecl's autotune on lavapipe compiles and times every
//! candidate kernel of each new matrix-product and reduction shape in software, which was most
//! of the suite's time on a fresh machine (a run's cubecl records: 2268 s of tuning, of it
//! 1149 s compiling matrix-product candidates, beside a suite of about 21 minutes). The suite
//! imports the picks a run made (`tests/fixtures/lavapipe-picks.bundle.xz`, written by
//! `tests/tuned_bundle.rs`'s `write_suite_picks` and compressed with `xz -9`) before its first
//! wgpu operation, as a user imports a cluster's picks: the kernels are then compiled once,
//! without the candidates. Only the time changes: cubecl checks every imported pick against the
//! kernels it tunes and tunes a shape the bundle lacks, and the checks compare graphed with
//! eager runs on the same picks.

use std::sync::Once;

use burn::prelude::*;

/// The compressed bundle, relative to the suite's manifest.
const PICKS: &str = "tests/fixtures/lavapipe-picks.bundle.xz";

/// The default wgpu device (lavapipe on a machine without a GPU), after the suite's picks were
/// imported into this process's cubecl cache (once per process, before its first operation).
///
/// # Panics
///
/// When the bundle cannot be decompressed (`xz` missing: `cargo xtask test` installs it) or
/// imported.
pub fn wgpu() -> Device {
    static IMPORTED: Once = Once::new();
    IMPORTED.call_once(import);
    Device::wgpu(Default::default())
}

fn import() {
    let packed = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(PICKS);
    let bundle = std::env::temp_dir().join(format!(
        "burn-graphed-suite-picks-{}.bundle",
        std::process::id()
    ));
    let unpacked = std::process::Command::new("xz")
        .args(["--decompress", "--stdout"])
        .arg(&packed)
        .output()
        .unwrap_or_else(|e| panic!("running xz on {} (install xz-utils): {e}", packed.display()));
    assert!(
        unpacked.status.success(),
        "xz could not decompress {}: {}",
        packed.display(),
        String::from_utf8_lossy(&unpacked.stderr)
    );
    std::fs::write(&bundle, &unpacked.stdout).expect("the unpacked bundle");
    let imported = burn_graphed::import_tuned(&bundle);
    let _ = std::fs::remove_file(&bundle);
    let imported = imported.expect("the suite's kernel picks");
    assert_eq!(imported.failed, 0, "{imported:?}");
}
