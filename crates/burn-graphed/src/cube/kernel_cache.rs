//! cubecl's persistent cache of compiled kernels and autotune results: on by default from
//! process start, chosen or moved from code, and its tuned picks carried from one machine to
//! others (cubecl's environment bundles).
//!
//! cubecl reads its configuration once, at the first tensor operation, and turns its kernel
//! cache on only from there, so a library that waits for its first call is always too late.
//! [`at_process_start`] runs before `main` and gives cubecl a computed default through
//! `try_set`, the hook cubecl provides to libraries for this: the cache on, under cubecl's
//! per-user directory, wherever the user's own configuration does not say otherwise.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Once, OnceLock};

use cubecl::bundle::{self, BundleFormat, ExportOptions};
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};

use crate::config::KERNEL_CACHE_VAR;
use crate::stats::TunedBundle;

/// What process start did with cubecl's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum AtStart {
    /// The cache is on, its environments kept under `root`.
    On { root: PathBuf },
    /// The user's configuration file says whether the cache is on (`[compilation] cache`):
    /// left to cubecl, which loads it at the first tensor operation.
    Configured { file: PathBuf },
    /// [`KERNEL_CACHE_VAR`] is `off`.
    OptedOut,
    /// The cache's directory cannot be written: left off (cubecl keeps its picks in memory),
    /// said once at the first capture.
    Unwritable { root: PathBuf, reason: String },
    /// cubecl's configuration was loaded before the hook ran (another constructor ran a tensor
    /// operation): left as it is.
    AlreadyLoaded,
}

static AT_START: OnceLock<AtStart> = OnceLock::new();

/// What the process start decided; `None` where the hook did not run (a platform without
/// constructors before `main`).
pub(crate) fn at_start() -> Option<&'static AtStart> {
    AT_START.get()
}

// SAFETY: a constructor runs before `main`, where Rust's runtime promises nothing; this one
// relies only on what the platform's C runtime has set up by then on the targets burn-graphed
// builds for (Linux, macOS, Windows): the allocator, the environment, the file system and
// locks. It starts no thread, and no panic leaves it (`catch_unwind`; a panic there would
// abort the process): whatever fails leaves cubecl's configuration unloaded, as without the
// hook.
#[ctor::ctor(unsafe)]
fn kernel_cache_at_process_start() {
    let decided = std::panic::catch_unwind(at_process_start).unwrap_or(AtStart::AlreadyLoaded);
    let _ = AT_START.set(decided);
}

/// Reads [`KERNEL_CACHE_VAR`] and the user's cubecl configuration file (as cubecl would find
/// it: `cubecl.toml`, or a `burn.toml`'s `[cubecl]` table, in the working directory or above)
/// and, where nothing says otherwise, turns the cache on under cubecl's per-user directory.
fn at_process_start() -> AtStart {
    let var = std::env::var_os(KERNEL_CACHE_VAR);
    let file = config_file();
    let plan = plan(
        var.as_deref(),
        file.as_ref().map(|(path, table)| (path.as_path(), table)),
    );
    let root_choice = match plan {
        Plan::LeaveAlone(decided) => return decided,
        Plan::TurnOn(root_choice) => root_choice,
    };
    let mut config = from_table(file.map(|(_, table)| table)).override_from_env();
    config.compilation.cache = true;
    match root_choice {
        Root::AsConfigured => {}
        Root::UserCache => config.environment.path = CacheConfig::Global,
        Root::Directory(dir) => config.environment.path = CacheConfig::Directory(dir),
    }
    let root = config.environment.path.root();
    if let Err(reason) = writable(&root) {
        return AtStart::Unwritable { root, reason };
    }
    if CubeClRuntimeConfig::try_set(config) {
        AtStart::On { root }
    } else {
        AtStart::AlreadyLoaded
    }
}

/// What [`at_process_start`] does, decided from [`KERNEL_CACHE_VAR`] and the user's
/// configuration file (its path and, for a `burn.toml`, its `[cubecl]` table).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Plan {
    LeaveAlone(AtStart),
    /// Turn the cache on, rooted there.
    TurnOn(Root),
}

