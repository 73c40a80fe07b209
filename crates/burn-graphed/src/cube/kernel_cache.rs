//! cubecl's persistent cache of compiled kernels and autotune results: turned on from code, and
//! its tuned picks carried from one machine to others (cubecl's environment bundles).

use std::path::{Path, PathBuf};

use cubecl::bundle::{self, BundleFormat, ExportOptions};
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};

use crate::stats::TunedBundle;

/// Turns on cubecl's persistent cache (compiled kernels and autotune results kept on disk
/// between processes), under `dir` or where cubecl's configuration says (`cubecl.toml`, by
/// default the project's `target/`). Every other setting is read from the configuration files
/// as cubecl would. Returns `false`, changing nothing, when cubecl's configuration is already
/// loaded (a tensor operation ran before).
pub(crate) fn enable(dir: Option<PathBuf>) -> bool {
    let mut config = CubeClRuntimeConfig::from_current_dir();
    config.compilation.cache = true;
    if let Some(dir) = dir {
        config.environment.path = CacheConfig::Directory(dir);
    }
    CubeClRuntimeConfig::try_set(config)
}

/// The cache namespaces a bundle leaves out: cubecl's account of how the cache was built
/// (sessions, tuning and compilation records), which another machine has no use for.
const NOT_SHIPPED: &str = "records";

/// Writes what this process's cubecl cache holds (autotune picks; compiled kernels where the
/// cache keeps them) to `out`, as a cubecl bundle, and says what it holds.
///
/// # Errors
///
/// cubecl's export error, as text (the cache cannot be read, `out` cannot be written).
pub(crate) fn export_tuned(out: &Path) -> Result<TunedBundle, String> {
    // The configuration says where the cache lives: loaded now if nothing ran yet.
    let _ = CubeClRuntimeConfig::get();
    let options = ExportOptions {
        name: "burn-graphed kernel picks".into(),
        excluded_namespaces: vec![NOT_SHIPPED.into()],
        format: BundleFormat::Sqlite,
        ..Default::default()
    };
    bundle::export(&[cubecl::environment::path()], out, &options).map_err(|e| e.to_string())?;
    let written = bundle::open(out).map_err(|e| e.to_string())?;
    let (namespaces, entries) = contents(written.as_ref());
    Ok(TunedBundle {
        namespaces,
        entries,
        ..TunedBundle::default()
    })
}

/// The namespaces of `bundle` and how many entries it holds in all.
fn contents(bundle: &dyn bundle::Bundle) -> (Vec<String>, usize) {
    let namespaces = bundle.namespaces();
    let mut entries = 0;
    for namespace in &namespaces {
        bundle.scan(namespace, &mut |_, _| entries += 1);
    }
    (namespaces, entries)
}

/// Copies the bundle at `path` into this process's cubecl cache: entries the cache lacks are
/// added, the cache's own are kept. cubecl reads only the entries of its own version and of
/// this device, and checks each autotune pick against the kernels it tunes.
///
/// # Errors
///
/// cubecl's error opening the bundle, as text (no file, not a bundle).
pub(crate) fn import_tuned(path: &Path) -> Result<TunedBundle, String> {
    let _ = CubeClRuntimeConfig::get();
    let opened = bundle::open(path).map_err(|e| e.to_string())?;
    let (_, entries) = contents(opened.as_ref());
    let report = bundle::import(opened.as_ref());
    Ok(TunedBundle {
        namespaces: report.namespaces,
        entries,
        imported: report.imported,
        skipped: report.skipped,
        failed: report.failed,
    })
}
