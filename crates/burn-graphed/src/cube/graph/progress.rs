//! What a long capture says while it works. A capture runs its callable eagerly a few times
//! and records it; the first capture of a model in a process compiles every new kernel (NVRTC
//! on CUDA) and tunes each new matrix product and reduction, which can take minutes on a
//! transformer, and a silent program for minutes reads as a hang.
//!
//! While a capture is under way, a watcher thread of its own writes an `info` line of target
//! [`TARGET`] after [`FIRST_REPORT`] and every [`EVERY`] after that: what is being captured,
//! the phase it is in (the phases [`super::lifecycle::announce`] names), the time so far and
//! the distinct kernels launched so far; and, when a capture that reported ends, the time it
//! took and the kernels it launched. The lines go through `log`, so the logger's configuration
//! silences them (filter the target out) or shows them; with no logger that would show them,
//! no watcher is started and nothing is counted.
//!
//! The kernels are counted by cubecl's own collection of launched kernels
//! (`cubecl_runtime::launched::LaunchedKernels`, by each compiled kernel's stable hash, on every
//! thread: another capture's launches meanwhile count too). A kernel is compiled, or loaded
//! from the kernel cache, at its first launch in a process, and tuning launches every
//! candidate, so a cold capture's count climbs while it compiles and tunes. How many it will
//! need is not known before its callable has run: the lines give the count, not a fraction.

use std::cell::RefCell;
use std::fmt::Display;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cubecl_runtime::launched::LaunchedKernels;

use crate::sync::lock;

/// The `log` target of the progress lines.
pub(crate) const TARGET: &str = "burn_graphed::progress";

/// How long a capture runs before its first progress line.
pub(crate) const FIRST_REPORT: Duration = Duration::from_secs(1);

/// How often a capture that goes on reports again.
pub(crate) const EVERY: Duration = Duration::from_secs(5);

thread_local! {
    /// The capture under way on this thread, whose phase [`phase`] sets.
    static CURRENT: RefCell<Option<Arc<Shared>>> = const { RefCell::new(None) };
}

/// What the capture's thread and its watcher share.
struct Shared {
    what: String,
    started: Instant,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    phase: String,
    done: bool,
    reports: usize,
    /// Distinct kernels launched since the capture started, as of the last line.
    kernels: usize,
}

/// A capture under way, from [`CaptureProgress::start`] until it is dropped (the capture
/// ended, with its graphs or its error).
pub(crate) struct CaptureProgress {
    shared: Arc<Shared>,
    watcher: Option<JoinHandle<()>>,
    /// The capture this one runs inside, if any, current again when this one ends.
    outer: Option<Arc<Shared>>,
}

/// Intervals set by tests ([`set_intervals`]) in place of [`FIRST_REPORT`] and [`EVERY`], in
/// milliseconds; `u64::MAX` where unset.
static INTERVALS_MS: [AtomicU64; 2] = [AtomicU64::new(u64::MAX), AtomicU64::new(u64::MAX)];

/// Captures from now on report after `first` and every `every` (`burn_graphed::testing`).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn set_intervals(first: Duration, every: Duration) {
    for (slot, interval) in INTERVALS_MS.iter().zip([first, every]) {
        let ms = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX - 1);
        slot.store(ms, Ordering::Relaxed);
    }
}

fn interval(slot: usize, default: Duration) -> Duration {
    match INTERVALS_MS[slot].load(Ordering::Relaxed) {
        u64::MAX => default,
        ms => Duration::from_millis(ms),
    }
}

impl CaptureProgress {
    /// A capture of `what` starts on this thread, reporting after [`FIRST_REPORT`] and every
    /// [`EVERY`].
    pub(crate) fn start(what: impl Into<String>) -> Self {
        super::super::kernel_cache::warn_once_if_unwritable();
        Self::start_with(what, interval(0, FIRST_REPORT), interval(1, EVERY))
    }

