//! Warnings of the libraries under the bench (cubecl, burn) on stderr, each with the phase of
//! the run it came in (`# WARN [capture] target: first line`).
//!
//! Why: cubecl's autotuner says only there that it "measured no candidate" for a key and
//! decided one unmeasured: what happens to a key first met inside a graph recording, where
//! profiling is refused. The decision (the first candidate that launches, often the slowest,
//! e.g. the direct convolution for a weight gradient) is kept for the rest of the process, and
//! its autotune log (`BURN_GRAPHED_AUTOTUNE_LOG`) leaves it out. Each row counts them
//! (`autotune_unmeasured`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The run's phase: set by `trace_phase`, refined by burn-graphed's capture announcements.
static PHASE: Mutex<String> = Mutex::new(String::new());
static UNMEASURED: AtomicUsize = AtomicUsize::new(0);
/// burn-graphed announces each capture phase with a debug event of this target.
const CAPTURE_TARGET: &str = "burn_graphed::capture";

struct Warnings;

impl log::Log for Warnings {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Warn || metadata.target() == CAPTURE_TARGET
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let message = record.args().to_string();
        if record.target() == CAPTURE_TARGET {
            *PHASE.lock().unwrap_or_else(|e| e.into_inner()) = format!("capture: {message}");
            return;
        }
        if message.contains("measured no candidate") {
            UNMEASURED.fetch_add(1, Ordering::Relaxed);
        }
        // One per launch `--kernel-trace` could not time (its report counts them).
        if message.starts_with("Skipped timing a launch") {
            return;
        }
        // An unmeasured decision's message goes on with every candidate's outcome (its
        // error names why it was not measured): kept whole, on one line. (A cap of 6000
        // characters cut the matmul sets' lists, about 30 candidates, short.)
        let (lines, width) = if message.contains("measured no candidate") {
            (usize::MAX, 50_000)
        } else {
            (1, 400)
        };
        let text: String = message
            .lines()
            .take(lines)
            .collect::<Vec<_>>()
            .join(" | ")
            .chars()
            .take(width)
            .collect();
        eprintln!(
            "# {} [{}] {}: {text}",
            record.level(),
            phase(),
            record.target()
        );
    }

    fn flush(&self) {}
}

/// Installs the logger (once per process; a second call changes nothing).
pub fn install() {
    if log::set_logger(&Warnings).is_ok() {
        log::set_max_level(log::LevelFilter::Warn);
    }
}

/// Starts phase `name`. Debug events reach the logger only in `setup` and `capture` (where
/// burn-graphed announces its phases): every `log::debug!` of the libraries asks the logger
/// whether it is enabled while the level allows it, which the timed steps should not pay.
pub fn set_phase(name: &str) {
    *PHASE.lock().unwrap_or_else(|e| e.into_inner()) = name.to_string();
    log::set_max_level(match name {
        "setup" | "capture" => log::LevelFilter::Debug,
        _ => log::LevelFilter::Warn,
    });
}

/// The current phase.
pub fn phase() -> String {
    PHASE.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Autotune decisions taken unmeasured so far in this process.
pub fn unmeasured() -> usize {
    UNMEASURED.load(Ordering::Relaxed)
}