/// Where [`Plan::TurnOn`] roots the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Root {
    /// Where the user's configuration file says (`[environment] path`).
    AsConfigured,
    /// cubecl's per-user cache directory (its `global` path).
    UserCache,
    /// The directory [`KERNEL_CACHE_VAR`] names.
    Directory(PathBuf),
}

fn plan(var: Option<&OsStr>, file: Option<(&Path, &toml::Table)>) -> Plan {
    let says = |section: &str, key: &str| {
        file.and_then(|(_, table)| table.get(section))
            .and_then(|section| section.get(key))
            .is_some()
    };
    match var {
        Some(var)
            if ["off", "0", "false"]
                .iter()
                .any(|off| var.eq_ignore_ascii_case(off)) =>
        {
            Plan::LeaveAlone(AtStart::OptedOut)
        }
        // Asked for by name: on, there, whatever a file says.
        Some(dir) if !dir.is_empty() => Plan::TurnOn(Root::Directory(dir.into())),
        _ if says("compilation", "cache") => Plan::LeaveAlone(AtStart::Configured {
            file: file.map(|(path, _)| path.to_path_buf()).unwrap_or_default(),
        }),
        _ if says("environment", "path") => Plan::TurnOn(Root::AsConfigured),
        _ => Plan::TurnOn(Root::UserCache),
    }
}

/// The configuration file cubecl would load from the working directory, and its table (a
/// `burn.toml`'s `[cubecl]` one). Files that do not parse are passed over, as cubecl does.
fn config_file() -> Option<(PathBuf, toml::Table)> {
    let mut dir = std::env::current_dir().ok()?;
    loop {
        for name in CubeClRuntimeConfig::file_names() {
            if let Some(table) = table_at(&dir.join(name)) {
                return Some((dir.join(name), table));
            }
        }
        for (name, section) in CubeClRuntimeConfig::section_file_names() {
            let section = table_at(&dir.join(name))
                .and_then(|mut table| table.remove(*section))
                .and_then(|value| value.try_into::<toml::Table>().ok());
            if let Some(table) = section {
                return Some((dir.join(name), table));
            }
        }
        if !dir.pop() {
            return None;
        }
    }
}

fn table_at(path: &Path) -> Option<toml::Table> {
    std::fs::read_to_string(path).ok()?.parse().ok()
}

/// cubecl's configuration from the table [`config_file`] found, as cubecl reads the file (a
/// table that does not fit is passed over, as cubecl passes over the file); its defaults
/// without one.
fn from_table(table: Option<toml::Table>) -> CubeClRuntimeConfig {
    table
        .and_then(|table| toml::Value::Table(table).try_into().ok())
        .unwrap_or_default()
}