    /// [`CaptureProgress::start`] with other intervals.
    pub(crate) fn start_with(what: impl Into<String>, first: Duration, every: Duration) -> Self {
        let shared = Arc::new(Shared {
            what: what.into(),
            started: Instant::now(),
            state: Mutex::new(State {
                phase: "preparing".into(),
                ..State::default()
            }),
            wake: Condvar::new(),
        });
        let watcher = log::log_enabled!(target: TARGET, log::Level::Info).then(|| {
            let shared = shared.clone();
            // Opened here, before the capture's first launch, not on the watcher's thread.
            let launched = LaunchedKernels::new();
            std::thread::Builder::new()
                .name("burn-graphed-progress".into())
                .spawn(move || watch(&shared, first, every, launched))
        });
        // A thread that cannot start leaves the capture silent, not failed.
        let watcher = watcher.and_then(Result::ok);
        let outer = CURRENT.with(|current| current.replace(Some(shared.clone())));
        Self {
            shared,
            watcher,
            outer,
        }
    }

    /// How many progress lines this capture wrote so far.
    #[cfg(test)]
    fn reports(&self) -> usize {
        lock(&self.shared.state).reports
    }
}

impl Drop for CaptureProgress {
    fn drop(&mut self) {
        CURRENT.with(|current| *current.borrow_mut() = self.outer.take());
        lock(&self.shared.state).done = true;
        self.shared.wake.notify_all();
        if let Some(watcher) = self.watcher.take() {
            // The watcher wakes at once and returns: a join costs no waiting.
            let _ = watcher.join();
        }
        let (reports, kernels) = {
            let state = lock(&self.shared.state);
            (state.reports, state.kernels)
        };
        if reports > 0 {
            log::info!(
                target: TARGET,
                "{}: done in {:.1} s, {kernels} distinct kernels launched",
                self.shared.what,
                self.shared.started.elapsed().as_secs_f64()
            );
        }
    }
}

/// Runs `work` on this thread under a watcher of its own, as a capture is watched: after
/// [`FIRST_REPORT`] and every [`EVERY`] a line of target [`TARGET`] says `what`, that it is
/// running, the time so far and the distinct kernels launched so far, and a last line when it
/// ends. For the long work a capture does not cover: a model's first eager steps compile and
/// tune their kernels as a capture's warm-ups do.
pub(crate) fn report_while<T>(what: &str, work: impl FnOnce() -> T) -> T {
    let _progress = CaptureProgress::start(what);
    phase("running");
    work()
}

/// The capture under way on this thread enters `phase` (a no-op without one).
pub(crate) fn phase(phase: impl Display) {
    CURRENT.with(|current| {
        if let Some(shared) = current.borrow().as_ref() {
            lock(&shared.state).phase = phase.to_string();
        }
    });
}

/// The watcher: waits `first`, then reports every `every` until the capture is done, counting
/// the kernels `launched` collects (and, when the capture ends, leaving the count in the state
/// for its last line). The line is written with the state unlocked, so that a slow logger never
/// holds up the capture.
fn watch(shared: &Shared, first: Duration, every: Duration, launched: LaunchedKernels) {
    // A collection hands its kernels back only when it finishes: each count finishes it and
    // continues in a new one, opened first so that no launch falls between the two.
    let mut collection = launched;
    let mut seen = std::collections::HashSet::new();
    let mut count = |collection: &mut LaunchedKernels| {
        let finished = std::mem::replace(collection, LaunchedKernels::new());
        seen.extend(finished.finish());
        seen.len()
    };
    let mut next = first;
    loop {
        let (phase, first_report, kernels) = {
            let mut state = lock(&shared.state);
            loop {
                let waited = shared.started.elapsed();
                if state.done {
                    state.kernels = count(&mut collection);
                    return;
                }
                if waited >= next {
                    break;
                }
                state = match shared.wake.wait_timeout(state, next - waited) {
                    Ok((state, _)) => state,
                    Err(poisoned) => poisoned.into_inner().0,
                };
            }
            state.reports += 1;
            state.kernels = count(&mut collection);
            (state.phase.clone(), state.reports == 1, state.kernels)
        };
        let waited = shared.started.elapsed();
        let hint = if first_report {
            cache_hint()
        } else {
            String::new()
        };
        log::info!(
            target: TARGET,
            "{}: {phase}, {:.0} s so far, {kernels} distinct kernels launched{hint}",
            shared.what,
            waited.as_secs_f64()
        );
        next = waited + every;
    }
}

