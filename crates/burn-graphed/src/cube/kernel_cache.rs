//! cubecl's persistent cache of compiled kernels and autotune results, turned on from code.

use std::path::PathBuf;

use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};

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