/// Whether a file can be made in `root` (made if missing); the reason where not.
fn writable(root: &Path) -> Result<(), String> {
    std::fs::create_dir_all(root).map_err(|e| e.to_string())?;
    let probe = root.join(format!(".burn-graphed-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Says once, at the first capture, where the process-start hook could not turn the cache on
/// for want of a writable directory (no logger is set before `main`).
pub(crate) fn warn_once_if_unwritable() {
    static WARNED: Once = Once::new();
    if let Some(AtStart::Unwritable { root, reason }) = at_start() {
        WARNED.call_once(|| {
            log::warn!(
                target: "burn_graphed::kernel_cache",
                "the kernel cache is off: {} cannot be written ({reason}); every process \
                 compiles and tunes its kernels again. Set {KERNEL_CACHE_VAR} to a writable \
                 directory, or to `off` to silence this",
                root.display()
            );
        });
    }
}

/// Where this process keeps compiled kernels and autotune picks for the next one: cubecl's
/// environment file, or `None` where the kernel cache is off (picks then last for the process
/// alone, or for the project, as cubecl's configuration says). Loads cubecl's configuration.
pub(crate) fn location() -> Option<PathBuf> {
    CubeClRuntimeConfig::get()
        .compilation
        .cache
        .then(cubecl::environment::path)
}

/// Turns on cubecl's persistent cache (compiled kernels and autotune results kept on disk
/// between processes), under `dir` or where cubecl's configuration says. With the cache on
/// already (by default, from process start), moves it to `dir` for every store opened or used
/// from now on. Returns `false`, changing nothing, when the cache is off and cubecl's
/// configuration is already loaded (a tensor operation ran before).
pub(crate) fn enable(dir: Option<PathBuf>) -> bool {
    let loaded = CubeClRuntimeConfig::storage().lock().as_ref().cloned();
    match loaded {
        Some(config) if config.compilation.cache => {
            if let Some(dir) = dir {
                cubecl::environment::set_root(dir);
            }
            true
        }
        Some(_) => false,
        None => {
            let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
            config.compilation.cache = true;
            if let Some(dir) = dir {
                config.environment.path = CacheConfig::Directory(dir);
            }
            CubeClRuntimeConfig::try_set(config)
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> toml::Table {
        text.parse().expect("a toml table")
    }

    #[test]
    fn the_variable_turns_the_cache_off_or_names_its_directory() {
        let file = table("[compilation]\ncache = false\n");
        let file = Some((Path::new("/p/cubecl.toml"), &file));
        for off in ["off", "OFF", "0", "false"] {
            assert_eq!(
                plan(Some(OsStr::new(off)), file),
                Plan::LeaveAlone(AtStart::OptedOut)
            );
        }
        // A named directory wins over the file's word.
        assert_eq!(
            plan(Some(OsStr::new("/cache/here")), file),
            Plan::TurnOn(Root::Directory("/cache/here".into()))
        );
    }

    #[test]
    fn a_file_that_says_whether_the_cache_is_on_is_left_to_cubecl() {
        for text in [
            "[compilation]\ncache = false\n",
            "[compilation]\ncache = true\n",
        ] {
            let file = table(text);
            // An empty variable counts as unset.
            for var in [None, Some(OsStr::new(""))] {
                assert_eq!(
                    plan(var, Some((Path::new("/p/cubecl.toml"), &file))),
                    Plan::LeaveAlone(AtStart::Configured {
                        file: "/p/cubecl.toml".into()
                    })
                );
            }
        }
    }

    #[test]
    fn otherwise_the_cache_turns_on_where_the_file_or_the_user_cache_says() {
        let rooted = table("[environment]\npath = \"target\"\n");
        assert_eq!(
            plan(None, Some((Path::new("/p/cubecl.toml"), &rooted))),
            Plan::TurnOn(Root::AsConfigured)
        );
        let silent = table("[autotune]\nlevel = \"minimal\"\n");
        assert_eq!(
            plan(None, Some((Path::new("/p/cubecl.toml"), &silent))),
            Plan::TurnOn(Root::UserCache)
        );
        assert_eq!(plan(None, None), Plan::TurnOn(Root::UserCache));
    }

    #[test]
    fn the_file_s_other_settings_are_read_as_cubecl_reads_them() {
        let named = from_table(Some(table("[environment]\nname = \"h200\"\n")));
        assert_eq!(named.environment.name, "h200");
        // A table that does not fit gives the defaults, as cubecl passes over such a file.
        let wrong = from_table(Some(table("[environment]\nname = 3\n")));
        assert_eq!(
            wrong.environment.name,
            CubeClRuntimeConfig::default().environment.name
        );
        assert!(!from_table(None).compilation.cache);
    }

    #[test]
    fn a_directory_that_cannot_be_made_is_not_writable() {
        let file =
            std::env::temp_dir().join(format!("burn-graphed-probe-file-{}", std::process::id()));
        std::fs::write(&file, b"a file, not a folder").expect("a temporary file");
        let under_a_file = file.join("cache");
        let refused = writable(&under_a_file);
        let made =
            std::env::temp_dir().join(format!("burn-graphed-probe-dir-{}", std::process::id()));
        let accepted = writable(&made);
        let _ = std::fs::remove_file(&file);
        let _ = std::fs::remove_dir_all(&made);
        assert!(refused.is_err(), "{refused:?}");
        assert_eq!(accepted, Ok(()));
    }
}