/// What the first progress line of a capture adds: whether the kernels it compiles and tunes
/// are kept for the next run, and where.
fn cache_hint() -> String {
    match super::super::kernel_cache::location() {
        Some(file) => format!(
            " (each new kernel is compiled and tuned once, and kept for the next run in {})",
            file.display()
        ),
        None => format!(
            " (each new kernel is compiled and tuned in every process: the kernel cache is \
             off, see {} to keep them for the next run)",
            crate::config::KERNEL_CACHE_VAR
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The progress lines of this test binary, on a logger that keeps them.
    struct Lines(Mutex<Vec<String>>);

    impl log::Log for Lines {
        fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
            metadata.target() == TARGET
        }
        fn log(&self, record: &log::Record<'_>) {
            if self.enabled(record.metadata()) {
                lock(&self.0).push(record.args().to_string());
            }
        }
        fn flush(&self) {}
    }

    static LINES: Lines = Lines(Mutex::new(Vec::new()));

    /// A capture of `what` that ends long before it would report.
    fn quiet(what: &str) -> CaptureProgress {
        CaptureProgress::start_with(what, Duration::from_secs(60), Duration::from_secs(60))
    }

    fn lines_of(what: &str) -> Vec<String> {
        let _ = log::set_logger(&LINES);
        log::set_max_level(log::LevelFilter::Info);
        lock(&LINES.0)
            .iter()
            .filter(|line| line.starts_with(what))
            .cloned()
            .collect()
    }

    #[test]
    fn a_long_capture_reports_its_phase_then_its_end() {
        lines_of("");
        let progress = CaptureProgress::start_with(
            "test capture A",
            Duration::from_millis(20),
            Duration::from_millis(40),
        );
        phase("forward warm-up");
        std::thread::sleep(Duration::from_millis(150));
        let reports = progress.reports();
        drop(progress);
        let lines = lines_of("test capture A");
        assert!(reports >= 2, "{lines:?}");
        assert!(
            lines[0].starts_with("test capture A: forward warm-up, ")
                && lines[0].contains(" distinct kernels launched")
                && lines[0].contains("for the next run"),
            "{lines:?}"
        );
        assert!(!lines[1].contains("for the next run"), "{lines:?}");
        assert_eq!(lines.len(), reports + 1, "{lines:?}");
        assert!(
            lines[reports].starts_with("test capture A: done in "),
            "{lines:?}"
        );
    }

    #[test]
    fn work_reported_while_it_runs_says_what_and_when_it_ends() {
        lines_of("");
        set_intervals(Duration::from_millis(20), Duration::from_millis(40));
        let answer = report_while("test work E", || {
            std::thread::sleep(Duration::from_millis(120));
            42
        });
        set_intervals(FIRST_REPORT, EVERY);
        assert_eq!(answer, 42);
        let lines = lines_of("test work E");
        assert!(
            lines.len() >= 3 && lines[0].starts_with("test work E: running, "),
            "{lines:?}"
        );
        assert!(
            lines[lines.len() - 1].starts_with("test work E: done in "),
            "{lines:?}"
        );
    }

    #[test]
    fn a_short_capture_says_nothing() {
        lines_of("");
        let progress = quiet("test capture B");
        phase("forward capture");
        let started = Instant::now();
        drop(progress);
        // The watcher is woken, not waited out.
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(lines_of("test capture B"), Vec::<String>::new());
    }

    #[test]
    fn an_inner_capture_hands_the_phase_back() {
        lines_of("");
        let outer = quiet("test capture C");
        {
            let _inner = quiet("test capture D");
            phase("inner phase");
        }
        phase("outer phase");
        assert_eq!(lock(&outer.shared.state).phase, "outer phase");
    }
}
