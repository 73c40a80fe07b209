//! Every kernel a run launches, with its device time (`--kernel-trace FILE`, backends with
//! cubecl): a cubecl launch observer that asks for each launch to be timed on the device
//! without waiting (events in the stream, read after the run). Appends per run: the kernels
//! launched while a graph recorded (in order; burn-graphed announces its capture phases, see
//! [`warn_log`]), and per phase (setup, the capture's warm-ups, recordings and validation,
//! warm-up, timed, read back, check) each kernel's launches and device time. Launches without
//! a time are counted apart: a recorded launch cannot be timed, nor one that failed or that cubecl
//! skipped because an input carries an earlier failure (an H100's eager bf16 CNN: 114 of the
//! 126 launches of its timed steps; see [`assert_ran`](super::assert_ran)), so "untimed" does
//! not mean "recorded". The timing events cost the host a round trip per launch: a traced
//! run's step times are not results.

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use burn_cubecl::cubecl::config::{TypeNameFormatLevel, type_name_format};
use burn_cubecl::cubecl::future::block_on;
use burn_cubecl::cubecl::logging::{
    Duration, LaunchObservation, LaunchObserver, ProfileDuration, TimingMethod, TimingRequest,
};

/// One launch: the phase it happened in, the kernel, and its measurement if one was taken.
struct Launch {
    phase: String,
    kernel: &'static str,
    profile: Option<ProfileDuration>,
    duration: Option<Duration>,
}

#[derive(Default)]
struct Recorder {
    launches: Mutex<Vec<Launch>>,
}

impl Recorder {
    /// Applies `f` to the last launch of `kernel` that has no measurement yet.
    fn with_untimed(&self, kernel: &str, f: impl FnOnce(&mut Launch)) {
        let mut launches = self.launches.lock().unwrap();
        if let Some(launch) = launches
            .iter_mut()
            .rev()
            .find(|l| l.kernel == kernel && l.profile.is_none() && l.duration.is_none())
        {
            f(launch);
        }
    }
}

impl LaunchObserver for Recorder {
    fn launched(&self, kernel: &'static str) {
        let phase = super::warn_log::phase();
        self.launches.lock().unwrap().push(Launch {
            phase,
            kernel,
            profile: None,
            duration: None,
        });
    }

    fn timing(&self) -> TimingRequest {
        TimingRequest::Deferred
    }

    // Called on the launching thread right after `launched`: the measurement belongs to
    // the last launch of that kernel that has none.
    fn profiled(&self, kernel: &'static str, profile: ProfileDuration) {
        self.with_untimed(kernel, |launch| launch.profile = Some(profile));
    }

    fn timed(&self, kernel: &'static str, duration: Duration, _method: TimingMethod) {
        self.with_untimed(kernel, |launch| launch.duration = Some(duration));
    }
}

static RECORDER: OnceLock<Arc<Recorder>> = OnceLock::new();
/// The phases (as burn-graphed announces them) in which launches are recorded, not run.
const RECORDINGS: [&str; 2] = ["capture: forward capture", "capture: backward capture"];

/// Traces launches until dropped, then appends the report of run `label` to `file`.
pub struct Trace {
    _observation: LaunchObservation,
    file: String,
    label: String,
}

impl Trace {
    pub fn start(file: &str, label: &str) -> Self {
        let recorder = RECORDER.get_or_init(Default::default).clone();
        recorder.launches.lock().unwrap().clear();
        Self {
            _observation: LaunchObservation::new(recorder),
            file: file.into(),
            label: label.into(),
        }
    }
}

/// A kernel's type name without module paths (cubecl's `Balanced` format) nor the element
/// type placeholders every matmul carries, cut to a readable length.
fn short(kernel: &str) -> String {
    type_name_format(kernel, TypeNameFormatLevel::Balanced)
        .split(" | ")
        .filter(|part| !part.starts_with("Dynamic") && !part.starts_with("__"))
        .collect::<Vec<_>>()
        .join(" | ")
        .chars()
        .take(200)
        .collect()
}

impl Drop for Trace {
    fn drop(&mut self) {
        let Some(recorder) = RECORDER.get() else {
            return;
        };
        let launches = std::mem::take(&mut *recorder.launches.lock().unwrap());
        let mut out = format!("## {}: {} launches\n", self.label, launches.len());
        // (phase, kernel) -> (launches, device microseconds, launches without a time)
        let mut table: HashMap<(String, String), (usize, f64, usize)> = HashMap::new();
        let mut phases: Vec<String> = Vec::new();
        let mut recorded: Vec<(String, usize)> = Vec::new();
        for launch in launches {
            let us = match (launch.profile, launch.duration) {
                (Some(profile), _) => {
                    block_on(profile.resolve()).map(|ticks| ticks.duration().as_secs_f64() * 1e6)
                }
                (None, Some(duration)) => Some(duration.as_secs_f64() * 1e6),
                (None, None) => None,
            };
            if !phases.contains(&launch.phase) {
                phases.push(launch.phase.clone());
            }
            let kernel = short(launch.kernel);
            let is_recorded = RECORDINGS.contains(&launch.phase.as_str());
            if is_recorded {
                match recorded.last_mut() {
                    Some((last, n)) if *last == kernel => *n += 1,
                    _ => recorded.push((kernel.clone(), 1)),
                }
            }
            let entry = table.entry((launch.phase, kernel)).or_default();
            entry.0 += 1;
            entry.1 += us.unwrap_or(0.0);
            if us.is_none() {
                entry.2 += 1;
            }
        }
        let count: usize = recorded.iter().map(|(_, n)| n).sum();
        out += &format!("### recorded (launched while a graph recorded): {count}\n");
        for (kernel, n) in &recorded {
            out += &format!("    {n:>4}x  {kernel}\n");
        }
        for phase in phases {
            let mut rows: Vec<_> = table.iter().filter(|((p, _), _)| *p == phase).collect();
            rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
            let total: f64 = rows.iter().map(|(_, v)| v.1).sum();
            let n: usize = rows.iter().map(|(_, v)| v.0).sum();
            out += &format!("### {phase}: {n} launches, {total:.1} us timed\n");
            for ((_, kernel), (n, us, untimed)) in rows {
                out += &format!("    {us:>10.1} us  {n:>5}x  ({untimed} untimed)  {kernel}\n");
            }
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.file)
            .expect("kernel trace file");
        file.write_all(out.as_bytes())
            .expect("kernel trace written");
    }
}
