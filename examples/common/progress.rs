//! The examples' logger for burn-graphed's capture progress (`log` target
//! `burn_graphed::progress`: a capture that compiles and tunes kernels for more than a second
//! says what it is doing and how many kernels it launched, then how long it took). On a
//! terminal each capture is a spinner (indicatif) that shows the latest line and keeps turning;
//! elsewhere (a pipe, a CI log) the lines are printed as they come. `BURN_GRAPHED_PROGRESS=off`
//! silences them.

use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// The spinner of the capture under way, if one is shown.
struct Progress {
    spinner: Mutex<Option<ProgressBar>>,
}

static PROGRESS: Progress = Progress {
    spinner: Mutex::new(None),
};

/// Runs step `step` of an eager loop: the first (which compiles and tunes every kernel it
/// launches) under burn-graphed's watcher, which says so while it works.
#[allow(dead_code)] // not every example trains eagerly
pub fn eager_step<T>(step: usize, work: impl FnOnce() -> T) -> T {
    if step == 0 {
        burn_graphed::report_progress("eager first step", work)
    } else {
        work()
    }
}

/// Installs the logger (a no-op where another logger is installed already, or with
/// `BURN_GRAPHED_PROGRESS=off`).
pub fn install() {
    if std::env::var("BURN_GRAPHED_PROGRESS").is_ok_and(|v| v == "off") {
        return;
    }
    if log::set_logger(&PROGRESS).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}

impl log::Log for Progress {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.target() == "burn_graphed::progress" && metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let line = record.args().to_string();
        let mut spinner = self.spinner.lock().unwrap_or_else(|e| e.into_inner());
        // The library's last line of a capture: "...: done in N s".
        if line.contains(": done in ") {
            match spinner.take() {
                Some(bar) => bar.finish_with_message(line),
                None => eprintln!("{line}"),
            }
            return;
        }
        let bar = spinner.get_or_insert_with(|| {
            let bar = ProgressBar::new_spinner();
            if let Ok(style) = ProgressStyle::with_template("{spinner} {msg}") {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        });
        if bar.is_hidden() {
            // Not a terminal: no spinner to draw, the line as it is.
            eprintln!("{line}");
        }
        bar.set_message(line);
    }

    fn flush(&self) {}
}
